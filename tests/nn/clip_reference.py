#!/usr/bin/python3
"""Independent reference for the clip_text encoder: reads a safetensors file with plain json + struct and
computes CLIPTextModel's last_hidden_state and pooler_output in float64 from the formulas of transformers'
modeling_clip (CLIPTextTransformer): token + position embeddings; per layer
x += out_proj(softmax((q_proj(ln1 x) / sqrt(dh)) k^T + causal + padding) v), x += fc2(act(fc1(ln2 x)));
final LayerNorm; pooled at the first eos_token_id (at argmax(ids) when eos_token_id == 2).
It shares no code with dew; tests/nn/test_text_encoders.cpp compares the results.

    clip_reference.py WEIGHTS CONFIG_JSON IDS_JSON MASK_JSON OUT_F32 [WEIGHTS CONFIG_JSON ...]
    CONFIG_JSON: {"num_attention_heads", "hidden_act", "layer_norm_eps", "eos_token_id"}
    OUT_F32: float32 raw, last_hidden_state [B, S, D] followed by pooled [B, D]
"""
import json
import math
import struct
import sys

import torch

DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dt, _ = DTYPES[e["dtype"]]
        a, b = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[8 + n + a:8 + n + b]), dtype=dt)
        out[name] = t.reshape(e["shape"]).to(torch.float64)
    return out


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def linear(x, w, b):
    return x @ w.t() + b


def run(weights, config, ids_path, mask_path, out_path):
    c = json.load(open(config))
    w = load_safetensors(weights)
    w = {(k if k.startswith("text_model.") else "text_model." + k): v for k, v in w.items()}
    ids = torch.tensor(json.load(open(ids_path)), dtype=torch.int64)
    mask = torch.tensor(json.load(open(mask_path)), dtype=torch.bool)
    B, S = ids.shape
    H = c["num_attention_heads"]
    eps = c["layer_norm_eps"]
    p = "text_model."
    x = w[p + "embeddings.token_embedding.weight"][ids] + w[p + "embeddings.position_embedding.weight"][:S]
    D = x.shape[-1]
    dh = D // H
    neg = torch.finfo(torch.float64).min
    causal = torch.full((S, S), neg, dtype=torch.float64).triu(1)  # 0 on and below the diagonal
    padding = torch.zeros(B, 1, 1, S, dtype=torch.float64).masked_fill(~mask[:, None, None, :], neg)
    add = causal[None, None] + padding
    n_layers = 1 + max([int(k.split(".")[3]) for k in w if k.startswith(p + "encoder.layers.")] + [-1])
    for i in range(n_layers):
        q = p + "encoder.layers.%d." % i
        r = x
        h = layer_norm(x, w[q + "layer_norm1.weight"], w[q + "layer_norm1.bias"], eps)

        def proj(name):
            t = linear(h, w[q + "self_attn.%s.weight" % name], w[q + "self_attn.%s.bias" % name])
            return t.view(B, S, H, dh).transpose(1, 2)

        qs = proj("q_proj") * (dh ** -0.5)
        ks, vs = proj("k_proj"), proj("v_proj")
        scores = qs @ ks.transpose(-1, -2) + add
        probs = torch.softmax(scores, dim=-1)
        o = (probs @ vs).transpose(1, 2).reshape(B, S, D)
        x = r + linear(o, w[q + "self_attn.out_proj.weight"], w[q + "self_attn.out_proj.bias"])
        r = x
        h = layer_norm(x, w[q + "layer_norm2.weight"], w[q + "layer_norm2.bias"], eps)
        h = linear(h, w[q + "mlp.fc1.weight"], w[q + "mlp.fc1.bias"])
        if c["hidden_act"] == "quick_gelu":
            h = h * torch.sigmoid(1.702 * h)
        else:
            h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        x = r + linear(h, w[q + "mlp.fc2.weight"], w[q + "mlp.fc2.bias"])
    x = layer_norm(x, w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"], eps)
    if c["eos_token_id"] == 2:
        index = ids.argmax(-1)
    else:
        index = (ids == c["eos_token_id"]).int().argmax(-1)
    pooled = x[torch.arange(B), index]
    with open(out_path, "wb") as f:
        f.write(x.to(torch.float32).contiguous().numpy().tobytes())
        f.write(pooled.to(torch.float32).contiguous().numpy().tobytes())


def main():
    args = sys.argv[1:]
    assert args and len(args) % 5 == 0, "expected groups of WEIGHTS CONFIG_JSON IDS_JSON MASK_JSON OUT_F32"
    for i in range(0, len(args), 5):
        run(*args[i:i + 5])


if __name__ == "__main__":
    main()
