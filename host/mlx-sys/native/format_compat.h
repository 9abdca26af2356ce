// std::format stand-in for GCC 12 (no <format>), force-included into mlx-c.
// Only "{}" placeholders are supported: all mlx-c uses.
#pragma once
#if defined(__cplusplus) && !__has_include(<format>)
#include <sstream>
#include <string>
#include <string_view>
namespace std {
namespace mlxsys_detail {
inline void format_into(std::ostringstream& os, std::string_view fmt) { os << fmt; }
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, std::string_view fmt, const T& first, const Rest&... rest) {
  auto pos = fmt.find("{}");
  if (pos == std::string_view::npos) {
    os << fmt;
    return;
  }
  os << fmt.substr(0, pos) << first;
  format_into(os, fmt.substr(pos + 2), rest...);
}
}  // namespace mlxsys_detail
template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream os;
  mlxsys_detail::format_into(os, fmt, args...);
  return os.str();
}
}  // namespace std
#endif
