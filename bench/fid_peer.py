#!/usr/bin/python3
"""Python peer of `dew bench --models fid`: pytorch-fid's own InceptionV3 as installed (pytorch-fid 0.3.0,
requirements.txt), timed on the pass FID runs per batch of images: InceptionV3([3]).forward = bilinear resize to
299 x 299 (align_corners=False), 2x - 1, the network to pool3 (2048-d), under torch.no_grad. Its pretrained weights
are not downloaded: `load_state_dict_from_url` is pointed at a random state dict of the model's own names and
shapes (speed does not depend on the values); nothing else is replaced. forward = the resize, backward = the
network, optimizer 0 in the result line (the C++ side's phases). --compile runs the network (its blocks, in
order) under torch.compile (bench/peer.py's compiled(); the resize stays eager, as it is one ATen call).

    .venv/bin/python bench/fid_peer.py --params 21785568 --batch 8 --image-size 64 --steps 20 --warmup 5 --threads 2

prints one JSON line with the keys of bench/peer.py.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peer  # noqa: E402  (the result line)


def build():
    import pytorch_fid.inception as pinc

    # The state dict's names and shapes: fid_inception_v3() once with loading switched off.
    orig = torch.nn.Module.load_state_dict
    torch.nn.Module.load_state_dict = lambda self, sd, *a, **k: None
    pinc.load_state_dict_from_url = lambda *a, **k: {}
    try:
        template = pinc.fid_inception_v3().state_dict()
    finally:
        torch.nn.Module.load_state_dict = orig
    g = torch.Generator().manual_seed(0)

    def value(k, v):
        # He-scaled convolutions and BatchNorms near identity keep the activations O(1) through the 94 layers
        # (all-positive weights grew them to 1e10: a checksum of 1e21).
        if not v.is_floating_point():
            return v
        if v.dim() == 4:
            return torch.randn(v.shape, generator=g) * (2.0 / v[0].numel()) ** 0.5
        if k.endswith("running_var") or k.endswith("bn.weight"):
            return 1 + 0.1 * torch.rand(v.shape, generator=g)
        return 0.1 * torch.randn(v.shape, generator=g)

    sd = {k: value(k, v).to(v.dtype) for k, v in template.items()}
    pinc.load_state_dict_from_url = lambda *a, **k: sd
    return pinc.InceptionV3([3]).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed passes")
    ap.add_argument("--warmup", type=int, default=5, help="untimed passes first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")
    peer.add_compile_flag(ap)
    a = ap.parse_args()
    if a.device != "cpu":
        peer.fail("the FID peer runs on the CPU only")
    if min(a.batch, a.steps, a.threads, a.image_size) < 1 or a.warmup < 0:
        peer.fail("--batch, --steps, --threads, --image-size must be >= 1, --warmup >= 0")
    torch.set_num_threads(a.threads)
    model = build()
    n = sum(p.numel() for p in model.parameters())
    if a.params >= 0 and n != a.params:
        peer.fail(f"pytorch-fid's InceptionV3 has {n} parameters here and {a.params} in C++: the two models differ")
    x = torch.rand(a.batch, 3, a.image_size, a.image_size, generator=torch.Generator().manual_seed(1))
    network = peer.compiled(a, torch.nn.Sequential(*model.blocks))  # InceptionV3.forward's loop over its blocks
    times, out, first = [], 0.0, 0.0
    with torch.no_grad():
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            # InceptionV3.forward, split at the resize to time its two phases like the C++ side
            r = 2 * F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False) - 1
            t1 = time.perf_counter()
            h = network(r)
            t2 = time.perf_counter()
            out = float(h.pow(2).mean())
            if i == 0:
                first = t2 - t0
            if i >= a.warmup:
                times.append((t2 - t0, t1 - t0, t2 - t1, 0.0))
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    print(__import__("json").dumps(peer.result(med, a.batch, n, out, **peer.compile_extra(a, first, med[0]))),
          flush=True)


if __name__ == "__main__":
    main()
