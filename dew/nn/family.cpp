#include "dew/nn/family.h"

#include <map>
#include <string>
#include <vector>

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

std::vector<std::string> recorded_family_names() {
  std::vector<std::string> names;
  for (const auto& kv : table()) names.push_back(kv.first);
  return names;
}

}  // namespace dew::models
