#include "dew/bench/sweep.h"

#include <algorithm>
#include <memory>

#include "dew/bench/child_process.h"
#include "dew/bench/measure.h"
#include "dew/bench/report.h"
#include "dew/data/dataset.h"
#include "dew/io/safetensors.h"

namespace dew::bench {

namespace {

// One progress line: the round, the run and its time.
void print_progress(std::ostream& log, int64_t round, int64_t rounds, const std::string& what, const Measurement& m) {
  log << "bench: round " << round << "/" << rounds << "  " << what << "  " << config_name(m) << ": " << fixed(m.ms, 1)
      << " ms/step";
  if (m.gen_ms_per_token > 0) log << ", generation " << fixed(m.gen_ms_per_token, 2) << " ms/token";
  if (m.prefill_ms > 0 && m.gen_ms_per_token == 0) log << ", " << fixed(m.tokens_per_s, 0) << " generated tokens/s";
  log << "\n";
}

// The cases whose peers also run under torch.compile: the training steps and the FID feature pass.
bool compiles(const BenchCase& c) {
  return c.kind != CaseKind::sd_vae && c.kind != CaseKind::sample && c.kind != CaseKind::grpo_rollout &&
         c.kind != CaseKind::ddp;
}

// A ddp configuration of several ranks on a fresh loopback port: the C++ child under `dew launch` (argv = the
// `dew bench --one` child's), the Python peer under torchrun (python -m torch.distributed.run; argv = the peer's).
std::vector<std::string> launched(const std::vector<std::string>& argv, int64_t ranks, int64_t threads, bool cpp) {
  const std::string port = std::to_string(free_local_port()), n = std::to_string(ranks);
  if (cpp) {
    std::vector<std::string> out = {
        argv[0], "launch", "--nproc-per-node", n, "--threads", std::to_string(threads), "--master-port", port, "--"};
    out.insert(out.end(), argv.begin() + 1, argv.end());
    return out;
  }
  std::vector<std::string> out = {
      argv[0],         "-m", "torch.distributed.run", "--nproc-per-node", n, "--master-addr", "127.0.0.1",
      "--master-port", port};
  out.insert(out.end(), argv.begin() + 1, argv.end());
  return out;
}

}  // namespace

std::string sweep(const SweepOptions& o, std::ostream& log) {
  ReportContext ctx;
  ctx.sizes = o.sizes;
  ctx.rounds = o.rounds;
  ctx.device = o.device.str();
  ctx.command = o.command;
  ctx.peers = find_peers(o.peer, o.cases, o.program, o.peers, log);
  const Peers& peers = ctx.peers;

  // The optimizer both sides of a step case use (bench_optim), and `dew train`'s default recipe for the train
  // case: the parent prepares it once (its complete model fields, the Python peer's settings) and dumps its
  // training images and labels for the peer, which reads them instead of the IDX files. The sample case samples
  // from the same recipe's model (its fields and preset from the same record).
  PeerArgs args;
  args.sizes = o.sizes;
  args.optim_json = to_json(bench_optim(warmup_of(bench_cases().front(), o.sizes))).dump();  // a step case's warm-up
  std::unique_ptr<TempDir> train_dir;
  json train_fields;
  const bool any_train = any_of_kind(o.cases, CaseKind::train), any_ddp = any_of_kind(o.cases, CaseKind::ddp);
  if (any_train || any_ddp || any_of_kind(o.cases, CaseKind::sample)) {
    train_dir = std::make_unique<TempDir>("bench_train_data");
    auto run = prepare_default_train((train_dir->path / "run").string(), 0, batch_of(train_case(), o.sizes), o.device);
    args.train_record = run.record;
    args.train_record["optim"] = to_json(run.optim);
    args.train_record["trainer"] = to_json(run.trainer);
    train_fields = run.record["model"]["fields"];
    const data::TensorDataset& ds = run.built.loader->dataset();
    if ((any_train && !peers.script(CaseKind::train).empty()) || (any_ddp && !peers.script(CaseKind::ddp).empty())) {
      args.train_data = (train_dir->path / "train_data.safetensors").string();
      io::save_safetensors(args.train_data, ds.fields());
    }
  }
  ctx.train_record = args.train_record;

  // The parent builds each model once for its complete field set (defaults included) and parameter count, which
  // the peer receives so it builds, and checks, the same model. The SD peer gets the diffusers config.json dict
  // the C++ fields came from.
  std::vector<Row> rows;
  for (const BenchCase* c : o.cases) {
    const CaseModel m = case_model(*c, o.sizes.seq_len, train_fields);
    Row row{c, is_sd(*c) ? reference_config(*c).dump() : m.fields.dump(), m.params, {}};
    if (c->kind == CaseKind::ddp) {  // the cores in one rank's threads, then one thread per rank
      row.configs.push_back({kDdpCores, kDdpCores, {}, {}, {}, 1});
      row.configs.push_back({1, 1, {}, {}, {}, kDdpCores, true});  // what overlapping the all-reduce wins
      row.configs.push_back({1, 1, {}, {}, {}, kDdpCores});
    } else {
      for (int64_t intra : o.threads)
        for (int64_t blas : o.blas_threads) row.configs.push_back({intra, blas, {}, {}, {}});
    }
    rows.push_back(std::move(row));
  }

  ctx.load_before = load_average();
  // Rounds sweep every configuration in turn, and C++ and Python alternate within each, so slow spells of a
  // shared machine spread over both sides and over all configurations.
  for (int64_t round = 1; round <= o.rounds; ++round) {
    for (auto& row : rows) {
      const std::string& name = row.c->name;
      for (auto& cfg : row.configs) {
        const auto common = child_args(*row.c, o.sizes, cfg.intra, ctx.device);
        const std::string ranks = (cfg.ranks > 1 ? " " + std::to_string(cfg.ranks) + " ranks" : "") +
                                  (cfg.overlap ? " (all-reduce overlapping backward)" : "");
        auto cpp_argv = std::vector<std::string>{o.program, "bench", "--one", name};
        cpp_argv.insert(cpp_argv.end(), common.begin(), common.end());
        if (cfg.overlap) cpp_argv.insert(cpp_argv.end(), {"--overlap", "on"});
        if (cfg.ranks > 1) cpp_argv = launched(cpp_argv, cfg.ranks, cfg.intra, true);
        cfg.cpp.push_back(measure_child(cpp_argv, cfg.intra, cfg.blas, name + " C++" + ranks));
        print_progress(log, round, o.rounds, name + "  C++   " + ranks, cfg.cpp.back());
        auto py_argv = peer_argv(peers, *row.c, row.fields, row.params, args);
        if (py_argv.empty() || cfg.overlap) continue;  // DDP's peer always overlaps
        py_argv.insert(py_argv.end(), common.begin(), common.end());
        auto py_env = peers.env;
        if (cfg.ranks > 1) {
          py_argv = launched(py_argv, cfg.ranks, cfg.intra, false);
          py_env["OMP_NUM_THREADS"] = std::to_string(cfg.intra);  // as dew launch sets it (torchrun: 1, warning)
        }
        cfg.py.push_back(measure_child(py_argv, cfg.intra, cfg.blas, name + " Python" + ranks, py_env, peers.unset));
        print_progress(log, round, o.rounds, name + "  Python" + ranks, cfg.py.back());
      }
    }
  }
  // The training-step cases again in Python under torch.compile, in the eager peer's fastest configuration
  // (compiling costs 30-120 s a process, so not every configuration): inductor's cache makes later rounds'
  // compiles shorter; the steady-state steps are timed either way.
  if (o.compile) {
    for (int64_t round = 1; round <= o.rounds; ++round) {
      for (auto& row : rows) {
        auto py_argv = peer_argv(peers, *row.c, row.fields, row.params, args);
        const Measurement* eager = fastest_of(row.configs, &Config::py);
        if (py_argv.empty() || !eager || !compiles(*row.c)) continue;
        auto cfg = std::find_if(row.configs.begin(), row.configs.end(),
                                [&](const Config& c) { return c.intra == eager->intra && c.blas == eager->blas; });
        for (auto& a : child_args(*row.c, o.sizes, cfg->intra, ctx.device)) py_argv.push_back(a);
        py_argv.push_back("--compile");
        cfg->pyc.push_back(
            measure_child(py_argv, cfg->intra, cfg->blas, row.c->name + " Python compiled", peers.env, peers.unset));
        print_progress(log, round, o.rounds,
                       row.c->name + "  Python compiled (" + fixed(cfg->pyc.back().compile_s, 1) + " s to compile)",
                       cfg->pyc.back());
      }
    }
  }
  ctx.load_after = load_average();
  return write_report(rows, ctx);
}

}  // namespace dew::bench
