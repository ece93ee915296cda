// `dew bench`: one full diffusion training step (EDM inputs, forward, loss, backward, AdamW, EMA) of the
// small CPU models, timed in C++ and, in the same invocation, in Python PyTorch eager (bench/peer.py),
// with the speed-up of the C++ side.
//
//   dew bench                                   # every model, intra-op {1,2} x OpenBLAS {1,2} threads
//   dew bench --models unet --steps 10 --threads 1 --blas-threads 1 --out bench.md
//
// Every (model, side, thread configuration) runs in a fresh child process (the dew binary re-executed
// with the hidden `--one MODEL`, or the Python peer), so each peak RSS belongs to one configuration and
// OPENBLAS_NUM_THREADS, read by OpenBLAS when it loads, can be set per child.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/training/optim.h"

extern char** environ;

namespace fs = std::filesystem;

namespace dew::cli {

namespace {

const char* kPython = "/usr/bin/python3";  // Debian's python3-torch; a pyenv python on PATH has no torch

// The step's hyper-parameters; bench/peer.py holds the same values.
constexpr double kLr = 1e-3;
constexpr double kEmaDecay = 0.995;
constexpr int64_t kImage = 28;  // input side in pixels (Fashion-MNIST)

const char* kBenchUsage =
    "usage: dew bench [--models simple_dit,unet,unet_attn] [--steps N] [--warmup W] [--batch B]\n"
    "                 [--threads 1,2] [--blas-threads 1,2] [--rounds R] [--no-peer] [--peer FILE]\n"
    "                 [--peer-coretype CORE] [--out FILE.md]\n"
    "\n"
    "Times one full diffusion training step (EDM inputs, forward, loss, backward, AdamW, EMA) per model,\n"
    "in C++ and in Python PyTorch eager (bench/peer.py run by /usr/bin/python3), for every combination of\n"
    "LibTorch intra-op threads (--threads) and OpenBLAS threads (--blas-threads), each in a fresh process.\n"
    "Prints a markdown table with each side's fastest configuration and the speed-up (Python / C++).\n"
    "\n"
    "  --models        simple_dit, unet (the demo model), unet_attn (attention at 14x14); default all\n"
    "  --steps N       timed steps per configuration, median reported (default 20)\n"
    "  --warmup W      untimed steps first (default 5)\n"
    "  --batch B       batch size (default 32)\n"
    "  --threads L     LibTorch intra-op thread counts to try (default 1,2)\n"
    "  --blas-threads L  OPENBLAS_NUM_THREADS values to try (default 1,2)\n"
    "  --rounds R      measure every configuration R times per side, alternating, keep the fastest\n"
    "                  (default 2: process-to-process spread on a shared machine is 10-30%)\n"
    "  --no-peer       C++ only\n"
    "  --peer FILE     the Python peer (default: bench/peer.py next to the build directory)\n"
    "  --peer-coretype CORE  OPENBLAS_CORETYPE for the Python peer (default: the caller's environment;\n"
    "                  dew itself switches OpenBLAS from its SSE3 fallback to the CPU's AVX-512/AVX2\n"
    "                  kernels, Python does not, so --peer-coretype SkylakeX compares like with like)\n"
    "  --out FILE.md   also write the report to FILE.md\n";

// One benchmarked model: a registry architecture at a fixed small CPU size.
struct BenchCase {
  std::string name;  // what --models selects
  std::string arch;  // dew::models registry name (also the peer's --model)
  std::string size;  // for the table
  json fields;
};

const std::vector<BenchCase>& bench_cases() {
  // Fashion-MNIST-shaped inputs (1 x 28 x 28, 10 classes); unet is the `dew train diffusion` demo model.
  static const std::vector<BenchCase> cases = [] {
    const json unet = {{"in_channels", 1},         {"output_channels", 1},          {"num_classes", 10},
                       {"emb_features", 64},       {"feature_depths", {32, 64}},    {"num_res_blocks", 1},
                       {"num_middle_res_blocks", 1}, {"norm_groups", 8},
                       {"attention_configs", {nullptr, nullptr}}};
    json unet_attn = unet;
    unet_attn["attention_configs"] = {nullptr, 4};
    return std::vector<BenchCase>{
        {"simple_dit", "simple_dit", "1x28x28, patch 4 (49 tokens), width 128, 4 layers, 4 heads",
         {{"in_channels", 1},
          {"output_channels", 1},
          {"num_classes", 10},
          {"patch_size", 4},
          {"emb_features", 128},
          {"num_layers", 4},
          {"num_heads", 4}}},
        {"unet", "unet", "1x28x28, depths [32,64], 1 res block, no attention", unet},
        {"unet_attn", "unet", "1x28x28, depths [32,64], 1 res block, 4-head attention at 14x14", unet_attn},
    };
  }();
  return cases;
}

const BenchCase& find_case(const std::string& name) {
  std::string names;
  for (const auto& c : bench_cases()) {
    if (c.name == name) return c;
    names += (names.empty() ? "" : ", ") + c.name;
  }
  fail("bench: unknown model \"", name, "\"; accepted: ", names);
}

std::vector<std::string> split_list(const std::string& s, const std::string& flag) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    DEW_CHECK(!item.empty(), "--", flag, ": expected a comma-separated list, got \"", s, "\"");
    out.push_back(item);
    start = comma + 1;
  }
  return out;
}

