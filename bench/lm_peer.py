#!/usr/bin/python3
"""Python eager peer of `dew bench --models lm`: the causal_transformer and its step in plain PyTorch.

The model is dew's `causal_transformer` (dew/nn/backbones/causal_transformer.cpp) written the way a PyTorch
user writes a Llama-style decoder: nn.Module, nn.Linear projections without bias, RMSNorm in fp32, q/k
RMSNorm over the head (qk_norm), rotate-half RoPE, attention as matmul + masked softmax (PyTorch 1.13 has
no F.scaled_dot_product_attention), SwiGLU MLP, a head tied to the embedding. Timed like the C++ side:

- training step: forward, F.cross_entropy over the logits of [B, S] next-token targets, backward,
  torch.optim.AdamW (decay on matrices), an fp32 EMA of every parameter;
- generation: greedy decoding of `--new-tokens` tokens after a `--prompt-len` prompt (batch 1) with a
  KV cache (tensors concatenated per step): one prefill forward, then one token per forward.

    /usr/bin/python3 bench/lm_peer.py --config '{"vocab_size": 257, ...}' --params 3279872 \
        --batch 4 --seq-len 256 --steps 10 --warmup 3 --threads 1

prints one JSON line with the keys of bench/peer.py plus tokens_per_s, gen_ms_per_token and prefill_ms.
Run one configuration per process: peak RSS (ru_maxrss) is a high-water mark of the whole process.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (the diffusion peer: the training step's optimizer/EMA, result line, BLAS probe)

# Fields this peer implements only at one value (dew's default), and the ones it implements.
FIXED = {"mlp": "swiglu", "partial_rotary_factor": 1.0, "layer_types": [], "scale_offset": 0.0,
         "sandwich_norms": False, "attention_bias": False, "embedding_scale": 1.0, "final_logit_softcap": 0.0,
         "tie_embeddings": True, "dropout": 0.0, "remat": False, "dtype": "float32"}
USED = {"vocab_size", "emb_features", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_features",
        "max_seq_len", "rope_theta", "norm_eps", "qk_norm", "init_std",
        # no effect in fp32 eager (dew's attention implementation choice, sliding window without sliding layers)
        "attention_impl", "force_fp32_for_softmax", "sliding_window", "sliding_rope_theta"}


def fail(msg):
    print(f"lm_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class Attention(nn.Module):
    def __init__(self, f):
        super().__init__()
        d, self.h, self.kv, self.dh = f["emb_features"], f["num_heads"], f["kv_heads"], f["head_size"]
        self.q_proj = nn.Linear(d, self.h * self.dh, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=False)
        self.q_norm = RMSNorm(self.dh, f["norm_eps"]) if f["qk_norm"] else None
        self.k_norm = RMSNorm(self.dh, f["norm_eps"]) if f["qk_norm"] else None
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=f["init_std"])
        nn.init.normal_(self.o_proj.weight, std=f["init_std"] / math.sqrt(2 * f["num_layers"]))

    def forward(self, x, cos, sin, mask, cache):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.h, self.dh)
        k = self.k_proj(x).view(B, S, self.kv, self.dh)
        v = self.v_proj(x).view(B, S, self.kv, self.dh).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], 2)
                v = torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, 1)
            v = v.repeat_interleave(self.h // self.kv, 1)
        att = (q @ k.transpose(-2, -1)) * self.dh ** -0.5
        if mask is not None:
            att = att.masked_fill(~mask, float("-inf"))
        out = att.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.h * self.dh))


class MLP(nn.Module):
    def __init__(self, f):
        super().__init__()
        d, hidden = f["emb_features"], f["mlp_hidden"]
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=f["init_std"])
        nn.init.normal_(self.up_proj.weight, std=f["init_std"])
        nn.init.normal_(self.down_proj.weight, std=f["init_std"] / math.sqrt(2 * f["num_layers"]))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.input_layernorm = RMSNorm(f["emb_features"], f["norm_eps"])
        self.self_attn = Attention(f)
        self.post_attention_layernorm = RMSNorm(f["emb_features"], f["norm_eps"])
        self.mlp = MLP(f)

    def forward(self, h, cos, sin, mask, cache):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalTransformer(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.embed_tokens = nn.Embedding(f["vocab_size"], f["emb_features"])
        nn.init.normal_(self.embed_tokens.weight, std=f["init_std"])
        self.layers = nn.ModuleList(DecoderLayer(f) for _ in range(f["num_layers"]))
        self.norm = RMSNorm(f["emb_features"], f["norm_eps"])
        dh = f["head_size"]
        inv_freq = 1.0 / f["rope_theta"] ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
        freqs = torch.arange(f["max_seq_len"], dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids, caches=None):
        """ids [B, S] -> logits [B, S, V]; with caches (a dict per layer) the new tokens follow the cached ones."""
        S = ids.shape[1]
        past = caches[0]["k"].shape[2] if caches and "k" in caches[0] else 0
        cos, sin = self.cos[past:past + S], self.sin[past:past + S]
        # Causal mask of the new queries against every key; one new token sees all keys.
        mask = None
        if S > 1:
            mask = torch.ones(S, past + S, dtype=torch.bool).tril(past)
        h = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, caches[i] if caches is not None else None)
        return F.linear(self.norm(h), self.embed_tokens.weight)


# dew's defaults of the implemented fields (CausalTransformerOptions); `dew bench` passes the complete set.
DEFAULTS = {"num_kv_heads": 0, "head_dim": 0, "mlp_features": 0, "max_seq_len": 2048, "rope_theta": 10000.0,
            "norm_eps": 1e-5, "qk_norm": True, "init_std": 0.02}


def build(fields, seq_needed):
    for key in ("vocab_size", "emb_features", "num_layers", "num_heads"):
        if key not in fields:
            fail(f"--config lacks causal_transformer.{key}")
    f = dict(DEFAULTS, **fields)
    for key, only in FIXED.items():
        if key in f and f[key] != only:
            fail(f"causal_transformer.{key} = {f[key]!r} is not implemented by the peer (only {only!r})")
    unknown = set(f) - set(FIXED) - USED
    if unknown:
        fail(f"causal_transformer fields not implemented by the peer: {', '.join(sorted(unknown))}")
    if f.get("attention_impl", "auto") not in ("auto", "reference", "chunked", "sdpa"):
        fail(f"unknown attention_impl {f['attention_impl']!r}")
    d, h = f["emb_features"], f["num_heads"]
    f["kv_heads"] = f.get("num_kv_heads", 0) or h
    f["head_size"] = f.get("head_dim", 0) or d // h
    f["mlp_hidden"] = f.get("mlp_features", 0) or (d * 8 // 3 + 63) // 64 * 64
    f["max_seq_len"] = max(f.get("max_seq_len", 2048), seq_needed)
    return CausalTransformer(f)


class Step(peer.TrainStep):
    """One training step: forward, cross entropy, then the diffusion peer's (dew's trainer step) finite check,
    backward, clip, schedule, AdamW, EMA."""

    def __init__(self, model, tokens, optim, total):
        super().__init__(model, optim, total)
        self.tokens = tokens

    def loss(self):
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(model, prompt, new_tokens):
    """Greedy decoding with a KV cache; returns (tokens, their log-probs, prefill seconds)."""
    caches = [{} for _ in model.layers]
    peer.sync()
    t0 = time.perf_counter()
    logits = model(prompt, caches)[:, -1]
    peer.sync()
    prefill = time.perf_counter() - t0
    out, logprobs = [], []
    for i in range(new_tokens):
        tok = logits.argmax(-1, keepdim=True)  # [1, 1]
        logprobs.append(logits.log_softmax(-1).gather(1, tok).item())
        out.append(tok.item())
        if i + 1 == new_tokens:
            break
        logits = model(tok, caches)[:, -1]
    return out, logprobs, prefill


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the causal_transformer fields as JSON (dew's names)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256, help="training tokens per row")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gen-reps", type=int, default=5, help="timed generations (after one untimed)")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--optim", default="{}", help="dew's OptimOptions as JSON (lr, schedule, warm-up, grad_clip, ...)")
    peer.add_compile_flag(ap)  # the training step only: generation stays eager (its cache grows every token)
    a = ap.parse_args()
    peer.use_device(a.device)
    optim = peer.parse_optim(a.optim)
    if min(a.batch, a.seq_len, a.steps, a.threads, a.prompt_len, a.new_tokens, a.gen_reps) < 1 or a.warmup < 0:
        fail("--batch, --seq-len, --steps, --threads, --prompt-len, --new-tokens and --gen-reps must be >= 1, "
             "--warmup >= 0")
    try:
        fields = json.loads(a.config)
    except ValueError as e:
        fail(f"bad --config: {e}")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build(fields, max(a.seq_len, a.prompt_len + a.new_tokens))
    model.train()
    n = sum(p.numel() for p in model.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"causal_transformer has {n} parameters here and {a.params} in C++: the two models differ")

    V = fields["vocab_size"]
    g = peer.generator(1)
    tokens = torch.randint(0, V, (a.batch, a.seq_len + 1), generator=g)
    prompt = torch.randint(0, V, (1, a.prompt_len), generator=g)
    step = Step(peer.compiled(a, model), tokens, optim, a.warmup + a.steps)
    times, loss, first = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        fwd, bwd, opt, loss = step.run()
        if not math.isfinite(loss):
            fail(f"non-finite loss {loss} at step {i}")
        if i == 0:
            first = time.perf_counter() - t0
        if i >= a.warmup:
            times.append((time.perf_counter() - t0, fwd, bwd, opt))
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]

    model.eval()
    gen, prefills = [], []
    for r in range(1 + a.gen_reps):
        t0 = time.perf_counter()
        toks, _, prefill = generate(model, prompt, a.new_tokens)
        if r > 0:
            gen.append(time.perf_counter() - t0)
            prefills.append(prefill)
    if len(toks) != a.new_tokens:
        fail(f"generated {len(toks)} tokens, expected {a.new_tokens}")
    gen_ms = statistics.median(gen) * 1e3

    print(json.dumps(peer.result(med, a.batch, n, loss,
                                 tokens_per_s=a.batch * a.seq_len / (med[0] / 1e3),
                                 gen_ms_per_token=gen_ms / a.new_tokens,
                                 prefill_ms=statistics.median(prefills) * 1e3,
                                 **peer.compile_extra(a, first, med[0]))), flush=True)


if __name__ == "__main__":
    main()
