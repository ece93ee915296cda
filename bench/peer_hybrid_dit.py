#!/usr/bin/python3
"""Python eager peer of `hybrid_dit` (dew/nn/backbones/hybrid_dit.{h,cpp}, dew/nn/s5.{h,cpp}): SimpleDiT's stem
with each layer an attention block or an S5 block, in plain PyTorch, layer for layer (same parameter names,
shapes and initialisation scheme). The S5 recurrence runs as the same parallel (Hillis-Steele) scan over
offsets 1, 2, 4, ..., complex values carried as (real, imaginary) fp32 pairs.

    /usr/bin/python3 bench/peer_hybrid_dit.py --config '{"patch_size": 2, "emb_features": 32, ...}'

prints one JSON line with the parameter count and the output shape of one forward. Scan orders: raster and
zigzag (hilbert is refused); qk_norm is not implemented.
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
from peer import DiTBlock, FinalLayer, Mlp, TimeEmbedding, modulate, rope_tables, sincos_2d  # noqa: E402

DEFAULTS = {"output_channels": 3, "patch_size": 16, "emb_features": 768, "num_layers": 12, "num_heads": 12,
            "mlp_ratio": 4.0, "norm_epsilon": 1e-5, "qk_norm": False, "in_channels": 3, "num_classes": 0,
            "context_features": 0, "scan_order": "raster", "ssm_state_dim": 64, "ssm_attention_ratio": "3:1",
            "block_pattern": [], "bidirectional_ssm": True, "use_2d_fusion": False}
IGNORED = {"dtype", "attention_impl", "remat", "dropout_rate", "force_fp32_for_softmax"}


def lecun_normal_(t, fan_in):
    """JAX's lecun_normal: truncated at +-2 std, rescaled to variance 1/fan_in."""
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    with torch.no_grad():
        nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std)
    return t


# ---- S5 (dew/nn/s5.cpp) ----

def s5_scan(lr, li, x_re, x_im):
    """x_k = a x_{k-1} + b_k for a = exp(lr + i li): log2(L) steps, x_k += a^s x_{k-s} for every k >= s."""
    L, s = x_re.shape[1], 1
    while s < L:
        mag, ang = torch.exp(lr * s), li * s
        p_re, p_im = mag * torch.cos(ang), mag * torch.sin(ang)
        h_re, h_im = x_re[:, :L - s], x_im[:, :L - s]
        x_re = x_re + F.pad(p_re * h_re - p_im * h_im, (0, 0, s, 0))
        x_im = x_im + F.pad(p_re * h_im + p_im * h_re, (0, 0, s, 0))
        s *= 2
    return x_re, x_im


class S5Layer(nn.Module):
    def __init__(self, dim, n, dt_min=1e-3, dt_max=1e-1):
        super().__init__()
        idx = torch.arange(n, dtype=torch.float32)
        self.log_A_real = nn.Parameter(torch.log(idx + 0.5))
        self.A_imag = nn.Parameter(idx * math.pi)
        self.B_re = nn.Parameter(lecun_normal_(torch.empty(n, dim), n))
        self.B_im = nn.Parameter(lecun_normal_(torch.empty(n, dim), n))
        self.C_re = nn.Parameter(lecun_normal_(torch.empty(dim, n), dim))
        self.C_im = nn.Parameter(lecun_normal_(torch.empty(dim, n), dim))
        self.D = nn.Parameter(torch.randn(dim))
        self.log_dt = nn.Parameter(torch.empty(n).uniform_(math.log(dt_min), math.log(dt_max)))

    def forward(self, u):
        dt = self.log_dt.exp()
        a_re, a_im = -self.log_A_real.exp(), self.A_imag
        lr, li = a_re * dt, a_im * dt                                  # log Abar = A dt
        m_re = torch.expm1(lr) * torch.cos(li) - 2 * torch.sin(li / 2) ** 2  # Abar - 1
        m_im = torch.exp(lr) * torch.sin(li)
        a2 = a_re ** 2 + a_im ** 2
        q_re, q_im = ((m_re * a_re + m_im * a_im) / a2)[:, None], ((m_im * a_re - m_re * a_im) / a2)[:, None]
        b_re, b_im = q_re * self.B_re - q_im * self.B_im, q_re * self.B_im + q_im * self.B_re  # Bbar
        uf = u.float()
        n = self.log_dt.shape[0]
        bu = F.linear(uf, torch.cat([b_re, b_im], 0))
        x_re, x_im = s5_scan(lr, li, bu[..., :n], bu[..., n:])
        y = F.linear(torch.cat([x_re, x_im], -1), torch.cat([self.C_re, -self.C_im], 1)) + self.D * uf
        return y.to(u.dtype)


