#!/usr/bin/python3
"""Independent reference for exported decoders: reads a transformers-style folder (config.json +
model.safetensors, float32) with plain Python and computes logits with PyTorch following the
transformers modelling code of the family (LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM).
It shares no code with dew; tests/interop/test_hf_decoder.cpp compares its logits with dew's.

    hf_reference.py DIR IDS_JSON OUT_F32      # IDS_JSON: [[id, ...], ...]; OUT: float32 [B, S, V] raw
"""
import json
import math
import struct
import sys

import torch


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", (name, e["dtype"])
        a, b = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[8 + n + a:8 + n + b]), dtype=torch.float32)
        out[name] = t.reshape(e["shape"])
    return out


def rms_norm(x, w, eps, gemma):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if gemma else y * w


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(x.shape[-2], dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def main():
    folder, ids_path, out_path = sys.argv[1:4]
    c = json.load(open(folder + "/config.json"))
    w = load_safetensors(folder + "/model.safetensors")
    ids = torch.tensor(json.load(open(ids_path)), dtype=torch.int64)
    fam = c["model_type"]
    gemma = fam == "gemma3_text"
    H, Hkv, Dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    act_name = c["hidden_activation"] if gemma else c["hidden_act"]
    act = torch.nn.functional.silu if act_name == "silu" else (lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    scaling = c["query_pre_attn_scalar"] ** -0.5 if gemma else Dh ** -0.5
    B, S = ids.shape
    h = w["model.embed_tokens.weight"][ids]
    if gemma:
        h = h * torch.tensor(c["hidden_size"] ** 0.5, dtype=torch.float32)
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        lin = lambda x, name: torch.nn.functional.linear(x, w[p + name + ".weight"], w.get(p + name + ".bias"))
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps, gemma)
        q = lin(x, "self_attn.q_proj").view(B, S, H, Dh).transpose(1, 2)
        k = lin(x, "self_attn.k_proj").view(B, S, Hkv, Dh).transpose(1, 2)
        v = lin(x, "self_attn.v_proj").view(B, S, Hkv, Dh).transpose(1, 2)
        if fam in ("qwen3", "gemma3_text"):
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        sliding = types[i] == "sliding_attention"
        theta = c["rope_local_base_freq"] if (gemma and sliding) else c["rope_theta"]
        q, k = rope(q, theta), rope(k, theta)
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling
        qi = torch.arange(S).view(S, 1)
        ki = torch.arange(S).view(1, S)
        allowed = ki <= qi
        if sliding:
            allowed = allowed & (ki > qi - c["sliding_window"])
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.matmul(torch.softmax(scores.float(), dim=-1), v)
        attn = lin(attn.transpose(1, 2).reshape(B, S, H * Dh), "self_attn.o_proj")
        if gemma:
            h = h + rms_norm(attn, w[p + "post_attention_layernorm.weight"], eps, True)
            x = rms_norm(h, w[p + "pre_feedforward_layernorm.weight"], eps, True)
        else:
            h = h + attn
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps, False)
        m = lin(act(lin(x, "mlp.gate_proj")) * lin(x, "mlp.up_proj"), "mlp.down_proj")
        h = h + (rms_norm(m, w[p + "post_feedforward_layernorm.weight"], eps, True) if gemma else m)
    h = rms_norm(h, w["model.norm.weight"], eps, gemma)
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    logits = torch.nn.functional.linear(h, head)
    cap = c.get("final_logit_softcapping") if gemma else None
    if cap:
        logits = torch.tanh(logits / cap) * cap
    with open(out_path, "wb") as f:
        f.write(logits.contiguous().numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    main()
