#!/usr/bin/python3
"""Python peer of `dew bench --models ddp`: train_peer.py's run as one process, or one rank of PyTorch DDP.

Run plainly, it is bench/train_peer.py's loop (the same unet, flow loss, label drop, clip, schedule, AdamW and
EMA around a torch.utils.data.DataLoader over the images dew dumped). Under torchrun (WORLD_SIZE set), each
rank joins the Gloo process group (env://), wraps the model in DistributedDataParallel with its defaults
(rank 0's weights broadcast, 25 MB buckets whose all-reduce overlaps backward), reads its rows through a
DistributedSampler (batch / WORLD_SIZE rows per rank, so the global batch is --batch) and, as dew's trainer
does, all-reduces the loss and its finite flag every step.

    /usr/bin/python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29511 bench/ddp_peer.py \
        --config '{"feature_depths": [32, 64], ...}' --params 595937 --data /tmp/x/train_data.safetensors \
        --recipe '{...run.json...}' --batch 32 --steps 20 --warmup 5 --threads 1

Rank 0 prints one JSON line with the keys of bench/train_peer.py plus ranks, allreduce_ms (per step, the time
the gradient buckets' all-reduces were in flight, timed by a comm hook around DDP's default all-reduce, the
buckets' intervals merged), allreduce_share (that over the step's time) and allreduce_exposed_ms (from the last
bucket's launch, when backward has no gradient left to compute, to the end of backward: the all-reduce time
backward did not hide). Seconds are averaged over the ranks; samples/s counts the global batch.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (clip, the schedule, the result line)
import train_peer  # noqa: E402  (the arguments, the run, the flow step)


def fail(msg):
    print(f"ddp_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


class CommTimes:
    """A DDP comm hook: DDP's default all-reduce of each bucket (sum / world size), with the time from the
    bucket's launch to its completion recorded."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.intervals, self.last_launch = [], None

    def hook(self, state, bucket):
        t0 = time.perf_counter()
        self.last_launch = t0
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f):
            self.intervals.append((t0, time.perf_counter()))
            return f.value()

        return fut.then(done)

    def in_flight(self):
        """Seconds with at least one bucket's all-reduce in flight (the intervals merged)."""
        total, end = 0.0, None
        for a, b in sorted(self.intervals):
            if end is None or a > end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
        return total


class DdpStep(train_peer.FlowStep):
    """train_peer.FlowStep's step (peer.TrainStep's order) with, on several ranks, dew's agreement: the loss and
    the finite flag summed over the ranks before backward. run() also returns when backward ended."""

    world = 1

    def run(self, images, labels):
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        ts = time.perf_counter()
        loss = self.loss(images, labels)
        value = loss.item()
        finite = math.isfinite(value)
        if self.world > 1:
            v = torch.tensor([0.0 if finite else 1.0, value / self.world if finite else 0.0], dtype=torch.float64)
            dist.all_reduce(v)
            finite, value = v[0].item() == 0, v[1].item()
        t1 = time.perf_counter()
        if not finite:
            fail(f"non-finite loss {value} at step {self.step}")
        loss.backward()  # DDP: returns once every bucket's all-reduce has completed
        tb = time.perf_counter()
        peer.clip(self.params, self.optim)
        t2 = time.perf_counter()
        peer.set_lr(self.opt, self.optim, self.step, self.total)
        self.opt.step()
        with torch.no_grad():
            d = min(self.ema_decay, (1 + self.step) / (10 + self.step))
            for e, p in zip(self.ema, self.params):
                e.mul_(d).add_(p, alpha=1 - d)
        t3 = time.perf_counter()
        self.step += 1
        return t1 - ts, t2 - t1, t3 - t2 + ts - t0, value, tb


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    train_peer.add_args(ap)
    a = ap.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world < 1 or not 0 <= rank < world:
        fail(f"RANK={rank} WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    if a.batch % world:
        fail(f"--batch {a.batch}: the global batch must divide into WORLD_SIZE={world} equal shares")
    if world > 1:
        dist.init_process_group("gloo")  # env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    run = train_peer.Run(a)
    model, comm = run.model, CommTimes()
    seed = run.recipe.get("seed", 0)
    drop_last = run.loader.get("drop_last", False)
    sampler = None
    if world > 1:
        model = DistributedDataParallel(model)
        model.register_comm_hook(None, comm.hook)
        sampler = DistributedSampler(run.dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                     drop_last=drop_last)
        loader = DataLoader(run.dataset, batch_size=a.batch // world, sampler=sampler, num_workers=0,
                            drop_last=drop_last)
    else:
        loader = DataLoader(run.dataset, batch_size=a.batch, shuffle=True, num_workers=0, drop_last=drop_last,
                            generator=torch.Generator().manual_seed(seed))
    epoch, batches = 0, iter(loader)

    def next_batch():
        nonlocal epoch, batches
        try:
            return next(batches)
        except StopIteration:  # the next epoch
            epoch += 1
            if sampler is not None:
                sampler.set_epoch(epoch)
            batches = iter(loader)
            return next(batches)

    step = run.step(model, DdpStep)
    step.world = world
    times, data, seconds, samples, loss = [], [], 0.0, 0, 0.0
    allreduce, exposed = 0.0, 0.0
    for i in range(a.warmup + a.steps):
        comm.reset()
        t0 = time.perf_counter()
        images, labels = next_batch()
        t1 = time.perf_counter()
        fwd, bwd, opt, loss, tb = step.run(images, labels)
        t2 = time.perf_counter()
        if i >= a.warmup:
            seconds += t2 - t0
            samples += images.shape[0] * world  # every rank reads as many rows (the sampler pads)
            times.append((t2 - t0, fwd, bwd, opt))
            data.append(t1 - t0)
            allreduce += comm.in_flight()
            exposed += max(0.0, tb - comm.last_launch) if comm.last_launch is not None else 0.0
    if world > 1:
        v = torch.tensor([seconds, allreduce, exposed], dtype=torch.float64)
        dist.all_reduce(v)
        seconds, allreduce, exposed = (x / world for x in v.tolist())
        dist.destroy_process_group()
    if rank != 0:
        return
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    out = peer.result(med, a.batch, run.n, loss, data_ms=statistics.median(data) * 1e3)
    out["ms_per_step"] = seconds / a.steps * 1e3
    out["samples_per_s"] = samples / seconds
    out["ranks"] = world
    out["allreduce_ms"] = allreduce / a.steps * 1e3
    out["allreduce_share"] = allreduce / seconds
    out["allreduce_exposed_ms"] = exposed / a.steps * 1e3
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
