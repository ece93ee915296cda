// dew::Error and the checks that raise it (docs/core.md: what was wrong, where, what is accepted).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace dew {

/// The one exception type of the library. The message names the field or file, the offending value
/// and what is accepted; the CLI prints it on one line and exits 2.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... R>
void append(std::ostringstream& s, const T& v, const R&... rest) {
  s << v;
  append(s, rest...);
}
}  // namespace detail

/// Concatenates the arguments (operator<<) into a message.
template <class... A>
std::string str(const A&... a) {
  std::ostringstream s;
  detail::append(s, a...);
  return s.str();
}

/// Throws dew::Error with the concatenated arguments.
template <class... A>
[[noreturn]] void fail(const A&... a) {
  throw Error(::dew::str(a...));
}

}  // namespace dew

/// DEW_CHECK(cond, "field x must be > 0, got ", x): throws dew::Error when cond is false.
#define DEW_CHECK(cond, ...)               \
  do {                                     \
    if (!(cond)) ::dew::fail(__VA_ARGS__); \
  } while (0)