std::vector<int64_t> int_list(const Flags& f, const std::string& flag, const std::string& def) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(f.get(flag, def), flag)) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DEW_CHECK(used == item.size() && v >= 1, "--", flag, ": expected positive integers like 1,2, got \"",
              f.get(flag, def), "\"");
    out.push_back(v);
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Peak resident set size of this process (VmHWM), in MB.
double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmHWM:  123456 kB"
  return 0.0;
}


// ---- the measured child: `dew bench --one MODEL --threads T ...` ----

// Runs warmup + steps training steps of one case and prints one JSON line (same keys as bench/peer.py).
int run_one(const BenchCase& c, int64_t batch, int64_t warmup, int64_t steps, int64_t threads) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  at::set_num_threads(int(threads));
  at::manual_seed(0);  // parameter initialisation draws from the global generator
  auto model = models::build(c.arch, c.fields);
  model->train();
  training::NamedTensors params;
  int64_t nparams = 0;
  for (const auto& kv : model->named_parameters()) {
    params.emplace_back(kv.key(), kv.value());
    nparams += kv.value().numel();
  }
  training::OptimOptions oo;  // adamw, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on matrices
  oo.lr = kLr;
  training::Optimizer opt(params, oo);
  training::EMA ema(params, kEmaDecay);
  diffusion::PresetOptions po;
  po.regime = "pixel";
  diffusion::DiffusionProcess process(diffusion::preset("edm", po));

  // A fixed batch stands in for the data loader: the bench times the step, not the input pipeline.
  auto data_gen = at::detail::createCPUGenerator(1);
  const auto& f = c.fields;
  const at::Tensor x0 = at::rand({batch, f.value("in_channels", int64_t(3)), kImage, kImage}, data_gen) * 2 - 1;
  Conditioning cond;
  if (f.value("num_classes", int64_t(0)) > 0)
    cond.labels = at::randint(0, f["num_classes"].get<int64_t>(), {batch}, data_gen);
  auto step_gen = at::detail::createCPUGenerator(2);

  std::vector<double> total, fwd, bwd, upd;
  double loss_value = 0;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    const auto t0 = clock::now();
    auto in = process.training_inputs(x0, step_gen);
    auto loss = process.loss(model->forward(in.net_input, in.model_time, cond), in);
    const auto t1 = clock::now();
    loss.backward();
    const auto t2 = clock::now();
    opt.step(kLr);
    ema.update(params, i);
    opt.zero_grad();
    const auto t3 = clock::now();
    loss_value = loss.item<double>();
    if (i < warmup) continue;
    total.push_back(secs(t3 - t0));
    fwd.push_back(secs(t1 - t0));
    bwd.push_back(secs(t2 - t1));
    upd.push_back(secs(t3 - t2));
  }
  DEW_CHECK(std::isfinite(loss_value), "bench ", c.name, ": non-finite loss ", loss_value);
  const double ms = median(total) * 1e3;
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  json out = {{"ms_per_step", ms},
              {"samples_per_s", double(batch) / (ms / 1e3)},
              {"peak_rss_mb", peak_rss_mb()},
              {"params", nparams},
              {"threads", at::get_num_threads()},
              {"blas_threads", blas ? blas : ""},
              {"blas_core", blas_core()},
              {"phases_ms", {{"forward", median(fwd) * 1e3}, {"backward", median(bwd) * 1e3},
                             {"optimizer", median(upd) * 1e3}}},
              {"loss", loss_value},
              {"torch", TORCH_VERSION}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// ---- the parent: child processes and the report ----

struct ChildResult {
  int exit_code = -1;  // -1: could not be started or was killed
  std::string out;     // its stdout
};

// Runs argv[0] (a path) with `env` added to this environment and the variables in `unset` removed,
// capturing stdout; stderr passes through unless `quiet`.
ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      bool quiet = false, const std::vector<std::string>& unset = {}) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string s(*e), name = s.substr(0, s.find('='));
    if (!env.count(name) && std::find(unset.begin(), unset.end(), name) == unset.end()) env_strings.push_back(s);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : env_strings) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);

  int fds[2];
  DEW_CHECK(pipe(fds) == 0, "bench: cannot create a pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  if (quiet) posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, cargv[0], &actions, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  ChildResult r;
  if (rc != 0) {
    close(fds[0]);
    return r;
  }
  char buf[4096];
  ssize_t n = 0;
  while ((n = read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR))
    if (n > 0) r.out.append(buf, size_t(n));
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

std::string quoted(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    const bool plain = a.find_first_of(" \"'{}[],$\\") == std::string::npos;
    s += (s.empty() ? "" : " ") + (plain ? a : "'" + a + "'");
  }
  return s;
}

