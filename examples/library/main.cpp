// dew from C++ (docs/library.md): build a model, train a run, sample it. Built by the test
// Install.ConsumerBuildsAgainstThePackage against the installed package.
#include <ATen/ATen.h>

#include <iostream>

#include "dew/nn/backbones/backbone.h"
#include "dew/runs/diffusion_run.h"
#include "dew/sampling/diffusion_sample.h"

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "runs/library_example";
  try {
    // 1. A model from the registry, by name and fields, as `dew models` lists them.
    const dew::json fields = {{"patch_size", 2},  {"emb_features", 32},   {"num_layers", 1}, {"num_heads", 2},
                              {"in_channels", 1}, {"output_channels", 1}, {"num_classes", 3}};
    auto model = dew::models::build("simple_dit", fields);
    dew::Conditioning cond;
    cond.labels = at::tensor({0, 2}, at::kLong);
    at::Tensor F = model->forward(at::zeros({2, 1, 8, 8}), at::full({2}, 0.5), cond);  // [2, 1, 8, 8]
    std::cout << "simple_dit output " << F.sizes() << "\n";

    // 2. A training run: the `dew train diffusion` recipe with a few fields changed.
    dew::json recipe = dew::runs::default_recipe("diffusion");
    recipe["run"] = dir;
    recipe["data"] = {{"name", "gaussian_blobs"}, {"count", 64}, {"size", 8}, {"classes", 3}};
    recipe["model"] = {{"architecture", "simple_dit"},
                       {"fields", {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 1}, {"num_heads", 2}}}};
    recipe["loader"]["batch_size"] = 8;
    recipe["trainer"]["steps"] = 20;
    recipe["trainer"]["log_every"] = 10;
    recipe["objective"]["steps"] = 4;
    auto run = dew::runs::prepare("diffusion", recipe);  // every field checked, nothing written yet
    auto result = dew::runs::train(run);                 // rerunning resumes from the latest checkpoint
    std::cout << "trained " << result.step << " steps, checkpoint " << result.last_checkpoint << "\n";

    // 3. Sampling the run's EMA weights: two samples of each class.
    auto trained = dew::runs::open_diffusion_run(dir);
    dew::DiffusionSampleOptions g;
    g.shape = trained.shape;  // [1, 8, 8]
    g.count = 6;
    g.labels = at::arange(3).repeat({2});
    g.solver = "euler";
    g.steps = 10;
    at::Tensor images = dew::sample_diffusion(*trained.model, *trained.process, g);  // [6, 1, 8, 8] in [-1, 1]
    dew::save_samples(dir + "/library_grid.png", images, 3);
    std::cout << "wrote " << dir << "/library_grid.png\n";
  } catch (const dew::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
