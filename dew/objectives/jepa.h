// JEPAObjective (docs/jepa.md): I-JEPA / V-JEPA feature prediction. The context encoder sees the visible
// tokens, the predictor predicts the target encoder's LayerNorm'd (no affine) features at the hidden
// target blocks, and the target encoder is the trainer's EMA of the context encoder (momentum 0.996 -> 1.0
// linear over the run), never trained by gradients.
//
//   auto obj = std::make_shared<dew::JEPAObjective>(encoder, predictor, dew::JEPAObjectiveOptions{});
//   auto out = obj->loss(batch, step, gen);   // batch: {"image": uint8 [B, C, H, W] or [B, C, T, H, W]}
//   // out.metrics: repr_std, repr_cov_offdiag, context_tokens, target_tokens
#pragma once
#include "dew/data/dataset.h"
#include "dew/data/masks.h"
#include "dew/metrics/probes.h"
#include "dew/nn/roles.h"
#include "dew/training/objective.h"

namespace dew {

struct JEPAObjectiveOptions {
  std::string loss = "mse";
  double momentum = 0.996;
  double final_momentum = 1.0;
  data::MultiBlockOptions masks;
  data::TubeOptions tubes;
  int64_t probe_train = 2000;
  int64_t probe_test = 1000;
  int64_t knn_k = 20;
  std::string knn_prep = "none";
  std::string knn_vote = "weighted";
  double knn_temperature = 0.07;
  int64_t probe_epochs = 30;
  std::string probe_pool = "mean";
  template <class V>
  void visit(V& v) {
    v.choice("loss", loss, {"mse", "smooth_l1", "l1"}, "distance to the target features (I-JEPA smooth_l1, V-JEPA l1)");
    v("momentum", momentum, "target-encoder EMA momentum at the first step");
    v("final_momentum", final_momentum, "target-encoder EMA momentum at the last step (linear in between)");
    v("masks", masks, "multi-block masks of images (I-JEPA)");
    v("tubes", tubes, "multi-block tube masks of video (V-JEPA)");
    v("probe_train", probe_train, "validation probe: training items (0 = no probe)");
    v("probe_test", probe_test, "validation probe: test items");
    v("knn_k", knn_k, "neighbours of the kNN probe");
    v.choice("knn_prep", knn_prep, metrics::knn_preps(),
             "kNN probe: features as they are, less the training mean, or standardised");
    v.choice("knn_vote", knn_vote, metrics::knn_votes(),
             "kNN probe: neighbours vote exp(cosine / knn_temperature) (DINO) or 1 (a count)");
    v("knn_temperature", knn_temperature, "kNN probe: temperature of the weighted vote (> 0)");
    v("probe_epochs", probe_epochs, "epochs of the linear probe");
    v("probe_pool", probe_pool,
      "probe features: mean (over tokens), tokens (all, concatenated) or gridK (K x K region means)");
  }
};

/// The distance of predictions to targets, averaged over every element: mse, smooth_l1 (beta 1) or l1.
at::Tensor jepa_distance(const at::Tensor& prediction, const at::Tensor& target, const std::string& loss);

/// How token features become one vector per item: "mean" (over tokens, [N, D]), "tokens" (every token's
/// features in raster order, concatenated: [N, tokens * D]) or "gridK" (the means over K x K regions of the
/// token grid, as adaptive average pooling cuts it, over every frame, concatenated: [N, K * K * D]).
const std::vector<std::string>& feature_pools();
/// K of "gridK" (1 for "mean", 0 for "tokens"); a dew::Error naming `field` for any other pool or a K larger
/// than the grid `g`.
int64_t pool_regions(const std::string& pool, const TokenGrid& g, const std::string& field);

/// Encoder features of images or clips (uint8, as the datasets hold them), pooled by `pool`, computed in
/// batches of `batch` on the encoder's device without gradients: float32 on the CPU.
at::Tensor pooled_features(TokenEncoderImpl& encoder, const at::Tensor& images, const std::string& pool = "mean",
                           int64_t batch = 256);

/// The probes of frozen features: linear-probe and kNN accuracy.
struct ProbeResult {
  double linear = 0;
  double knn = 0;
};
/// Fits on `train` ("image", "label"), scores on `test`; features from pooled_features(encoder, pool) or,
/// with a null encoder, the flattened pixels in [-1, 1]. knn.k is capped at the training items.
ProbeResult probe(TokenEncoderImpl* encoder, const data::TensorDataset& train, const data::TensorDataset& test,
                  int64_t classes, const metrics::KnnOptions& knn, const metrics::LinearProbeOptions& linear,
                  const std::string& pool = "mean");

class JEPAObjective : public Objective {
 public:
  /// `probe_train` / `probe_test` (optional) are the sets validation probes on.
  JEPAObjective(std::shared_ptr<TokenEncoderImpl> encoder, std::shared_ptr<TokenPredictorImpl> predictor,
                JEPAObjectiveOptions options, data::DatasetPtr probe_train = nullptr,
                data::DatasetPtr probe_test = nullptr, int64_t classes = 0);
  std::string name() const override { return "jepa"; }
  /// "encoder" and "predictor".
  torch::nn::Module& module() override { return *root_; }
  /// batch: "image" uint8. Metrics: repr_std and repr_cov_offdiag of the target features (every token of the
  /// batch), context_tokens, target_tokens (per item).
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  /// Data-parallel: the draws (the context and target masks) are made for the whole batch and this rank keeps its rows', so every row
  /// gets what a one-process run gives it; the loss is a mean over rows, which the trainer's row share weighs.
  LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                          at::Generator gen) override;
  /// With the EMA (the target encoder) swapped in: val/linear_acc and val/knn_acc of quick probes.
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  /// EmaSpec::ramp(momentum, final_momentum) over the encoder's parameters.
  training::EmaSpec ema() const override;
  void bind_ema(const std::map<std::string, at::Tensor>& averages) override { averages_ = &averages; }
  std::vector<std::string> batch_fields() const override { return {"image"}; }
  std::vector<std::string> progress_metrics() const override { return {"repr_std"}; }
  /// The loss of images or clips x (float, model range, on the encoder's device) under given masks.
  LossOutput loss_of(const at::Tensor& x, const data::Masks& masks);
  /// The masks of a batch of `batch` items drawn from `gen`.
  data::Masks draw_masks(int64_t batch, at::Generator gen) const;
  TokenEncoderImpl& target_encoder() { return *target_; }

 private:
  std::shared_ptr<TokenEncoderImpl> encoder_, target_;
  std::shared_ptr<TokenPredictorImpl> predictor_;
  std::shared_ptr<torch::nn::Module> root_;
  JEPAObjectiveOptions o_;
  data::DatasetPtr probe_train_, probe_test_;
  int64_t classes_ = 0;
  bool video_ = false;
  const std::map<std::string, at::Tensor>* averages_ = nullptr;
};

}  // namespace dew
