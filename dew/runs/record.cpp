#include "dew/runs/record.h"

namespace dew::runs {

json recipe_of_record(json record) {
  for (const char* k : {"kind", "format", "dew_version", "derived"}) record.erase(k);
  return record;
}

}  // namespace dew::runs
