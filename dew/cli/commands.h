// Sub-commands of the dew program. `run` dispatches on args[0]; each command parses its own flags and
// throws dew::Error on bad input.
#pragma once
#include <string>
#include <vector>

namespace dew::cli {

/// Runs the command line (without the program name); returns the exit code.
int run(const std::vector<std::string>& args);

/// `dew list [KIND]`: every registry (or one) with entries, fields and defaults.
int cmd_list(const std::vector<std::string>& args);
/// `dew train KIND [--config FILE] [--a.b value ...]` (KIND: diffusion, lm, jepa).
int cmd_train(const std::vector<std::string>& args);
/// `dew launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P --threads T]
/// -- train KIND ...`: the ranks of a data-parallel run on this node (docs/distributed.md).
int cmd_launch(const std::vector<std::string>& args);
/// `dew sample RUN [--solver S --steps N --guidance G --labels all|0,3 --count N --seed S --weights ema|live --out F]`.
int cmd_sample(const std::vector<std::string>& args);
/// `dew sample --pipeline DIR --prompt TEXT [--negative-prompt TEXT] [--prompt-2 TEXT] [--negative-prompt-2 TEXT]
/// [--steps N] [--guidance S] [--seed K] [--size HxW] [--count N] [--scheduler CLASS] [--eta E]
/// [--latents F.safetensors] [--threads N] --out FILE.png`: a diffusers text-to-image folder.
int cmd_sample_pipeline(const std::vector<std::string>& args);
/// `dew eval RUN [--solvers a,b --steps N --guidance G --count N]`: classifier accuracy of conditional
/// samples and the Frechet distance of classifier features to the test set; `dew eval --classifier`.
int cmd_eval(const std::vector<std::string>& args);
/// `dew eval AUTOENCODER_RUN [--count N --weights ema|live --step N --device D --threads N]`: PSNR and SSIM
/// of the run's reconstructions of its held-out set.
int cmd_eval_autoencoder(const std::vector<std::string>& args);
/// `dew eval --pipeline DIR --prompts FILE --clip CLIP_DIR [--count N --steps N --guidance G --seed S]`: the CLIP
/// score of a diffusers pipeline folder's images of each prompt.
int cmd_eval_pipeline(const std::vector<std::string>& args);
/// `dew eval RUN` of a JEPA run [--train-items N --test-items N --knn-k K --probe-epochs E --probe-lr LR
/// --pool mean|tokens|gridK --knn-prep none|center|standardize --knn-vote weighted|majority --knn-temperature T
/// --no-baselines --weights ema|live --step N --device D]: linear and kNN probes of the frozen encoder, the
/// encoder at its initialisation and the raw pixels.
int cmd_eval_jepa(const std::vector<std::string>& args);

/// `dew eval RUN --prompts F` on a language-model run (lm, sft, dpo, grpo): rewards of greedy completions.
int cmd_eval_policy(const std::vector<std::string>& args);

/// `dew pairs RUN --prompts F --out F`: DPO pairs from a policy's own samples.
int cmd_pairs(const std::vector<std::string>& args);

/// `dew task sums --out DIR`: the post-training demo's data.
int cmd_task(const std::vector<std::string>& args);
/// `dew bench [--models a,b --steps N --warmup W --batch B --threads 1,2 --blas-threads 1,2 --no-peer --out F]`:
/// a full training step of the small CPU models timed in C++ and in Python eager, with the speed-up.
int cmd_bench(const std::vector<std::string>& args);
/// `dew tune threads [--workloads intra_op,gemm --splits 2x1,1x2 --steps N --warmup W --rounds R --no-write
/// --dry-run]`: the fastest intra-op x OpenBLAS split of each workload on this machine, cached for
/// set_threads (dew/core/threads.h).
int cmd_tune(const std::vector<std::string>& args);
/// `dew models`: every registered model with its fields and defaults.
int cmd_models(const std::vector<std::string>& args);
/// `dew tokenize --input FILE|DIR --out DIR [--tokenizer byte|PATH] [--val-fraction F] [--pack]
/// [--split auto|fortune|file]`: documents -> train.bin, val.bin, meta.json.
int cmd_tokenize(const std::vector<std::string>& args);
/// `dew export RUN DEST [--ema] [--family auto|llama|qwen3|gemma3_text] [--tokenizer SPEC]`: a
/// causal_transformer run as a Hugging Face checkpoint folder.
int cmd_export(const std::vector<std::string>& args);
/// `dew forward DIR --inputs IN.safetensors --out OUT.safetensors [--class NAME] [--method NAME]
/// [--dtype float32|float64] [--device D]`: one diffusers model folder run on tensors named as its arguments.
int cmd_forward(const std::vector<std::string>& args);
/// `dew generate RUN --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N --temperature T --top-k K
/// --top-p P --min-p M --repetition-penalty R --seed S --weights ema|live --step N --device D --stop S ...
/// --padding left|right --threads N --json]`.
int cmd_generate(const std::vector<std::string>& args);

}  // namespace dew::cli
