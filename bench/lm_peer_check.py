#!/usr/bin/python3
"""Checks that bench/lm_peer.py computes dew's causal_transformer: loads the weights `dew export` wrote and
compares greedy KV-cache generation with `dew generate --json` on the same weights (tokens equal, raw
log-probs within --tol). Byte-level runs only (prompt ids = the prompt's UTF-8 bytes).

    dew train lm --run R --model.fields.emb_features 256 --model.fields.num_layers 4 \\
        --model.fields.num_heads 4 --trainer.steps 20 --objective.sample_tokens 0 --threads 1
    dew export R E
    dew generate R --prompt "The quick brown fox" --temperature 0 --max-new-tokens 32 --weights live \\
        --no-eos --json > gen.json
    /usr/bin/python3 bench/lm_peer_check.py --export E --generated gen.json --prompt "The quick brown fox"
"""
import argparse
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_peer  # noqa: E402


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            lm_peer.fail(f"{name}: dtype {t['dtype']}, only F32 is read here")
        a, b = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.float32).view(t["shape"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="folder written by `dew export`")
    ap.add_argument("--generated", required=True, help="the first line of `dew generate --json`")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.export, "config.json")))
    if cfg.get("model_type") not in ("qwen3", "llama"):
        lm_peer.fail(f"model_type {cfg.get('model_type')!r}: the peer implements the qwen3/llama layout only")
    fields = {"vocab_size": cfg["vocab_size"], "emb_features": cfg["hidden_size"],
              "num_layers": cfg["num_hidden_layers"], "num_heads": cfg["num_attention_heads"],
              "num_kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
              "mlp_features": cfg["intermediate_size"], "max_seq_len": cfg["max_position_embeddings"],
              "rope_theta": cfg["rope_theta"], "norm_eps": cfg["rms_norm_eps"],
              "qk_norm": cfg["model_type"] == "qwen3"}
    if not cfg.get("tie_word_embeddings", False):
        lm_peer.fail("untied heads are not implemented by the peer")
    model = lm_peer.build(fields, 0)
    sd = {k[len("model."):] if k.startswith("model.") else k: v
          for k, v in load_safetensors(os.path.join(a.export, "model.safetensors")).items()}
    sd.pop("lm_head.weight", None)  # tied: the embedding
    model.load_state_dict(sd, strict=True)
    model.eval()
    ref = json.loads(open(a.generated).read().splitlines()[0])
    prompt = torch.tensor([list(a.prompt.encode())])
    tokens, logprobs, _ = lm_peer.generate(model, prompt, len(ref["tokens"]))
    diff = max(abs(x - y) for x, y in zip(logprobs, ref["raw_logprobs"]))
    print(f"tokens equal: {tokens == ref['tokens']}; max |log-prob difference|: {diff:.3g}")
    if tokens != ref["tokens"] or diff > a.tol:
        lm_peer.fail(f"the peer differs from dew: tokens {tokens} vs {ref['tokens']}, log-prob difference {diff}")


if __name__ == "__main__":
    main()
