#include "dew/training/trainer.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <ATen/autocast_mode.h>

#include "dew/core/log.h"
#include "dew/core/rng.h"
#include "dew/io/files.h"
#include "dew/io/stops.h"
#include "dew/io/tensorboard.h"
#include "dew/io/weights.h"
#include "dew/training/run_dir.h"

namespace dew::training {

using io::stop_requested;

namespace {

// Autocast on or off for one device type (CPU or CUDA), in `dtype` when on.
void set_autocast(c10::DeviceType type, bool enabled, at::ScalarType dtype) {
  if (enabled) at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, enabled);
}

// Mixed precision of the forward (docs/core.md: bf16 by default on CUDA). On the CPU only when asked
// (`bfloat16`, as torch.autocast("cpu")): measured no faster there (docs/benchmarks.md). Restores the previous
// autocast state at scope exit.
struct AutocastScope {
  c10::DeviceType type = c10::kCPU;
  bool on = false;
  AutocastScope(const std::string& mode, const c10::Device& device) : type(device.type()) {
    if (mode == "off" || (mode == "auto" && !device.is_cuda())) return;
    set_autocast(type, true, mode == "float16" ? at::kHalf : at::kBFloat16);
    on = true;
  }
  ~AutocastScope() {
    if (!on) return;
    set_autocast(type, false, at::kBFloat16);
    at::autocast::clear_cache();
  }
};

// A metric for the progress lines: 4 significant digits; whole numbers (counts of items, tokens) in full.
std::string format_metric(double x) {
  char buf[32];
  const bool whole = std::isfinite(x) && std::fabs(x) < 1e15 && x == std::floor(x);
  std::snprintf(buf, sizeof buf, whole ? "%.0f" : "%.4g", x);
  return buf;
}

// Markdown of a preformatted text for TensorBoard's text dashboard: indented four spaces, a code block.
std::string tensorboard_code_block(const std::string& text) {
  std::string out = "    ";
  for (char c : text) out += c == '\n' ? std::string("\n    ") : std::string(1, c);
  return out;
}

std::string format_duration(double s) {
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(s) % 60);
  return buf;
}

}  // namespace

void validate(const TrainerOptions& o) {
  DEW_CHECK(o.steps >= 1, "trainer.steps: must be >= 1, got ", o.steps);
  DEW_CHECK(o.accumulation >= 1, "trainer.accumulation: must be >= 1, got ", o.accumulation);
  DEW_CHECK(o.log_every >= 1, "trainer.log_every: must be >= 1, got ", o.log_every);
  DEW_CHECK(o.val_every >= 0, "trainer.val_every: must be >= 0, got ", o.val_every);
  DEW_CHECK(o.checkpoint_every >= 1, "trainer.checkpoint_every: must be >= 1, got ", o.checkpoint_every);
  DEW_CHECK(o.keep_checkpoints >= 1, "trainer.keep_checkpoints: must be >= 1, got ", o.keep_checkpoints);
  DEW_CHECK(o.max_bad_loss_steps >= 1, "trainer.max_bad_loss_steps: must be >= 1, got ", o.max_bad_loss_steps);
  DEW_CHECK(o.time_limit_minutes >= 0, "trainer.time_limit_minutes: must be >= 0, got ", o.time_limit_minutes);
}

void check_autocast(const std::string& mode, const c10::Device& device) {
  DEW_CHECK(device.is_cuda() || mode != "float16", "trainer.autocast: float16 runs on CUDA only, got it with device ",
            device.str(), "; accepted on the CPU: auto, off, bfloat16");
}

void truncate_metrics(const std::string& run_dir, int64_t step) {
  io::truncate_jsonl(RunDir(run_dir).metrics(), step);
  io::truncate_event_files(RunDir(run_dir).tensorboard(), step, {"recipe"});
}

TensorMap module_state(torch::nn::Module& m) {
  TensorMap out;
  for (const auto& kv : m.named_parameters()) out[kv.key()] = kv.value().detach();
  for (const auto& kv : m.named_buffers()) out[kv.key()] = kv.value().detach();
  return out;
}

