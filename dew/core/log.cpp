#include "dew/core/log.h"

#include <cstdlib>
#include <cstring>
#include <iostream>

namespace dew::log {

Level level() {
  static const Level l = [] {
    const char* e = std::getenv("DEW_LOG");
    if (!e) return Level::info;
    if (!std::strcmp(e, "debug")) return Level::debug;
    if (!std::strcmp(e, "warn")) return Level::warn;
    if (!std::strcmp(e, "error")) return Level::error;
    return Level::info;
  }();
  return l;
}

void write(Level l, const std::string& message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::cerr << "[dew " << names[static_cast<int>(l)] << "] " << message << "\n";
}

}  // namespace dew::log
