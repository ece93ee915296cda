#include "dew/bench/report.h"

#include <ATen/Version.h>
#include <sched.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "dew/bench/measure.h"
#include "dew/core/threads.h"
#include "dew/nn/fused.h"
#include "dew/objectives/diffusion.h"

namespace dew::bench {

namespace {

// A side of a table: its name and its measurements in a Config.
using Side = std::pair<std::string, std::vector<Measurement> Config::*>;

// C++, then Python when its peer ran.
std::vector<Side> sides_of(bool with_peer) {
  std::vector<Side> sides{{"C++", &Config::cpp}};
  if (with_peer) sides.push_back({"Python", &Config::py});
  return sides;
}

// The fastest run of one side over all configurations (the side ran them all).
const Measurement& fastest(const std::vector<Config>& configs, std::vector<Measurement> Config::*side,
                           double Measurement::*key = &Measurement::ms) {
  const Measurement* out = fastest_of(configs, side, key);
  DEW_CHECK(out != nullptr, "bench: no measurement of this side");
  return *out;
}

// 2.1e-06: a small difference, two significant digits.
std::string scientific(double v) {
  std::ostringstream s;
  s << std::scientific << std::setprecision(1) << v;
  return s.str();
}

// 1234567 -> "1,234,567".
std::string grouped(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
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

// What `nproc` prints: the CPUs this process may run on.
int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return int(sysconf(_SC_NPROCESSORS_ONLN));
}

// Every round's value of `key`, fastest first, so the spread between processes is visible.
std::string rounds_cell(const std::vector<Measurement>& ms, double Measurement::*key = &Measurement::ms,
                        int digits = 1) {
  std::vector<double> v;
  for (const auto& m : ms) v.push_back(m.*key);
  std::sort(v.begin(), v.end());
  std::string s;
  for (double x : v) s += (s.empty() ? "" : " / ") + fixed(x, digits);
  return s;
}

// A side's BLAS kernels as its children reported them.
std::string core_of(const std::vector<Measurement>& ms) {
  if (ms.empty()) return "n/a (not run)";
  if (!ms.front().blas_core.empty()) return ms.front().blas_core;
  return "unknown (neither oneMKL nor OpenBLAS answered)";
}

// The JEPA case's masks, from the recipe.
std::string jepa_masks_text() {
  const auto m = jepa_objective_options().masks;
  return std::to_string(m.targets) + " target block(s) of scale [" + fixed(m.target_scale.first, 2) + ", " +
         fixed(m.target_scale.second, 2) + "], context scale [" + fixed(m.context_scale.first, 2) + ", " +
         fixed(m.context_scale.second, 2) + "], min_keep " + std::to_string(m.min_keep);
}

// Writes the sections of one sweep.
class ReportWriter {
 public:
  explicit ReportWriter(const ReportContext& ctx) : ctx_(ctx), s_(ctx.sizes) {}

  // The machine line and the command; `probe` supplies the kernel sets each side's BLAS chose.
  std::string machine(const Row& probe, bool with_peer) const {
    // OpenBLAS picks its kernels from the CPU model unless OPENBLAS_CORETYPE forces them; on a CPU it does not
    // recognise it falls back to SSE3 kernels, which shapes every number. dew sets it for itself.
    const char* by_dew = std::getenv(kCoretypeMarker);
    const char* coretype = by_dew ? nullptr : std::getenv("OPENBLAS_CORETYPE");
    // keep_freed_memory() is idempotent; its answer is what the C++ children (dew processes too) did.
    const bool malloc_kept = keep_freed_memory();
    const Peers& p = ctx_.peers;
    std::ostringstream m;
    m << "Machine: " << usable_cpus() << " CPUs (nproc), " << cpu_model() << "; device " << ctx_.device << "; LibTorch "
      << TORCH_VERSION << " (C++)";
    if (with_peer) m << ", PyTorch " << p.torch << " (" << p.python << ")";
    const auto& probe_cfg = probe.configs.front();
    m << "; BLAS " << core_of(probe_cfg.cpp) << " (C++)";
    if (with_peer) m << ", " << core_of(probe_cfg.py) << " (Python)";
    // The children inherit DEW_FUSED_ISA, so this process's choice is theirs.
    m << "; dew's fused kernels " << nn::fused_kernel_isa() << (std::getenv("DEW_FUSED_ISA") ? " (DEW_FUSED_ISA)" : "")
      << "; ATen's CPU kernels " << at::get_cpu_capability();
    m << "; OPENBLAS_CORETYPE "
      << (by_dew     ? std::string("set by dew for itself (") + by_dew + ")"
          : coretype ? std::string("set by the user (") + coretype + ")"
                     : "unset");
    if (with_peer && p.coretype) m << ", " << *p.coretype << " for Python (--peer-coretype)";
    m << (malloc_kept ? "; malloc keeps freed memory in dew" : "; malloc as the environment sets it in dew");
    if (with_peer) m << (p.malloc_like_dew ? " and in Python (--peer-malloc-like-dew)" : ", glibc defaults in Python");
    m << "; " << utc_now() << "; 1-minute load average " << ctx_.load_before << " before the runs, " << ctx_.load_after
      << " after (the runs themselves add 1-2).\n\nCommand: `";
    if (coretype) m << "OPENBLAS_CORETYPE=" << coretype << " ";
    m << "dew bench";  // (the re-exec's own setting is not part of the user's command)
    for (const auto& a : ctx_.command) m << " " << a;
    m << "`\n\n";
    return m.str();
  }

  // A training step's tables (the JEPA, DPO and SD UNet steps): each side's fastest run, the speed-up, every
  // configuration. `per_s` names samples_per_s (batch rows per second).
  void step_tables(const Row& r, bool with_peer, const std::string& per_s) {
    md_ << "| side | best config | ms/step | " << per_s << " | forward ms | backward ms | optimizer ms | peak MB |\n"
        << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 1)
          << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.opt, 1) << " | "
          << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nSpeed-up (Python ms/step / C++ ms/step): "
          << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
    every_configuration(r, with_peer, "Every configuration (each round's median, fastest first):", "ms/step");
  }

