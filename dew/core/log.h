// Minimal levelled logging to stderr; the level comes from DEW_LOG (debug|info|warn|error).
#pragma once
#include "dew/core/error.h"

namespace dew::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3 };
Level level();
void write(Level l, const std::string& message);

template <class... A>
void debug(const A&... a) {
  if (level() <= Level::debug) write(Level::debug, ::dew::str(a...));
}
template <class... A>
void info(const A&... a) {
  if (level() <= Level::info) write(Level::info, ::dew::str(a...));
}
template <class... A>
void warn(const A&... a) {
  if (level() <= Level::warn) write(Level::warn, ::dew::str(a...));
}

}  // namespace dew::log
