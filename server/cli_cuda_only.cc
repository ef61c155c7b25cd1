#include "server/cli_cuda_only.h"

#include <string_view>

namespace tpserve {

void CudaOnly(CLI::Option* opt, std::vector<const CLI::Option*>* cuda_only) {
  constexpr std::string_view kShort = "cuda: ";
  std::string help = opt->get_description();
  if (help.starts_with(kShort)) help.erase(0, kShort.size());
  opt->description("cuda backend only: " + help);
  cuda_only->push_back(opt);
}

std::vector<std::string> GivenFlags(const std::vector<const CLI::Option*>& options) {
  std::vector<std::string> given;
  for (const CLI::Option* opt : options) {
    if (opt->count() > 0) given.push_back(opt->get_name());
  }
  return given;
}

std::string JoinFlags(const std::vector<std::string>& flags) {
  std::string out;
  for (size_t i = 0; i < flags.size(); ++i) {
    if (i > 0) out += i + 1 == flags.size() ? " and " : ", ";
    out += flags[i];
  }
  return out;
}

std::string CudaOnlyFlagsError(const std::string& backend, const std::vector<std::string>& given,
                               bool offers_auto) {
  if (backend != "cpu" || given.empty()) return "";
  const bool one = given.size() == 1;
  return "--backend cpu: " + JoinFlags(given) + (one ? " needs" : " need") + " --backend cuda" +
         (offers_auto ? " (or --backend auto on a node with the GPUs)" : "") +
         "; the cpu backend does not read " + (one ? "it" : "them");
}

}  // namespace tpserve