  // The table of every configuration's rounds, one time column per side.
  void every_configuration(const Row& r, bool with_peer, const std::string& title, const std::string& unit) {
    md_ << "\n"
        << title << "\n\n| intra | blas | C++ " << unit << " |" << (with_peer ? " Python " + unit + " |" : "")
        << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md_ << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md_ << " " << rounds_cell(cfg.py) << " |";
      md_ << "\n";
    }
  }

  void diffusion(const std::vector<const Row*>& drows) {
    const bool with_peer = !ctx_.peers.script(CaseKind::diffusion).empty();
    const BenchCase& c = *drows.front()->c;
    const int64_t warmup = warmup_of(c, s_);
    md_ << "## dew bench: one diffusion training step on the CPU\n\n"
        << "Step: the trainer's own (training::Trainer::train_step, the step of `dew train`) on a fixed batch of "
        << "uint8 images: DiffusionObjective with the EDM pixel preset (labels dropped to the null class with "
        << "probability " << DiffusionObjectiveOptions{}.unconditional_prob << "; the models reading a text context "
        << "get a fixed one), the finite check of the loss, backward, global-norm clip "
        << bench_optim(warmup).grad_clip << ", learning rate warmed up over the untimed steps to " << kLr
        << " then cosine, AdamW (weight decay 0.01 on "
        << "matrices), fp32 EMA (decay " << kEmaDecay << "); batch " << batch_of(c, s_) << ". Python: bench/peer.py, "
        << "the same per step (torch.nn.utils.clip_grad_norm_, the lr set per step, loss.item() and isfinite). Each "
        << "configuration runs in a fresh process: " << warmup << " warm-up + " << steps_of(c, s_)
        << " timed steps, median; " << ctx_.rounds << " round(s) per side"
        << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported. Thread "
        << "configurations: LibTorch intra-op threads (intra) x BLAS threads (blas).\n\n"
        << machine(*drows.front(), with_peer);
    if (!ctx_.peers.note.empty()) md_ << ctx_.peers.note << "\n\n";

    md_ << "| model | size | params | C++ best config | C++ ms/step | samples/s | peak MB |";
    if (with_peer) md_ << " Python best config | Python ms/step | peak MB | speed-up |";
    md_ << "\n|---|---|---:|---|---:|---:|---:|" << (with_peer ? "---|---:|---:|---:|" : "") << "\n";
    for (const Row* r : drows) {
      const auto& m = fastest(r->configs, &Config::cpp);
      md_ << "| " << r->c->name << " | " << r->c->size << " | " << grouped(r->params) << " | " << config_name(m)
          << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 1) << " | " << fixed(m.peak_mb, 0) << " |";
      if (with_peer && r->c->peer) {
        const auto& p = fastest(r->configs, &Config::py);
        md_ << " " << config_name(p) << " | " << fixed(p.ms, 1) << " | " << fixed(p.peak_mb, 0) << " | "
            << fixed(p.ms / m.ms, 2) << "x |";
      } else if (with_peer) {
        md_ << " no peer | - | - | - |";
      }
      md_ << "\n";
    }

    md_ << "\nEvery configuration (ms/step: each round's median, fastest first; peak MB of the fastest round):\n\n"
        << "| model | intra | blas | C++ ms/step | C++ peak MB |"
        << (with_peer ? " Python ms/step | Python peak MB |" : "") << "\n|---|---:|---:|---:|---:|"
        << (with_peer ? "---:|---:|" : "") << "\n";
    for (const Row* r : drows) {
      for (const auto& cfg : r->configs) {
        md_ << "| " << r->c->name << " | " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " | "
            << fixed(best(cfg.cpp).peak_mb, 0) << " |";
        if (with_peer && r->c->peer)
          md_ << " " << rounds_cell(cfg.py) << " | " << fixed(best(cfg.py).peak_mb, 0) << " |";
        else if (with_peer) md_ << " - | - |";
        md_ << "\n";
      }
    }

    md_ << "\nWhere the time goes in each side's fastest run (ms, medians of the timed steps; forward: the batch, "
        << "the EDM inputs, the loss and its finite check; backward: backward and the gradient clip; optimizer: the "
        << "rest of the step, zero_grad, AdamW and the EMA update):\n\n"
        << "| model | side | forward | backward | optimizer |\n|---|---|---:|---:|---:|\n";
    for (const Row* r : drows) {
      for (const auto& [side, member] : sides_of(with_peer && r->c->peer)) {
        const auto& m = fastest(r->configs, member);
        md_ << "| " << r->c->name << " | " << side << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | "
            << fixed(m.opt, 1) << " |\n";
      }
    }
  }

  void lm(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::lm).empty();
    const int64_t warmup = warmup_of(*r.c, s_), steps = steps_of(*r.c, s_);
    md_ << "## dew bench: a language-model training step and KV-cache generation on the CPU\n\n"
        << "Model: causal_transformer, " << r.c->size << ", " << grouped(r.params) << " parameters.\n\n"
        << "Training step: batch " << batch_of(*r.c, s_) << " x " << s_.seq_len << " tokens; forward, next-token "
        << "cross entropy (C++: LMObjective, `dew train lm`'s chunked fp32 cross entropy, which also counts correct "
        << "argmaxes; Python: F.cross_entropy of the logits), the finite check, backward, global-norm clip, warm-up + "
        << "cosine lr (peak " << kLr << "), AdamW (weight decay 0.01 on matrices), fp32 EMA (decay " << kEmaDecay
        << "); C++ through the trainer's step (Trainer::train_step); " << warmup << " warm-up + " << steps
        << " timed steps, median. Generation: batch 1, a " << kLmPrompt << "-token prompt, " << kLmNewTokens
        << " greedy new tokens with a KV cache, prefill then one token per forward (C++: sampling::generate_tokens, "
        << "as `dew generate`; Python: the cache as tensors concatenated per step); 1 untimed + " << kLmGenReps
        << " timed generations, median; ms/token = the whole generation, prefill included, / " << kLmNewTokens
        << ". Each configuration runs in a fresh process (training, then generation); " << ctx_.rounds
        << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported, for training and for generation separately. Thread configurations: "
        << "LibTorch intra-op threads (intra) x BLAS threads (blas).\n\n"
        << machine(r, with_peer);
    if (!ctx_.peers.lm_note.empty()) md_ << ctx_.peers.lm_note << "\n\n";

    md_ << "Training (forward includes the cross entropy; optimizer is AdamW, EMA and zero_grad; peak MB of the "
        << "whole process):\n\n"
        << "| side | best config | ms/step | tokens/s | forward ms | backward ms | optimizer ms | peak MB |\n"
        << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.tokens_per_s, 0)
          << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.opt, 1) << " | "
          << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nTraining speed-up (Python ms/step / C++ ms/step): "
          << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";

    const auto gen = &Measurement::gen_ms_per_token;
    md_ << "\nGeneration (prefill: the " << kLmPrompt << "-token prompt's forward alone, median):\n\n"
        << "| side | best config | ms/token | tokens/s | prefill ms |\n|---|---|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member, gen);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.gen_ms_per_token, 2) << " | "
          << fixed(1e3 / m.gen_ms_per_token, 0) << " | " << fixed(m.prefill_ms, 1) << " |\n";
    }
    if (with_peer)
      md_ << "\nGeneration speed-up (Python ms/token / C++ ms/token): "
          << fixed(fastest(r.configs, &Config::py, gen).gen_ms_per_token /
                       fastest(r.configs, &Config::cpp, gen).gen_ms_per_token,
                   2)
          << "x\n";

    md_ << "\nEvery configuration (each round's median, fastest first):\n\n"
        << "| intra | blas | C++ ms/step | C++ ms/token |" << (with_peer ? " Python ms/step | Python ms/token |" : "")
        << "\n|---:|---:|---:|---:|" << (with_peer ? "---:|---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md_ << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " | "
          << rounds_cell(cfg.cpp, gen, 2) << " |";
      if (with_peer) md_ << " " << rounds_cell(cfg.py) << " | " << rounds_cell(cfg.py, gen, 2) << " |";
      md_ << "\n";
    }
  }

  void jepa(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::jepa).empty();
    md_ << "## dew bench: a JEPA training step on the CPU\n\n"
        << "Models: jepa_encoder + jepa_predictor, " << r.c->size << ", " << grouped(r.params)
        << " parameters. Step (`dew train jepa`'s): I-JEPA multi-block masks drawn, the target encoder's "
        << "LayerNorm'd features at the target blocks without gradients (the recipe's masks: " << jepa_masks_text()
        << "), the context encoder on the context block, "
        << "the predictor, MSE; the finite check, backward, global-norm clip, warm-up + cosine lr (peak " << kLr
        << "), AdamW (weight decay 0.01 on matrices), all through the trainer's step (Trainer::train_step); the target "
        << "encoder's momentum update (C++: the trainer's fp32 EMA the objective reads; Python: "
        << "bench/jepa_peer.py, I-JEPA's modules and its per-parameter update). Batch " << batch_of(*r.c, s_) << "; "
        << warmup_of(*r.c, s_) << " warm-up + " << steps_of(*r.c, s_) << " timed steps, median; " << ctx_.rounds
        << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported.\n\n"
        << machine(r, with_peer);
    step_tables(r, with_peer, "samples/s");
  }

  void dpo(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::dpo).empty();
    const int64_t batch = batch_of(*r.c, s_);
    md_ << "## dew bench: a DPO training step on the CPU\n\n"
        << "Model: causal_transformer, " << r.c->size << " (`dew train dpo`'s fresh model), " << grouped(r.params)
        << " parameters. Step (`dew train dpo`'s, beta 0.1, reference log-probs per batch): " << batch << " pairs of "
        << kDpoLen << " tokens, chosen and rejected sharing a " << kDpoLen - kDpoCompletion
        << "-token prompt and differing in the last " << kDpoCompletion << " (the completion mask); the frozen "
        << "reference's forward on the " << 2 * batch << " rows without gradient, the policy's forward, each row's "
        << "summed completion log-probs, the sigmoid loss -logsigmoid(beta * (chosen - rejected log-ratio)) and its "
        << "reward metrics; the finite check, backward, global-norm clip, warm-up + cosine lr (peak " << kLr
        << "), AdamW (weight decay 0.01 on matrices), through the trainer's step (Trainer::train_step). C++: "
        << "DPOObjective with the trainer's EMA as its reference (a frozen copy, never updated); Python: "
        << "bench/dpo_peer.py, TRL's step (concatenated chosen + rejected forward, a deepcopy as the reference). "
        << warmup_of(*r.c, s_) << " warm-up + " << steps_of(*r.c, s_) << " timed steps, median; " << ctx_.rounds
        << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported.\n\n"
        << machine(r, with_peer);
    step_tables(r, with_peer, "pairs/s");
  }

  void rollout(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::grpo_rollout).empty();
    const int64_t n = kGrpoPrompts * kGrpoGroup;
    md_ << "## dew bench: a GRPO rollout (batched sampling with a KV cache) on the CPU\n\n"
        << "Model: causal_transformer, " << r.c->size << " (`dew train grpo`'s fresh model), " << grouped(r.params)
        << " parameters. Rollout (GRPOObjective's generation): " << kGrpoPrompts << " prompts of " << kGrpoPromptLen
        << " tokens x group " << kGrpoGroup << " = " << n << " rows in one batch; prefill, then " << kGrpoNewTokens - 1
        << " single-token forwards with the KV cache, each row sampling " << kGrpoNewTokens
        << " tokens at temperature 1 (no EOS, so every row generates all of them) and keeping their log-probs. "
        << "C++: sampling::generate_tokens; Python: bench/grpo_rollout_peer.py, torch.multinomial of "
        << "softmax(logits / T), the cache as tensors concatenated per step. " << warmup_of(*r.c, s_) << " warm-up + "
        << steps_of(*r.c, s_) << " timed rollouts, median; " << ctx_.rounds << " round(s) per side"
        << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
        << machine(r, with_peer);
    md_ << "| side | best config | ms/rollout | generated tokens/s | prefill ms | peak MB |\n"
        << "|---|---|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.tokens_per_s, 0)
          << " | " << fixed(m.prefill_ms, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nSpeed-up (C++ tokens/s / Python tokens/s, higher is better for C++): "
          << fixed(fastest(r.configs, &Config::cpp).tokens_per_s / fastest(r.configs, &Config::py).tokens_per_s, 2)
          << "x\n";
    every_configuration(r, with_peer,
                        "Every configuration (ms/rollout, each round's median, fastest first):", "ms/rollout");
  }

  void sd(const Row* unet, const Row* lora, const Row* vae) {
    const bool with_peer = !ctx_.peers.script(CaseKind::sd_unet).empty() ||
                           !ctx_.peers.script(CaseKind::sd_unet_lora).empty() ||
                           !ctx_.peers.script(CaseKind::sd_vae).empty();
    const Row& first = unet ? *unet : lora ? *lora : *vae;
    const BenchCase& c = *first.c;
    md_ << "## dew bench: Stable Diffusion components on the CPU\n\n"
        << "Both sides build each model from the same diffusers config.json dict (below): C++ through "
        << "models::fields_from_reference_config, Python (bench/sd_peer.py) as diffusers' own class ("
        << ctx_.peers.diffusers << "); the parameter counts "
        << "must agree. Each configuration runs in a fresh process: " << warmup_of(c, s_) << " warm-up + "
        << steps_of(c, s_) << " timed steps, median; " << ctx_.rounds << " round(s) per side"
        << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported. Thread configurations: LibTorch intra-op threads (intra) x "
        << "BLAS threads (blas).\n\n"
        << machine(first, with_peer);
    if (!ctx_.peers.sd_note.empty()) md_ << ctx_.peers.sd_note << "; C++ side only.\n\n";
    if (unet) {
      const Row& r = *unet;
      const int64_t batch = batch_of(*r.c, s_);
      md_ << "### sd_unet: a UNet2DConditionModel training step\n\n"
          << "Model: unet_2d_condition / UNet2DConditionModel, " << r.c->size << ", " << grouped(r.params)
          << " parameters; config `" << r.fields << "`. Step (diffusers' train_text_to_image.py, epsilon "
          << "prediction): batch " << batch << "; noise and timesteps in [0, " << kSdTrainTimesteps
          << ") drawn, the noisy latents of SD's scaled_linear schedule (" << kSdBetaStart << " .. " << kSdBetaEnd
          << "; DDPMScheduler.add_noise), the UNet on a fixed [" << batch << ", " << kSdContextLen << ", "
          << sd_unet_config().at("cross_attention_dim").get<int64_t>() << "] text context, MSE against the noise; "
          << "backward; AdamW (lr " << kSdLr << "; C++: weight decay 0.01 on matrices, Python: torch.optim.AdamW with "
          << "weight_decay 0.01 on every parameter, as the script); EMA (decay " << kEmaDecay
          << " with the (1 + step)/(10 + step) ramp; Python: diffusers.training_utils.EMAModel); zero_grad. No "
          << "gradient clipping.\n\n";
      step_tables(r, with_peer, "samples/s");
    }
    if (lora) {
      const Row& r = *lora;
      if (unet) md_ << "\n";
      const nn::LoraOptions lo = sd_unet_lora_options();
      std::string targets;
      for (const auto& t : lo.target_modules()) targets += (targets.empty() ? "" : ", ") + t;
      md_ << "### sd_unet_lora: a LoRA training step of the same UNet\n\n"
          << "Model: sd_unet's UNet2DConditionModel with LoRA adapters of rank " << lo.rank() << " and alpha "
          << lo.alpha() << " on every " << targets << " (C++: nn::apply_lora; Python: peft's LoraConfig through "
          << "unet.add_adapter, init_lora_weights=\"gaussian\"), the base frozen; " << grouped(r.params)
          << " parameters with the adapters. Step (diffusers' train_text_to_image_lora.py): sd_unet's batch, noise, "
          << "timesteps, noisy latents and MSE; backward; the adapters' gradient norm clipped to " << kSdLoraGradClip
          << " (--max_grad_norm; counted in the backward phase); AdamW (lr " << kSdLr
          << ") over the adapters only (C++: weight decay 0.01 on matrices, Python: torch.optim.AdamW with "
             "weight_decay "
          << "0.01, as the script); zero_grad; no EMA.\n\n";
      step_tables(r, with_peer, "samples/s");
    }
    if (vae) {
      const Row& r = *vae;
      if (unet || lora) md_ << "\n";
      md_ << "### sd_vae: AutoencoderKL encode + decode\n\n"
          << "Model: autoencoder_kl / AutoencoderKL, " << r.c->size << ", " << grouped(r.params) << " parameters; "
          << "config `" << r.fields << "`. Pass (as a pipeline runs it, without gradients): batch "
          << batch_of(*r.c, s_)
          << "; z = scaling_factor * encode(x).latent_dist.sample(generator), x_hat = decode(z / scaling_factor).\n\n";
      pass_table(r, with_peer, "encode ms", "decode ms");
    }
  }

  // The table of an inference pass without gradients (a VAE's encode + decode, FID's features): per side the
  // fastest configuration with its two phases (fwd, bwd of the row), the speed-up, then every configuration.
  void pass_table(const Row& r, bool with_peer, const char* first_phase, const char* second_phase) {
    md_ << "| side | best config | ms/pass | images/s | " << first_phase << " | " << second_phase << " | peak MB |\n"
        << "|---|---|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 1)
          << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nSpeed-up (Python ms/pass / C++ ms/pass): "
          << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
    every_configuration(r, with_peer, "Every configuration (each round's median, fastest first):", "ms/pass");
  }

  // FID's InceptionV3 feature extraction against pytorch-fid's own InceptionV3 (bench/fid_peer.py).
  void fid(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::fid).empty();
    md_ << "## dew bench: FID feature extraction (InceptionV3 to pool3)\n\n"
        << "Model: " << r.c->size << ", " << grouped(r.params) << " parameters, random weights; C++: "
        << "dew::metrics::InceptionV3, Python (bench/fid_peer.py): pytorch_fid.inception.InceptionV3([3]) "
        << "(pytorch-fid 0.3.0); the parameter counts must agree. Pass (as FID extracts features, without "
        << "gradients): batch " << batch_of(*r.c, s_) << " of images in [0, 1], bilinear resize to 299 x 299 "
        << "(align_corners=False), 2x - 1, the network to pool3. " << warmup_of(*r.c, s_) << " warm-up + "
        << steps_of(*r.c, s_) << " timed passes, median; " << ctx_.rounds << " round(s) per side, the fastest "
        << "reported.\n\n"
        << machine(r, with_peer);
    pass_table(r, with_peer, "resize ms", "network ms");
  }

  // The flow-matching transformers against diffusers' own classes: one section, a table set per model.
  void flow_transformers(const Row* sd3, const Row* flux) {
    const bool with_peer = !ctx_.peers.script(CaseKind::sd3).empty();
    const BenchCase& c = sd3 ? *sd3->c : *flux->c;
    const int64_t batch = batch_of(c, s_);
    md_ << "## dew bench: SD3 and Flux transformers on the CPU\n\n"
        << "Both sides build each model from the same diffusers config.json dict (below): C++ through "
        << "models::fields_from_reference_config (sd3_transformer, flux_transformer), Python (bench/sd_peer.py) as "
        << "diffusers' own class (" << ctx_.peers.diffusers << "); the parameter counts must agree (diffusers' "
        << "SD3Transformer2DModel also holds the last block's text query projection, attn.add_q_proj, which feeds "
        << "only the discarded text output; dew does not build it, and the peer leaves it out of its count). Step "
        << "(diffusers' train_dreambooth_sd3.py / train_dreambooth_flux.py, flow matching without output "
        << "preconditioning, with the flow preset's continuous sigmas where the scripts index a scheduler table): "
        << "batch " << batch << " latents " << kFlowChannels << " x " << kFlowLatent << " x " << kFlowLatent
        << "; sigma ~ logit-normal(0, 1) and noise drawn, noisy = (1 - sigma) latents + sigma noise, the transformer "
        << "on (noisy, timestep 1000 sigma, a fixed [" << batch << ", " << kFlowContextLen
        << ", joint_attention_dim] text context and [" << batch << ", pooled_projection_dim] pooled text; Flux: "
        << "guidance " << kFlowGuidance << ", the latents packed into 2 x 2 tokens with their image and text ids "
        << "and the prediction unpacked), MSE against noise - latents (C++: dew's DiffusionProcess under the flow "
        << "preset); backward; the global gradient norm clipped to " << kFlowGradClip << "; AdamW (lr " << kFlowLr
        << ", weight decay " << kFlowWeightDecay << "; C++: on matrices, Python: torch.optim.AdamW on every "
        << "parameter, as the scripts); zero_grad; no EMA. Each configuration runs in a fresh process: "
        << warmup_of(c, s_) << " warm-up + " << steps_of(c, s_) << " timed steps, median; " << ctx_.rounds
        << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported; peak MB is each process's peak RSS. Thread configurations: LibTorch "
        << "intra-op threads (intra) x BLAS threads (blas).\n\n"
        << machine(sd3 ? *sd3 : *flux, with_peer);
    if (!ctx_.peers.sd_note.empty()) md_ << ctx_.peers.sd_note << "; C++ side only.\n\n";
    const std::vector<std::pair<const Row*, std::string>> models = {
        {sd3, "### sd3: an SD3Transformer2DModel training step"},
        {flux, "### flux: a FluxTransformer2DModel training step"}};
    bool first = true;
    for (const auto& [r, title] : models) {
      if (!r) continue;
      if (!first) md_ << "\n";
      first = false;
      md_ << title << "\n\nModel: " << r->c->arch << ", " << r->c->size << ", " << grouped(r->params)
          << " parameters; config `" << r->fields << "`.\n\n";
      step_tables(*r, with_peer, "samples/s");
    }
  }

  // Qwen-Image 2.1's transformer against diffusers' QwenImage21Transformer2DModel: the training step, then
  // sampling without and with the prefix KV cache.
  void qwen_image(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::qwen_image).empty();
    const BenchCase& c = *r.c;
    const int64_t batch = batch_of(c, s_);
    md_ << "## dew bench: Qwen-Image 2.1 transformer on the CPU\n\n"
        << "Both sides build the model from the same diffusers config.json dict (below): C++ through "
        << "models::fields_from_reference_config (qwen_image_transformer), Python (bench/sd_peer.py) as diffusers' "
        << "own QwenImage21Transformer2DModel (" << ctx_.peers.diffusers << "); the parameter counts must agree. "
        << "Training step (the SD3 / Flux step of train_dreambooth_sd3.py; there is no Qwen-Image training script in "
        << "diffusers): batch " << batch << " latents " << kFlowChannels << " x " << kQwenLatent << " x " << kQwenLatent
        << " (one token per latent), sigma ~ logit-normal(0, 1), noisy = (1 - sigma) latents + sigma "
        << "noise, the transformer on (noisy, timestep sigma on diffusers' [0, 1] scale, a fixed [" << batch << ", "
        << kFlowContextLen << ", context_in_dim] text context; Python: the latents packed, img_shapes and img_mask "
        << "of the text-only layout, the target tokens of the output unpacked), MSE against noise - latents; "
        << "backward; the gradient norm clipped to " << kFlowGradClip << "; AdamW (lr " << kFlowLr << ", weight decay "
        << kFlowWeightDecay << "); zero_grad. Sampling (QwenImage21Pipeline's loop on the "
        << "trained model in eval mode, without gradients or guidance): one image of " << kFlowChannels << " x "
        << kQwenLatent << " x " << kQwenLatent << " latents under a " << kQwenSampleText << "-token prompt, "
        << kQwenSampleSteps << " Euler steps over sigmas linspace(1, 1/n, n), once recomputing the text every step "
        << "and once with the prefix KV cache (the first step extracts the text's keys and values, later steps "
        << "recompute only the image tokens: the pipeline's use_kv_cache); one untimed run of each, then "
        << kQwenSampleReps
        << " timed runs of each, median. Each configuration runs in a fresh process: " << warmup_of(c, s_)
        << " warm-up + " << steps_of(c, s_) << " timed training steps, median; " << ctx_.rounds
        << " round(s) per side, the fastest reported.\n\n"
        << machine(r, with_peer);
    if (!ctx_.peers.sd_note.empty()) md_ << ctx_.peers.sd_note << "; C++ side only.\n\n";
    md_ << "### qwen_image: a QwenImage21Transformer2DModel training step\n\nModel: " << c.arch << ", " << c.size
        << ", " << grouped(r.params) << " parameters; config `" << r.fields << "`.\n\n";
    step_tables(r, with_peer, "samples/s");
    const auto cached = &Measurement::sample_cached_ms;
    md_ << "\n### qwen_image: sampling with and without the prefix KV cache\n\n"
        << "| side | best config | ms/step, no cache | ms/step, KV cache | cache speed-up | final latents apart |\n"
        << "|---|---|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member, cached);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.sample_ms, 1) << " | "
          << fixed(m.sample_cached_ms, 1) << " | " << fixed(m.sample_ms / m.sample_cached_ms, 2) << "x | "
          << scientific(m.sample_cache_max_diff) << " |\n";
    }
    if (with_peer)
      md_ << "\nSampling speed-up with the cache (Python ms/step / C++ ms/step): "
          << fixed(fastest(r.configs, &Config::py, cached).sample_cached_ms /
                       fastest(r.configs, &Config::cpp, cached).sample_cached_ms,
                   2)
          << "x\n";
  }

  void train(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::train).empty();
    const json& rec = ctx_.train_record;
    md_ << "## dew bench: `dew train` throughput, the default recipe with its data loader\n\n"
        << "Run: " << r.c->size << " (" << grouped(r.params) << " parameters); batch " << batch_of(*r.c, s_)
        << ", optim " << rec["optim"].dump() << ", trainer.steps " << rec["trainer"]["steps"].dump()
        << " (the schedule's length; " << warmup_of(*r.c, s_) << " warm-up + " << steps_of(*r.c, s_)
        << " timed steps run). C++: "
        << "runs::prepare of the recipe, as `dew train diffusion` with no flags, and training::Trainer::train_step "
        << "(the loader's next batch, DiffusionObjective's loss, the finite guard, backward, clip, the learning-rate "
        << "schedule, AdamW, the EMA), the DataLoader with its " << rec["loader"]["num_workers"].dump()
        << " worker thread(s) and prefetch " << rec["loader"]["prefetch"].dump()
        << ". Python (bench/train_peer.py): the same unet, flow loss, label drop, clip, schedule and EMA around a "
        << "torch.utils.data.DataLoader (num_workers 0, shuffle, same batch size, no augmentation as the recipe) over "
        << "the same uint8 images and labels, dumped by dew. samples/s = items / seconds of the timed steps; data ms = "
        << "median wait for the next batch; " << ctx_.rounds << " round(s) per side"
        << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
        << machine(r, with_peer);
    md_ << "| side | best config | samples/s | ms/step | data ms | forward ms | backward ms | optimizer ms | peak MB "
           "|\n"
        << "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.samples_per_s, 1) << " | " << fixed(m.ms, 1)
          << " | " << fixed(m.data_ms, 2) << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | "
          << fixed(m.opt, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nSpeed-up (C++ samples/s / Python samples/s): "
          << fixed(fastest(r.configs, &Config::cpp).samples_per_s / fastest(r.configs, &Config::py).samples_per_s, 2)
          << "x\n";
    every_configuration(r, with_peer, "Every configuration (ms/step, each round's, fastest first):", "ms/step");
  }

  // Data-parallel training: each side's samples/s as 1 rank and as several, the scaling efficiency, the
  // gradient all-reduce's share of the step.
  void ddp(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::ddp).empty();
    const json& rec = ctx_.train_record;
    const int64_t batch = batch_of(*r.c, s_);
    md_ << "## dew bench: data-parallel `dew train`, 1 rank against " << kDdpCores << " ranks, against PyTorch DDP\n\n"
        << "Run: the train case's (" << r.c->size << ", " << grouped(r.params) << " parameters; global batch " << batch
        << ", optim " << rec["optim"].dump() << "), " << warmup_of(*r.c, s_) << " warm-up + " << steps_of(*r.c, s_)
        << " timed steps, as 1 rank x " << kDdpCores << " threads and as " << kDdpCores << " ranks x 1 thread on "
        << "the same cores. C++: `dew bench --one ddp` alone, and under `dew launch --nproc-per-node " << kDdpCores
        << " --threads 1` (each rank joins the Gloo group on 127.0.0.1, takes rank 0's weights and steps "
        << "Trainer::train_step: every rank loads the global batch and computes its rows, the loss and finite "
        << "flag agreed per step, SUM all-reduces of flattened buckets of "
        << rec.value("dist", json::object()).value("bucket_mb", training::DistOptions{}.bucket_mb)
        << " MB: the recipe's dist.overlap auto, with Gloo after the whole backward; the dist.overlap on row "
           "starts each bucket, the last layers' first and at most 1 MB, from the parameters' gradient hooks as "
           "soon as backward has filled it). Python (bench/ddp_peer.py): train_peer.py's model, flow loss and "
        << "step, plain as 1 process, and under torchrun (`python -m torch.distributed.run`, Gloo) as "
        << "DistributedDataParallel(model) with its default buckets (all-reduce overlapping backward) and a "
        << "DistributedSampler giving each rank batch / ranks rows, the loss and finite flag all-reduced as dew "
        << "does. samples/s = global items / seconds of the timed steps (the ranks' seconds averaged). All-reduce "
        << "ms: the gradient all-reduce per step in flight (dew: from the first bucket's start to the last one's "
        << "end; DDP: a comm hook around its default all-reduce, the time its buckets were in flight, merged); not "
        << "overlapped: what backward did not hide (dew: average_gradients' wait after backward; DDP: from the last "
        << "bucket's launch to the end of backward). Both include waiting for the slower "
        << "rank. Scaling efficiency = " << kDdpCores << "-rank samples/s / 1-rank samples/s (1.0: the split "
        << "costs nothing; the cores are the same). " << ctx_.rounds << " round(s) per configuration"
        << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported; peak MB: rank 0's "
        << "process.\n\n"
        << machine(r, with_peer);
    md_ << "| side | ranks x threads | samples/s | ms/step | all-reduce ms | all-reduce share | not overlapped ms | "
           "peak "
           "MB |\n"
        << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    const auto layout = [](const Config& cfg) {
      return std::to_string(cfg.ranks) + " x " + std::to_string(cfg.intra) + (cfg.overlap ? ", dist.overlap on" : "");
    };
    for (const auto& [side, member] : sides_of(with_peer)) {
      for (const auto& cfg : r.configs) {
        if ((cfg.*member).empty()) continue;  // the dist.overlap configuration is dew's alone
        const Measurement& m = best(cfg.*member);
        const bool one = m.ranks <= 1;
        md_ << "| " << (side == "C++" ? "dew" : "PyTorch" + std::string(one ? "" : " DDP")) << " | " << layout(cfg)
            << " | " << fixed(m.samples_per_s, 1) << " | " << fixed(m.ms, 1) << " | "
            << (one ? "-" : fixed(m.allreduce_ms, 2)) << " | " << (one ? "-" : fixed(100 * m.allreduce_share, 1) + " %")
            << " | " << (one ? "-" : fixed(m.allreduce_exposed_ms, 2)) << " | " << fixed(m.peak_mb, 0) << " |\n";
      }
    }
    const auto efficiency = [&](std::vector<Measurement> Config::*side) {
      return best(r.configs.back().*side).samples_per_s / best(r.configs.front().*side).samples_per_s;
    };
    md_ << "\nScaling efficiency (" << kDdpCores << "-rank samples/s / 1-rank samples/s): dew "
        << fixed(efficiency(&Config::cpp), 2);
    if (with_peer)
      md_ << ", PyTorch DDP " << fixed(efficiency(&Config::py), 2) << ". dew / PyTorch samples/s: "
          << fixed(best(r.configs.front().cpp).samples_per_s / best(r.configs.front().py).samples_per_s, 2)
          << "x at 1 rank, "
          << fixed(best(r.configs.back().cpp).samples_per_s / best(r.configs.back().py).samples_per_s, 2) << "x at "
          << kDdpCores << " ranks";
    for (const auto& cfg : r.configs) {
      if (!cfg.overlap || cfg.cpp.empty()) continue;
      const Measurement &during = best(cfg.cpp), &plain = best(r.configs.back().cpp);
      md_ << ". dew with dist.overlap on at " << kDdpCores << " ranks: " << fixed(during.samples_per_s, 1)
          << " samples/s against " << fixed(plain.samples_per_s, 1) << " with the recipe's dist.overlap auto ("
          << (ctx_.device.rfind("cuda", 0) == 0 ? "on with nccl" : "off with gloo: the all-reduce after backward")
          << "; " << fixed(during.samples_per_s / plain.samples_per_s, 2)
          << "x); the all-reduce waited for after backward " << fixed(during.allreduce_exposed_ms, 2) << " ms against "
          << fixed(plain.allreduce_exposed_ms, 2) << " ms";
    }
    md_ << ".\n\nEvery round (samples/s, fastest first):\n\n| ranks x threads | dew |"
        << (with_peer ? " PyTorch |" : "") << "\n|---|---:|" << (with_peer ? "---:|" : "") << "\n";
    const auto per_s = [](std::vector<Measurement> ms) {
      std::sort(ms.begin(), ms.end(), [](const auto& a, const auto& b) { return a.samples_per_s > b.samples_per_s; });
      std::string out;
      for (const auto& m : ms) out += (out.empty() ? "" : " / ") + fixed(m.samples_per_s, 1);
      return out;
    };
    for (const auto& cfg : r.configs) {
      md_ << "| " << layout(cfg) << " | " << per_s(cfg.cpp) << " |";
      if (with_peer) md_ << " " << per_s(cfg.py) << " |";
      md_ << "\n";
    }
  }

  void sample(const Row& r) {
    const bool with_peer = !ctx_.peers.script(CaseKind::sample).empty();
    const json& rec = ctx_.train_record;
    const int64_t images = s_.images, sample_steps = s_.sample_steps;
    const int64_t num_classes = rec["model"]["fields"].value("num_classes", int64_t(0));
    const DiffusionSampleOptions g =
        sample_options(rec["derived"]["sample_shape"].get<std::vector<int64_t>>(), num_classes, images, sample_steps);
    const bool guided = g.guidance.scale != 1.0 && g.labels.defined();
    const int64_t chunks = (images + g.batch_size - 1) / g.batch_size;
    md_ << "## dew bench: `dew sample`, " << images << " images, " << sample_steps << " " << g.solver << " steps\n\n"
        << "Model: " << r.c->size << ", " << grouped(r.params) << " parameters; preset " << rec["preset"].dump()
        << ". Sampling (`dew sample RUN`'s defaults; C++: sample_diffusion, as "
        << "cmd_sample calls it after opening the run, with run.images and .cpu(), without writing the PNG): " << images
        << " images in " << chunks << " chunk(s) of at most " << g.batch_size
        << ", labels 0, 1, ... cycling through the " << num_classes
        << " classes (for a multiple of the class count, `dew sample --count N`'s labels), solver " << g.solver
        << " on the grid "
        << "linspace(t_max, t_min, " << sample_steps << ") (" << sample_steps - 1 << " Euler steps, then the final "
        << "denoise)"
        << (guided ? ", classifier-free guidance " + fixed(g.guidance.scale, 1) +
                         " (every forward on the doubled batch: the labels, then the null class)"
                   : ", unguided")
        << ", so " << sample_steps << " forwards per chunk, no gradients; then the clamp to [-1, 1]. Python "
        << "(bench/sample_peer.py): bench/peer.py's Unet under torch.no_grad(), the same prior N(0, 1), grid, "
        << "model time, guidance, x0 read-back and Euler update, the same chunks. Network ms: the model's "
        << "forwards alone on the same doubled chunks, measured after the runs (the median of 3 per chunk, x "
        << sample_steps << "; an estimate, noisy on a shared machine); rest = the sampling run minus that. Before "
        << "the runs one forward of every chunk warms its shape up; then " << warmup_of(*r.c, s_) << " warm-up + "
        << steps_of(*r.c, s_) << " timed sampling run(s) per configuration, median; " << ctx_.rounds
        << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
        << ", the fastest round reported.\n\n"
        << machine(r, with_peer);
    md_ << "| side | best config | ms/sampling run | images/s | network ms (est.) | rest ms (est.) | peak MB |\n"
        << "|---|---|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides_of(with_peer)) {
      const auto& m = fastest(r.configs, member);
      md_ << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 2)
          << " | " << fixed(m.fwd, 1) << " | " << fixed(m.ms - m.fwd, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md_ << "\nSpeed-up (Python ms/sampling run / C++ ms/sampling run): "
          << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
    md_ << "\nEvery configuration (ms/sampling run, each round's median, fastest first):\n\n| intra | blas | C++ |"
        << (with_peer ? " Python |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md_ << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md_ << " " << rounds_cell(cfg.py) << " |";
      md_ << "\n";
    }
  }

  // The summary: every case's time on each side and both ratios, ahead of the sections; empty when no Python
  // peer ran.
  std::string summary(const std::vector<Row>& rows) const {
    std::ostringstream out;
    // ddp compares configurations of processes in its own section, not a fastest time per side.
    const auto in_summary = [](const Row& r) { return r.c->kind != CaseKind::ddp; };
    if (!std::any_of(rows.begin(), rows.end(),
                     [&](const Row& r) { return in_summary(r) && !r.configs.front().py.empty(); }))
      return "";
    out << "## dew bench: summary\n\n"
        << "Each case's fastest time per side: C++ (dew), Python eager and Python under torch.compile "
        << "(inductor, default mode; the training-step cases and fid only, in the eager peer's fastest thread "
        << "configuration; its compile time, the first step's time beyond a steady step, apart). Both sides load "
        << "the same libtorch. vs eager = Python eager time / C++ time, vs compiled = Python compiled time / C++ "
        << "time: above 1, dew is faster. The sections below hold every configuration and round.\n\n"
        << machine(rows.front(), true)
        << "| case | unit | C++ | Python eager | Python compiled | vs eager | vs compiled | compile s |\n"
        << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    const auto line = [&](const Row& r, const std::string& name, const std::string& unit, double Measurement::*key) {
      const Measurement* c = fastest_of(r.configs, &Config::cpp, key);
      const Measurement* e = fastest_of(r.configs, &Config::py, key);
      const Measurement* k = key == &Measurement::ms ? fastest_of(r.configs, &Config::pyc, key) : nullptr;
      const int digits = key == &Measurement::ms ? 1 : 2;
      out << "| " << name << " | " << unit << " | " << (c ? fixed(c->*key, digits) : "-") << " | "
          << (e ? fixed(e->*key, digits) : "-") << " | " << (k ? fixed(k->*key, digits) : "-") << " | "
          << (c && e ? fixed(e->*key / (c->*key), 2) + "x" : "-") << " | "
          << (c && k ? fixed(k->*key / (c->*key), 2) + "x" : "-") << " | " << (k ? fixed(k->compile_s, 0) : "-")
          << " |\n";
    };
    for (const Row& r : rows) {
      if (!in_summary(r)) continue;
      const CaseKind kind = r.c->kind;
      const std::string unit = kind == CaseKind::sd_vae || kind == CaseKind::fid ? "ms/pass"
                               : kind == CaseKind::sample                        ? "ms/sampling run"
                               : kind == CaseKind::grpo_rollout                  ? "ms/rollout"
                                                                                 : "ms/step";
      line(r, kind == CaseKind::lm ? "lm training" : r.c->name, unit, &Measurement::ms);
      if (kind == CaseKind::lm) line(r, "lm generation", "ms/token", &Measurement::gen_ms_per_token);
      if (kind == CaseKind::qwen_image)
        line(r, "qwen_image sampling, KV cache", "ms/step", &Measurement::sample_cached_ms);
    }
    out << "\n";
    return out.str();
  }

  // Every section of the cases in `rows`, a blank line between sections.
  std::string sections(const std::vector<Row>& rows) {
    std::vector<const Row*> drows;  // the diffusion models
    std::map<CaseKind, const Row*> other;
    for (const auto& r : rows) {
      if (r.c->kind == CaseKind::diffusion) drows.push_back(&r);
      else other[r.c->kind] = &r;
    }
    const auto row = [&](CaseKind k) { return other.count(k) ? other.at(k) : nullptr; };
    if (!drows.empty()) diffusion(drows);
    const std::vector<std::pair<CaseKind, void (ReportWriter::*)(const Row&)>> singles = {
        {CaseKind::lm, &ReportWriter::lm},
        {CaseKind::jepa, &ReportWriter::jepa},
        {CaseKind::dpo, &ReportWriter::dpo},
        {CaseKind::grpo_rollout, &ReportWriter::rollout}};
    for (const auto& [kind, section] : singles) {
      if (!row(kind)) continue;
      if (!md_.str().empty()) md_ << "\n";
      (this->*section)(*row(kind));
    }
    if (row(CaseKind::sd_unet) || row(CaseKind::sd_unet_lora) || row(CaseKind::sd_vae)) {
      if (!md_.str().empty()) md_ << "\n";
      sd(row(CaseKind::sd_unet), row(CaseKind::sd_unet_lora), row(CaseKind::sd_vae));
    }
    if (row(CaseKind::sd3) || row(CaseKind::flux)) {
      if (!md_.str().empty()) md_ << "\n";
      flow_transformers(row(CaseKind::sd3), row(CaseKind::flux));
    }
    if (row(CaseKind::qwen_image)) {
      if (!md_.str().empty()) md_ << "\n";
      qwen_image(*row(CaseKind::qwen_image));
    }
    if (row(CaseKind::train)) {
      if (!md_.str().empty()) md_ << "\n";
      train(*row(CaseKind::train));
    }
    if (row(CaseKind::sample)) {
      if (!md_.str().empty()) md_ << "\n";
      sample(*row(CaseKind::sample));
    }
    if (row(CaseKind::fid)) {
      if (!md_.str().empty()) md_ << "\n";
      fid(*row(CaseKind::fid));
    }
    if (row(CaseKind::ddp)) {
      if (!md_.str().empty()) md_ << "\n";
      ddp(*row(CaseKind::ddp));
    }
    return md_.str();
  }

 private:
  const ReportContext& ctx_;
  const Sizes& s_;
  std::ostringstream md_;
};

}  // namespace

const Measurement& best(const std::vector<Measurement>& ms, double Measurement::*key) {
  return *std::min_element(ms.begin(), ms.end(), [key](const auto& a, const auto& b) { return a.*key < b.*key; });
}

const Measurement* fastest_of(const std::vector<Config>& configs, std::vector<Measurement> Config::*side,
                              double Measurement::*key) {
  const Measurement* out = nullptr;
  for (const auto& c : configs)
    if (!(c.*side).empty() && (!out || best(c.*side, key).*key < out->*key)) out = &best(c.*side, key);
  return out;
}

std::string config_name(const Measurement& m) {
  return "intra " + std::to_string(m.intra) + ", blas " + std::to_string(m.blas);
}

std::string write_report(const std::vector<Row>& rows, const ReportContext& ctx) {
  ReportWriter w(ctx);
  const std::string sections = w.sections(rows);
  return w.summary(rows) + sections;
}

}  // namespace dew::bench
