#include "dew/bench/run_one.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "dew/bench/measure.h"
#include "dew/bench/timing.h"
#include "dew/core/threads.h"
#include "dew/data/dataset.h"
#include "dew/diffusion/process.h"
#include "dew/metrics/inception.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "dew/nn/roles.h"
#include "dew/objectives/diffusion.h"
#include "dew/objectives/dpo.h"
#include "dew/objectives/jepa.h"
#include "dew/objectives/lm.h"
#include "dew/sampling/diffusion_sample.h"
#include "dew/sampling/generate.h"
#include "dew/training/optim.h"
#include "dew/training/trainer.h"

namespace dew::bench {

namespace {

// A measured child's threads: `threads` intra-op threads and the configuration's BLAS threads, which the
// parent passes as OPENBLAS_NUM_THREADS (read by OpenBLAS when it loads; oneMKL is told here).
void set_child_threads(int64_t threads) {
  at::set_num_threads(int(threads));
  if (const char* b = std::getenv("OPENBLAS_NUM_THREADS"); b && std::atoll(b) >= 1) set_blas_threads(std::atoll(b));
}

// The timed loop of case c: its warm-up and timed steps on the options' device.
LoopOptions loop_of(const BenchCase& c, const OneOptions& o, const std::string& profile = "") {
  LoopOptions l;
  l.warmup = warmup_of(c, o.sizes);
  l.steps = steps_of(c, o.sizes);
  l.device = o.device;
  l.profile = profile;
  return l;
}

// Training steps through the trainer: the timings (phases forward, backward, optimizer), the last loss and the
// trainable parameters.
struct TrainerSteps {
  Timings timings;
  double loss = 0;
  int64_t params = 0;
};

// warmup + steps steps of `objective` through the trainer's own step (training::Trainer::train_step, the
// step `dew train` takes: zero_grad, the objective's loss with its generators from (seed 0, step), the finite
// guard, backward, clip_grad_norm, the warm-up + cosine learning rate, AdamW, the EMA of objective->ema()),
// on `batch` every step: an in-memory loader over exactly its rows (in order, built on the caller's thread),
// so data costs one gather of the batch. Autocast is off (both sides compute in fp32). Phases: forward = taking
// the batch + the loss (the objective's forward) + its finite check; backward = backward + gradient norm and
// clip; optimizer = the rest of the step (zero_grad, AdamW, the EMA).
TrainerSteps time_trainer_steps(const ObjectivePtr& objective, const data::Batch& batch, LoopOptions loop,
                                const std::string& what) {
  objective->module().train();
  TrainerSteps t;
  for (const auto& p : objective->module().parameters())
    if (p.requires_grad()) t.params += p.numel();
  TempDir dir("bench_" + what);
  const auto trainer =
      fixed_batch_trainer(objective, batch, bench_optim(loop.warmup), loop.warmup + loop.steps, dir.path.string());
  std::optional<training::StepOutcome> out;  // the step's own outcome, read after its closing time stamp
  loop.rest = true;  // optimizer = the time beyond forward and backward, synced (on CUDA the update runs async)
  t.timings = timed_loop(
      loop, [&](int64_t, StepClock&) { out.emplace(trainer->train_step()); },
      [&](int64_t i, StepClock& clock) {
        DEW_CHECK(out->finite, "bench ", what, ": non-finite loss at step ", i);
        t.loss = out->loss;
        clock.phase(out->data_s + out->loss_s);
        clock.phase(out->backward_s);
        out.reset();
      });
  return t;
}

// The result line of trainer steps over `batch` rows.
json trainer_result(const TrainerSteps& t, int64_t batch) {
  const Timings& s = t.timings;
  return step_result(s.total, s.phase(0), s.phase(1), s.phase(2), batch, t.params, t.loss, s.peak_rss_mb);
}

// A denoiser that reads a text context, given a fixed one (context [B, L, D], mask [B, L]) in place of the text
// encoder a text run would train: the models reading a context (simple_mmdit, hierarchical_mmdit) then train with
// DiffusionObjective's own loss, labels and their drop included, as the other diffusion cases do.
class FixedContextBackbone : public BackboneImpl {
 public:
  FixedContextBackbone(BackbonePtr model, at::Tensor context, at::Tensor mask)
      : model_(register_module("model", std::move(model))), context_(std::move(context)), mask_(std::move(mask)) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override {
    Conditioning c = cond;
    c.context = context_;
    c.context_mask = mask_;
    return model_->forward(x, time, c);
  }