Trainer::Trainer(ObjectivePtr objective, std::shared_ptr<data::DataLoader> loader, OptimOptions optim,
                 TrainerOptions options, std::string run_dir, uint64_t seed)
    : obj_(std::move(objective)),
      loader_(std::move(loader)),
      oo_(std::move(optim)),
      to_(std::move(options)),
      run_dir_(std::move(run_dir)),
      seed_(seed) {
  validate(to_);
  for (const auto& kv : obj_->module().named_parameters())
    if (kv.value().requires_grad()) params_.emplace_back(kv.key(), kv.value());
  DEW_CHECK(!params_.empty(), "objective ", obj_->name(), " has no trainable parameters");
  check_autocast(to_.autocast, params_.front().second.device());
  opt_ = std::make_unique<Optimizer>(params_, oo_);
  ema_ = std::make_unique<EMA>(params_, obj_->ema(), to_.steps);
  obj_->bind_ema(ema_->averages());
}

void Trainer::set_adapter_checkpoints(json lora) { lora_ = std::move(lora); }

void Trainer::restore(const Checkpoint& c) {
  const std::string where = run_dir_ + " step_" + std::to_string(c.step) + "/model.safetensors";
  if (lora_.is_null()) {
    io::load_weights(obj_->module(), io::WeightSource::of_tensors(c.model, where));
  } else {
    // The adapters alone, every one present and nothing else: the base is already in the module.
    DEW_CHECK(c.state.contains("lora"), where, " holds a whole model, not the LoRA adapters this run trains");
    DEW_CHECK(c.model.size() == params_.size(), where, " holds ", c.model.size(), " tensors; the run trains ",
              params_.size(), " adapter parameters");
    at::NoGradGuard ng;
    for (auto& [name, p] : params_) {
      auto it = c.model.find(name);
      DEW_CHECK(it != c.model.end(), where, ": missing the adapter \"", name, "\"");
      DEW_CHECK(it->second.sizes() == p.sizes(), where, ": \"", name, "\" has shape ", it->second.sizes(),
                ", the run's adapter ", p.sizes());
      p.copy_(it->second);
    }
  }
  at::NoGradGuard ng;
  for (auto& [name, avg] : ema_->averages()) {
    auto it = c.ema.find(name);
    DEW_CHECK(it != c.ema.end(), "checkpoint step_", c.step, "/ema.safetensors: missing \"", name, "\"");
    avg.copy_(it->second);
  }
  opt_->load_state_dict(c.optimizer);
  step_ = c.step;
  bad_total_ = c.state.value("bad_loss_steps_total", int64_t(0));
  bad_consecutive_ = c.state.value("bad_loss_steps_consecutive", int64_t(0));
  best_ = c.state.contains("best") ? c.state["best"] : json(nullptr);
  if (c.state.contains("data")) loader_->load_state(c.state["data"]);
  obj_->load_state(c.objective);
}

void Trainer::set_distributed(std::shared_ptr<Distributed> dist) {
  if (dist) check_global_batch(loader_->options().batch_size, dist->world_size());
  if (dist) obj_->bind_distributed(dist);
  dist_ = std::move(dist);
}

std::string Trainer::save() {
  if (dist_ && !dist_->is_main()) return RunDir(run_dir_).checkpoint(step_);  // rank 0 writes
  Checkpoint c;
  c.step = step_;
  if (lora_.is_null()) {
    c.model = module_state(obj_->module());
  } else {
    for (const auto& [name, p] : params_) c.model[name] = p.detach();
  }
  c.ema = ema_->averages();
  c.optimizer = opt_->state_dict();
  c.objective = obj_->state();
  c.state = {{"data", loader_->state()},
             {"ema_role", ema_->spec().reference ? "reference" : "average"},
             {"seed", seed_},
             {"bad_loss_steps_total", bad_total_},
             {"bad_loss_steps_consecutive", bad_consecutive_},
             {"best", best_}};
  if (!lora_.is_null()) c.state["lora"] = lora_;
  return save_checkpoint(run_dir_, c, to_.keep_checkpoints);
}

