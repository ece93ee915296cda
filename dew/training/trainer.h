// The trainer (docs/training.md): one loop for every objective. It owns the optimizer (with warm-up and
// decay), gradient accumulation, gradient clipping, the fp32 EMA, the non-finite loss guard, validation
// and checkpoint cadence, metrics.jsonl, the progress line and SIGINT/SIGTERM handling. Rerunning the
// same command on a run directory resumes from its latest checkpoint and continues bit for bit.
#pragma once
#include "dew/training/checkpoint.h"
#include "dew/training/distributed.h"
#include "dew/training/objective.h"
#include "dew/training/optim.h"

namespace dew::training {

struct TrainerOptions {
  int64_t steps = 1000;
  int64_t accumulation = 1;
  int64_t log_every = 50;
  int64_t val_every = 0;
  int64_t checkpoint_every = 500;
  int64_t keep_checkpoints = 2;
  int64_t max_bad_loss_steps = 20;
  double time_limit_minutes = 0;
  std::string best_metric;
  bool best_mode_max = false;
  std::string autocast = "auto";
  std::string tensorboard = "on";
  bool strict_resume = false;
  template <class V>
  void visit(V& v) {
    v("steps", steps, "optimizer steps in the run");
    v("accumulation", accumulation, "micro-batches per optimizer step");
    v("log_every", log_every, "metrics.jsonl and progress line cadence in steps");
    v("val_every", val_every, "validation cadence in steps (0 = only at the end)");
    v("checkpoint_every", checkpoint_every, "checkpoint cadence in steps (and at the end)");
    v("keep_checkpoints", keep_checkpoints, "number of latest checkpoints kept (plus the best)");
    v("max_bad_loss_steps", max_bad_loss_steps, "stop after this many consecutive non-finite losses");
    v("time_limit_minutes", time_limit_minutes, "stop with a checkpoint after this wall time (0 = none)");
    v("best_metric", best_metric, "validation metric that selects the best checkpoint, e.g. val/loss (empty = none)");
    v("best_mode_max", best_mode_max, "larger best_metric is better");
    v.choice("autocast", autocast, {"auto", "off", "bfloat16", "float16"},
             "mixed precision of the forward (auto = bfloat16 on CUDA, fp32 on the CPU; float16 on CUDA only)");
    v.choice("tensorboard", tensorboard, {"on", "off"},
             "TensorBoard event files in RUN/tensorboard (metrics, sample grids, the recipe); the flag --tensorboard");
    v("strict_resume", strict_resume,
      "refuse to resume when the latest checkpoint is damaged, instead of setting it aside and resuming from the "
      "newest complete one; the flag --strict-resume");
  }
};

void validate(const TrainerOptions& o);
/// Refuses an autocast mode the device cannot run (float16 on the CPU) with a dew::Error naming the field.
void check_autocast(const std::string& mode, const c10::Device& device);

/// How a run ended.
struct TrainResult {
  int64_t step = 0;                // steps completed
  int64_t bad_loss_steps = 0;      // non-finite losses skipped in total
  bool interrupted = false;        // by SIGINT/SIGTERM or the time limit
  bool stopped_by_signal = false;  // interrupted by SIGINT/SIGTERM
  std::string last_checkpoint;
  std::map<std::string, double> last_metrics;
};

/// What one optimizer step did (Trainer::train_step).
struct StepOutcome {
  bool finite = true;                     // false: a non-finite loss skipped the update (no optimizer or EMA change)
  double loss = 0;                        // the loss averaged over the micro-batches (finite steps)
  double lr = 0;                          // the learning rate of the step
  double grad_norm = 0;                   // global gradient norm before clipping (finite steps)
  int64_t samples = 0;                    // items of the micro-batches whose gradient was taken
  std::map<std::string, double> metrics;  // the objective's metrics, averaged over the micro-batches
  // Wall time of the step's parts, summed over its micro-batches (clock reads around each; on CUDA the
  // loss ends with the device sync of the finite check and the backward with that of the gradient norm):
  double data_s = 0;                // waiting for the loader's batches
  double loss_s = 0;                // the objective's loss (the forward) and the finite check
  double backward_s = 0;            // backward and the gradient norm and clip
  double update_s = 0;              // zero_grad, the optimizer step and the EMA update
  double collective_s = 0;          // data-parallel runs: the all-reduces of the loss and the gradients (in backward_s)
  double allreduce_s = 0;           // data-parallel runs: the gradient average alone (part of collective_s): with
                                    // dist.overlap the wait after backward, the part backward did not hide
  double allreduce_inflight_s = 0;  // with dist.overlap: first bucket's start to the last one's end
};

class Trainer {
 public:
  /// run_dir must exist (the caller writes run.json); seed drives every random draw of the run.
  Trainer(ObjectivePtr objective, std::shared_ptr<data::DataLoader> loader, OptimOptions optim, TrainerOptions options,
          std::string run_dir, uint64_t seed);
  /// Resumes from the newest complete checkpoint if there is one (resume_point: a damaged newer one is set
  /// aside with a warning naming it, or refused with trainer.strict_resume), then trains to options.steps: train_step() until
  /// then, with metrics, validation and checkpoints at their cadence.
  TrainResult fit();
  /// One optimizer step at step(), the step fit() takes: zero_grad; trainer.accumulation micro-batches from
  /// the loader, each with its generators from (seed, micro-batch) for the loss and dropout, under autocast,
  /// the finite check of its loss, then backward; the gradient clip to optim.grad_clip, the optimizer at
  /// learning_rate(optim, step, trainer.steps), the EMA update. A non-finite loss skips the update and counts
  /// it; the max_bad_loss_steps-th in a row writes a checkpoint and throws dew::Error. Advances step() by one.
  /// Called without fit(), the first call starts the objective (Objective::begin) at step().
  StepOutcome train_step();
  /// Makes this trainer one rank of a data-parallel run (docs/distributed.md): each micro-batch the loader
  /// gives is the global one; this rank computes the loss of its contiguous rows [r N / W, (r + 1) N / W)
  /// (Objective::loss_of_rows), the gradients are averaged over the ranks before clipping, a non-finite loss
  /// on any rank skips the step on all, and only rank 0 writes metrics, validation previews and
  /// checkpoints. dew::Error when the loader's batch size is not divisible by the world size.
  void set_distributed(std::shared_ptr<Distributed> dist);
  /// LoRA runs (docs/lora.md): checkpoints hold only the trainable parameters (the adapters; the frozen base
  /// is not written) and `lora` (the adapters' options and the base's reference) in state.json; restore()
  /// then loads the adapters into a module whose base weights the caller has loaded.
  void set_adapter_checkpoints(json lora);
  /// Restores the state of a checkpoint (parameters, EMA, optimizer, data position, counters).
  void restore(const Checkpoint& c);
  /// Writes a checkpoint of the current state (rank 0 of a data-parallel run; the others return its path).
  std::string save();
  Optimizer& optimizer() { return *opt_; }
  EMA& ema() { return *ema_; }
  int64_t step() const { return step_; }
  /// Named parameters of the objective's module, in a stable order.
  const NamedTensors& parameters() const { return params_; }

 private:
  ObjectivePtr obj_;
  std::shared_ptr<data::DataLoader> loader_;
  OptimOptions oo_;
  TrainerOptions to_;
  std::string run_dir_;
  uint64_t seed_;
  NamedTensors params_;
  std::unique_ptr<Optimizer> opt_;
  std::unique_ptr<EMA> ema_;
  std::shared_ptr<Distributed> dist_;  // null: one process
  int64_t step_ = 0;
  bool begun_ = false;  // Objective::begin called
  int64_t bad_consecutive_ = 0;
  int64_t bad_total_ = 0;
  json best_ = nullptr;
  json lora_ = nullptr;  // set_adapter_checkpoints
};

/// Keeps the lines of RUN/metrics.jsonl whose step is at most `step` (a resumed run rewrites what came after
/// its checkpoint; a fresh run, step 0, starts an empty file), and cuts the event files of RUN/tensorboard
/// back to the same step (io::truncate_event_files; the "recipe" text at `step` is logged again by the start).
void truncate_metrics(const std::string& run_dir, int64_t step);

/// Model state of a module: parameters and buffers by path (what model.safetensors holds).
TensorMap module_state(torch::nn::Module& m);

}  // namespace dew::training