class S5(nn.Module):
    def __init__(self, dim, n, bidirectional):
        super().__init__()
        self.s5_forward = S5Layer(dim, n)
        self.bidirectional = bidirectional
        if bidirectional:
            self.s5_backward = S5Layer(dim, n)
            self.out_proj = nn.Linear(2 * dim, dim)
            lecun_normal_(self.out_proj.weight, 2 * dim)
            nn.init.zeros_(self.out_proj.bias)

    def forward(self, u):
        if not self.bidirectional:
            return self.s5_forward(u)
        return self.out_proj(torch.cat([self.s5_forward(u), self.s5_backward(u.flip(1)).flip(1)], -1))


class SpatialFusion(nn.Module):
    """y + depthwise 3x3 convs at dilations 1, 2, 3 (zero-initialised) over the token grid."""

    def __init__(self, dim, dilations=(1, 2, 3)):
        super().__init__()
        for d in dilations:
            conv = nn.Conv2d(dim, dim, 3, padding=d, dilation=d, groups=dim, bias=False)
            nn.init.zeros_(conv.weight)
            self.add_module(f"dwconv_dil{d}", conv)

    def forward(self, y, h, w, perm, inverse):
        B, S, D = y.shape
        raster = y if perm is None else y[:, inverse]
        grid = raster.transpose(1, 2).reshape(B, D, h, w)
        delta = sum(conv(grid) for conv in self.children()).flatten(2).transpose(1, 2)
        return y + (delta if perm is None else delta[:, perm])


class SSMDiTBlock(nn.Module):
    def __init__(self, dim, n, mlp_ratio, eps, bidirectional, fusion):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ssm = S5(dim, n, bidirectional)
        self.spatial_fusion = SpatialFusion(dim) if fusion else None
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.mlp = Mlp(dim, int(mlp_ratio * dim))
        self.adaLN_modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.adaLN_modulation.weight)
        nn.init.zeros_(self.adaLN_modulation.bias)

    def forward(self, x, c, grid):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(F.silu(c)).chunk(6, 1)
        y = self.ssm(modulate(self.norm1(x), shift_msa, scale_msa))
        if self.spatial_fusion is not None:
            y = self.spatial_fusion(y, *grid)
        x = x + gate_msa.unsqueeze(1) * y
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


# ---- the model ----

def zigzag_perm(h, w):
    """perm[n] = raster index of the n-th token: rows alternate left-to-right and right-to-left."""
    return torch.tensor([r * w + (c if r % 2 == 0 else w - 1 - c) for r in range(h) for c in range(w)])


def block_pattern(f):
    ratio, layers = f["ssm_attention_ratio"], f["num_layers"]
    if f["block_pattern"]:
        if ratio != "3:1":
            raise ValueError("set block_pattern or ssm_attention_ratio, not both")
        if len(f["block_pattern"]) != layers or any(k not in ("ssm", "attn") for k in f["block_pattern"]):
            raise ValueError(f"block_pattern must name {layers} layers, each ssm or attn")
        return list(f["block_pattern"])
    if ratio in ("all-ssm", "all-attn"):
        return [ratio[4:]] * layers
    n_ssm, n_attn = (int(v) for v in ratio.split(":"))
    return [("ssm" if i % (n_ssm + n_attn) < n_ssm else "attn") for i in range(layers)]


