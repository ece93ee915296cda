#!/usr/bin/python3
"""Python eager peer of `dew bench`: the same models and the same training step, in plain PyTorch.

SimpleDiT and Unet are re-implemented layer for layer from dew/nn (same layers, same parameter shapes,
same initialisation scheme); the step is the one `dew bench` times in C++, dew's trainer step
(Trainer::train_step) around DiffusionObjective: uint8 images to [-1, 1], EDM training inputs
(sigma = exp(P_mean + P_std n), c_in / c_skip / c_out preconditioning, loss 0.5 lambda (D - x0)^2), labels
replaced by the null class with probability --unconditional-prob, forward, loss.item() and its isfinite
check (a non-finite loss skips the update), backward, torch.nn.utils.clip_grad_norm_ to the optimizer's
grad_clip, the learning rate of dew's schedule (linear warm-up, then cosine / linear / constant) set on the
optimizer, torch.optim.AdamW, then an fp32 EMA of every parameter. The code is written the way a PyTorch
user would write it (nn modules, F.linear through nn.Linear, the optimizer's defaults), because that is
the baseline the C++ numbers are compared with.

    /usr/bin/python3 bench/peer.py --model unet --config '{"feature_depths": [32, 64], ...}' \
        --batch 32 --steps 20 --warmup 5 --threads 1 --params 1234567 --optim '{"lr": 0.001, ...}'

prints one JSON line: {"ms_per_step", "samples_per_s", "peak_rss_mb", "params", "threads", ...}.
Run one configuration per process: peak RSS (ru_maxrss) is a high-water mark of the whole process.
"""
import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# EDM "pixel" regime and data standard deviation, as dew's `edm` preset.
P_MEAN, P_STD, SIGMA_DATA = -1.2, 1.2, 0.5
# The step's hyper-parameters, as dew bench's C++ side (dew::training::OptimOptions, EMA); --optim (the
# C++ side's OptimOptions as JSON) replaces OPTIM's values.
LR, BETAS, EPS, WEIGHT_DECAY, EMA_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.995
OPTIM = {"name": "adamw", "lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WEIGHT_DECAY,
         "schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1, "grad_clip": 1.0}


def parse_optim(text):
    """dew's OptimOptions from JSON (the keys this peer uses); AdamW only."""
    try:
        o = dict(OPTIM, **json.loads(text))
    except ValueError as e:
        fail(f"bad --optim: {e}")
    if o["name"] != "adamw":
        fail(f"--optim name {o['name']!r}: the peer implements adamw only")
    if o["schedule"] not in ("cosine", "linear", "constant"):
        fail(f"--optim schedule {o['schedule']!r}: accepted cosine, linear, constant")
    return o


def learning_rate(o, step, total):
    """dew::training::learning_rate: linear warm-up from 0 over warmup_steps, then the decay to lr * min_lr_ratio."""
    if step < o["warmup_steps"]:
        return o["lr"] * (step + 1) / (o["warmup_steps"] + 1)
    if o["schedule"] == "constant":
        return o["lr"]
    p = min(1.0, (step - o["warmup_steps"]) / max(1, total - o["warmup_steps"]))
    floor = o["lr"] * o["min_lr_ratio"]
    if o["schedule"] == "linear":
        return floor + (o["lr"] - floor) * (1 - p)
    return floor + (o["lr"] - floor) * 0.5 * (1 + math.cos(math.pi * p))


def adamw(params, o):
    """torch.optim.AdamW with dew's decay rule: matrices decayed, biases and norm scales not."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])


def clip(params, o):
    """dew's clip_grad_norm after backward: the global gradient norm clipped to grad_clip (0 = off)."""
    if o["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip"])


def set_lr(opt, o, step, total):
    """The schedule's learning rate of `step` on every parameter group, before opt.step()."""
    lr = learning_rate(o, step, total)
    for g in opt.param_groups:
        g["lr"] = lr


