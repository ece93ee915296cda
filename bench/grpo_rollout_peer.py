#!/usr/bin/python3
"""Python eager peer of `dew bench --models grpo_rollout`: a GRPO rollout's batched sampling in plain PyTorch.

The model is bench/lm_peer.py's causal_transformer with its KV cache (tensors concatenated per step). A
rollout, as a GRPO trainer generates with its policy (TRL's generate without vLLM, verl's HF rollout): every
prompt repeated `--group` times into one [prompts x group, prompt-len] batch, one prefill forward, then one
token per row per forward, each sampled with torch.multinomial from softmax(logits / T) and its log-prob
(log_softmax(logits / T) at the token) kept; no EOS, so every row generates `--new-tokens` tokens.

    /usr/bin/python3 bench/grpo_rollout_peer.py --config '{"vocab_size": 257, ...}' --params 886272 \
        --prompts 16 --group 8 --prompt-len 36 --new-tokens 16 --temperature 1.0 --steps 20 --warmup 5

prints one JSON line with the keys of bench/peer.py (ms_per_step = ms per rollout, forward = the whole
rollout) plus tokens_per_s (generated tokens per second) and prefill_ms (the prompts' forward, median).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_peer  # noqa: E402  (the causal_transformer and its KV cache)
import peer  # noqa: E402  (result line)


def fail(msg):
    print(f"grpo_rollout_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


@torch.no_grad()
def rollout(model, ids, new_tokens, temperature, g):
    """Samples new_tokens tokens for every row of ids [N, P]; returns (tokens [N, T], log-probs [N, T],
    prefill seconds)."""
    caches = [{} for _ in model.layers]
    t0 = time.perf_counter()
    logits = model(ids, caches)[:, -1]  # [N, V]
    prefill = time.perf_counter() - t0
    toks, logps = [], []
    for i in range(new_tokens):
        scaled = logits / temperature
        tok = torch.multinomial(scaled.softmax(-1), 1, generator=g)  # [N, 1]
        logps.append(scaled.log_softmax(-1).gather(1, tok))
        toks.append(tok)
        if i + 1 == new_tokens:
            break
        logits = model(tok, caches)[:, -1]
    return torch.cat(toks, 1), torch.cat(logps, 1), prefill


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the causal_transformer fields as JSON (dew's names)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=36)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20, help="timed rollouts")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rollouts first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.device != "cpu":
        fail("the rollout peer runs on the CPU only")
    if min(a.prompts, a.group, a.prompt_len, a.new_tokens, a.steps, a.threads) < 1 or a.warmup < 0 \
            or not a.temperature > 0:
        fail("--prompts, --group, --prompt-len, --new-tokens, --steps, --threads must be >= 1, --warmup >= 0, "
             "--temperature > 0")
    try:
        fields = json.loads(a.config)
    except ValueError as e:
        fail(f"bad --config: {e}")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = lm_peer.build(fields, a.prompt_len + a.new_tokens)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"causal_transformer has {n} parameters here and {a.params} in C++: the two models differ")

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (a.prompts, a.prompt_len), generator=g)
    ids = prompts.repeat_interleave(a.group, 0)  # [prompt 0] x group, [prompt 1] x group, ...
    rows = ids.shape[0]
    times, prefills = [], []
    for r in range(a.warmup + a.steps):
        sample_gen = torch.Generator().manual_seed(r)
        t0 = time.perf_counter()
        toks, logps, prefill = rollout(model, ids, a.new_tokens, a.temperature, sample_gen)
        t = time.perf_counter() - t0
        if toks.shape != (rows, a.new_tokens) or not torch.isfinite(logps).all():
            fail(f"rollout gave tokens {tuple(toks.shape)}, expected {(rows, a.new_tokens)}, or non-finite log-probs")
        if r >= a.warmup:
            times.append(t)
            prefills.append(prefill)
    ms = statistics.median(times) * 1e3
    print(json.dumps(peer.result([ms, ms, 0.0, 0.0], rows, n, 0.0, tokens_per_s=rows * a.new_tokens / (ms / 1e3),
                                 prefill_ms=statistics.median(prefills) * 1e3)), flush=True)


if __name__ == "__main__":
    main()
