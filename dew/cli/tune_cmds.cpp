// `dew tune threads`: times each workload's representative step under every candidate split of the CPU
// between LibTorch's intra-op threads and the BLAS's threads, each split in a fresh child process, prints
// the table and records the fastest split of each workload in the thread cache (dew/core/threads.h), where
// set_threads(0, workload) finds it.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "dew/bench/child_process.h"
#include "dew/bench/measure.h"
#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/rng.h"
#include "dew/core/threads.h"
#include "dew/data/tokenizer.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/runs/run.h"
#include "dew/sampling/generate.h"
#include "dew/training/objective.h"

namespace fs = std::filesystem;

namespace dew::cli {

namespace {

const char* kTuneUsage =
    "usage: dew tune threads [--workloads intra_op,gemm] [--splits 2x1,1x2,1x1] [--steps 8] [--warmup 3]\n"
    "                        [--rounds 2] [--no-write] [--dry-run]\n"
    "\n"
    "Times each workload under every split of the CPU between LibTorch's intra-op threads and the BLAS's\n"
    "threads (INTRAxBLAS; default: Cx1, 1xC, 1x1 and, from 4 cores, C/2x2, C/2x1, 2xC/2 for C usable cores),\n"
    "each split in a fresh process: --warmup untimed then --steps timed repetitions, their median; --rounds\n"
    "rounds over the splits (every other one in reverse order), each split's fastest round kept. The fastest\n"
    "split of each workload (the built-in default where it is within 2% of the fastest) is written to the\n"
    "thread cache under this machine's key, and `--threads 0` (every command's default) uses it when\n"
    "OMP_NUM_THREADS is unset. Thread counts can change the order of float reductions (the last bits of\n"
    "results); the default changes only when this is rerun.\n"
    "  intra_op  a training step of `dew train diffusion`'s default recipe (unet, flow, batch 32 of\n"
    "            Fashion-MNIST) through the trainer's own step\n"
    "  gemm      batch-1 greedy generation of `dew train lm`'s default model (randomly initialised):\n"
    "            a 32-token prompt and 64 new tokens with the KV cache\n"
    "  --no-write  print the table, leave the cache as it is\n"
    "  --dry-run   print the machine key, the cache file, the current defaults and the splits; measure nothing\n"
    "Cache file: DEW_THREADS_CACHE, else $XDG_CACHE_HOME/dew/threads.json, else ~/.cache/dew/threads.json\n"
    "(DEW_THREADS_CACHE=off: none).\n";

constexpr int64_t kPromptTokens = 32;
// A split within this fraction of the fastest ties with it; a tie keeps the built-in default, so a rerun on
// an unchanged machine does not flip the default on noise.
constexpr double kTie = 0.02;
constexpr int64_t kNewTokens = 64;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string split_text(const ThreadSplit& s) { return std::to_string(s.intra) + "x" + std::to_string(s.blas); }

ThreadSplit parse_split(const std::string& s, const std::string& flag) {
  // A count: 1 to 4 digits (at most 9999 threads); 0 = not a count.
  auto count = [](const std::string& part) -> int64_t {
    const bool digits = !part.empty() && part.size() <= 4 && part.find_first_not_of("0123456789") == std::string::npos;
    return digits ? std::stoll(part) : 0;
  };
  const auto x = s.find('x');
  const ThreadSplit out =
      x == std::string::npos ? ThreadSplit{0, 0} : ThreadSplit{count(s.substr(0, x)), count(s.substr(x + 1))};
  DEW_CHECK(out.intra >= 1 && out.blas >= 1, flag, ": expected INTRAxBLAS with counts >= 1 (e.g. 2x1), got \"", s,
            "\"");
  return out;
}

std::vector<std::string> comma_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The default candidates for `cores` usable cores, without repeats.
std::vector<ThreadSplit> default_splits(int64_t cores) {
  std::vector<ThreadSplit> all = {{cores, 1}, {1, cores}, {1, 1}};
  if (cores >= 4) {
    all.push_back({cores / 2, 2});
    all.push_back({cores / 2, 1});
    all.push_back({2, cores / 2});
  }
  std::vector<ThreadSplit> out;
  for (const auto& s : all)
    if (std::none_of(out.begin(), out.end(),
                     [&](const ThreadSplit& o) { return o.intra == s.intra && o.blas == s.blas; }))
      out.push_back(s);
  return out;
}

std::string describe(Workload w) {
  return w == Workload::kIntraOp ? "training step of dew train diffusion's default recipe (ms/step)"
                                 : "batch-1 greedy generation, 32-token prompt + 64 new tokens (ms/generation)";
}

// ---- the measured child: `dew tune threads --one WORKLOAD --split IxB --steps N --warmup W` ----

// Sets the split, after the model is built (building runs set_threads of its own), before the first step.
void apply(const ThreadSplit& split) {
  at::set_num_threads(int(split.intra));
  set_blas_threads(split.blas);
}

// Times warmup + steps training steps of the default diffusion recipe on its first batch under `split`,
// through the trainer's own step (Trainer::train_step under the recipe's optimizer options); returns the
// timed ones in ms.
std::vector<double> time_training_steps(const ThreadSplit& split, int64_t warmup, int64_t steps) {
  json recipe = runs::default_recipe("diffusion");
  recipe["run"] = (fs::temp_directory_path() / "dew_tune_threads_not_written").string();  // prepare writes nothing
  recipe["device"] = "cpu";
  runs::PreparedRun run = runs::prepare("diffusion", recipe);
  const data::Batch batch = run.built.loader->next();
  run.built.loader.reset();  // stops the loader's worker thread: only the step runs while timed
  bench::TempDir dir("tune_threads");
  const auto trainer =
      bench::fixed_batch_trainer(run.built.objective, batch, run.optim, warmup + steps, dir.path.string());
  apply(split);
  std::vector<double> ms;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const training::StepOutcome out = trainer->train_step();
    DEW_CHECK(out.finite, "tune threads: non-finite training loss ", out.loss, " at repetition ", i);
    if (i >= warmup) ms.push_back(ms_since(t0));
  }
  return ms;
}

// Times warmup + steps batch-1 greedy generations of the default language model under `split`; returns the
// timed ones in ms.
std::vector<double> time_generations(const ThreadSplit& split, int64_t warmup, int64_t steps) {
  json record = runs::default_recipe("lm")["model"];
  record["fields"]["vocab_size"] = data::load_tokenizer("byte")->vocab_size();  // the default data's tokenizer
  rng::DefaultGeneratorScope init(0, 0, "init");
  nn::CausalTransformer model = models::build_language_model(record);
  model->eval();
  std::vector<int64_t> prompt(kPromptTokens);
  for (int64_t i = 0; i < kPromptTokens; ++i) prompt[size_t(i)] = (i * 37 + 11) % 256;  // fixed bytes
  sampling::GenerationOptions g;
  g.max_new_tokens = kNewTokens;
  g.temperature = 0;
  apply(split);
  std::vector<double> ms;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto out = sampling::generate_tokens(*model, {prompt}, g);
    DEW_CHECK(out.lengths.at(0) == kNewTokens, "tune threads: generation stopped after ", out.lengths.at(0), " tokens");
    if (i >= warmup) ms.push_back(ms_since(t0));
  }
  return ms;
}