# Where the peer runs (--device). On a CUDA device, torch.set_default_device puts every tensor the models
# make there, and the generators are made on it too; timings synchronise the device (sync()).
DEVICE = "cpu"


def use_device(name):
    global DEVICE
    DEVICE = name
    if name != "cpu":
        if not hasattr(torch, "set_default_device"):
            fail(f"--device {name}: this PyTorch ({torch.__version__}) has no set_default_device (needs >= 2.0)")
        if not torch.cuda.is_available():
            fail(f"--device {name}: torch.cuda is not available")
        torch.set_default_device(name)


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def fail(msg):
    print(f"peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def act_fn(name):
    table = {"swish": F.silu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu, "mish": F.mish,
             "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in table:
        fail(f"activation {name!r} is not implemented here; accepted: {', '.join(table)}")
    return table[name]


# ---- embeddings (dew/nn/embeddings.cpp) ----

class TimeEmbedding(nn.Module):
    """Fixed random Fourier features of t, then Linear-SiLU-Linear."""

    def __init__(self, features, scale=16.0, seed=42):
        super().__init__()
        g = generator(seed)
        self.register_buffer("freqs", torch.randn(features // 2, generator=g) * scale)
        self.linear_1 = nn.Linear(features, features)
        self.linear_2 = nn.Linear(features, features)
        for lin in (self.linear_1, self.linear_2):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, t):
        arg = t.float()[:, None] * (2 * math.pi) * self.freqs[None]
        return self.linear_2(F.silu(self.linear_1(torch.cat([arg.sin(), arg.cos()], 1))))


def sincos_1d(dim, pos):
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    arg = pos.double()[:, None] * omega[None]
    return torch.cat([arg.sin(), arg.cos()], 1).float()


def sincos_2d(dim, h, w):
    """MAE's 2D table in raster order: first half encodes the column, second half the row."""
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    return torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], 1)


def rope_tables(n, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


# ---- attention and blocks (dew/nn/attention.cpp, dew/nn/blocks.cpp) ----

class Attention(nn.Module):
    """timm-style self-attention: fused qkv, optional RoPE on q and k, softmax(q k^T / sqrt(d)) v."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        for lin in (self.qkv, self.proj):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, rope=None):
        B, S, D = x.shape
        q, k, v = self.qkv(x).reshape(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, S, D))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """adaLN-Zero block: the modulation Linear starts at zero, so the block starts as the identity."""

    def __init__(self, dim, heads, mlp_ratio, eps):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.mlp = Mlp(dim, int(mlp_ratio * dim))
        self.adaLN_modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.adaLN_modulation.weight)
        nn.init.zeros_(self.adaLN_modulation.bias)

    def forward(self, x, c, rope):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(F.silu(c)).chunk(6, 1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim, out_features, eps):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.adaLN_modulation = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, out_features)
        for lin in (self.adaLN_modulation, self.linear):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(F.silu(c)).chunk(2, 1)
        return self.linear(modulate(self.norm(x), shift, scale))


class SimpleDiT(nn.Module):
    def __init__(self, f):
        super().__init__()
        d, p = f["emb_features"], f["patch_size"]
        self.p, self.heads, self.out = p, f["num_heads"], f["output_channels"]
        self.x_embedder = nn.Conv2d(f["in_channels"], d, p, stride=p)
        nn.init.xavier_uniform_(self.x_embedder.weight.view(d, -1))
        nn.init.zeros_(self.x_embedder.bias)
        self.t_embedder = TimeEmbedding(d)
        self.y_embedder = nn.Embedding(f["num_classes"] + 1, d) if f["num_classes"] > 0 else None
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        self.blocks = nn.ModuleList(DiTBlock(d, f["num_heads"], f["mlp_ratio"], f["norm_epsilon"])
                                    for _ in range(f["num_layers"]))
        self.final_layer = FinalLayer(d, p * p * f["output_channels"], f["norm_epsilon"])
        self._grid = None  # (h, w, pos, rope): built once per grid size, as the C++ model caches it

    def forward(self, x, t, y):
        B, _, H, W = x.shape
        gh, gw = H // self.p, W // self.p
        if self._grid is None or self._grid[:2] != (gh, gw):
            d = self.x_embedder.out_channels
            self._grid = (gh, gw, sincos_2d(d, gh, gw), rope_tables(gh * gw, d // self.heads))
        _, _, pos, rope = self._grid
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + pos
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y)
        for block in self.blocks:
            h = block(h, c, rope)
        out = self.final_layer(h, c)  # [B, N, p p C]
        p = self.p
        return out.reshape(B, gh, gw, p, p, self.out).permute(0, 5, 1, 3, 2, 4).reshape(B, self.out, H, W)


# ---- Unet (dew/nn/backbones/unet.cpp) ----

class ResBlock(nn.Module):
    def __init__(self, cin, cout, emb, groups, act):
        super().__init__()
        self.act = act
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(emb, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)  # ADM's zero_module: the block starts as its skip path
        nn.init.zeros_(self.conv2.bias)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, temb):
        h = self.conv1(self.act(self.norm1(x)))
        h = h + self.time_emb_proj(self.act(temb))[:, :, None, None]
        h = self.conv2(self.act(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class UnetAttention(nn.Module):
    def __init__(self, ch, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(ch)
        self.attn1 = Attention(ch, heads)

    def forward(self, x):
        B, C, H, W = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.attn1(self.norm1(t))
        return t.transpose(1, 2).reshape(B, C, H, W)


class Level(nn.Module):
    def __init__(self, resnets, attention, resample):
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        self.attention = attention
        self.resample = resample


class Unet(nn.Module):
    def __init__(self, f):
        super().__init__()
        depths, heads, E, G = f["feature_depths"], f["attention_configs"], f["emb_features"], f["norm_groups"]
        self.act = act_fn(f["activation"])
        res = lambda cin, cout: ResBlock(cin, cout, E, G, self.act)
        attn = lambda ch, h: UnetAttention(ch, h) if h else None
        self.t_embedder = TimeEmbedding(E)
        self.y_embedder = nn.Embedding(f["num_classes"] + 1, E) if f["num_classes"] > 0 else None
        self.conv_in = nn.Conv2d(f["in_channels"], depths[0], 3, padding=1)
        ch, skips, levels = depths[0], [depths[0]], len(depths)
        down = []
        for i in range(levels):
            resnets = []
            for _ in range(f["num_res_blocks"]):
                resnets.append(res(ch, depths[i]))
                ch = depths[i]
                skips.append(ch)
            resample = None
            if i != levels - 1:
                resample = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
                skips.append(ch)
            down.append(Level(resnets, attn(ch, heads[i]), resample))
        self.down_blocks = nn.ModuleList(down)
        mid = [res(ch, ch) for _ in range(2 * f["num_middle_res_blocks"])]
        self.mid_block = Level(mid, attn(ch, heads[-1]) if mid else None, None)
        up = []
        for i in reversed(range(levels)):
            resnets = []
            for _ in range(f["num_res_blocks"] + 1):
                resnets.append(res(ch + skips.pop(), depths[i]))
                ch = depths[i]
            up.append(Level(resnets, attn(ch, heads[i]), nn.Conv2d(ch, ch, 3, padding=1) if i != 0 else None))
        self.up_blocks = nn.ModuleList(up)
        self.norm_out = nn.GroupNorm(G, ch)
        self.conv_out = nn.Conv2d(ch, f["output_channels"], 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def forward(self, x, t, y):
        temb = self.t_embedder(t)
        if self.y_embedder is not None:
            temb = temb + self.y_embedder(y)
        h = self.conv_in(x)
        skips = [h]
        for lv in self.down_blocks:
            for j, block in enumerate(lv.resnets):
                h = block(h, temb)
                if j == len(lv.resnets) - 1 and lv.attention is not None:
                    h = lv.attention(h)
                skips.append(h)
            if lv.resample is not None:
                h = lv.resample(h)
                skips.append(h)
        mid = self.mid_block
        for k in range(0, len(mid.resnets), 2):
            h = mid.resnets[k](h, temb)
            if k + 2 == len(mid.resnets) and mid.attention is not None:
                h = mid.attention(h)
            h = mid.resnets[k + 1](h, temb)
        for lv in self.up_blocks:
            for j, block in enumerate(lv.resnets):
                h = block(torch.cat([h, skips.pop()], 1), temb)
                if j == len(lv.resnets) - 1 and lv.attention is not None:
                    h = lv.attention(h)
            if lv.resample is not None:
                h = lv.resample(F.interpolate(h, scale_factor=2, mode="nearest"))
        return self.conv_out(self.act(self.norm_out(h)))


# ---- building from dew's field set ----

# Fields whose non-default values this peer does not implement (the C++ side supports them; the bench
# does not use them).
UNSUPPORTED = {
    "simple_dit": {"dtype": "float32", "remat": False, "qk_norm": False, "scan_order": "raster",
                   "context_features": 0, "dropout_rate": 0.0},
    "unet": {"dtype": "float32", "remat": False, "context_features": 0, "dropout_rate": 0.0},
}
DEFAULTS = {
    "simple_dit": {"mlp_ratio": 4.0, "norm_epsilon": 1e-5, "in_channels": 3, "output_channels": 3,
                   "num_classes": 0},
    "unet": {"num_middle_res_blocks": 1, "norm_groups": 8, "activation": "swish", "in_channels": 3,
             "output_channels": 3, "num_classes": 0},
}


def build(model, fields):
    if model in ("simple_mmdit", "hybrid_dit"):
        # Their peers live next to this file and reuse its building blocks.
        import importlib
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return importlib.import_module("peer_" + model).build(fields)
    f = dict(DEFAULTS[model], **fields)
    for key, only in UNSUPPORTED[model].items():
        if key in f and f[key] != only:
            fail(f"{model}.{key} = {f[key]!r} is not implemented by the peer (only {only!r})")
    if model == "simple_dit" and f.get("attention_impl", "auto") not in ("auto", "reference"):
        fail(f"simple_dit.attention_impl = {f['attention_impl']!r}: the peer runs the reference attention")
    return SimpleDiT(f) if model == "simple_dit" else Unet(f)


# ---- the training step ----

class TrainStep:
    """dew's trainer step around `loss(*batch)`: zero_grad (set_to_none, as dew), the loss, loss.item() and
    its isfinite check (a non-finite loss skips the update), backward, the gradient clip, the schedule's
    learning rate, AdamW (decay on matrices only, as dew's optimizer: biases and norm scales are not
    decayed), then an fp32 EMA of every parameter (decay min(ema_decay, (1 + step) / (10 + step))).
    `total` is the run's step count, the schedule's length. Subclasses provide loss()."""

    def __init__(self, model, optim=None, total=1, ema_decay=EMA_DECAY):
        self.model = model
        self.optim = optim or OPTIM
        self.total = total
        self.ema_decay = ema_decay
        self.params = [p for p in model.parameters()]
        self.opt = adamw(self.params, self.optim)
        self.ema = [p.detach().clone().float() for p in self.params]
        self.step = 0
        self.bad = 0

    def run(self, *batch):
        """Returns (forward, backward, optimizer) seconds and the loss; forward includes the finite check,
        backward the clip, optimizer zero_grad, the update and the EMA."""
        sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        ts = time.perf_counter()
        loss = self.loss(*batch)
        value = loss.item()
        t1 = time.perf_counter()
        if not math.isfinite(value):
            self.bad += 1
            self.step += 1
            return t1 - ts, 0.0, ts - t0, value
        loss.backward()
        clip(self.params, self.optim)
        sync()
        t2 = time.perf_counter()
        set_lr(self.opt, self.optim, self.step, self.total)
        self.opt.step()
        with torch.no_grad():
            d = min(self.ema_decay, (1 + self.step) / (10 + self.step))
            for e, p in zip(self.ema, self.params):
                e.mul_(d).add_(p, alpha=1 - d)
        sync()
        t3 = time.perf_counter()
        self.step += 1
        return t1 - ts, t2 - t1, t3 - t2 + ts - t0, value


class Step(TrainStep):
    """One diffusion training step (dew's DiffusionObjective, EDM pixel preset): uint8 images to [-1, 1], EDM
    inputs, labels dropped to the null class with probability `drop`, forward, loss, then TrainStep's check,
    backward, clip, schedule, AdamW, EMA."""

    def __init__(self, model, images, labels, seed, num_classes, drop, optim, total, context=None, context_mask=None):
        super().__init__(model, optim, total)
        self.images, self.labels, self.num_classes, self.drop = images, labels, num_classes, drop
        self.text = {} if context is None else {"context": context, "context_mask": context_mask}
        self.gen = generator(seed)

    def loss(self):
        x0 = self.images.float() / 127.5 - 1
        B = x0.shape[0]
        sigma64 = (P_MEAN + P_STD * torch.randn(B, dtype=torch.float64, generator=self.gen)).exp()
        eps = torch.randn(x0.shape, generator=self.gen)
        labels = self.labels
        if self.num_classes > 0:
            dropped = torch.rand(B, generator=self.gen) < self.drop
            labels = torch.where(dropped, torch.full_like(labels, self.num_classes), labels)
        sigma = sigma64.float().view(B, 1, 1, 1)
        x_t = x0 + sigma * eps
        c_in = 1 / (sigma ** 2 + SIGMA_DATA ** 2).sqrt()
        c_skip = SIGMA_DATA ** 2 / (sigma ** 2 + SIGMA_DATA ** 2)
        c_out = sigma * SIGMA_DATA / (sigma ** 2 + SIGMA_DATA ** 2).sqrt()
        weight = ((sigma64 ** 2 + SIGMA_DATA ** 2) / (sigma64 * SIGMA_DATA) ** 2).float()
        F_x = self.model(x_t * c_in, (sigma64.log() / 4).float(), labels, **self.text)
        D = c_skip * x_t + c_out * F_x
        return (0.5 * ((D - x0) ** 2).flatten(1).mean(1) * weight).mean()


def blas_core():
    """The BLAS torch runs and its kernel set, as dew names it: "oneMKL 2024.2 AVX2" (oneMKL's verbose mode
    names its kernels on the first call after it is turned on), "OpenBLAS Haswell", or "" for another."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0")  # the copy torch already loaded, if it links OpenBLAS
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return "OpenBLAS " + lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        pass
    if not torch.backends.mkl.is_available():
        return ""
    import re
    import tempfile
    version = re.search(r"Math Kernel Library Version ([0-9.]+)", torch.__config__.show())
    name = "oneMKL " + (version.group(1) if version else "")
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                a = torch.ones(64, 64)
                torch.mm(a, a)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    # "... for Intel(R) 64 architecture Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled
    # processors, Lnx ..." on Intel CPUs; "... architecture Intel(R) Architecture processors, ..." elsewhere.
    found = re.search(r"64 architecture (.*?)(?: enabled)? processors,", text)
    if not found:
        return name
    short = re.search(r"\(([^()]*)\)\s*$", found.group(1))
    return name + " " + (short.group(1) if short else found.group(1) + " processors").replace("Intel(R) ", "")


def add_compile_flag(ap):
    """--compile: the peers' torch.compile mode (dew bench's "Python compiled" side)."""
    ap.add_argument("--compile", action="store_true",
                    help="run the model(s) under torch.compile (inductor, default mode); the first step's extra "
                         "time is reported as compile_s, the timed steps are steady state")


def compiled(a, *models):
    """The models under torch.compile (inductor, default mode) when --compile, else as they are; compiling
    happens in the first step, so --compile takes at least one untimed step."""
    if not a.compile:
        return models[0] if len(models) == 1 else models
    a.warmup = max(a.warmup, 1)
    out = tuple(torch.compile(m) for m in models)
    return out[0] if len(out) == 1 else out


def compile_extra(a, first_s, med_ms):
    """{"compile_s": the first step's time beyond a steady-state step} under --compile, else {}."""
    return {"compile_s": max(0.0, first_s - med_ms / 1e3)} if a.compile else {}


def result(med, batch, params, loss, **extra):
    """The result line's keys (as dew bench's C++ children): med = median ms of (step, forward, backward,
    optimizer); `extra` adds keys (the LM peer's tokens/s and generation numbers)."""
    out = {
        "ms_per_step": med[0],
        "samples_per_s": batch / (med[0] / 1e3),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "params": params,
        "threads": torch.get_num_threads(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
        "blas_core": blas_core(),
        "phases_ms": {"forward": med[1], "backward": med[2], "optimizer": med[3]},
        "loss": loss,
        "torch": torch.__version__,
    }
    out.update(extra)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, choices=["simple_dit", "unet", "simple_mmdit", "hybrid_dit"])
    ap.add_argument("--config", required=True, help="the model's fields as JSON (dew's field names)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--image", default="28x28", help="H x W of the input")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--context-len", type=int, default=0, help="text tokens of a random context (0: none)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--optim", default="{}", help="dew's OptimOptions as JSON (lr, schedule, warm-up, grad_clip, ...)")
    ap.add_argument("--unconditional-prob", type=float, default=0.12, help="probability of the null label")
    ap.add_argument("--profile", default="", help="write a Chrome trace of the timed steps (torch.profiler) here")
    add_compile_flag(ap)
    a = ap.parse_args()
    use_device(a.device)
    optim = parse_optim(a.optim)
    if a.batch < 1 or a.steps < 1 or a.warmup < 0 or a.threads < 1:
        fail("--batch, --steps and --threads must be >= 1, --warmup >= 0")
    try:
        fields = json.loads(a.config)
        H, W = (int(v) for v in a.image.lower().split("x"))
    except ValueError as e:
        fail(f"bad --config or --image: {e}")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build(a.model, fields)
    model.train()
    n = sum(p.numel() for p in model.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"{a.model} has {n} parameters here and {a.params} in C++: the two models differ")

    g = generator(1)
    images = torch.randint(0, 256, (a.batch, fields.get("in_channels", 3), H, W), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, max(1, fields.get("num_classes", 0)), (a.batch,), generator=g)
    context = mask = None
    if a.context_len > 0:
        context = torch.randn(a.batch, a.context_len, fields["context_features"], generator=g)
        mask = torch.ones(a.batch, a.context_len, dtype=torch.bool)
    model = compiled(a, model)
    step = Step(model, images, labels, seed=2, num_classes=fields.get("num_classes", 0), drop=a.unconditional_prob,
                optim=optim, total=a.warmup + a.steps, context=context, context_mask=mask)
    times, loss, first = [], 0.0, 0.0
    prof = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup and a.profile:
            # the same window as `dew bench --one MODEL --profile`: the timed steps only
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        fwd, bwd, opt, loss = step.run()
        if not math.isfinite(loss):
            fail(f"non-finite loss {loss} at step {i}")
        if i == 0:
            first = time.perf_counter() - t0
        if i >= a.warmup:
            times.append((time.perf_counter() - t0, fwd, bwd, opt))
    if prof is not None:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(a.profile)
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    print(json.dumps(result(med, a.batch, n, loss, **compile_extra(a, first, med[0]))), flush=True)


if __name__ == "__main__":
    main()
