#!/usr/bin/python3
"""Python eager peer of `dew bench --models train`: `dew train diffusion`'s default recipe, the whole loop.

The loop a PyTorch user writes for the recipe dew trains with no flags: bench/peer.py's Unet (dew's unet,
layer for layer) built from the recipe's model fields; a torch.utils.data.DataLoader (num_workers 0, shuffle,
the recipe's batch size, drop_last false, no augmentation, as the recipe) over a TensorDataset of the same
uint8 Fashion-MNIST training images and labels (read from --data, the safetensors file dew wrote, so no
download); per step the flow-matching loss of dew's `flow` preset (t = sigmoid(m + s n), x_t = (1 - t) x0 +
t eps with x0 = image / 127.5 - 1, the model at time 1000 t, target eps - x0, loss 0.5 mean((F - target)^2)),
labels dropped to the null class with the objective's unconditional_prob, then dew's trainer step
(bench/peer.py TrainStep: loss.item() and isfinite, backward, clip_grad_norm_, the recipe's learning-rate
schedule over trainer.steps, AdamW, the fp32 EMA of objective.ema_decay).

    /usr/bin/python3 bench/train_peer.py --config '{"feature_depths": [32, 64], ...}' --params 595937 \
        --data /tmp/x/train_data.safetensors --recipe '{...run.json...}' --batch 32 --steps 20 --warmup 5 --threads 2

prints one JSON line with the keys of bench/peer.py plus data_ms (median wait for the next batch);
samples_per_s = items / seconds of the timed steps, ms_per_step their mean.
"""
import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (the Unet, dew's trainer step, the result line)


def fail(msg):
    print(f"train_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


DTYPES = {"U8": torch.uint8, "I64": torch.int64, "F32": torch.float32}


def read_safetensors(path):
    """The tensors of a safetensors file (8-byte little-endian header length, JSON header, raw data)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            fail(f"{path}: {name} has dtype {info['dtype']}; read here: {', '.join(DTYPES)}")
        a, b = info["data_offsets"]
        buf = bytearray(data[8 + n + a:8 + n + b])
        out[name] = torch.frombuffer(buf, dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


class FlowStep(peer.TrainStep):
    """One step of dew's DiffusionObjective with the flow preset, then TrainStep's check, backward, clip,
    schedule, AdamW and EMA."""

    def __init__(self, model, flow, num_classes, drop, gen, optim, total, ema_decay):
        super().__init__(model, optim, total, ema_decay)
        self.flow, self.num_classes, self.drop, self.gen = flow, num_classes, drop, gen

    def loss(self, images, labels):
        x0 = images.float() / 127.5 - 1
        B = x0.shape[0]
        t = torch.sigmoid(self.flow["m"] + self.flow["s"] * torch.randn(B, dtype=torch.float64, generator=self.gen))
        eps = torch.randn(x0.shape, generator=self.gen)
        tt = t.float().view(B, 1, 1, 1)
        x_t = (1 - tt) * x0 + tt * eps
        if self.num_classes > 0:
            dropped = torch.rand(B, generator=self.gen) < self.drop
            labels = torch.where(dropped, torch.full_like(labels, self.num_classes), labels)
        F_x = self.model(x_t, (1000.0 * t).float(), labels)
        return (0.5 * ((F_x - (eps - x0)) ** 2).flatten(1).mean(1)).mean()


def add_args(ap):
    """The command line of this peer (bench/ddp_peer.py takes the same)."""
    ap.add_argument("--config", required=True, help="the unet's fields as JSON (dew's names)")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--data", required=True, help="safetensors file with image uint8 [N,C,H,W] and label int64 [N]")
    ap.add_argument("--recipe", required=True, help="the run's record as JSON (loader, optim, trainer, preset, "
                                                    "objective, seed)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")


class Run:
    """What the arguments describe, checked: the recipe's parts, the model (built with torch.manual_seed(0)),
    its parameter count n and the dataset."""

    def __init__(self, a):
        if a.device != "cpu":
            fail("the train peer runs on the CPU only")
        if min(a.batch, a.steps, a.threads) < 1 or a.warmup < 0:
            fail("--batch, --steps and --threads must be >= 1, --warmup >= 0")
        try:
            self.fields, self.recipe = json.loads(a.config), json.loads(a.recipe)
        except ValueError as e:
            fail(f"bad --config or --recipe: {e}")
        recipe = self.recipe
        if recipe["model"]["architecture"] != "unet":
            fail(f"model {recipe['model']['architecture']!r}: the peer implements the recipe's unet only")
        preset = recipe["preset"]
        flow = {"density": "logit_normal", "m": 0.0, "s": 1.0, "shift": 1.0, "resolution_shift": False}
        flow.update({k: preset[k] for k in flow if k in preset})
        if preset["name"] != "flow" or flow["density"] != "logit_normal" or flow["shift"] != 1.0 \
                or flow["resolution_shift"] or preset.get("min_snr_gamma") is not None:
            fail(f"preset {preset}: the peer implements flow with logit_normal density, shift 1, no min-SNR only")
        self.flow = flow
        self.loader = lo = recipe["loader"]
        if lo.get("hflip") or lo.get("crop_padding", 0) or not lo.get("shuffle", True):
            fail(f"loader {lo}: the peer implements the default recipe's loader (shuffle, no augmentation) only")
        self.objective = recipe["objective"]

        torch.set_num_threads(a.threads)
        torch.manual_seed(0)
        self.model = peer.build("unet", self.fields)
        self.model.train()
        self.n = sum(p.numel() for p in self.model.parameters())
        if a.params >= 0 and self.n != a.params:
            fail(f"unet has {self.n} parameters here and {a.params} in C++: the two models differ")
        tensors = read_safetensors(a.data)
        self.dataset = TensorDataset(tensors["image"], tensors["label"])

    def step(self, model, cls=None):
        """The training step (FlowStep, or `cls`) of `model`: the loss, the objective's settings, the recipe's
        optimizer and schedule."""
        obj = self.objective
        return (cls or FlowStep)(model, self.flow, self.fields.get("num_classes", 0),
                                 obj.get("unconditional_prob", 0.12), torch.Generator().manual_seed(2),
                                 peer.parse_optim(json.dumps(self.recipe["optim"])), self.recipe["trainer"]["steps"],
                                 obj.get("ema_decay", 0.999))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap)
    peer.add_compile_flag(ap)
    a = ap.parse_args()
    run = Run(a)
    loader = DataLoader(run.dataset, batch_size=a.batch, shuffle=True, num_workers=0,
                        drop_last=run.loader.get("drop_last", False),
                        generator=torch.Generator().manual_seed(run.recipe.get("seed", 0)))
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:  # the next epoch, as dew's loader crosses into it
            batches = iter(loader)
            return next(batches)

    model, n = run.model, run.n
    step = run.step(peer.compiled(a, model))
    times, data, seconds, samples, loss, first = [], [], 0.0, 0, 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        images, labels = next_batch()
        t1 = time.perf_counter()
        fwd, bwd, opt, loss = step.run(images, labels)
        t2 = time.perf_counter()
        if not math.isfinite(loss):
            fail(f"non-finite loss {loss} at step {i}")
        if i == 0:
            first = t2 - t0
        if i >= a.warmup:
            seconds += t2 - t0
            samples += images.shape[0]
            times.append((t2 - t0, fwd, bwd, opt))
            data.append(t1 - t0)
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    out = peer.result(med, a.batch, n, loss, data_ms=statistics.median(data) * 1e3,
                      **peer.compile_extra(a, first, med[0]))
    out["ms_per_step"] = seconds / a.steps * 1e3
    out["samples_per_s"] = samples / seconds
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
