#!/usr/bin/python3
"""Python eager peer of `dew bench --models sample`: `dew sample RUN`'s sampling loop for the default recipe.

The loop a PyTorch user writes to sample the model `dew train diffusion` trains with no flags, with `dew sample`'s
defaults: bench/peer.py's Unet (dew's unet, layer for layer) built from the recipe's model fields, freshly
initialised, in eval mode under torch.no_grad(); the images in chunks of --chunk (dew's DiffusionSampleOptions
batch_size), labels 0, 1, ... cycling through the classes; per chunk the prior x ~ N(0, 1) (the flow schedule's
prior_std is 1), then on dew's grid linspace(1, 0, S) of the flow preset (alpha = 1 - t', sigma = t',
t' = shift t / (1 + (shift - 1) t); c_in = 1) S - 1 Euler steps and the final denoise, each one forward of the
doubled batch [x; x] with labels [y; null class] at model time 1000 t', classifier-free guidance
F = F_u + w (F_c - F_u), x0 = (x - sigma F) / (alpha + sigma), and dew's Euler step for any (alpha, sigma):
d = (x - c x0) / sigma_t, c = (alpha_t sigma_s - alpha_s sigma_t) / (sigma_s - sigma_t), x += d (sigma_s - sigma_t);
finally x0 clamped to [-1, 1].

    /usr/bin/python3 bench/sample_peer.py --config '{"feature_depths": [32, 64], ...}' --params 595937 \
        --preset '{"name": "flow", ...}' --shape '[1, 28, 28]' --solver euler --guidance 3 --chunk 64 \
        --images 100 --sample-steps 30 --steps 1 --warmup 0 --threads 2

prints one JSON line with the keys of bench/peer.py: ms_per_step = ms per sampling run (median of --steps runs
after --warmup untimed ones), samples_per_s = images/s, phases_ms.forward = the network's forwards alone on the
same doubled chunks, measured after the runs (the median of 3 per chunk, times --sample-steps); one forward per
chunk before the runs warms every chunk's shape up, as on the C++ side.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (the Unet, the result line)


def fail(msg):
    print(f"sample_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def flow_rates(t, shift):
    """(alpha, sigma) of dew's flow schedule at time t (a float)."""
    ts = shift * t / (1.0 + (shift - 1.0) * t)
    return 1.0 - ts, ts


@torch.no_grad()
def sample_chunk(model, labels, shape, steps, guidance, null_class, shift, gen):
    """One chunk of dew sample: the prior, steps - 1 Euler steps and the final denoise; returns x0 in [-1, 1]."""
    n = labels.shape[0]
    guided = guidance != 1.0
    x = torch.randn((n, *shape), generator=gen)
    y = torch.cat([labels, torch.full_like(labels, null_class)]) if guided else labels
    grid = torch.linspace(1.0, 0.0, steps, dtype=torch.float64).tolist()

    def denoise(x, t):
        alpha, sigma = flow_rates(t, shift)
        rows = 2 * n if guided else n
        tt = torch.full((rows,), 1000.0 * sigma, dtype=torch.float32)  # model time 1000 t'
        F = model(torch.cat([x, x]) if guided else x, tt, y)
        if guided:
            cond, uncond = F.chunk(2)
            F = uncond + guidance * (cond - uncond)
        return (x - sigma * F) / (alpha + sigma)

    for i in range(steps - 1):
        t, s = grid[i], grid[i + 1]
        at, st = flow_rates(t, shift)
        as_, ss = flow_rates(s, shift)
        x0 = denoise(x, t)
        if ss == st:
            x = as_ * x0 + ss * (x - at * x0) / st
            continue
        c = (at * ss - as_ * st) / (ss - st)
        x = x + (x - c * x0) / st * (ss - st)
    return denoise(x, grid[-1]).clamp(-1, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the unet's fields as JSON (dew's names)")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--preset", required=True, help="the run's preset as JSON (flow only)")
    ap.add_argument("--shape", required=True, help="one sample's [C, H, W] as JSON")
    ap.add_argument("--solver", default="euler", help="euler only")
    ap.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = unguided)")
    ap.add_argument("--chunk", type=int, default=64, help="images per chunk (dew's DiffusionSampleOptions batch_size)")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--sample-steps", type=int, default=30, help="grid points (steps - 1 Euler steps + final denoise)")
    ap.add_argument("--steps", type=int, default=1, help="timed sampling runs")
    ap.add_argument("--warmup", type=int, default=0, help="untimed sampling runs first (after the network-alone forwards)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.device != "cpu":
        fail("the sample peer runs on the CPU only")
    if a.solver != "euler":
        fail(f"solver {a.solver!r}: the peer implements euler only")
    if min(a.chunk, a.images, a.sample_steps, a.steps, a.threads) < 1 or a.warmup < 0:
        fail("--chunk, --images, --sample-steps, --steps and --threads must be >= 1, --warmup >= 0")
    try:
        fields, preset, shape = json.loads(a.config), json.loads(a.preset), json.loads(a.shape)
    except ValueError as e:
        fail(f"bad --config, --preset or --shape: {e}")
    if preset.get("name") != "flow" or preset.get("resolution_shift", False):
        fail(f"preset {preset}: the peer implements flow with a fixed shift only")
    shift = float(preset.get("shift", 1.0))

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = peer.build("unet", fields)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"unet has {n} parameters here and {a.params} in C++: the two models differ")
    num_classes = fields.get("num_classes", 0)
    guidance = a.guidance if num_classes > 0 else 1.0
    labels = torch.arange(a.images) % num_classes if num_classes > 0 else torch.zeros(a.images, dtype=torch.long)

    def net_forwards(reps):
        """The network alone on each chunk's doubled batch: the median of `reps` forwards, summed over chunks (ms)."""
        total, gen = 0.0, torch.Generator().manual_seed(3)
        with torch.no_grad():
            for b0 in range(0, a.images, a.chunk):
                y = labels[b0:b0 + a.chunk]
                if guidance != 1.0:
                    y = torch.cat([y, torch.full_like(y, num_classes)])
                x = torch.randn((y.shape[0], *shape), generator=gen)
                t = torch.full((y.shape[0],), 500.0)
                s = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    model(x, t, y)
                    s.append(time.perf_counter() - t0)
                total += statistics.median(s) * 1e3
        return total

    net_forwards(1)  # warms every chunk's shape up, as on the C++ side

    times, out = [], 0.0
    for r in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        x = torch.cat([sample_chunk(model, labels[b0:b0 + a.chunk], shape, a.sample_steps, guidance, num_classes,
                                    shift, torch.Generator().manual_seed(b0))
                       for b0 in range(0, a.images, a.chunk)])
        t1 = time.perf_counter()
        out = x.square().mean().item()
        if x.shape[0] != a.images:
            fail(f"{x.shape[0]} images, expected {a.images}")
        if r >= a.warmup:
            times.append(t1 - t0)
    if not math.isfinite(out):
        fail(f"non-finite samples (mean square {out})")

    net = net_forwards(3) * a.sample_steps
    ms = statistics.median(times) * 1e3
    print(json.dumps(peer.result([ms, net, 0.0, 0.0], a.images, n, out)), flush=True)


if __name__ == "__main__":
    main()
