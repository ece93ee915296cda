#!/usr/bin/python3
"""Python eager peer of `dew bench --models jepa`: one I-JEPA training step in plain PyTorch.

The modules are written the way facebookresearch/ijepa writes them (src/models/vision_transformer.py:
Conv2d patch embedding, a fixed 2D sin-cos table, pre-norm blocks with a fused qkv Linear and an explicit
softmax attention, exact GELU, final LayerNorm; the predictor maps to its width, adds the mask token and the
target positions, and projects back), and so is the step (src/train.py): the target encoder's LayerNorm'd
features at the target blocks without gradients, the context encoder on the context block, the predictor,
the loss (MSE, as dew's default), then dew's trainer step around it (bench/peer.py): loss.item() and its
isfinite check, backward, clip_grad_norm_ to --optim's grad_clip, the schedule's learning rate, AdamW (weight
decay on matrices), then the momentum update of the target encoder parameter by parameter. Masks: I-JEPA's
multi-block rule with the sizes of the config's "masks" (dew's recipe: 1 target block of scale (0.2, 0.25);
without it I-JEPA's 4 targets of scale (0.15, 0.2)), aspect (0.75, 1.5), one context block of scale (0.85, 1.0)
minus the targets, drawn every step.

    /usr/bin/python3 bench/jepa_peer.py --config '{"encoder": {...}, "predictor": {...}}' --batch 32 \
        --steps 20 --warmup 5 --threads 1 --params 1234567 --optim '{"lr": 0.001, ...}'

prints one JSON line with the keys of bench/peer.py.
"""
import argparse
import copy
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (dew's optimizer, schedule and clip)

MOMENTUM = 0.996


def fail(msg):
    print(f"jepa_peer.py: {msg}", file=sys.stderr)
    sys.exit(2)


def sincos_2d(dim, g):
    def one(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=float) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    gw, gh = np.meshgrid(np.arange(g, dtype=float), np.arange(g, dtype=float))
    return torch.from_numpy(np.concatenate([one(dim // 2, gw), one(dim // 2, gh)], axis=1)).float().unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, eps):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, int(dim * mlp_ratio))
        self.fc2 = nn.Linear(int(dim * mlp_ratio), dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def gather(x, idx):
    return torch.gather(x, 1, idx.unsqueeze(-1).repeat(1, 1, x.size(-1)))


class Encoder(nn.Module):
    def __init__(self, f):
        super().__init__()
        d = f["emb_features"]
        self.grid = f["image_size"] // f["patch_size"]
        self.proj = nn.Conv2d(f["in_channels"], d, f["patch_size"], f["patch_size"])
        self.register_buffer("pos_embed", sincos_2d(d, self.grid))
        self.blocks = nn.ModuleList([Block(d, f["num_heads"], f["mlp_ratio"], f["norm_eps"]) for _ in range(f["num_layers"])])
        self.norm = nn.LayerNorm(d, eps=f["norm_eps"])

    def forward(self, x, keep=None):
        x = self.proj(x).flatten(2).transpose(1, 2) + self.pos_embed
        if keep is not None:
            x = gather(x, keep)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class Predictor(nn.Module):
    def __init__(self, f):
        super().__init__()
        p, e = f["emb_features"], f["encoder_features"]
        self.embed = nn.Linear(e, p)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, p))
        self.register_buffer("pos", sincos_2d(p, f["image_size"] // f["patch_size"]))
        self.blocks = nn.ModuleList([Block(p, f["num_heads"], f["mlp_ratio"], f["norm_eps"]) for _ in range(f["num_layers"])])
        self.norm = nn.LayerNorm(p, eps=f["norm_eps"])
        self.out = nn.Linear(p, e)

    def forward(self, ctx, ctx_idx, targets):  # targets: list of [B, Kt]
        B = ctx.size(0)
        pos = self.pos.repeat(B, 1, 1)
        x = self.embed(ctx) + gather(pos, ctx_idx)
        n = x.size(1)
        t = torch.cat([gather(pos, m) for m in targets], 0)
        x = torch.cat([x.repeat(len(targets), 1, 1), self.mask_token + t], 1)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x)[:, n:])


def block_size(g, r, scale, aspect, H, W):
    s = scale[0] + r * (scale[1] - scale[0])
    keep = int(H * W * s)
    ar = aspect[0] + r * (aspect[1] - aspect[0])
    h, w = int(round(math.sqrt(keep * ar))), int(round(math.sqrt(keep / ar)))
    return min(h, H - 1), min(w, W - 1)


def block(g, size, H, W, regions=None, min_keep=4):
    h, w = size
    tries, timeout = 0, 20
    while True:
        top = int(torch.randint(0, H - h, (1,), generator=g))
        left = int(torch.randint(0, W - w, (1,), generator=g))
        mask = torch.zeros((H, W), dtype=torch.int32)
        mask[top:top + h, left:left + w] = 1
        if regions is not None:
            for k in range(max(len(regions) - tries, 0)):
                mask *= regions[k]
        idx = torch.nonzero(mask.flatten()).squeeze(1)
        if len(idx) > min_keep:
            comp = torch.ones((H, W), dtype=torch.int32)
            comp[top:top + h, left:left + w] = 0
            return idx, comp
        timeout -= 1
        if timeout == 0:
            tries, timeout = tries + 1, 20


IJEPA_MASKS = {"targets": 4, "target_scale": (0.15, 0.2), "target_aspect": (0.75, 1.5), "context_scale": (0.85, 1.0),
               "min_keep": 4}


def masks(g, B, H, W, opts):
    """opts: dew's MultiBlockOptions (targets, target_scale, target_aspect, context_scale, min_keep)."""
    M, keep = opts["targets"], opts["min_keep"]
    ts = block_size(g, float(torch.rand(1, generator=g)), opts["target_scale"], opts["target_aspect"], H, W)
    cs = block_size(g, float(torch.rand(1, generator=g)), opts["context_scale"], (1.0, 1.0), H, W)
    tgt, ctx = [[] for _ in range(M)], []
    for _ in range(B):
        comps = []
        for m in range(M):
            idx, comp = block(g, ts, H, W, min_keep=keep)
            tgt[m].append(idx)
            comps.append(comp)
        ctx.append(block(g, cs, H, W, comps, min_keep=keep)[0])
    kt = min(len(t) for per in tgt for t in per)
    kc = min(len(c) for c in ctx)
    return torch.stack([c[:kc] for c in ctx]), [torch.stack([t[:kt] for t in per]) for per in tgt]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True,
                    help='{"encoder": fields, "predictor": fields, "masks": MultiBlockOptions} (dew names)')
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--params", type=int, default=-1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optim", default="{}", help="dew's OptimOptions as JSON (lr, schedule, warm-up, grad_clip, ...)")
    peer.add_compile_flag(ap)
    a = ap.parse_args()
    optim = peer.parse_optim(a.optim)
    if a.device != "cpu":
        fail("the JEPA peer runs on the CPU only")
    cfg = json.loads(a.config)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    enc, pred = Encoder(cfg["encoder"]), Predictor(cfg["predictor"])
    target = copy.deepcopy(enc)
    for p in target.parameters():
        p.requires_grad_(False)
    n = sum(p.numel() for p in enc.parameters()) + sum(p.numel() for p in pred.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"{n} parameters here and {a.params} in C++: the two models differ")
    params = list(enc.parameters()) + list(pred.parameters())
    opt = peer.adamw(params, optim)
    total = a.warmup + a.steps
    f = cfg["encoder"]
    G = f["image_size"] // f["patch_size"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (a.batch, f["in_channels"], f["image_size"], f["image_size"]), generator=g,
                      dtype=torch.uint8)
    # The modules run compiled under --compile; parameters, the optimizer and the EMA stay the eager ones.
    run_enc, run_pred, run_target = peer.compiled(a, enc, pred, target)
    times, loss, first = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        xf = x.float() / 127.5 - 1
        ctx, tgt = masks(g, a.batch, G, G, cfg.get("masks", IJEPA_MASKS))
        with torch.no_grad():
            h = F.layer_norm(run_target(xf), (f["emb_features"],))
            h = torch.cat([gather(h, m) for m in tgt], 0)
        z = run_pred(run_enc(xf, ctx), ctx, tgt)
        l = F.mse_loss(z, h)
        loss = l.item()
        if not math.isfinite(loss):
            fail(f"non-finite loss {loss} at step {i}")
        t1 = time.perf_counter()
        l.backward()
        peer.clip(params, optim)
        t2 = time.perf_counter()
        peer.set_lr(opt, optim, i, total)
        opt.step()
        with torch.no_grad():
            for q, k in zip(enc.parameters(), target.parameters()):
                k.data.mul_(MOMENTUM).add_((1.0 - MOMENTUM) * q.detach().data)
        t3 = time.perf_counter()
        if i == 0:
            first = t3 - t0
        if i >= a.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    print(json.dumps(peer.result(med, a.batch, n, loss, **peer.compile_extra(a, first, med[0]))), flush=True)


if __name__ == "__main__":
    main()
