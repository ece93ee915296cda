#!/usr/bin/python3
"""Python eager peer of `simple_mmdit` (dew/nn/backbones/mmdit.{h,cpp}): the same SD3-style dual-stream
MM-DiT in plain PyTorch, layer for layer (same parameter names, shapes and initialisation scheme).

    /usr/bin/python3 bench/peer_simple_mmdit.py --config '{"patch_size": 2, "emb_features": 32, ...}'

prints one JSON line with the parameter count and the output shape of one forward.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from peer import FinalLayer, Mlp, TimeEmbedding, apply_rope, modulate, rope_tables, sincos_2d  # noqa: E402

DEFAULTS = {"output_channels": 3, "patch_size": 16, "emb_features": 768, "num_layers": 12, "num_heads": 12,
            "mlp_ratio": 4.0, "norm_epsilon": 1e-5, "qk_norm": False, "in_channels": 3, "num_classes": 0,
            "context_features": 768}


class RMSHeadNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Stream(nn.Module):
    """One stream of a joint block; pre_only: keys and values only (SD3's context_pre_only)."""

    def __init__(self, dim, heads, mlp_ratio, eps, qk_norm, pre_only):
        super().__init__()
        self.heads, self.eps, self.pre_only = heads, eps, pre_only
        self.adaLN_modulation = nn.Linear(dim, (2 if pre_only else 6) * dim)
        nn.init.zeros_(self.adaLN_modulation.weight)
        nn.init.zeros_(self.adaLN_modulation.bias)
        if pre_only:
            self.kv = nn.Linear(dim, 2 * dim)
            projections = [self.kv]
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.mlp = Mlp(dim, int(mlp_ratio * dim))
            projections = [self.qkv, self.proj]
        for lin in projections:
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)
        if qk_norm:
            if not pre_only:
                self.q_norm = RMSHeadNorm(dim // heads)
            self.k_norm = RMSHeadNorm(dim // heads)
        self.qk_norm = qk_norm

    def heads_of(self, x, mod):
        B, S, D = x.shape
        h = modulate(F.layer_norm(x, (D,), eps=self.eps), mod[0], mod[1])
        n = 2 if self.pre_only else 3
        out = list((self.kv if self.pre_only else self.qkv)(h).reshape(B, S, n, self.heads, D // self.heads)
                   .permute(2, 0, 3, 1, 4).unbind(0))
        if self.qk_norm:
            if not self.pre_only:
                out[0] = self.q_norm(out[0])
            out[-2] = self.k_norm(out[-2])
        return out

    def finish(self, x, o, mod):
        B, S, D = x.shape
        x = x + mod[2].unsqueeze(1) * self.proj(o.transpose(1, 2).reshape(B, S, D))
        return x + mod[5].unsqueeze(1) * self.mlp(modulate(F.layer_norm(x, (D,), eps=self.eps), mod[3], mod[4]))


class JointBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, eps, qk_norm, pre_only):
        super().__init__()
        self.image = Stream(dim, heads, mlp_ratio, eps, qk_norm, False)
        self.text = Stream(dim, heads, mlp_ratio, eps, qk_norm, pre_only)

    def forward(self, x, txt, c, rope, key_mask):
        c = F.silu(c)
        mi = self.image.adaLN_modulation(c).chunk(6, 1)
        mt = self.text.adaLN_modulation(c).chunk(2 if self.text.pre_only else 6, 1)
        qi, ki, vi = self.image.heads_of(x, mi)
        if rope is not None:
            qi, ki = apply_rope(qi, *rope), apply_rope(ki, *rope)
        ht = self.text.heads_of(txt, mt)
        q = qi if self.text.pre_only else torch.cat([ht[0], qi], 2)
        k, v = torch.cat([ht[-2], ki], 2), torch.cat([ht[-1], vi], 2)
        scores = (q * (q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        o = scores.softmax(-1) @ v
        if self.text.pre_only:
            return self.image.finish(x, o, mi), None
        L = txt.shape[1]
        return self.image.finish(x, o[:, :, L:], mi), self.text.finish(txt, o[:, :, :L], mt)


class SimpleMMDiT(nn.Module):
    def __init__(self, f):
        super().__init__()
        d, p, ctx = f["emb_features"], f["patch_size"], f["context_features"]
        self.p, self.heads, self.out = p, f["num_heads"], f["output_channels"]
        self.x_embedder = nn.Conv2d(f["in_channels"], d, p, stride=p)
        nn.init.xavier_uniform_(self.x_embedder.weight.view(d, -1))
        nn.init.zeros_(self.x_embedder.bias)
        self.context_embedder = nn.Linear(ctx, d)
        self.t_embedder = TimeEmbedding(d)
        self.y_embedder = nn.Embedding(f["num_classes"] + 1, d) if f["num_classes"] > 0 else None
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        self.pooled_text_embedder = nn.Linear(ctx, d)
        for lin in (self.context_embedder, self.pooled_text_embedder):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)
        n = f["num_layers"]
        self.blocks = nn.ModuleList(JointBlock(d, f["num_heads"], f["mlp_ratio"], f["norm_epsilon"], f["qk_norm"],
                                               i + 1 == n) for i in range(n))
        self.final_layer = FinalLayer(d, p * p * f["output_channels"], f["norm_epsilon"])

    def forward(self, x, t, y, context, context_mask=None):
        if context is None:
            raise ValueError("simple_mmdit needs a text context")
        B, _, H, W = x.shape
        gh, gw, d = H // self.p, W // self.p, self.x_embedder.out_channels
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + sincos_2d(d, gh, gw)
        rope = rope_tables(gh * gw, d // self.heads)
        txt = self.context_embedder(context)
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y)
        if context_mask is None:
            pooled = context.mean(1)
            key_mask = None
        else:
            m = context_mask.float().unsqueeze(-1)
            pooled = (context * m).sum(1) / m.sum(1).clamp_min(1.0)
            key_mask = torch.cat([context_mask.bool(), torch.ones(B, gh * gw, dtype=torch.bool)], 1)
        c = c + self.pooled_text_embedder(pooled)
        for block in self.blocks:
            h, txt = block(h, txt, c, rope, key_mask)
        out = self.final_layer(h, c)
        p = self.p
        return out.reshape(B, gh, gw, p, p, self.out).permute(0, 5, 1, 3, 2, 4).reshape(B, self.out, H, W)


def build(fields):
    f = dict(DEFAULTS)
    unknown = set(fields) - set(DEFAULTS) - {"dtype", "attention_impl", "remat", "dropout_rate",
                                             "force_fp32_for_softmax", "scan_order"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if fields.get("scan_order", "raster") != "raster":
        raise ValueError("the peer implements raster order only")
    f.update(fields)
    return SimpleMMDiT(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default='{"patch_size": 2, "emb_features": 32, "num_layers": 2, "num_heads": 4, '
                                        '"mlp_ratio": 2, "context_features": 8}')
    args = ap.parse_args()
    fields = json.loads(args.config)
    torch.manual_seed(0)
    model = build(fields)
    params = sum(p.numel() for p in model.parameters())
    x, t = torch.randn(2, fields.get("in_channels", 3), 8, 8), torch.rand(2)
    ctx = torch.randn(2, 5, model.context_embedder.in_features)
    mask = torch.rand(2, 5) > 0.3
    mask[:, 0] = True
    y = model(x, t, None if model.y_embedder is None else torch.zeros(2, dtype=torch.long), ctx, mask)
    print(json.dumps({"params": params, "output_shape": list(y.shape), "output_abs_max": y.abs().max().item(),
                      "finite": bool(torch.isfinite(y).all())}))


if __name__ == "__main__":
    main()
