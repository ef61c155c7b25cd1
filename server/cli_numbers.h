// Strict numbers on the command line, for the `tpserve` commands and the benchmarks alike.
// Header-only: CLI11 belongs to the executables that include it.
//
// CLI11 2.1 reads integers with strtoll/strtoull in base 0 and floats with strtold: "010" is 8
// and "0x10" 16, "-1" for an unsigned option wraps to 18446744073709551615, an integer beyond
// 64 bits saturates silently, and nan or inf pass its Range checks. StrictNumbers makes every
// integer option of `app` and its subcommands decimal (leading zeros are read as decimal: "010"
// is 10), not negative where the type is unsigned and within 64 bits, and (with finite_floats)
// every float option finite. Call it after the options are added.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

namespace tpserve {

namespace cli_numbers_detail {

// The check of one integer value; rewrites `s` to plain decimal.
inline std::string CheckInteger(std::string& s, bool is_unsigned) {
  const std::string what = is_unsigned ? "a whole number from 0 to 18446744073709551615"
                                       : "a whole number from -9223372036854775808 to "
                                         "9223372036854775807";
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  const size_t digits = i;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  if (i == digits || i != s.size() || (negative && is_unsigned)) {
    return "'" + s + "' is not " + what;
  }
  size_t first = s.find_first_not_of('0', digits);
  std::string plain = (negative ? "-" : "") + (first == std::string::npos ? "0" : s.substr(first));
  errno = 0;
  if (is_unsigned) {
    (void)std::strtoull(plain.c_str(), nullptr, 10);
  } else {
    (void)std::strtoll(plain.c_str(), nullptr, 10);
  }
  if (errno == ERANGE) return "'" + s + "' is not " + what;
  s = plain;
  return "";
}

inline std::string CheckFinite(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0') return "'" + s + "' is not a number";
  if (!std::isfinite(v)) return "'" + s + "' is not a finite number";
  return "";
}

}  // namespace cli_numbers_detail

// A number > 0 and a number >= 0. CLI11 2.1's PositiveNumber and NonNegativeNumber are ranges
// up to the largest double, and their messages say so: "Value 0 not in range 0.000000 to"
// followed by 309 digits.
namespace cli_numbers_detail {
// A validator named `name` that accepts a number for which ok(value) holds; `fails` ends the
// message for one that does not (after "'VALUE' ").
template <typename Ok>
CLI::Validator NumberValidator(Ok ok, std::string fails, std::string name) {
  return CLI::Validator(
      [ok, fails](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (end == s.c_str() || *end != '\0') return "'" + s + "' is not a number";
        return ok(v) ? "" : "'" + s + "' " + fails;
      },
      std::move(name));
}
}  // namespace cli_numbers_detail

inline CLI::Validator Positive() {
  return cli_numbers_detail::NumberValidator([](double v) { return v > 0; },
                                             "is not positive: give a number > 0", "POSITIVE");
}

inline CLI::Validator NonNegative() {
  return cli_numbers_detail::NumberValidator([](double v) { return v >= 0; },
                                             "is negative: give a number >= 0", "NONNEGATIVE");
}

inline void StrictNumbers(CLI::App& app, bool finite_floats = true) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    if (base == "INT" || base == "UINT") {
      const bool is_unsigned = base == "UINT";
      opt->transform(CLI::Validator(
          [is_unsigned](std::string& s) {
            return cli_numbers_detail::CheckInteger(s, is_unsigned);
          },
          ""));
    } else if (base == "FLOAT" && finite_floats) {
      opt->transform(
          CLI::Validator([](std::string& s) { return cli_numbers_detail::CheckFinite(s); }, ""));
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    StrictNumbers(*sub, finite_floats);
  }
}

}  // namespace tpserve