int run_one_split(Workload workload, const ThreadSplit& split, int64_t warmup, int64_t steps) {
  const std::vector<double> ms = workload == Workload::kIntraOp ? time_training_steps(split, warmup, steps)
                                                                : time_generations(split, warmup, steps);
  std::cout << json{{"ms", ms}, {"intra", at::get_num_threads()}, {"blas", blas_threads()}}.dump() << std::endl;
  return 0;
}

// ---- the parent ----

// The median ms of one split of one workload, measured in a child process.
double measure(Workload w, const ThreadSplit& split, int64_t warmup, int64_t steps) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  const std::vector<std::string> argv = {exe,
                                         "tune",
                                         "threads",
                                         "--one",
                                         workload_name(w),
                                         "--split",
                                         split_text(split),
                                         "--warmup",
                                         std::to_string(warmup),
                                         "--steps",
                                         std::to_string(steps)};
  // The environment holds the split too, so OpenMP's pool starts at its size and set_threads keeps the BLAS's.
  const bench::ChildResult c = bench::run_child(argv,
                                                {{"OMP_NUM_THREADS", std::to_string(split.intra)},
                                                 {"OPENBLAS_NUM_THREADS", std::to_string(split.blas)},
                                                 {"DEW_THREADS_CACHE", "off"}},
                                                /*quiet=*/false, {}, "tune threads");
  std::string command;
  for (const auto& a : argv) command += (command.empty() ? "" : " ") + a;
  DEW_CHECK(c.exit_code == 0, "tune threads: the ", workload_name(w), " measurement of ", split_text(split),
            " failed (exit code ", c.exit_code, "): ", command);
  const auto last = c.out.find_last_of('{');
  DEW_CHECK(last != std::string::npos, "tune threads: no result from ", command, "; it printed: ", c.out);
  const json j = json::parse(c.out.substr(last));
  DEW_CHECK(j["intra"] == split.intra && (j["blas"] == -1 || j["blas"] == split.blas), "tune threads: ", command,
            " ran ", j["intra"].dump(), " intra-op x ", j["blas"].dump(), " BLAS threads");
  return bench::median(j["ms"].get<std::vector<double>>());
}