class HybridDiT(nn.Module):
    def __init__(self, f):
        super().__init__()
        d, p = f["emb_features"], f["patch_size"]
        self.p, self.heads, self.out, self.order = p, f["num_heads"], f["output_channels"], f["scan_order"]
        self.x_embedder = nn.Conv2d(f["in_channels"], d, p, stride=p)
        nn.init.xavier_uniform_(self.x_embedder.weight.view(d, -1))
        nn.init.zeros_(self.x_embedder.bias)
        self.t_embedder = TimeEmbedding(d)
        self.y_embedder = nn.Embedding(f["num_classes"] + 1, d) if f["num_classes"] > 0 else None
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        self.context_embedder = nn.Linear(f["context_features"], d) if f["context_features"] > 0 else None
        if self.context_embedder is not None:
            nn.init.xavier_uniform_(self.context_embedder.weight)
            nn.init.zeros_(self.context_embedder.bias)
        self.kinds = block_pattern(f)
        self.blocks = nn.ModuleList(
            DiTBlock(d, f["num_heads"], f["mlp_ratio"], f["norm_epsilon"]) if k == "attn" else
            SSMDiTBlock(d, f["ssm_state_dim"], f["mlp_ratio"], f["norm_epsilon"], f["bidirectional_ssm"],
                        f["use_2d_fusion"])
            for k in self.kinds)
        self.final_layer = FinalLayer(d, p * p * f["output_channels"], f["norm_epsilon"])
        self._grid = None  # per grid size: (h, w, pos, rope, perm, inverse)

    def grid(self, gh, gw):
        if self._grid is None or self._grid[:2] != (gh, gw):
            d = self.x_embedder.out_channels
            perm = zigzag_perm(gh, gw) if self.order == "zigzag" else None
            inverse = None if perm is None else torch.argsort(perm)
            pos = sincos_2d(d, gh, gw)
            # RoPE over the sequence index is a grid coordinate only in raster order.
            rope = rope_tables(gh * gw, d // self.heads) if perm is None else None
            self._grid = (gh, gw, pos if perm is None else pos[perm], rope, perm, inverse)
        return self._grid

    def forward(self, x, t, y, context=None, context_mask=None):
        B, _, H, W = x.shape
        gh, gw = H // self.p, W // self.p
        _, _, pos, rope, perm, inverse = self.grid(gh, gw)
        h = self.x_embedder(x).flatten(2).transpose(1, 2)
        if perm is not None:
            h = h[:, perm]
        h = h + pos
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y if y is not None else torch.full((B,), self.y_embedder.num_embeddings - 1))
        if context is not None:
            if context_mask is None:
                pooled = context.mean(1)
            else:
                m = context_mask.float().unsqueeze(-1)
                pooled = (context * m).sum(1) / m.sum(1).clamp_min(1.0)
            c = c + self.context_embedder(pooled)
        for kind, block in zip(self.kinds, self.blocks):
            h = block(h, c, rope) if kind == "attn" else block(h, c, (gh, gw, perm, inverse))
        out = self.final_layer(h, c)  # [B, N, p p C] in scan order
        if perm is not None:
            out = out[:, inverse]
        p = self.p
        return out.reshape(B, gh, gw, p, p, self.out).permute(0, 5, 1, 3, 2, 4).reshape(B, self.out, H, W)


def build(fields):
    unknown = set(fields) - set(DEFAULTS) - IGNORED
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    f = dict(DEFAULTS, **fields)
    if f["scan_order"] not in ("raster", "zigzag"):
        raise ValueError("the peer implements raster and zigzag orders only")
    if f["qk_norm"]:
        raise ValueError("the peer does not implement qk_norm")
    return HybridDiT(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default='{"patch_size": 2, "emb_features": 32, "num_layers": 4, "num_heads": 4, '
                                        '"mlp_ratio": 2, "ssm_state_dim": 8}')
    ap.add_argument("--size", type=int, default=8)
    args = ap.parse_args()
    fields = json.loads(args.config)
    torch.manual_seed(0)
    model = build(fields)
    params = sum(p.numel() for p in model.parameters())
    x, t = torch.randn(2, fields.get("in_channels", 3), args.size, args.size), torch.rand(2)
    ctx = None
    if model.context_embedder is not None:
        ctx = torch.randn(2, 5, model.context_embedder.in_features)
    y = model(x, t, None, ctx)
    # Move the zero-initialised layers off zero, then check the backward reaches every parameter.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model(x, t, None, ctx).square().sum().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    print(json.dumps({"params": params, "pattern": model.kinds, "output_shape": list(y.shape),
                      "output_abs_max_at_init": y.abs().max().item(), "params_without_gradient": no_grad}))


if __name__ == "__main__":
    main()