 private:
  BackbonePtr model_;
  at::Tensor context_, mask_;
};

// warmup + steps diffusion training steps of one case through the trainer: `dew train diffusion`'s
// DiffusionObjective (EDM pixel preset, unconditional_prob 0.12, EMA decay kEmaDecay) on a fixed batch of uint8
// images and labels (same keys as bench/peer.py).
json run_one_diffusion(const BenchCase& c, const OneOptions& o) {
  set_child_threads(o.threads);
  at::manual_seed(0);  // parameter initialisation draws from the global generator
  auto model = models::build(c.arch, c.fields);
  model->to(o.device);
  diffusion::PresetOptions po;
  po.regime = "pixel";
  auto preset = diffusion::preset("edm", po);

  // A fixed batch stands in for the data loader: the bench times the step, not the input pipeline.
  const int64_t batch = batch_of(c, o.sizes);
  auto data_gen = at::detail::createCPUGenerator(1);
  const int64_t num_classes = c.fields.value("num_classes", int64_t(0));
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  data::Batch b{{"image", at::randint(0, 256, shape, data_gen).to(at::kByte)}};
  if (num_classes > 0) b["label"] = at::randint(0, num_classes, {batch}, data_gen);
  else b["label"] = at::zeros({batch}, at::kLong);
  BackbonePtr trained = model;
  if (c.context_len > 0) {
    const int64_t features = c.fields["context_features"].get<int64_t>();
    auto context = at::randn({batch, c.context_len, features}, data_gen).to(o.device);
    auto mask = at::ones({batch, c.context_len}, at::TensorOptions().dtype(at::kBool).device(o.device));
    trained = std::make_shared<FixedContextBackbone>(model, context, mask);
  }
  DiffusionObjectiveOptions d;
  d.ema_decay = kEmaDecay;
  auto objective = std::make_shared<DiffusionObjective>(trained, preset, d, num_classes, c.item);
  return trainer_result(time_trainer_steps(objective, b, loop_of(c, o, o.profile), c.name), batch);
}

// warmup + steps optimizer steps of `dew train`'s default recipe through the Trainer it builds (train_step: the
// loader's next batch, the DiffusionObjective's loss, clip, schedule, AdamW, EMA): samples_per_s = items / seconds
// of the timed steps, ms_per_step their mean (the same throughput), phases and data_ms medians (data_ms: waiting
// for the loader).
//
// data_parallel (the ddp case): one rank, or the whole run when WORLD_SIZE is unset, with this process in the
// data-parallel group `dew launch` (or torchrun) set up in its environment, as runs::train joins it: the process
// group over the TCPStore rendezvous, rank 0's weights broadcast, then Trainer::train_step, whose gradient
// all-reduce is timed apart. Every rank times its own steps; the result averages the ranks' seconds (they step
// together), counts the global batch's items, and is returned by rank 0 alone (the others return null and print
// nothing). allreduce_ms: the gradient all-reduce per step in flight (mean; StepOutcome::allreduce_inflight_s:
// from the first bucket's start during backward to the last one's end), allreduce_share its share of the step's
// time, allreduce_exposed_ms the wait after backward (StepOutcome::allreduce_s); with one rank all 0.
json run_default_train(const BenchCase& c, const OneOptions& o, bool data_parallel) {
  const std::string what = data_parallel ? "ddp" : "train";
  if (data_parallel) set_child_threads(o.threads);
  TempDir dir("bench_" + what);
  auto run = prepare_default_train(dir.path.string(), o.threads, batch_of(c, o.sizes), o.device);
  if (!o.overlap.empty()) run.dist.overlap = o.overlap;
  std::shared_ptr<training::Distributed> dist;
  if (data_parallel && run.dist_env.world_size > 1) {
    training::check_global_batch(run.built.loader->options().batch_size, run.dist_env.world_size);
    dist = std::make_shared<training::Distributed>(run.dist_env, run.dist, run.device);
  }
  training::Trainer trainer(run.built.objective, run.built.loader, run.optim, run.trainer, dir.path.string(),
                            uint64_t(run.options.seed));
  trainer.set_distributed(dist);
  if (dist) dist->broadcast_module(run.built.objective->module());
  LoopOptions loop = loop_of(c, o);
  loop.rest = true;
  std::optional<training::StepOutcome> out;
  double loss = 0, allreduce = 0, inflight = 0;
  int64_t samples = 0;
  const Timings t = timed_loop(
      loop, [&](int64_t, StepClock&) { out.emplace(trainer.train_step()); },
      [&](int64_t i, StepClock& clock) {
        DEW_CHECK(out->finite, "bench ", what, ": non-finite loss at step ", i);
        loss = out->loss;
        if (i >= loop.warmup) {
          samples += out->samples;  // the global batch's items
          allreduce += out->allreduce_s;
          inflight += out->allreduce_inflight_s;
        }
        clock.phase(out->data_s);  // phases: data, forward, backward, then the rest
        clock.phase(out->loss_s);
        clock.phase(out->backward_s);
        out.reset();
      });
  double seconds = 0;
  for (double s : t.total) seconds += s;
  const double world = dist ? double(dist->world_size()) : 1.0;
  if (dist) {
    const auto sums = dist->sum({seconds, allreduce, inflight});
    seconds = sums[0] / world;
    allreduce = sums[1] / world;
    inflight = sums[2] / world;
  }
  if (dist && !dist->is_main()) return nullptr;
  int64_t nparams = 0;
  for (const auto& p : trainer.parameters()) nparams += p.second.numel();
  json j = step_result(t.total, t.phase(1), t.phase(2), t.phase(3), run.built.loader->options().batch_size, nparams,
                       loss, t.peak_rss_mb);
  j["ms_per_step"] = seconds / double(loop.steps) * 1e3;
  j["samples_per_s"] = double(samples) / seconds;
  j["data_ms"] = median(t.phase(0)) * 1e3;
  if (!data_parallel) return j;
  j["ranks"] = int64_t(world);
  j["allreduce_ms"] = inflight / double(loop.steps) * 1e3;  // in flight, during backward or after it
  j["allreduce_share"] = inflight / seconds;
  j["allreduce_exposed_ms"] = allreduce / double(loop.steps) * 1e3;  // waited for after backward
  return j;
}

// warmup + steps sampling runs of `dew sample RUN` on the default recipe's model: ms_per_step = ms per sampling
// run (median), samples_per_s = images/s. The run is built as runs::open_diffusion_run builds a trained one (the
// recipe's model from its completed record, eval mode, on the device; the process from its preset), the weights
// freshly initialised instead of loaded; each run is what cmd_sample does per call after opening the run, except
// writing the PNG: sample_diffusion (no gradients; per chunk of 64 the labels, the prior, sample_steps - 1 Euler
// steps and the final denoise, each a forward of the doubled batch for classifier-free guidance, the clamp) then
// run.images (nothing in pixel space) and .cpu(). phases_ms.forward = the network's forwards alone on the same
// doubled chunks, measured after the runs (the median of 3 per chunk, times sample_steps): an estimate of the
// model's share. One forward per chunk before the runs warms every chunk's shape up.
json run_one_sample(const BenchCase& c, const OneOptions& o) {
  const int64_t images = o.sizes.images, sample_steps = o.sizes.sample_steps;
  json record;
  {
    TempDir dir("bench_sample");
    record = prepare_default_train(dir.path.string(), o.threads, 0, o.device).record;  // the loader ends here
  }
  set_child_threads(o.threads);
  at::manual_seed(0);
  BackbonePtr model = models::build(record["model"]["architecture"], record["model"]["fields"]);
  model->to(o.device);
  model->eval();
  const diffusion::DiffusionProcess process(*diffusion::presets().build(record["preset"]));
  const auto shape = record["derived"]["sample_shape"].get<std::vector<int64_t>>();
  const int64_t num_classes = record["model"]["fields"].value("num_classes", int64_t(0));
  int64_t nparams = 0;
  for (const auto& p : model->parameters()) nparams += p.numel();
  const DiffusionSampleOptions g = sample_options(shape, num_classes, images, sample_steps);
  dew::validate(g, process);

  // The network alone on each chunk's doubled batch (conditional rows, then the null class): one untimed forward
  // per chunk before the runs (the warm-up of its shape's kernels and allocations), three timed after them.
  const bool guided = g.guidance.scale != 1.0 && g.labels.defined();
  double peak_mb = 0;
  const auto net_forwards = [&](int reps) {
    at::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(3);
    LoopOptions loop;
    loop.steps = reps;
    loop.device = o.device;
    double ms = 0;
    for (int64_t b0 = 0; b0 < images; b0 += g.batch_size) {
      const int64_t n = std::min(g.batch_size, images - b0), rows = guided ? 2 * n : n;
      std::vector<int64_t> xs = {rows};
      xs.insert(xs.end(), shape.begin(), shape.end());
      const at::Tensor x = at::randn(xs, gen).to(o.device);
      const at::Tensor t = at::full({rows}, 500.0f, at::TensorOptions().device(o.device));
      Conditioning cond;
      if (num_classes > 0) {
        const at::Tensor l = g.labels.slice(0, b0, b0 + n);
        cond.labels = (guided ? at::cat({l, at::full_like(l, num_classes)}) : l).to(o.device);
      }
      const Timings f = timed_loop(loop, [&](int64_t, StepClock&) { model->forward(x, t, cond); });
      ms += median(f.total) * 1e3;
      peak_mb = f.peak_rss_mb;
    }
    return ms;  // one forward of every chunk
  };
  net_forwards(1);

  std::optional<at::Tensor> x;  // the run's images, read back after its closing time stamp
  double out = 0;
  const Timings runs = timed_loop(
      loop_of(c, o), [&](int64_t, StepClock&) { x = sample_diffusion(*model, process, g).cpu(); },
      [&](int64_t, StepClock&) {
        out = x->square().mean().item<double>();  // run.images: pixel samples as they are
        DEW_CHECK(x->size(0) == images, "bench sample: ", x->size(0), " images, expected ", images);
        x.reset();
      });
  DEW_CHECK(std::isfinite(out), "bench sample: non-finite samples (mean square ", out, ")");

  const double net = net_forwards(3) / 1e3 * double(sample_steps);  // seconds per sampling run
  const std::vector<double> none(runs.total.size(), 0.0), fwd(runs.total.size(), net);
  return step_result(runs.total, fwd, none, none, images, nparams, out, peak_mb);
}

// --profile FILE.json's second trace for the lm case: FILE.generate.json.
std::string generation_trace(const std::string& profile) {
  const auto dot = profile.rfind('.');
  const auto slash = profile.find_last_of('/');
  const bool ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return (ext ? profile.substr(0, dot) : profile) + ".generate" + (ext ? profile.substr(dot) : ".json");
}

// warmup + steps language-model training steps, then 1 + kLmGenReps greedy generations: the keys of
// run_one_diffusion plus tokens_per_s, gen_ms_per_token and prefill_ms (as bench/lm_peer.py).
json run_one_lm(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes), seq_len = o.sizes.seq_len;
  set_child_threads(o.threads);
  at::manual_seed(0);
  nn::CausalTransformer model(from_json<nn::CausalTransformerOptions>(lm_fields(seq_len), "bench lm"));
  model->to(o.device);
  // The objective of `dew train lm`: chunked fp32 cross entropy (one chunk at this vocabulary), no data
  // (no validation), no samples.
  LMObjectiveOptions lo;
  lo.seq_len = seq_len;
  lo.sample_tokens = 0;
  lo.ema_decay = kEmaDecay;
  auto objective = std::make_shared<LMObjective>(model, nullptr, lo);