StepOutcome Trainer::train_step() {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  if (!begun_) {
    obj_->begin(step_, run_dir_);
    begun_ = true;
  }
  const c10::Device device = params_.front().second.device();
  StepOutcome out;
  auto t = clock::now();
  out.lr = learning_rate(oo_, step_, to_.steps);
  opt_->zero_grad();
  auto t1 = clock::now();
  out.update_s += secs(t, t1);
  t = t1;
  for (int64_t k = 0; k < to_.accumulation; ++k) {
    auto batch = loader_->next();
    t1 = clock::now();
    out.data_s += secs(t, t1);
    t = t1;
    const uint64_t micro = uint64_t(step_) * uint64_t(to_.accumulation) + uint64_t(k);
    // The same generators on every rank: each draws for the global batch and keeps its rows.
    auto gen = rng::generator(seed_, micro, "objective");
    // Dropout draws from the default generators: seeded per micro-batch, so a resumed run draws the same.
    rng::DefaultGeneratorScope dropout_draws(seed_, micro, "dropout");
    const int64_t rows = batch.begin()->second.size(0);
    // Data-parallel: this rank's contiguous rows of the global batch, and their share of it (an epoch's last
    // partial batch may split unevenly; the share weights each rank's mean so the sum is the global mean).
    const int64_t world = dist_ ? dist_->world_size() : 1, rank = dist_ ? dist_->rank() : 0;
    const int64_t begin = rows * rank / world, end = rows * (rank + 1) / world;
    DEW_CHECK(end > begin, "data-parallel: a batch of ", rows, " rows at step ", step_, " leaves rank ", rank, " of ",
              world, " no rows; use a dataset and batch size giving every batch at least ", world,
              " rows (set the loader's drop_last)");
    const double share = double(end - begin) / double(rows);
    LossOutput lo;
    {
      AutocastScope autocast(to_.autocast, device);
      lo = dist_ ? obj_->loss_of_rows(batch, begin, end, step_, gen) : obj_->loss(batch, step_, gen);
    }
    double l = lo.loss.item<double>();
    bool finite = std::isfinite(l);
    std::map<std::string, double> metrics = lo.metrics;
    if (dist_) {
      // One all-reduce per micro-batch: any rank's non-finite loss skips the step on every rank, and the
      // logged loss and metrics are those of the global batch.
      const auto tc = clock::now();
      std::vector<double> v{finite ? 0.0 : 1.0, finite ? l * share : 0.0};
      for (auto& [name, x] : metrics) v.push_back(finite ? x * share : 0.0);
      v = dist_->sum(v);
      finite = v[0] == 0;
      l = v[1];
      size_t i = 2;
      for (auto& [name, x] : metrics) x = v[i++];
      out.collective_s += secs(tc, clock::now());
    }
    t1 = clock::now();
    out.loss_s += secs(t, t1);
    t = t1;
    if (!finite) {
      out.finite = false;
      break;
    }
    // Each rank's share times the world size: after the average over the ranks the gradient is that of the
    // global batch's mean loss.
    if (dist_ && k + 1 == to_.accumulation) dist_->arm_overlap(params_);  // all-reduces start during backward
    if (dist_) (lo.loss * (share * double(world) / double(to_.accumulation))).backward();
    else (lo.loss / double(to_.accumulation)).backward();
    out.loss += l / double(to_.accumulation);
    for (auto& [name, x] : metrics) out.metrics[name] += x / double(to_.accumulation);
    out.samples += rows;
    t1 = clock::now();
    out.backward_s += secs(t, t1);
    t = t1;
  }
  if (!out.finite) {
    // Skip the update entirely: no optimizer or EMA change, the step's data is consumed.
    opt_->zero_grad();
    ++bad_total_;
    ++bad_consecutive_;
    log::warn("step ", step_, ": non-finite loss, update skipped (", bad_consecutive_, " in a row, ", bad_total_,
              " total)");
    if (bad_consecutive_ >= to_.max_bad_loss_steps) {
      const std::string last = save();
      fail("training stopped: ", bad_consecutive_, " consecutive non-finite losses at step ", step_,
           " (trainer.max_bad_loss_steps = ", to_.max_bad_loss_steps, "); last checkpoint ", last);
    }
    ++step_;
    out.update_s += secs(t, clock::now());
    return out;
  }
  bad_consecutive_ = 0;
  if (dist_) {
    // Once per optimizer step (after every micro-batch): identical gradients on every rank from here on, so
    // clipping, the optimizer, the EMA and the schedule stay identical too.
    const auto tc = clock::now();
    dist_->average_gradients(params_);
    out.allreduce_s = secs(tc, clock::now());
    out.allreduce_inflight_s = dist_->overlapped_share() > 0 ? dist_->inflight_seconds() : out.allreduce_s;
    out.collective_s += out.allreduce_s;
  }
  out.grad_norm = clip_grad_norm(params_, oo_.grad_clip);
  t1 = clock::now();
  out.backward_s += secs(t, t1);
  t = t1;
  opt_->step(out.lr);
  ema_->update(params_, step_);
  ++step_;
  out.update_s += secs(t, clock::now());
  return out;
}

