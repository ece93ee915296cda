// libFuzzer target for options <-> JSON (dew/core/options.h): every options struct, recipe section and
// config.json translation reads its typed fields through from_json. The input is a JSON text parsed into
// a struct with one field of each kind the project uses. Any input must either be refused with a
// dew::Error or give a struct whose integer fields hold exactly the numbers written (no wrap, no silent
// truncation), that writes an omittable section only when given, and that round-trips through to_json; anything else
// is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/error.h"
#include "dew/core/options.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

struct InnerOptions {
#define FUZZ_INNER_FIELDS(F, C)          \
  F(int64_t, depth, 2, "nested integer") \
  C(kind, "linear", ({"linear", "cosine"}), "nested choice")
  DEW_OPTIONS(FUZZ_INNER_FIELDS)
#undef FUZZ_INNER_FIELDS
};

using Window = std::pair<int64_t, double>;

struct FuzzOptions {
#define FUZZ_FIELDS(F, C)                                                            \
  F(int64_t, steps, 10, "int64")                                                     \
  F(int32_t, heads, 4, "int32")                                                      \
  F(int, layers, 2, "int")                                                           \
  F(uint64_t, seed, 0, "uint64")                                                     \
  F(double, lr, 1e-3, "double")                                                      \
  F(float, scale, 1.0f, "float")                                                     \
  F(bool, ema, true, "bool")                                                         \
  F(std::string, name, "x", "string")                                                \
  F(std::vector<int64_t>, depths, (std::vector<int64_t>{2, 2}), "list of int64")     \
  F(std::vector<double>, betas, (std::vector<double>{0.9, 0.999}), "list of double") \
  F(std::optional<int64_t>, limit, std::nullopt, "optional int64")                   \
  F(Window, window, (Window{1, 0.5}), "pair")                                        \
  F(InnerOptions, inner, InnerOptions{}, "nested options")                           \
  F(dew::Omittable<InnerOptions>, section, std::nullopt, "omittable section")        \
  F(dew::json, extra, dew::json::object(), "free JSON")                              \
  C(mode, "eps", ({"eps", "v", "x0"}), "choice")
  DEW_OPTIONS(FUZZ_FIELDS)
#undef FUZZ_FIELDS
};

// An integer field holds the number written: compared as JSON numbers (5 == 5.0, no wrap).
void require_same_number(const dew::json& in, const char* key, const dew::json& out) {
  auto it = in.find(key);
  if (it != in.end() && it->is_number()) require(*it == out.at(key));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const dew::json j = dew::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  FuzzOptions o;
  try {
    o = dew::from_json<FuzzOptions>(j, "fuzz");
  } catch (const dew::Error&) {
    return 0;  // refused with a message
  }
  const dew::json out = dew::to_json(o);
  if (j.is_object()) {
    for (const char* key : {"steps", "heads", "layers", "seed"}) require_same_number(j, key, out);
  }
  // An omittable section is written exactly when it was given as an object (absent or null: left out).
  require(out.contains("section") == (j.is_object() && j.contains("section") && j["section"].is_object()));
  // What was accepted serialises and reads back to the same struct.
  FuzzOptions again = dew::from_json<FuzzOptions>(out, "fuzz");
  require(dew::to_json(again) == out);
  return 0;
}