  // Fixed random ids stand in for the data loader, as in the diffusion bench.
  auto data_gen = at::detail::createCPUGenerator(1);
  const int64_t vocab = model->options.vocab_size();
  data::Batch batch_data{{"tokens", at::randint(0, vocab, {batch, seq_len + 1}, data_gen)}};
  const at::Tensor prompt_ids = at::randint(0, vocab, {kLmPrompt}, data_gen);
  const TrainerSteps t = time_trainer_steps(objective, batch_data, loop_of(c, o, o.profile), "lm");

  // Generation as `dew generate` runs it: prefill, then one token per forward with the KV cache.
  const std::vector<int64_t> prompt(prompt_ids.data_ptr<int64_t>(), prompt_ids.data_ptr<int64_t>() + kLmPrompt);
  sampling::GenerationOptions go;
  go.max_new_tokens = kLmNewTokens;
  go.temperature = 0;
  LoopOptions gl;
  gl.warmup = 1;
  gl.steps = kLmGenReps;
  gl.device = o.device;
  if (!o.profile.empty()) gl.profile = generation_trace(o.profile);
  // Phases: the generation, the prefill's set-up (not reported), the prefill alone as generate_tokens' first
  // forward runs it. What a step leaves behind is freed after its closing time stamp.
  std::optional<sampling::GenerationResult> res;
  std::optional<nn::KVCache> cache;
  const Timings gen = timed_loop(
      gl,
      [&](int64_t, StepClock& clock) {
        res.emplace(sampling::generate_tokens(*model, {prompt}, go));
        clock.lap();
        DEW_CHECK(res->lengths.at(0) == kLmNewTokens, "bench lm: generated ", res->lengths.at(0), " tokens, expected ",
                  kLmNewTokens);
        model->eval();
        at::NoGradGuard ng;
        cache.emplace();
        clock.lap();
        model->forward_tokens(prompt_ids.view({1, kLmPrompt}).to(o.device), {}, {}, {}, &*cache);
      },
      [&](int64_t, StepClock&) {
        res.reset();
        cache.reset();
      });
  json out = step_result(t.timings.total, t.timings.phase(0), t.timings.phase(1), t.timings.phase(2), batch, t.params,
                         t.loss, gen.peak_rss_mb);
  const double ms = out["ms_per_step"];
  out["tokens_per_s"] = double(batch * seq_len) / (ms / 1e3);
  out["gen_ms_per_token"] = median(gen.phase(0)) * 1e3 / double(kLmNewTokens);
  out["prefill_ms"] = median(gen.phase(2)) * 1e3;
  return out;
}

// warmup + steps JEPA training steps as `dew train jepa` takes them (JEPAObjective: masks drawn each step, the
// target encoder's forward without gradients, context encoder, predictor, MSE; backward; AdamW; the EMA that is
// the target encoder).
json run_one_jepa(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto encoder = models::build_token_encoder(jepa_recipe()["model"]);
  auto predictor = models::build_token_predictor(jepa_recipe()["predictor"]);
  encoder->to(o.device);
  predictor->to(o.device);
  auto objective = std::make_shared<JEPAObjective>(encoder, predictor, jepa_objective_options());
  auto data_gen = at::detail::createCPUGenerator(1);
  data::Batch b{{"image", at::randint(0, 256, {batch, 1, kImage, kImage}, data_gen).to(at::kByte)}};
  return trainer_result(time_trainer_steps(objective, b, loop_of(c, o), "jepa"), batch);
}

// The byte causal_transformer of `dew train dpo` / `grpo` (post_training_fields), on `device`.
nn::CausalTransformer post_training_model(const c10::Device& device) {
  nn::CausalTransformer model(from_json<nn::CausalTransformerOptions>(post_training_fields(), "bench post-training"));
  model->to(device);
  return model;
}

// warmup + steps DPO training steps as `dew train dpo` takes them (DPOObjective with its defaults: beta 0.1, the
// reference's log-probs per batch: the frozen reference's forward on the 2B rows without gradient, the policy's
// forward, the completion tokens' summed log-probs, the sigmoid loss and its metrics; backward; AdamW; the
// trainer's EMA, which is the frozen reference and never moves): the keys of run_one_diffusion plus tokens_per_s
// (policy tokens, 2 x batch x kDpoLen per step).
json run_one_dpo(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto model = post_training_model(o.device);
  // Fixed pairs stand in for the loader (preference_rows' layout): random bytes, a shared prompt, the last
  // kDpoCompletion tokens of each row the chosen (row 0) or rejected (row 1) completion.
  auto data_gen = at::detail::createCPUGenerator(1);
  at::Tensor ids = at::randint(0, 256, {batch, 2, kDpoLen}, data_gen);  // [B, 2, kDpoLen]
  const int64_t prompt_len = kDpoLen - kDpoCompletion;
  ids.select(1, 1).narrow(1, 0, prompt_len).copy_(ids.select(1, 0).narrow(1, 0, prompt_len));
  at::Tensor mask = at::zeros({batch, 2, kDpoLen}, at::kBool);
  mask.narrow(2, prompt_len, kDpoCompletion).fill_(true);
  data::Batch rows{{"ids", ids}, {"completion_mask", mask}, {"index", at::arange(batch, at::kLong)}};
  auto objective = std::make_shared<DPOObjective>(model, DPOObjectiveOptions{}, rows, nullptr);
  // The trainer builds its EMA from objective->ema() (the frozen reference) and binds it.
  json out = trainer_result(time_trainer_steps(objective, rows, loop_of(c, o), "dpo"), batch);
  out["tokens_per_s"] = double(2 * batch * kDpoLen) / (out["ms_per_step"].get<double>() / 1e3);
  return out;
}

// warmup + steps GRPO rollouts' generation as GRPOObjective takes it (roll_out: every prompt repeated group_size
// times, one generate_tokens call on all the rows: prefill, then one batched token per forward with the KV cache,
// sampled at temperature 1 from a seeded generator; eos_id -1 here, so every row generates kGrpoNewTokens
// tokens): ms_per_step = ms per rollout, tokens_per_s = generated tokens per second, prefill_ms = the prompts'
// forward alone (median).
json run_one_grpo_rollout(const BenchCase& c, const OneOptions& o) {
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto model = post_training_model(o.device);
  int64_t nparams = 0;
  for (const auto& p : model->parameters()) nparams += p.numel();
  auto data_gen = at::detail::createCPUGenerator(1);
  const at::Tensor prompt_ids = at::randint(0, 256, {kGrpoPrompts, kGrpoPromptLen}, data_gen);
  std::vector<std::vector<int64_t>> rows;  // [prompt 0] x group, [prompt 1] x group, ... as GRPOObjective
  for (int64_t i = 0; i < kGrpoPrompts; ++i) {
    const int64_t* p = prompt_ids[i].data_ptr<int64_t>();
    for (int64_t k = 0; k < kGrpoGroup; ++k) rows.emplace_back(p, p + kGrpoPromptLen);
  }
  const int64_t n = int64_t(rows.size());
  const at::Tensor all_ids = prompt_ids.repeat_interleave(kGrpoGroup, 0).to(o.device);  // [n, P]
  sampling::GenerationOptions go;  // GRPOObjectiveOptions' defaults: temperature 1, top-p 1, top-k 0
  go.max_new_tokens = kGrpoNewTokens;
  go.temperature = 1.0;
  go.eos_id = -1;
  // Phases: the rollout, its checks and the prefill's set-up (not reported), the prefill alone (all prompts the
  // same length: no padding). What a step leaves behind is freed after its closing time stamp.
  std::optional<sampling::GenerationResult> res;
  std::optional<nn::KVCache> cache;
  const Timings t = timed_loop(
      loop_of(c, o),
      [&](int64_t i, StepClock& clock) {
        go.seed = uint64_t(i);
        res.emplace(sampling::generate_tokens(*model, rows, go));
        clock.lap();
        for (int64_t r = 0; r < n; ++r)
          DEW_CHECK(res->lengths.at(size_t(r)) == kGrpoNewTokens, "bench grpo_rollout: row ", r, " generated ",
                    res->lengths.at(size_t(r)), " tokens, expected ", kGrpoNewTokens);
        model->eval();
        at::NoGradGuard ng;
        cache.emplace();
        clock.lap();
        model->forward_tokens(all_ids, {}, {},
                              at::ones({n, kGrpoPromptLen}, at::TensorOptions().dtype(at::kBool).device(o.device)),
                              &*cache);
      },
      [&](int64_t, StepClock&) {
        res.reset();
        cache.reset();
      });
  const std::vector<double>& rollout = t.phase(0);
  const std::vector<double> none(rollout.size(), 0.0);
  json out = step_result(rollout, rollout, none, none, n, nparams, 0.0, t.peak_rss_mb);
  out["tokens_per_s"] = double(n * kGrpoNewTokens) / (out["ms_per_step"].get<double>() / 1e3);
  out["prefill_ms"] = median(t.phase(2)) * 1e3;
  return out;
}

// The training process of diffusers' train_text_to_image.py in dew's terms: SD's scaled_linear betas over
// kSdTrainTimesteps steps (DDPMScheduler.add_noise's alphas_cumprod), epsilon prediction, every timestep weighted
// alike.
diffusion::Preset sd_unet_preset() {
  diffusion::DiscreteOptions d;
  d.timesteps = kSdTrainTimesteps;
  d.beta_range = std::make_pair(kSdBetaStart, kSdBetaEnd);
  diffusion::Preset p;
  p.name = "sd_train_text_to_image";
  p.train = p.sample = diffusion::schedules().build("scaled_linear", to_json(d));
  p.transform = diffusion::make_transform("epsilon");
  p.weighting = diffusion::weightings().build("constant", json::object());
  p.spec = {{"name", p.name}};
  return p;
}

// warmup + steps training steps of sd_unet as diffusers' train_text_to_image.py takes them (epsilon prediction):
// noise ~ N(0, I), timesteps uniform in [0, 1000), the noisy latents sqrt(alpha_bar_t) latents +
// sqrt(1 - alpha_bar_t) noise and the loss from dew's DiffusionProcess (the code `dew train` runs), the UNet on
// (noisy, t, text), MSE against the noise; backward; AdamW (lr kSdLr); the fp32 EMA; zero_grad. A fixed batch of
// latents and text embeddings stands in for the VAE, the text encoder and the data.
// sd_unet_lora, as train_text_to_image_lora.py: LoRA adapters (nn::apply_lora of sd_unet_lora_options()), the base
// frozen; AdamW on the adapters only, their gradient norm clipped to kSdLoraGradClip in the backward phase; no EMA.
json run_one_sd_unet(const BenchCase& c, const OneOptions& o) {
  const bool lora = c.kind == CaseKind::sd_unet_lora;
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto unet = models::build(c.arch, c.fields);
  if (lora) nn::apply_lora(*unet, sd_unet_lora_options());
  unet->to(o.device);
  unet->train();
  training::NamedTensors params;  // what trains: every parameter, or the adapters
  int64_t nparams = 0, trainable = 0;
  for (const auto& kv : unet->named_parameters()) {
    nparams += kv.value().numel();
    if (!kv.value().requires_grad()) continue;
    params.emplace_back(kv.key(), kv.value());
    trainable += kv.value().numel();
  }
  training::OptimOptions oo;
  oo.lr = kSdLr;
  training::Optimizer opt(params, oo);
  std::optional<training::EMA> ema;
  if (!lora) ema.emplace(params, training::EmaSpec{kEmaDecay});
  const diffusion::DiffusionProcess process(sd_unet_preset());
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor latents = at::randn(shape, data_gen).to(o.device);  // [B, 4, h, w]
  Conditioning cond;
  cond.context = at::randn({batch, c.context_len, sd_unet_config().at("cross_attention_dim").get<int64_t>()}, data_gen)
                     .to(o.device);  // [B, L, D]
  auto step_gen = at::detail::createCPUGenerator(2);

  // Phases: forward (the inputs, the UNet and the loss), backward (LoRA: with the clip), optimizer (AdamW, the
  // EMA, zero_grad).
  std::optional<at::Tensor> loss;
  double loss_value = 0;
  const Timings t = timed_loop(
      loop_of(c, o, o.profile),
      [&](int64_t i, StepClock& clock) {
        const at::Tensor noise = at::randn(latents.sizes(), step_gen).to(o.device);
        const at::Tensor timesteps = at::randint(0, kSdTrainTimesteps, {batch}, step_gen);  // [B] on the CPU
        const diffusion::TrainingInputs in = process.training_inputs(latents, timesteps, noise);
        // The process's loss is half the squared error; diffusers' is the plain MSE.
        loss.emplace(2 * process.loss(unet->forward(in.net_input, in.model_time, cond), in));
        clock.lap();
        loss->backward();
        if (lora) training::clip_grad_norm(params, kSdLoraGradClip);
        clock.lap();
        opt.step(kSdLr);
        if (ema) ema->update(params, i);
        opt.zero_grad();
      },
      [&](int64_t, StepClock&) {
        loss_value = loss->item<double>();
        loss.reset();
      });
  DEW_CHECK(std::isfinite(loss_value), "bench ", c.name, ": non-finite loss ", loss_value);
  json out = step_result(t.total, t.phase(0), t.phase(1), t.phase(2), batch, nparams, loss_value, t.peak_rss_mb);
  out["trainable"] = trainable;
  return out;
}

// Qwen-Image sampling as QwenImage21Pipeline runs it, on the trained bench model in eval mode: one image of `item`
// latents under a kQwenSampleText-token prompt, kQwenSampleSteps Euler steps over sigmas linspace(1, 1/n, n) then
// 0 (the model at 1000 sigma), without guidance; once recomputing the text every step, once with the prefix KV
// cache (extract on the first step, cached after). One untimed run of each, then kQwenSampleReps timed runs of each
// alternating. Adds sample_ms and sample_cached_ms (median ms per step) and sample_cache_max_diff (the two runs'
// final latents apart) to `out`.
void qwen_image_sampling(nn::QwenImageTransformerImpl& model, int64_t text_width, const std::vector<int64_t>& item,
                         const c10::Device& device, json& out) {
  model.eval();
  at::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(3);
  const at::Tensor x0 = at::randn({1, item[0], item[1], item[2]}, gen).to(device);
  Conditioning cond;
  cond.context = at::randn({1, kQwenSampleText, text_width}, gen).to(device);
  std::vector<double> sigmas;
  for (int64_t i = 0; i < kQwenSampleSteps; ++i)
    sigmas.push_back(1.0 + double(i) * (1.0 / double(kQwenSampleSteps) - 1.0) / double(kQwenSampleSteps - 1));
  sigmas.push_back(0.0);
  auto run = [&](bool cache) {
    at::Tensor x = x0.clone();
    nn::QwenImageKVCache kv;
    for (int64_t i = 0; i < kQwenSampleSteps; ++i) {
      const at::Tensor t = at::full({1}, 1000.0 * sigmas[size_t(i)], x.options());
      const at::Tensor v = !cache   ? model.forward(x, t, cond)
                           : i == 0 ? model.forward_extract(x, t, cond, kv)
                                    : model.forward_cached(x, t, cond, kv);
      x = x + (sigmas[size_t(i) + 1] - sigmas[size_t(i)]) * v;
    }
    return x;
  };
  const at::Tensor plain = run(false), cached = run(true);  // untimed
  std::vector<double> plain_s, cached_s;
  for (int64_t r = 0; r < kQwenSampleReps; ++r) {
    for (bool cache : {false, true}) {
      const auto t0 = synced_now(device);
      run(cache);
      (cache ? cached_s : plain_s).push_back(std::chrono::duration<double>(synced_now(device) - t0).count());
    }
  }
  out["sample_ms"] = median(plain_s) * 1e3 / double(kQwenSampleSteps);
  out["sample_cached_ms"] = median(cached_s) * 1e3 / double(kQwenSampleSteps);
  out["sample_cache_max_diff"] = (plain - cached).abs().max().item<double>();
}

// warmup + steps training steps of sd3 or flux as diffusers' train_dreambooth_sd3.py / train_dreambooth_flux.py take
// them (flow matching without output preconditioning; the flow preset's continuous sigmas where the scripts index
// a scheduler table): sigma ~ logit-normal(0, 1) and noise ~ N(0, I) drawn, noisy = (1 - sigma) latents + sigma
// noise, the transformer on (noisy, 1000 sigma, text, pooled; Flux: guidance kFlowGuidance, its latents packed into
// 2 x 2 tokens and unpacked inside forward, as the script does around the call), MSE against noise - latents;
// backward; the global gradient norm clipped to kFlowGradClip; AdamW (lr kFlowLr, weight decay kFlowWeightDecay);
// zero_grad. No EMA (the scripts keep none). A fixed batch of latents, text states and pooled text stands in for
// the VAE and the text encoders. The noising and the loss are dew's DiffusionProcess under the flow preset, the code
// `dew train diffusion` runs with that preset.
json run_one_flow_transformer(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto model = models::build(c.arch, c.fields);
  model->to(o.device);
  model->train();
  training::NamedTensors params;
  int64_t nparams = 0;
  for (const auto& kv : model->named_parameters()) {
    params.emplace_back(kv.key(), kv.value());
    nparams += kv.value().numel();
  }
  training::OptimOptions oo;
  oo.lr = kFlowLr;
  oo.weight_decay = kFlowWeightDecay;
  oo.grad_clip = kFlowGradClip;
  training::Optimizer opt(params, oo);
  // The flow preset as it stands: logit-normal(0, 1) sigmas, shift 1, velocity target eps - x0, weight 1.
  const diffusion::DiffusionProcess process(diffusion::preset("flow", diffusion::PresetOptions{}));
  const json& config = reference_config(c);
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor latents = at::randn(shape, data_gen).to(o.device);  // [B, 16, 32, 32]
  Conditioning cond;
  const int64_t text_width = flow_text_width(config).get<int64_t>();
  cond.context = at::randn({batch, c.context_len, text_width}, data_gen).to(o.device);  // [B, L, D]
  if (config.contains("pooled_projection_dim"))
    cond.pooled = at::randn({batch, config.at("pooled_projection_dim").get<int64_t>()}, data_gen).to(o.device);
  if (config.value("guidance_embeds", false))
    cond.extra["guidance"] = at::full({batch}, kFlowGuidance, at::TensorOptions().device(o.device));
  auto step_gen = at::detail::createCPUGenerator(2);

  // Phases: forward (the inputs, the transformer and the loss), backward (with the clip), optimizer (AdamW,
  // zero_grad).
  std::optional<at::Tensor> loss;
  double loss_value = 0;
  const Timings t = timed_loop(
      loop_of(c, o, o.profile),
      [&](int64_t, StepClock& clock) {
        const diffusion::TrainingInputs in = process.training_inputs(latents, step_gen);
        // The process's loss is half the squared error; the scripts' is the plain MSE.
        loss.emplace(2 * process.loss(model->forward(in.net_input, in.model_time, cond), in));
        clock.lap();
        loss->backward();
        training::clip_grad_norm(params, kFlowGradClip);
        clock.lap();
        opt.step(kFlowLr);
        opt.zero_grad();
      },
      [&](int64_t, StepClock&) {
        loss_value = loss->item<double>();
        loss.reset();
      });
  DEW_CHECK(std::isfinite(loss_value), "bench ", c.name, ": non-finite loss ", loss_value);
  json sampling = json::object();
  if (c.kind == CaseKind::qwen_image) {
    auto* qwen = dynamic_cast<nn::QwenImageTransformerImpl*>(model.get());
    DEW_CHECK(qwen, "bench ", c.name, ": not a qwen_image_transformer");
    qwen_image_sampling(*qwen, text_width, c.item, o.device, sampling);
  }
  // after the sampling: step_result's BLAS probe turns oneMKL's verbose mode on and off, after which oneMKL still
  // prints the first calls of routines it had not run yet (the sampling's matrix-vector products)
  json out = step_result(t.total, t.phase(0), t.phase(1), t.phase(2), batch, nparams, loss_value, t.peak_rss_mb);
  out.update(sampling);
  return out;
}

// warmup + steps encode + decode passes of sd_vae without gradients, as a pipeline runs them:
// z = to_latent(encode(x).sample(gen)) (scaling_factor z), x_hat = decode(from_latent(z)). Phases forward = encode
// (with the sample), backward = decode, optimizer 0; loss = mean(x_hat^2).
json run_one_sd_vae(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  auto vae = models::build_autoencoder({{"architecture", c.arch}, {"fields", c.fields}});
  vae->to(o.device);
  vae->eval();
  int64_t nparams = 0;
  for (const auto& p : vae->parameters()) nparams += p.numel();
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor x = (at::rand(shape, data_gen) * 2 - 1).to(o.device);  // [B, 3, H, W] in [-1, 1]
  auto sample_gen = at::detail::createCPUGenerator(2);
  at::NoGradGuard no_grad;
  std::optional<at::Tensor> x_hat;
  double out = 0;
  const Timings t = timed_loop(
      loop_of(c, o, o.profile),
      [&](int64_t, StepClock& clock) {
        const at::Tensor z = vae->to_latent(vae->encode(x).sample(sample_gen));
        clock.lap();
        x_hat.emplace(vae->decode(vae->from_latent(z)));
      },
      [&](int64_t, StepClock&) {
        out = x_hat->square().mean().item<double>();
        x_hat.reset();
      });
  DEW_CHECK(std::isfinite(out), "bench sd_vae: non-finite output ", out);
  const std::vector<double> none(t.total.size(), 0.0);
  return step_result(t.total, t.phase(0), t.phase(1), none, batch, nparams, out, t.peak_rss_mb);
}

// FID's feature extraction: pytorch-fid's forward (resize to 299, 2x - 1, the network to pool3) timed in two
// phases, the resize and the network, on fixed random images in [0, 1].
json run_one_fid(const BenchCase& c, const OneOptions& o) {
  const int64_t batch = batch_of(c, o.sizes);
  set_child_threads(o.threads);
  at::manual_seed(0);
  metrics::InceptionV3 net;
  net->to(o.device);
  net->eval();
  int64_t nparams = 0;
  for (const auto& p : net->parameters()) nparams += p.numel();
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor x = at::rand(shape, data_gen).to(o.device);  // [B, 3, H, W] in [0, 1]
  at::NoGradGuard no_grad;
  std::optional<at::Tensor> feats;
  double out = 0;
  const Timings t = timed_loop(
      loop_of(c, o, o.profile),
      [&](int64_t, StepClock& clock) {
        const at::Tensor r =
            2 * at::upsample_bilinear2d(x, at::IntArrayRef{299, 299}, false, std::nullopt, std::nullopt) - 1;
        clock.lap();
        feats.emplace(net->pool3(r));
      },
      [&](int64_t, StepClock&) {
        out = feats->square().mean().item<double>();
        feats.reset();
      });
  DEW_CHECK(std::isfinite(out), "bench fid: non-finite output ", out);
  const std::vector<double> none(t.total.size(), 0.0);
  return step_result(t.total, t.phase(0), t.phase(1), none, batch, nparams, out, t.peak_rss_mb);
}

}  // namespace

json run_one(const BenchCase& c, const OneOptions& o) {
  switch (c.kind) {
    case CaseKind::lm: return run_one_lm(c, o);
    case CaseKind::jepa: return run_one_jepa(c, o);
    case CaseKind::dpo: return run_one_dpo(c, o);
    case CaseKind::grpo_rollout: return run_one_grpo_rollout(c, o);
    case CaseKind::sd_unet:
    case CaseKind::sd_unet_lora: return run_one_sd_unet(c, o);
    case CaseKind::sd_vae: return run_one_sd_vae(c, o);
    case CaseKind::sd3:
    case CaseKind::flux:
    case CaseKind::qwen_image: return run_one_flow_transformer(c, o);
    case CaseKind::train: return run_default_train(c, o, /*data_parallel=*/false);
    case CaseKind::ddp: return run_default_train(c, o, /*data_parallel=*/true);
    case CaseKind::sample: return run_one_sample(c, o);
    case CaseKind::fid: return run_one_fid(c, o);
    case CaseKind::diffusion: return run_one_diffusion(c, o);
  }
  fail("bench: case \"", c.name, "\" has no measured child");
}

}  // namespace dew::bench