struct Measurement {
  int64_t intra = 0, blas = 0;
  double ms = 0, samples_per_s = 0, peak_mb = 0;
  double fwd = 0, bwd = 0, opt = 0;
  int64_t params = 0;
  std::string torch, blas_core;
};

Measurement measure(const std::vector<std::string>& argv, int64_t intra, int64_t blas, const std::string& what,
                    std::map<std::string, std::string> env = {}, const std::vector<std::string>& unset = {}) {
  env["OPENBLAS_NUM_THREADS"] = std::to_string(blas);
  auto r = run_child(argv, env, /*quiet=*/false, unset);
  DEW_CHECK(r.exit_code == 0, "bench: the ", what, " run failed (exit ", r.exit_code, "): ", quoted(argv));
  // The JSON line is the last line of stdout; anything before it is the child's own chatter.
  std::string line = r.out;
  while (!line.empty() && line.back() == '\n') line.pop_back();
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  DEW_CHECK(j.is_object() && j.contains("ms_per_step") && j.contains("phases_ms"), "bench: the ", what,
            " run printed no result line; got \"", line, "\"");
  Measurement m;
  m.intra = intra;
  m.blas = blas;
  m.ms = j["ms_per_step"];
  m.samples_per_s = j["samples_per_s"];
  m.peak_mb = j["peak_rss_mb"];
  m.params = j["params"];
  m.fwd = j["phases_ms"]["forward"];
  m.bwd = j["phases_ms"]["backward"];
  m.opt = j["phases_ms"]["optimizer"];
  m.torch = j.value("torch", "");
  m.blas_core = j.value("blas_core", "");
  return m;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string grouped(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string config_name(const Measurement& m) {
  return "intra " + std::to_string(m.intra) + ", blas " + std::to_string(m.blas);
}

// One thread configuration of one model: a measurement per round and side.
struct Config {
  int64_t intra = 1, blas = 1;
  std::vector<Measurement> cpp, py;
};

// One model: its complete fields (JSON, for the peer), parameter count and configurations.
struct Row {
  const BenchCase* c;
  std::string fields;
  int64_t params = 0;
  std::vector<Config> configs;
};

// The fastest of a configuration's rounds: the least disturbed by other work on the machine.
const Measurement& best(const std::vector<Measurement>& ms) {
  return *std::min_element(ms.begin(), ms.end(), [](const auto& a, const auto& b) { return a.ms < b.ms; });
}

// The fastest run of one side over all configurations.
const Measurement& fastest(const std::vector<Config>& configs, std::vector<Measurement> Config::*side) {
  const Measurement* out = &best(configs.front().*side);
  for (const auto& c : configs)
    if (best(c.*side).ms < out->ms) out = &best(c.*side);
  return *out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    auto colon = line.find(':');
    return colon == std::string::npos ? line : line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown CPU";
}

int usable_cpus() {
  // What `nproc` prints: the CPUs this process may run on.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return int(sysconf(_SC_NPROCESSORS_ONLN));
}

// The 1-minute load average: on a shared machine, other work during the run shows up here.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  return in >> one ? one : std::string("n/a");
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

// The peer script: --peer, else bench/peer.py beside the build directory holding this binary, else in
// the working directory. Empty when none is found.
std::string find_peer(const Flags& f, const fs::path& exe) {
  if (f.has("peer")) {
    DEW_CHECK(fs::is_regular_file(f.get("peer", "")), "--peer: no such file \"", f.get("peer", ""), "\"");
    return f.get("peer", "");
  }
  for (const fs::path& p : {exe.parent_path().parent_path() / "bench" / "peer.py",
                            exe.parent_path() / "bench" / "peer.py", fs::current_path() / "bench" / "peer.py"})
    if (fs::is_regular_file(p)) return p.lexically_normal().string();
  return "";
}

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  const Flags f = parse_flags(args,
                              {"models", "steps", "warmup", "batch", "threads", "blas-threads", "rounds", "peer", "out",
                               "one", "peer-coretype"},
                              {"no-peer", "help"});
  if (f.has("help")) {
    std::cout << kBenchUsage;
    return 0;
  }
  DEW_CHECK(f.positional.empty(), "bench: unexpected argument \"", f.positional.empty() ? "" : f.positional[0],
            "\" (dew bench --help)");
  const int64_t steps = f.get_int("steps", 20), warmup = f.get_int("warmup", 5), batch = f.get_int("batch", 32);
  DEW_CHECK(steps >= 1, "--steps: must be >= 1, got ", steps);
  DEW_CHECK(warmup >= 0, "--warmup: must be >= 0, got ", warmup);
  DEW_CHECK(batch >= 1, "--batch: must be >= 1, got ", batch);
  const auto threads = int_list(f, "threads", "1,2");
  const auto blas_threads = int_list(f, "blas-threads", "1,2");
  const int64_t rounds = f.get_int("rounds", 2);
  DEW_CHECK(rounds >= 1, "--rounds: must be >= 1, got ", rounds);

  if (f.has("one")) {
    DEW_CHECK(threads.size() == 1, "--one: needs exactly one --threads value, got \"", f.get("threads", ""), "\"");
    return run_one(find_case(f.get("one", "")), batch, warmup, steps, threads[0]);
  }

  std::vector<const BenchCase*> cases;
  std::string all_names;
  for (const auto& c : bench_cases()) all_names += (all_names.empty() ? "" : ",") + c.name;
  for (const auto& name : split_list(f.get("models", all_names), "models")) cases.push_back(&find_case(name));

  const fs::path exe = fs::read_symlink("/proc/self/exe");
  std::string peer, python_torch, peer_note;
  if (!f.has("no-peer")) {
    peer = find_peer(f, exe);
    auto probe = run_child({kPython, "-c", "import torch; print(torch.__version__)"}, {}, /*quiet=*/true);
    if (probe.exit_code != 0) {
      peer_note = std::string("Python peer skipped: ") + kPython + " with torch is not available; C++ side only.";
      peer.clear();
    } else if (peer.empty()) {
      peer_note = "Python peer skipped: bench/peer.py not found (pass --peer FILE); C++ side only.";
    } else {
      python_torch = probe.out.substr(0, probe.out.find('\n'));
    }
    if (!peer_note.empty()) std::cerr << peer_note << "\n";
  }

  // The peer runs in the environment the user gave: when OPENBLAS_CORETYPE was set by dew's own re-exec
  // (dew::reexec_with_blas_kernels), Python gets OpenBLAS's default choice, unless --peer-coretype says.
  std::map<std::string, std::string> peer_env;
  std::vector<std::string> peer_unset;
  if (f.has("peer-coretype")) {
    peer_env["OPENBLAS_CORETYPE"] = f.get("peer-coretype", "");
  } else if (std::getenv(kCoretypeMarker)) {
    peer_unset = {"OPENBLAS_CORETYPE", kCoretypeMarker};
  }

  const auto common = [&](int64_t t) {
    return std::vector<std::string>{"--batch", std::to_string(batch), "--steps", std::to_string(steps),
                                    "--warmup", std::to_string(warmup), "--threads", std::to_string(t)};
  };
  std::vector<Row> rows;
  for (const auto* c : cases) {
    // The parent builds the model once for its complete field set (defaults included) and parameter
    // count, which the peer receives so it builds, and checks, the same model.
    auto model = models::build(c->arch, c->fields);
    Row row{c, model->config().at("fields").dump(), 0, {}};
    for (const auto& p : model->parameters()) row.params += p.numel();
    for (int64_t intra : threads)
      for (int64_t blas : blas_threads) row.configs.push_back({intra, blas, {}, {}});
    rows.push_back(std::move(row));
  }
  const auto progress = [&](int64_t round, const std::string& what, const Measurement& m) {
    std::cerr << "bench: round " << round << "/" << rounds << "  " << what << "  " << config_name(m) << ": "
              << fixed(m.ms, 1) << " ms/step\n";
  };
  const std::string load_before = load_average();
  // Rounds sweep every configuration in turn, and C++ and Python alternate within each, so slow spells of
  // a shared machine spread over both sides and over all configurations.
  for (int64_t round = 1; round <= rounds; ++round) {
    for (auto& row : rows) {
      const std::string& name = row.c->name;
      for (auto& cfg : row.configs) {
        auto cpp_argv = std::vector<std::string>{exe.string(), "bench", "--one", name};
        for (auto& a : common(cfg.intra)) cpp_argv.push_back(a);
        cfg.cpp.push_back(measure(cpp_argv, cfg.intra, cfg.blas, name + " C++"));
        progress(round, name + "  C++   ", cfg.cpp.back());
        if (peer.empty()) continue;
        auto py_argv = std::vector<std::string>{kPython, peer, "--model", row.c->arch, "--config", row.fields,
                                                "--params", std::to_string(row.params), "--image",
                                                std::to_string(kImage) + "x" + std::to_string(kImage)};
        for (auto& a : common(cfg.intra)) py_argv.push_back(a);
        cfg.py.push_back(measure(py_argv, cfg.intra, cfg.blas, name + " Python", peer_env, peer_unset));
        progress(round, name + "  Python", cfg.py.back());
      }
    }
  }

  const bool with_peer = !peer.empty();
  std::ostringstream md;
  md << "## dew bench: one diffusion training step on the CPU\n\n"
     << "Step: EDM pixel-regime inputs, forward, loss, backward, AdamW (lr " << kLr
     << ", weight decay 0.01 on matrices), fp32 EMA (decay " << kEmaDecay << "); batch " << batch << ". Each "
     << "configuration runs in a fresh process: " << warmup << " warm-up + " << steps << " timed steps, median; "
     << rounds << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
     << ", the fastest round reported. Thread "
     << "configurations: LibTorch intra-op threads (intra) x OPENBLAS_NUM_THREADS (blas).\n\n"
     << "Machine: " << usable_cpus() << " CPUs (nproc), " << cpu_model() << "; LibTorch " << TORCH_VERSION
     << " (C++)";
  if (with_peer) md << ", PyTorch " << python_torch << " (" << kPython << ")";
  // OpenBLAS picks its kernels from the CPU model unless OPENBLAS_CORETYPE forces them; on a CPU it does
  // not recognise it falls back to SSE3 kernels, which shapes every number below. dew sets it for itself.
  const char* by_dew = std::getenv(kCoretypeMarker);
  const char* coretype = by_dew ? nullptr : std::getenv("OPENBLAS_CORETYPE");
  const auto& probe_cfg = rows.front().configs.front();
  auto core_of = [](const std::vector<Measurement>& ms) {
    return ms.empty() || ms.front().blas_core.empty() ? std::string("n/a") : ms.front().blas_core;
  };
  md << "; OpenBLAS kernels " << core_of(probe_cfg.cpp) << " (C++)";
  if (with_peer) md << ", " << core_of(probe_cfg.py) << " (Python)";
  md << "; OPENBLAS_CORETYPE " << (by_dew ? std::string("set by dew for itself (") + by_dew + ")"
                                          : coretype ? std::string("set by the user (") + coretype + ")" : "unset");
  if (with_peer && f.has("peer-coretype")) md << ", " << f.get("peer-coretype", "") << " for Python (--peer-coretype)";
  md << "; " << utc_now()
     << "; 1-minute load average " << load_before << " before the runs, " << load_average()
     << " after (the runs themselves add 1-2).\n\nCommand: `";
  if (coretype) md << "OPENBLAS_CORETYPE=" << coretype << " ";
  md << "dew bench";  // (the re-exec's own setting is not part of the user's command)
  for (const auto& a : args) md << " " << a;
  md << "`\n\n";
  if (!peer_note.empty()) md << peer_note << "\n\n";

  md << "| model | size | params | C++ best config | C++ ms/step | samples/s | peak MB |";
  if (with_peer) md << " Python best config | Python ms/step | peak MB | speed-up |";
  md << "\n|---|---|---:|---|---:|---:|---:|" << (with_peer ? "---|---:|---:|---:|" : "") << "\n";
  for (const auto& r : rows) {
    const auto& c = fastest(r.configs, &Config::cpp);
    md << "| " << r.c->name << " | " << r.c->size << " | " << grouped(r.params) << " | " << config_name(c) << " | "
       << fixed(c.ms, 1) << " | " << fixed(c.samples_per_s, 1) << " | " << fixed(c.peak_mb, 0) << " |";
    if (with_peer) {
      const auto& p = fastest(r.configs, &Config::py);
      md << " " << config_name(p) << " | " << fixed(p.ms, 1) << " | " << fixed(p.peak_mb, 0) << " | "
         << fixed(p.ms / c.ms, 2) << "x |";
    }
    md << "\n";
  }

  // Every round's median, fastest first, so the spread between processes is visible.
  auto rounds_cell = [](const std::vector<Measurement>& ms) {
    std::vector<double> v;
    for (const auto& m : ms) v.push_back(m.ms);
    std::sort(v.begin(), v.end());
    std::string s;
    for (double x : v) s += (s.empty() ? "" : " / ") + fixed(x, 1);
    return s;
  };
  md << "\nEvery configuration (ms/step: each round's median, fastest first; peak MB of the fastest round):\n\n"
     << "| model | intra | blas | C++ ms/step | C++ peak MB |"
     << (with_peer ? " Python ms/step | Python peak MB |" : "") << "\n|---|---:|---:|---:|---:|"
     << (with_peer ? "---:|---:|" : "") << "\n";
  for (const auto& r : rows) {
    for (const auto& cfg : r.configs) {
      md << "| " << r.c->name << " | " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " | "
         << fixed(best(cfg.cpp).peak_mb, 0) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " | " << fixed(best(cfg.py).peak_mb, 0) << " |";
      md << "\n";
    }
  }

  md << "\nWhere the time goes in each side's fastest run (ms, medians of the timed steps; forward includes "
     << "the EDM inputs and the loss, optimizer the AdamW step, the EMA update and zero_grad):\n\n"
     << "| model | side | forward | backward | optimizer |\n|---|---|---:|---:|---:|\n";
  for (const auto& r : rows) {
    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << r.c->name << " | " << side << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | "
         << fixed(m.opt, 1) << " |\n";
    }
  }

  std::cout << md.str();
  if (f.has("out")) {
    std::ofstream out(f.get("out", ""));
    DEW_CHECK(out && (out << md.str()), "--out: cannot write \"", f.get("out", ""), "\"");
    std::cerr << "bench: wrote " << f.get("out", "") << "\n";
  }
  return 0;
}

}  // namespace dew::cli
