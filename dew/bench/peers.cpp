#include "dew/bench/peers.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <tuple>

#include "dew/bench/child_process.h"
#include "dew/bench/measure.h"
#include "dew/core/threads.h"
#include "dew/objectives/diffusion.h"

namespace fs = std::filesystem;

namespace dew::bench {

namespace {

// A command as a shell would take it back, for error messages.
std::string quoted(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    const bool plain = a.find_first_of(" \"'{}[],$\\") == std::string::npos;
    s += (s.empty() ? "" : " ") + (plain ? a : "'" + a + "'");
  }
  return s;
}

// The peer script of --`flag` (e.g. "lm-peer"), else `file` (e.g. "lm_peer.py") under bench/ beside the build
// directory holding `exe`, else under the working directory. Empty when none is found.
std::string find_peer_script(const PeerOptions& o, const fs::path& exe, const std::string& flag,
                             const std::string& file) {
  if (auto it = o.files.find(flag); it != o.files.end()) {
    DEW_CHECK(fs::is_regular_file(it->second), "--", flag, ": no such file \"", it->second, "\"");
    return it->second;
  }
  for (const fs::path& p : {exe.parent_path().parent_path() / "bench" / file, exe.parent_path() / "bench" / file,
                            fs::current_path() / "bench" / file})
    if (fs::is_regular_file(p)) return p.lexically_normal().string();
  return "";
}

// The diffusers cases among `cases`, comma-separated, for the log line saying they run C++ only.
std::string diffusers_case_names(const std::vector<const BenchCase*>& cases) {
  std::string names;
  for (const BenchCase* c : cases)
    if (is_sd(*c)) names += (names.empty() ? "" : ", ") + c->name;
  return names;
}

}  // namespace

Measurement measure_child(const std::vector<std::string>& argv, int64_t intra, int64_t blas, const std::string& what,
                          std::map<std::string, std::string> env, const std::vector<std::string>& unset) {
  env["OPENBLAS_NUM_THREADS"] = std::to_string(blas);
  auto r = run_child(argv, env, /*quiet=*/false, unset);
  DEW_CHECK(r.exit_code == 0, "bench: the ", what, " run failed (exit ", r.exit_code, "): ", quoted(argv));
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
  m.tokens_per_s = j.value("tokens_per_s", 0.0);
  m.gen_ms_per_token = j.value("gen_ms_per_token", 0.0);
  m.prefill_ms = j.value("prefill_ms", 0.0);
  m.sample_ms = j.value("sample_ms", 0.0);
  m.sample_cached_ms = j.value("sample_cached_ms", 0.0);
  m.sample_cache_max_diff = j.value("sample_cache_max_diff", 0.0);
  m.data_ms = j.value("data_ms", 0.0);
  m.compile_s = j.value("compile_s", 0.0);
  m.ranks = j.value("ranks", int64_t(1));
  m.allreduce_ms = j.value("allreduce_ms", 0.0);
  m.allreduce_share = j.value("allreduce_share", 0.0);
  m.allreduce_exposed_ms = j.value("allreduce_exposed_ms", 0.0);
  m.torch = j.value("torch", "");
  m.blas_core = j.value("blas_core", "");
  return m;
}

const std::string& Peers::script(CaseKind k) const {
  static const std::string none;
  auto it = scripts.find(k);
  return it == scripts.end() ? none : it->second;
}

