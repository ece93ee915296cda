#include "dew/nn/family.h"

#include <map>

namespace dew::models {

namespace {

std::map<std::string, Family>& table() {
  static auto* t = new std::map<std::string, Family>();
  return *t;
}

}  // namespace

void add_family_info(const std::string& name, Family family) { table()[name] = std::move(family); }

const Family* find_family_info(const std::string& name) {
  auto it = table().find(name);
  return it == table().end() ? nullptr : &it->second;
}

}  // namespace dew::models
