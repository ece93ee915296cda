// The run kinds the library registers (internal to dew/runs: users reach them through run_kind()), and how a
// kind is made from its typed recipe.
#pragma once
#include <type_traits>

#include "dew/runs/run.h"

namespace dew::runs {

RunKind diffusion_kind();
RunKind autoencoder_kind();
RunKind lm_kind();
RunKind jepa_kind();
RunKind sft_kind();
RunKind dpo_kind();
RunKind grpo_kind();

/// A kind written against its recipe type R (a RecipeBase adding the kind's sections with their visit): R's
/// defaults, help over R, and the build that reads R and completes its data-dependent fields in place.
template <class R>
struct KindDefinition {
  std::string name;
  std::string doc;
  std::function<R()> defaults;
  std::vector<std::string> open_keys;
  std::vector<std::string> identity;
  std::function<std::string(const R&)> help;
  std::function<Built(R&, const c10::Device&)> build;
};

/// The RunKind of a definition: recipes parse into R once (from_json), build() reads only R, and the run
/// records to_json(R) as build() left it.
template <class R>
RunKind make_run_kind(KindDefinition<R> d) {
  static_assert(std::is_base_of_v<RecipeBase, R>, "a kind's recipe derives from RecipeBase");
  class Parsed final : public ParsedRecipe {
   public:
    Parsed(R recipe, std::function<Built(R&, const c10::Device&)> build)
        : recipe_(std::move(recipe)), build_(std::move(build)) {}
    const RecipeBase& base() const override { return recipe_; }
    Built build(const c10::Device& device) override { return build_(recipe_, device); }
    json to_json() const override { return dew::to_json(recipe_); }

   private:
    R recipe_;
    std::function<Built(R&, const c10::Device&)> build_;
  };
  RunKind k;
  k.name = std::move(d.name);
  k.doc = std::move(d.doc);
  k.defaults = [f = d.defaults] { return to_json(f()); };
  k.open_keys = std::move(d.open_keys);
  k.identity = std::move(d.identity);
  k.help = [h = d.help](const json& recipe) { return h(from_json<R>(recipe)); };
  k.parse = [b = d.build](const json& recipe) -> std::unique_ptr<ParsedRecipe> {
    return std::make_unique<Parsed>(from_json<R>(recipe), b);
  };
  return k;
}

}  // namespace dew::runs
