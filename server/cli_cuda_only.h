// Flags that only the cuda backend reads, on the commands that run on the cpu
// backend too (serve, run, layer). Their help starts with "cuda backend only: ",
// and the cpu backend refuses them when given instead of ignoring them.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace tpserve {

// Registers `opt` as read by the cuda backend only: its help starts with
// "cuda backend only: " (replacing a shared helper's "cuda: "), and
// *cuda_only lists it for GivenFlags after parsing.
void CudaOnly(CLI::Option* opt, std::vector<const CLI::Option*>* cuda_only);

// After parsing: the names of those of `options` given on the command line,
// whatever their value (a default given explicitly counts), in their order.
std::vector<std::string> GivenFlags(const std::vector<const CLI::Option*>& options);

// "a", "a and b", "a, b and c".
std::string JoinFlags(const std::vector<std::string>& flags);

// The error of cuda-only flags (`given`, from GivenFlags) on the cpu backend,
// which would not read them; "" unless `backend` is "cpu" and some were given.
// `offers_auto`: the command has --backend auto, named as the other way out.
std::string CudaOnlyFlagsError(const std::string& backend, const std::vector<std::string>& given,
                               bool offers_auto);

}  // namespace tpserve
