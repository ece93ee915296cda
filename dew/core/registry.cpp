#include "dew/core/registry.h"

namespace dew {

std::string format_registry(const RegistryBase& r) {
  std::string out;
  for (const auto& e : r.entries()) {
    out += e.name + " — " + e.doc + "\n";
    out += format_fields(e.fields, "    ");
  }
  return out;
}

}  // namespace dew
