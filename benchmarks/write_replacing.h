// Writing a results file so that it holds either its old contents or all of
// the new ones: through FILE.tmp and a rename. Header-only; used by
// tpserve-bench and tpserve-loadtest, which rewrite their results as they go.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace tpserve {

// Writes `content` to `path` through `path`.tmp and a rename. Returns an
// error message, or "" on success (the .tmp file is removed on failure).
inline std::string WriteReplacing(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return "cannot write " + tmp;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot replace " + path + " with " + tmp + ": " + why;
  }
  return "";
}

}  // namespace tpserve