Peers find_peers(const PeerOptions& o, const std::vector<const BenchCase*>& cases, const std::string& program,
                 bool enabled, std::ostream& log) {
  Peers p;
  p.python = o.python;
  p.diffusers_src = o.diffusers_src;
  p.coretype = o.coretype;
  p.malloc_like_dew = o.malloc_like_dew;
  const bool any_diffusion = any_of_kind(cases, CaseKind::diffusion), any_lm = any_of_kind(cases, CaseKind::lm);
  // The diffusers cases: the SD components and the flow transformers, one peer for all of them.
  const bool any_sd = std::any_of(cases.begin(), cases.end(), [](const BenchCase* c) { return is_sd(*c); });
  if (enabled) {
    const fs::path exe = program;
    // In the order of the report's sections, so a missing --FLAG file is named in that order.
    const std::vector<std::tuple<CaseKind, const char*, const char*>> kinds = {
        {CaseKind::diffusion, "peer", "peer.py"},
        {CaseKind::lm, "lm-peer", "lm_peer.py"},
        {CaseKind::jepa, "jepa-peer", "jepa_peer.py"},
        {CaseKind::dpo, "dpo-peer", "dpo_peer.py"},
        {CaseKind::grpo_rollout, "grpo-rollout-peer", "grpo_rollout_peer.py"},
        {CaseKind::sd_unet, "sd-peer", "sd_peer.py"},
        {CaseKind::train, "train-peer", "train_peer.py"},
        {CaseKind::ddp, "ddp-peer", "ddp_peer.py"},
        {CaseKind::sample, "sample-peer", "sample_peer.py"},
        {CaseKind::fid, "fid-peer", "fid_peer.py"}};
    for (const auto& [kind, flag, file] : kinds) {
      const bool used = kind == CaseKind::sd_unet ? any_sd : any_of_kind(cases, kind);
      if (used) p.scripts[kind] = find_peer_script(o, exe, flag, file);
    }
    std::string sd_peer = p.script(CaseKind::sd_unet);  // one peer for every diffusers case
    p.scripts.erase(CaseKind::sd_unet);
    auto probe = run_child({o.python, "-c", "import torch; print(torch.__version__)"}, {}, /*quiet=*/true);
    if (probe.exit_code != 0) {
      p.note = "Python peer skipped: " + o.python + " with torch is not available; C++ side only.";
      p.lm_note = p.note;
      p.scripts.clear();
      if (any_sd) p.sd_note = "peer: unavailable (" + o.python + " with torch is not available)";
      sd_peer.clear();
    } else {
      if (any_diffusion && p.script(CaseKind::diffusion).empty())
        p.note = "Python peer skipped: bench/peer.py not found (pass --peer FILE); C++ side only.";
      if (any_lm && p.script(CaseKind::lm).empty())
        p.lm_note = "Python peer skipped: bench/lm_peer.py not found (pass --lm-peer FILE); C++ side only.";
      p.torch = probe.out.substr(0, probe.out.find('\n'));
      if (any_sd && sd_peer.empty()) {
        p.sd_note = "peer: unavailable (bench/sd_peer.py not found; pass --sd-peer FILE)";
      } else if (any_sd) {
        // The peer imports diffusers from the checkout, or prints why it cannot (exit 3).
        auto sd_probe = run_child({o.python, sd_peer, "--probe", "--diffusers-src", o.diffusers_src}, {},
                                  /*quiet=*/true);
        std::string line = sd_probe.out.substr(0, sd_probe.out.find('\n'));
        if (sd_probe.exit_code != 0) {
          p.sd_note = "peer: unavailable (" + (line.empty() ? "bench/sd_peer.py --probe failed" : line) + ")";
          sd_peer.clear();
        } else {
          p.diffusers = line;
        }
      }
    }
    if (!sd_peer.empty())
      for (CaseKind k : {CaseKind::sd_unet, CaseKind::sd_unet_lora, CaseKind::sd_vae, CaseKind::sd3, CaseKind::flux,
                         CaseKind::qwen_image})
        p.scripts[k] = sd_peer;
    if (!p.sd_note.empty())
      log << p.sd_note << "; the diffusers cases (" << diffusers_case_names(cases) << ") run C++ only\n";
    if (!p.note.empty()) log << p.note << "\n";
    if (!p.lm_note.empty() && p.lm_note != p.note) log << p.lm_note << "\n";
  }

  // The peer runs in the environment the user gave: when OPENBLAS_CORETYPE was set by dew's own re-exec
  // (dew::reexec_with_blas_kernels), Python gets OpenBLAS's default choice, unless --peer-coretype says.
  if (o.coretype) {
    p.env["OPENBLAS_CORETYPE"] = *o.coretype;
  } else if (std::getenv(kCoretypeMarker)) {
    p.unset = {"OPENBLAS_CORETYPE", kCoretypeMarker};
  }
  if (o.malloc_like_dew) p.env["GLIBC_TUNABLES"] = kKeepFreedMemoryTunables;
  return p;
}

