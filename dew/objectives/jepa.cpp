#include "dew/objectives/jepa.h"

#include <ATen/ATen.h>

#include <cmath>

#include "dew/core/device.h"
#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/jepa.h"

namespace dew {

namespace {

// Rows of `n` items of a dataset: the first n (the sets are shuffled sources; a fixed prefix keeps the probe
// the same at every validation).
at::Tensor head(const at::Tensor& t, int64_t n) { return t.slice(0, 0, std::min(n, t.size(0))); }

}  // namespace

at::Tensor jepa_distance(const at::Tensor& prediction, const at::Tensor& target, const std::string& loss) {
  DEW_CHECK(prediction.sizes() == target.sizes(), "jepa loss: prediction ", prediction.sizes(), " and target ",
            target.sizes(), " differ in shape");
  // float32 at least (bf16 autocast outputs), float64 kept.
  const auto dt = prediction.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor p = prediction.to(dt), t = target.to(dt);
  if (loss == "mse") return at::mse_loss(p, t);
  if (loss == "smooth_l1") return at::smooth_l1_loss(p, t);
  if (loss == "l1") return at::l1_loss(p, t);
  fail("objective.loss: got \"", loss, "\", accepted: mse, smooth_l1, l1");
}

const std::vector<std::string>& feature_pools() {
  static const std::vector<std::string> pools{"mean", "tokens", "gridK"};
  return pools;
}

int64_t pool_regions(const std::string& pool, const TokenGrid& g, const std::string& field) {
  if (pool == "mean") return 1;
  if (pool == "tokens") return 0;
  int64_t k = -1;
  if (pool.size() > 4 && pool.compare(0, 4, "grid") == 0 &&
      pool.find_first_not_of("0123456789", 4) == std::string::npos && pool.size() <= 6)
    k = std::stoll(pool.substr(4));
  DEW_CHECK(k >= 1 && k <= std::min(g.h, g.w), field, ": got \"", pool,
            "\", accepted: mean, tokens, gridK with 1 <= K <= ", std::min(g.h, g.w), " (the token grid is ", g.h, " x ",
            g.w, ")");
  return k;
}

at::Tensor pooled_features(TokenEncoderImpl& encoder, const at::Tensor& images, const std::string& pool,
                           int64_t batch) {
  DEW_CHECK(images.scalar_type() == at::kByte, "pooled_features: images must be uint8, got ", images.scalar_type());
  const TokenGrid g = encoder.grid();
  const int64_t k = pool_regions(pool, g, "pool");
  at::NoGradGuard ng;
  const bool was_training = encoder.is_training();
  encoder.eval();
  const auto device = module_device(encoder);
  std::vector<at::Tensor> out;
  for (int64_t s = 0; s < images.size(0); s += batch) {
    const at::Tensor x = data::to_model_range(images.slice(0, s, std::min(images.size(0), s + batch))).to(device);
    const at::Tensor h = encoder.forward(x);  // [b, N, D]
    at::Tensor f;
    if (k == 0) {
      f = h.flatten(1);
    } else if (k == 1) {
      f = h.mean(1);
    } else {
      // [b, t, h, w, D] -> mean over time -> [b, D, h, w] -> K x K region means, region-major.
      const at::Tensor m = h.reshape({h.size(0), g.t, g.h, g.w, h.size(2)}).mean(1).permute({0, 3, 1, 2});
      f = at::adaptive_avg_pool2d(m, {k, k}).permute({0, 2, 3, 1}).flatten(1);
    }
    out.push_back(f.to(at::kFloat).cpu());
  }
  encoder.train(was_training);
  return at::cat(out);
}

ProbeResult probe(TokenEncoderImpl* encoder, const data::TensorDataset& train, const data::TensorDataset& test,
                  int64_t classes, const metrics::KnnOptions& knn, const metrics::LinearProbeOptions& linear,
                  const std::string& pool) {
  const auto features = [&](const data::TensorDataset& d) {
    const at::Tensor& img = d.field("image");
    return encoder ? pooled_features(*encoder, img, pool) : data::to_model_range(img).flatten(1);
  };
  const at::Tensor ftr = features(train), fte = features(test);
  ProbeResult r;
  r.linear = metrics::linear_probe_accuracy(ftr, train.field("label"), fte, test.field("label"), classes, linear);
  metrics::KnnOptions ko = knn;
  ko.k = std::min<int64_t>(ko.k, ftr.size(0));
  r.knn = metrics::knn_accuracy(ftr, train.field("label"), fte, test.field("label"), classes, ko);
  return r;
}

JEPAObjective::JEPAObjective(std::shared_ptr<TokenEncoderImpl> encoder, std::shared_ptr<TokenPredictorImpl> predictor,
                             JEPAObjectiveOptions options, data::DatasetPtr probe_train, data::DatasetPtr probe_test,
                             int64_t classes)
    : encoder_(std::move(encoder)),
      predictor_(std::move(predictor)),
      o_(std::move(options)),
      probe_train_(std::move(probe_train)),
      probe_test_(std::move(probe_test)),
      classes_(classes) {
  DEW_CHECK(encoder_ && predictor_, "objective jepa: needs an encoder and a predictor");
  DEW_CHECK(o_.momentum >= 0 && o_.momentum <= o_.final_momentum && o_.final_momentum <= 1,
            "objective.momentum / final_momentum: need 0 <= momentum <= final_momentum <= 1, got ", o_.momentum,
            " and ", o_.final_momentum);
  DEW_CHECK(o_.probe_train >= 0 && o_.probe_test >= 0 && o_.knn_k >= 1 && o_.probe_epochs >= 1,
            "objective.probe_train / probe_test / knn_k / probe_epochs: need >= 0, >= 0, >= 1, >= 1; got ",
            o_.probe_train, ", ", o_.probe_test, ", ", o_.knn_k, ", ", o_.probe_epochs);
  DEW_CHECK(std::isfinite(o_.knn_temperature) && o_.knn_temperature > 0, "objective.knn_temperature: must be > 0, got ",
            o_.knn_temperature);
  jepa_distance(at::zeros({1}), at::zeros({1}), o_.loss);  // the name, now
  const TokenGrid g = encoder_->grid();
  video_ = g.t > 1 || encoder_->config().value("architecture", "") == "jepa_video_encoder";
  pool_regions(o_.probe_pool, g, "objective.probe_pool");
  if (video_) data::validate(o_.tubes, g, "objective.tubes");
  else data::validate(o_.masks, g, "objective.masks");
  // The predictor must be built for the encoder's grid and width.
  const json pf = predictor_->config().value("fields", json::object());
  const json ef = encoder_->config().value("fields", json::object());
  for (const char* k : {"image_size", "patch_size"})
    DEW_CHECK(pf.value(k, json()) == ef.value(k, json()), "model.predictor.fields.", k, ": must be the encoder's ",
              ef.value(k, json()).dump(), ", got ", pf.value(k, json()).dump());
  DEW_CHECK(pf.value("encoder_features", int64_t(-1)) == encoder_->features(),
            "model.predictor.fields.encoder_features: must be the encoder's width ", encoder_->features(), ", got ",
            pf.value("encoder_features", json()).dump());
  if (probe_train_ || probe_test_)
    DEW_CHECK(probe_train_ && probe_test_ && classes_ >= 2,
              "objective jepa: a probe needs a training set, a test set and >= 2 classes");
  root_ = std::make_shared<torch::nn::Module>("JEPA");
  root_->register_module("encoder", encoder_);
  root_->register_module("predictor", predictor_);
  // The target encoder: the same architecture, holding the EMA averages (copied in before every loss).
  target_ = models::build_token_encoder(encoder_->config());
  target_->to(module_device(*encoder_));
  for (auto& p : target_->parameters()) p.set_requires_grad(false);
  target_->eval();
}

training::EmaSpec JEPAObjective::ema() const {
  auto s = training::EmaSpec::ramp(o_.momentum, o_.final_momentum);
  s.prefixes = {"encoder."};
  return s;
}

data::Masks JEPAObjective::draw_masks(int64_t batch, at::Generator gen) const {
  return video_ ? data::tube_masks(o_.tubes, encoder_->grid(), batch, gen)
                : data::multiblock_masks(o_.masks, encoder_->grid(), batch, gen);
}

LossOutput JEPAObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  auto it = batch.find("image");
  DEW_CHECK(it != batch.end(), "objective jepa: the batch has no \"image\" field");
  return loss_of_rows(batch, 0, it->second.size(0), step, gen);
}