TrainResult Trainer::fit() {
  namespace fs = std::filesystem;
  // Rank 0 alone writes the run directory; the other ranks only read its checkpoint when they resume.
  const bool main = !dist_ || dist_->is_main();
  if (main) fs::create_directories(run_dir_);
  const ResumePoint resume = resume_point(run_dir_, to_.strict_resume);
  for (const auto& [step, damage] : resume.damaged) {
    // Rank 0 sets it aside; every rank skips it, so all resume from the same step.
    const std::string aside = main ? set_aside_checkpoint(run_dir_, step) : std::string();
    log::warn("checkpoint ", RunDir(run_dir_).checkpoint(step), " is damaged (", damage, ")",
              aside.empty() ? std::string() : "; set aside as " + aside, "; resuming from step_", resume.step,
              " (trainer.strict_resume refuses instead)");
  }
  if (resume.step >= 0) {
    restore(load_checkpoint(run_dir_, resume.step));
    log::info("resuming ", run_dir_, " from step ", step_);
  }
  // Every rank starts from rank 0's weights (a fresh run's are already equal: initialisation is seeded).
  if (dist_) dist_->broadcast_module(obj_->module());
  // What a killed process logged past its last checkpoint is logged again by this one.
  if (main) truncate_metrics(run_dir_, step_);
  obj_->begin(step_, run_dir_);
  begun_ = true;
  TrainResult res;
  // The first SIGINT / SIGTERM asks the loop to checkpoint and return after the current step; a second one
  // stops the process at once, by the signal's default action.
  io::StopScope signals(io::OnStop::kAfterStep);
  std::ofstream metrics;
  if (main) metrics.open(RunDir(run_dir_).metrics(), std::ios::app);
  // TensorBoard follows metrics.jsonl (truncated with it above): one event file per start, the recipe (run.json)
  // as text at the start's step, every numeric field of every metrics line as a scalar, the preview the
  // validation wrote as an image (png) or text (txt). Rank 0 alone writes both.
  std::unique_ptr<io::EventWriter> tb;
  if (main && to_.tensorboard == "on") {
    tb = std::make_unique<io::EventWriter>(RunDir(run_dir_).tensorboard());
    if (fs::exists(RunDir(run_dir_).record()))
      tb->add_text("recipe", step_, tensorboard_code_block(read_run_json(run_dir_).dump(2)));
  }
  // One metrics line: metrics.jsonl, then TensorBoard (step is the x axis, time TensorBoard's wall time).
  auto log_line = [&](const json& line) {
    if (!main) return;
    metrics << line.dump() << "\n" << std::flush;
    if (!tb) return;
    for (auto it = line.begin(); it != line.end(); ++it)
      if (it->is_number() && it.key() != "step" && it.key() != "time")
        tb->add_scalar(it.key(), step_, it->get<double>());
  };
  auto log_preview = [&] {
    if (!tb) return;
    const std::string png = RunDir(run_dir_).sample(step_, ".png"), txt = RunDir(run_dir_).sample(step_, ".txt");
    if (fs::exists(png)) tb->add_image_png("samples", step_, io::read_file(png, "sample grid"));
    if (fs::exists(txt)) tb->add_text("samples", step_, tensorboard_code_block(io::read_file(txt, "samples")));
  };
  const auto t0 = std::chrono::steady_clock::now();
  // What ends the run: the step count, or the time limit if it comes first.
  if (main && to_.time_limit_minutes > 0)
    log::info("training to step ", to_.steps, " or for ", to_.time_limit_minutes,
              " minutes, whichever ends first (trainer.time_limit_minutes)");
  else if (main) log::info("training to step ", to_.steps);
  const std::vector<std::string> shown = obj_->progress_metrics();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  const int64_t start = step_;
  int64_t window_samples = 0;
  double window_loss = 0, window_start = 0;
  int64_t window_steps = 0;
  double window_collective = 0, window_busy = 0;
  std::map<std::string, double> window_metrics;

  // Validation runs the EMA weights, except where the EMA is a frozen reference (post-training).
  const bool swap = !ema_->spec().reference;
  auto run_validation = [&] {
    if (!main) return;  // previews and validation metrics are rank 0's
    if (swap) ema_->swap_into(params_);
    std::map<std::string, double> v;
    try {
      torch::NoGradGuard ng;
      v = obj_->validate(step_, run_dir_);
    } catch (...) {
      if (swap) ema_->swap_into(params_);
      throw;
    }
    if (swap) ema_->swap_into(params_);
    json line = {{"step", step_}, {"time", elapsed()}};
    for (auto& [k, x] : v) line[k] = x;
    if (!v.empty()) {  // a short line with every validation metric (held-out score, probe accuracy, PSNR, ...)
      std::string text;
      for (auto& [k, x] : v) text += (text.empty() ? "" : ", ") + k + " " + format_metric(x);
      std::fprintf(stderr, "step %lld/%lld  validation: %s\n", (long long)step_, (long long)to_.steps, text.c_str());
    }
    log_line(line);
    log_preview();
    if (!to_.best_metric.empty() && v.count(to_.best_metric)) {
      double x = v[to_.best_metric];
      bool better =
          best_.is_null() || (to_.best_mode_max ? x > best_["value"].get<double>() : x < best_["value"].get<double>());
      if (better) best_ = {{"metric", to_.best_metric}, {"value", x}, {"step", step_}};
    }
    for (auto& [k, x] : v) res.last_metrics[k] = x;
  };

  while (step_ < to_.steps) {
    const StepOutcome out = train_step();
    window_samples += out.samples;
    window_collective += out.collective_s;
    window_busy += out.data_s + out.loss_s + out.backward_s + out.update_s;
    if (!out.finite) continue;
    const double lr = out.lr, gnorm = out.grad_norm;
    window_loss += out.loss;
    ++window_steps;
    for (auto& [name, x] : out.metrics) window_metrics[name] += x;

    if (step_ % to_.log_every == 0 || step_ == to_.steps) {
      const double now = elapsed();
      const double rate = window_samples / std::max(1e-9, now - window_start);
      const double per_step = now / double(step_ - start);
      json line = {{"step", step_},
                   {"time", now},
                   {"train/loss", window_loss / window_steps},
                   {"train/lr", lr},
                   {"train/grad_norm", gnorm},
                   {"samples_per_s", rate},
                   {"train/bad_loss_steps", bad_total_}};
      for (auto& [name, x] : window_metrics) line["train/" + name] = x / window_steps;
      if (dist_) {
        line["world_size"] = dist_->world_size();
        line["allreduce_share"] = window_collective / std::max(1e-12, window_busy);
        line["allreduce_overlapped"] = dist_->overlapped_share();  // buckets started during the last backward
      }
      log_line(line);
      std::string extra;
      for (const auto& name : shown)
        if (window_metrics.count(name)) extra += "  " + name + " " + format_metric(window_metrics[name] / window_steps);
      // The ETA of whichever ends the run first: the remaining steps or the time limit.
      double left = per_step * double(to_.steps - step_);
      const bool by_time = to_.time_limit_minutes > 0 && to_.time_limit_minutes * 60 - now < left;
      if (by_time) left = std::max(0.0, to_.time_limit_minutes * 60 - now);
      if (main)
        std::fprintf(stderr, "step %lld/%lld  loss %.4f%s  lr %.2e  %.1f samples/s  ETA %s%s\n", (long long)step_,
                     (long long)to_.steps, window_loss / window_steps, extra.c_str(), lr, rate,
                     format_duration(left).c_str(), by_time ? " (time limit)" : "");
      res.last_metrics["train/loss"] = window_loss / window_steps;
      window_loss = 0;
      window_steps = 0;
      window_samples = 0;
      window_start = now;
      window_collective = 0;
      window_busy = 0;
      window_metrics.clear();
    }
    bool out_of_time = to_.time_limit_minutes > 0 && elapsed() > to_.time_limit_minutes * 60;
    if (dist_) {
      // Every rank stops at the same step: a signal to one rank, or rank 0's clock, stops them all.
      const auto flags = dist_->sum({stop_requested() ? 1.0 : 0.0, out_of_time && main ? 1.0 : 0.0});
      if (flags[0] > 0 && !stop_requested()) io::note_stop(SIGTERM);
      out_of_time = flags[1] > 0;
    }
    if (to_.val_every > 0 && step_ % to_.val_every == 0 && step_ < to_.steps && !out_of_time) run_validation();
    if (stop_requested() || out_of_time) {
      log::info(stop_requested() ? "signal received" : "time limit reached", ": checkpointing at step ", step_,
                stop_requested() ? " (a second signal stops at once, without it)" : "");
      res.interrupted = true;
      res.stopped_by_signal = stop_requested();
      break;
    }
    if (step_ % to_.checkpoint_every == 0 && step_ < to_.steps) res.last_checkpoint = save();
  }
  if (!stop_requested()) run_validation();  // also after the time limit: the run ends with its preview
  res.last_checkpoint = save();
  res.step = step_;
  res.bad_loss_steps = bad_total_;
  return res;
}

}  // namespace dew::training