std::vector<std::string> peer_argv(const Peers& peers, const BenchCase& c, const std::string& fields, int64_t params,
                                   const PeerArgs& a) {
  const std::string& script = peers.script(c.kind);
  if (script.empty() || (c.kind == CaseKind::diffusion && !c.peer)) return {};
  std::vector<std::string> argv = {peers.python, script};
  const auto add = [&argv](std::initializer_list<std::string> more) { argv.insert(argv.end(), more); };
  const std::string n = std::to_string(params);
  switch (c.kind) {
    case CaseKind::lm:
      add({"--config", fields, "--params", n, "--optim", a.optim_json});
      add({"--prompt-len", std::to_string(kLmPrompt), "--new-tokens", std::to_string(kLmNewTokens)});
      add({"--gen-reps", std::to_string(kLmGenReps)});
      break;
    case CaseKind::jepa: add({"--config", fields, "--params", n, "--optim", a.optim_json}); break;
    case CaseKind::dpo:
      add({"--config", fields, "--params", n, "--optim", a.optim_json});
      add({"--seq-len", std::to_string(kDpoLen), "--completion-len", std::to_string(kDpoCompletion)});
      break;
    case CaseKind::grpo_rollout:
      add({"--config", fields, "--params", n});
      add({"--prompts", std::to_string(kGrpoPrompts), "--group", std::to_string(kGrpoGroup)});
      add({"--prompt-len", std::to_string(kGrpoPromptLen), "--new-tokens", std::to_string(kGrpoNewTokens)});
      add({"--temperature", "1.0"});
      break;
    case CaseKind::sd_unet:
    case CaseKind::sd_unet_lora:
      add({"--model", c.name, "--config", fields, "--params", n, "--diffusers-src", peers.diffusers_src});
      add({"--latent-size", std::to_string(c.item[1]), "--context-len", std::to_string(c.context_len)});
      break;
    case CaseKind::sd_vae:
      add({"--model", c.name, "--config", fields, "--params", n, "--diffusers-src", peers.diffusers_src});
      add({"--image-size", std::to_string(c.item[1])});
      break;
    case CaseKind::sd3:
    case CaseKind::flux:
    case CaseKind::qwen_image:
      add({"--model", c.name, "--config", fields, "--params", n, "--diffusers-src", peers.diffusers_src});
      add({"--latent-size", std::to_string(c.item[1]), "--context-len", std::to_string(c.context_len)});
      if (c.kind == CaseKind::qwen_image)
        add({"--sample-text-len", std::to_string(kQwenSampleText), "--sample-steps", std::to_string(kQwenSampleSteps),
             "--sample-reps", std::to_string(kQwenSampleReps)});
      break;
    case CaseKind::train:
    case CaseKind::ddp:
      add({"--config", fields, "--params", n, "--data", a.train_data, "--recipe", a.train_record.dump()});
      break;
    case CaseKind::sample: {
      const json& rec = a.train_record;
      const DiffusionSampleOptions g =
          sample_options(rec["derived"]["sample_shape"].get<std::vector<int64_t>>(),
                         rec["model"]["fields"].value("num_classes", int64_t(0)), a.sizes.images, a.sizes.sample_steps);
      add({"--config", fields, "--params", n, "--preset", rec["preset"].dump(), "--shape", json(g.shape).dump()});
      add({"--solver", g.solver, "--guidance", fixed(g.guidance.scale, 6), "--chunk", std::to_string(g.batch_size)});
      break;
    }
    case CaseKind::fid: add({"--params", n, "--image-size", std::to_string(c.item[1])}); break;
    case CaseKind::diffusion:
      add({"--model", c.arch, "--config", fields, "--params", n});
      add({"--image", std::to_string(c.item[1]) + "x" + std::to_string(c.item[2])});
      add({"--context-len", std::to_string(c.context_len), "--optim", a.optim_json});
      add({"--unconditional-prob", fixed(DiffusionObjectiveOptions{}.unconditional_prob, 6)});
      break;
  }
  return argv;
}

std::vector<std::string> child_args(const BenchCase& c, const Sizes& s, int64_t threads, const std::string& device) {
  std::vector<std::string> a{"--steps",   std::to_string(steps_of(c, s)), "--warmup", std::to_string(warmup_of(c, s)),
                             "--threads", std::to_string(threads),        "--device", device};
  if (c.kind == CaseKind::sample)
    a.insert(a.end(), {"--images", std::to_string(s.images), "--sample-steps", std::to_string(s.sample_steps)});
  else if (c.kind != CaseKind::grpo_rollout)  // a rollout's rows are fixed
    a.insert(a.begin(), {"--batch", std::to_string(batch_of(c, s))});
  if (c.kind == CaseKind::lm) a.insert(a.end(), {"--seq-len", std::to_string(s.seq_len)});
  return a;
}

}  // namespace dew::bench