LossOutput JEPAObjective::loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                       at::Generator gen) {
  auto it = batch.find("image");
  DEW_CHECK(it != batch.end(), "objective jepa: the batch has no \"image\" field");
  // The whole batch's masks (their sizes are the batch's, as I-JEPA's collator draws them), this rank's rows.
  const data::Masks all = draw_masks(it->second.size(0), gen);
  const data::Masks mine{all.context.narrow(0, begin, end - begin), all.targets.narrow(1, begin, end - begin)};
  const auto device = module_device(*encoder_);
  return loss_of(data::to_model_range(it->second.narrow(0, begin, end - begin)).to(device), mine);
}

LossOutput JEPAObjective::loss_of(const at::Tensor& x, const data::Masks& masks) {
  const auto device = module_device(*encoder_);
  const at::Tensor ctx = masks.context.to(device), tgt = masks.targets.to(device);
  const int64_t m = tgt.size(0);
  at::Tensor h;
  metrics::ReprStats stats;
  {
    at::NoGradGuard ng;
    DEW_CHECK(averages_, "objective jepa: the trainer did not bind its EMA (the target encoder)");
    const auto dtype = encoder_->parameters().front().scalar_type();
    if (target_->parameters().front().scalar_type() != dtype) target_->to(dtype);
    for (const auto& kv : target_->named_parameters()) {
      auto a = averages_->find("encoder." + kv.key());
      DEW_CHECK(a != averages_->end(), "objective jepa: the EMA lacks encoder.", kv.key());
      kv.value().copy_(a->second);
    }
    const at::Tensor full = target_->forward(x);  // [B, N, D]
    stats = metrics::representation_stats(full.reshape({-1, full.size(2)}));
    const at::Tensor normed = at::layer_norm(full, {full.size(2)});  // no affine, eps 1e-5
    std::vector<at::Tensor> blocks;
    for (int64_t k = 0; k < m; ++k) blocks.push_back(nn::gather_tokens(normed, tgt[k]));
    h = at::cat(blocks);  // [M B, Kt, D], block-major as the predictor's rows
  }
  const at::Tensor z = predictor_->forward(encoder_->forward(x, ctx), ctx, tgt);
  LossOutput out;
  out.loss = jepa_distance(z, h, o_.loss);
  out.metrics = {{"repr_std", stats.std},
                 {"repr_cov_offdiag", stats.cov_offdiag},
                 {"context_tokens", double(ctx.size(1))},
                 {"target_tokens", double(tgt.size(2))}};
  return out;
}

std::map<std::string, double> JEPAObjective::validate(int64_t, const std::string&) {
  if (!probe_train_ || o_.probe_train == 0 || o_.probe_test == 0) return {};
  data::TensorDataset train({{"image", head(probe_train_->field("image"), o_.probe_train)},
                             {"label", head(probe_train_->field("label"), o_.probe_train)}});
  data::TensorDataset test({{"image", head(probe_test_->field("image"), o_.probe_test)},
                            {"label", head(probe_test_->field("label"), o_.probe_test)}});
  metrics::LinearProbeOptions lo;
  lo.epochs = o_.probe_epochs;
  const ProbeResult r = probe(encoder_.get(), train, test, classes_,
                              {o_.knn_k, o_.knn_prep, o_.knn_vote, o_.knn_temperature}, lo, o_.probe_pool);
  // The items the quick probe saw name themselves beside its scores (dew eval's probe may use more).
  return {{"val/linear_acc", r.linear},
          {"val/knn_acc", r.knn},
          {"val/probe_train_items", double(train.size())},
          {"val/probe_test_items", double(test.size())}};
}

}  // namespace dew