struct SplitRow {
  ThreadSplit split;
  std::vector<double> round_ms;  // the median of each round
  double best() const { return *std::min_element(round_ms.begin(), round_ms.end()); }
};

// The current default of a workload, as set_threads(0, w) would choose it with OMP_NUM_THREADS unset.
std::string current_default(Workload w, const std::string& cache) {
  if (auto m = cached_split(cache, w)) return split_text(m->split) + " (measured on " + m->measured_at + ")";
  return split_text(builtin_split(w)) + " (built-in default)";
}

}  // namespace

int cmd_tune(const std::vector<std::string>& args) {
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::cout << kTuneUsage;
    return 0;
  }
  const Flags f =
      parse_flags(args, {"workloads", "splits", "steps", "warmup", "rounds", "one", "split"}, {"no-write", "dry-run"});
  DEW_CHECK(f.positional.size() == 1 && f.positional[0] == "threads", "tune: expected `dew tune threads [flags]`, got ",
            f.positional.empty() ? std::string("no sub-command") : "\"" + f.positional[0] + "\"",
            (f.positional.size() > 1 ? " and more" : ""), " (dew tune --help)");
  const int64_t steps = f.get_int("steps", 8), warmup = f.get_int("warmup", 3), rounds = f.get_int("rounds", 2);
  DEW_CHECK(steps >= 1, "--steps: must be >= 1, got ", steps);
  DEW_CHECK(warmup >= 0, "--warmup: must be >= 0, got ", warmup);
  DEW_CHECK(rounds >= 1, "--rounds: must be >= 1, got ", rounds);
  if (f.has("one")) {
    DEW_CHECK(f.has("split"), "--one: needs --split INTRAxBLAS");
    return run_one_split(parse_workload(f.get("one", ""), "--one"), parse_split(f.get("split", ""), "--split"), warmup,
                         steps);
  }
  DEW_CHECK(!f.has("split"), "--split: only with --one (use --splits for the candidates)");

  std::vector<Workload> workloads;
  for (const auto& name : comma_list(f.get("workloads", "intra_op,gemm"))) {
    const Workload w = parse_workload(name, "--workloads");
    if (std::find(workloads.begin(), workloads.end(), w) == workloads.end()) workloads.push_back(w);
  }
  DEW_CHECK(!workloads.empty(), "--workloads: expected a list of intra_op, gemm");
  const int64_t cores = usable_cores();
  std::vector<ThreadSplit> splits;
  if (f.has("splits")) {
    for (const auto& s : comma_list(f.get("splits", ""))) splits.push_back(parse_split(s, "--splits"));
    DEW_CHECK(!splits.empty(), "--splits: expected INTRAxBLAS,... (e.g. 2x1,1x2)");
  } else {
    splits = default_splits(cores);
  }
  const std::string cache = threads_cache_path();
  const bool write = !f.has("no-write") && !f.has("dry-run");
  DEW_CHECK(!write || !cache.empty(), "tune threads: no cache file to write (DEW_THREADS_CACHE=off, or neither ",
            "XDG_CACHE_HOME nor HOME is set); pass --no-write to measure only");

  std::string split_list;
  for (const auto& s : splits) split_list += (split_list.empty() ? "" : ", ") + split_text(s);
  std::cout << "machine: " << machine_key() << "; BLAS " << (blas_core().empty() ? "n/a" : blas_core())
            << "\ncache: " << (cache.empty() ? "off" : cache) << "\nsplits (intra-op x BLAS): " << split_list << "; "
            << warmup << " warm-up + " << steps << " timed repetitions each, median; " << rounds
            << " round(s), the fastest kept\n";
  for (const Workload w : workloads)
    std::cout << "current default " << workload_name(w) << ": " << current_default(w, cache) << "\n";
  if (f.has("dry-run")) return 0;

  const std::string load_before = bench::load_average();
  std::map<Workload, std::vector<SplitRow>> table;
  for (const Workload w : workloads)
    for (const auto& s : splits) table[w].push_back(SplitRow{s, {}});
  for (int64_t r = 0; r < rounds; ++r)
    for (const Workload w : workloads)
      for (size_t k = 0; k < splits.size(); ++k) {
        SplitRow& row = table[w][r % 2 ? splits.size() - 1 - k : k];  // every other round in reverse order
        row.round_ms.push_back(measure(w, row.split, warmup, steps));
        std::cerr << "[dew tune] round " << r + 1 << "/" << rounds << " " << workload_name(w) << " "
                  << split_text(row.split) << ": " << bench::fixed(row.round_ms.back(), 1) << " ms\n";
      }
  const std::string load_after = bench::load_average();
  const std::string when = bench::utc_now();

  std::map<Workload, MeasuredSplit> winners;
  std::cout << "\n"
            << when << "; 1-minute load average " << load_before << " before, " << load_after
            << " after (the measurement adds its own threads)\n";
  for (const Workload w : workloads) {
    auto& rows = table[w];
    std::stable_sort(rows.begin(), rows.end(),
                     [](const SplitRow& a, const SplitRow& b) { return a.best() < b.best(); });
    const ThreadSplit builtin = builtin_split(w);
    std::cout << "\n"
              << workload_name(w) << ": " << describe(w)
              << "\n\n| intra | blas | ms (best round) | each round | vs fastest | |\n"
              << "|---:|---:|---:|---|---:|---|\n";
    const SplitRow* winner = &rows.front();
    for (const auto& row : rows)
      if (row.split.intra == builtin.intra && row.split.blas == builtin.blas &&
          row.best() <= (1 + kTie) * winner->best())
        winner = &row;
    for (const auto& row : rows) {
      std::string each;
      for (double v : row.round_ms) each += (each.empty() ? "" : ", ") + bench::fixed(v, 1);
      std::string note;
      auto add = [&note](const char* what) { note += (note.empty() ? "" : "; ") + std::string(what); };
      if (&row == &rows.front()) add("fastest");
      if (row.split.intra == builtin.intra && row.split.blas == builtin.blas) add("built-in default");
      if (&row == winner) add("chosen");
      std::cout << "| " << row.split.intra << " | " << row.split.blas << " | " << bench::fixed(row.best(), 1) << " | "
                << each << " | " << bench::fixed(row.best() / rows.front().best(), 2) << "x | " << note << " |\n";
    }
    winners[w] = MeasuredSplit{winner->split, winner->best(), when};
  }
  std::cout << "\n";
  for (const auto& [w, m] : winners)
    std::cout << "chosen " << workload_name(w) << ": " << m.split.intra << " intra-op x " << m.split.blas
              << " BLAS (built-in: " << split_text(builtin_split(w)) << ")\n";
  if (write) {
    record_measured_splits(cache, winners);
    std::cout << "wrote " << cache << " (entry \"" << machine_key() << "\")\n";
  } else {
    std::cout << "cache not written (--no-write)\n";
  }
  return 0;
}

}  // namespace dew::cli
