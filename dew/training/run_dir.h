// The layout of a run directory, named in one place. Every reader and writer of a run — the trainer
// (metrics, checkpoints), the objectives (previews), runs/ (run.json) and the CLI's reports — asks a RunDir
// for its paths instead of spelling them:
//
//   RUN/run.json                      the record: kind, recipe, model, format (runs::read_record)
//   RUN/metrics.jsonl                 one JSON object per logged step
//   RUN/checkpoints/step_N/           model, ema, optimizer (+ objective) .safetensors and state.json
//   RUN/samples/step_N.EXT            previews the objectives write during training (png, txt)
//   RUN/eval.jsonl, RUN/eval/         what `dew eval` measured, one row per command
//   RUN/tensorboard/                  TensorBoard event files: one per start of train or eval (docs/tensorboard.md)
//   RUN/writer.lock                   held by the one command writing the run (train, eval), with its PID
//
//   dew::training::RunDir run("runs/fashion");
//   std::ifstream in(run.record());   // "runs/fashion/run.json"
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "dew/io/files.h"

namespace dew::training {

class RunDir {
 public:
  explicit RunDir(std::string path) : path_(std::move(path)) {}
  /// The run directory as given.
  const std::string& path() const { return path_; }
  /// RUN/run.json.
  std::string record() const;
  /// RUN/metrics.jsonl.
  std::string metrics() const;
  /// RUN/checkpoints.
  std::string checkpoints() const;
  /// RUN/checkpoints/step_N.
  std::string checkpoint(int64_t step) const;
  /// RUN/samples.
  std::string samples() const;
  /// RUN/samples/step_N.EXT (`ext` with its dot: ".png").
  std::string sample(int64_t step, const std::string& ext) const;
  /// RUN/eval.jsonl: one row per `dew eval`, with the command that made it.
  std::string eval_log() const;
  /// RUN/eval: files `dew eval` writes beside its rows (JEPA's probes).
  std::string eval_dir() const;
  /// RUN/tensorboard: the TensorBoard event files of every start (`tensorboard --logdir RUN/tensorboard`).
  std::string tensorboard() const;
  /// RUN/writer.lock: the lock of the one command that writes the run (lock_for_writing).
  std::string lock() const;
  /// Takes the run's writer lock for the caller's lifetime: a second train or eval of the same run gets a
  /// dew::Error naming the holder's PID. The directory must exist. Readers (sample, export) never lock.
  std::unique_ptr<io::FileLock> lock_for_writing() const;
  /// Fails, before any work, when another process holds the run's writer lock (nothing is created).
  void check_not_being_written() const;
  /// Whether `path` holds a run record (RUN/run.json is a file).
  static bool holds_run(const std::string& path);

 private:
  std::string path_;
};

}  // namespace dew::training
