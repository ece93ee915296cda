#!/usr/bin/python3
"""Python eager peer of `dew bench --models dpo`: one DPO training step in plain PyTorch, as TRL takes it.

The model is bench/lm_peer.py's causal_transformer (dew's, written as a Llama-style decoder). The step is
TRL's DPOTrainer step with its defaults (loss_type "sigmoid", beta 0.1, no label smoothing, a reference
model): chosen and rejected rows concatenated into one [2B, L] batch (concatenated_forward), the reference
model (a frozen deepcopy of the starting policy) run on it under torch.no_grad, the policy run on it, each
row's log-probs of its shifted labels (log_softmax + gather) masked by the completion mask and summed, the
loss -logsigmoid(beta * ((chosen - ref chosen) - (rejected - ref rejected))) averaged over pairs and the
reward metrics (.item() of their means, as TRL logs them); then dew's trainer step around the loss
(bench/peer.py): loss.item() and its isfinite check, backward, clip_grad_norm_ to --optim's grad_clip, the
schedule's learning rate, torch.optim.AdamW (decay on matrices, as dew), zero_grad(set_to_none). The
reference never changes, so there is no EMA.

    /usr/bin/python3 bench/dpo_peer.py --config '{"vocab_size": 257, ...}' --params 886272 \
        --batch 32 --seq-len 48 --completion-len 10 --steps 20 --warmup 5 --threads 1 --optim '{"lr": 0.001}'

prints one JSON line with the keys of bench/peer.py plus tokens_per_s (policy tokens, 2 x batch x seq-len).
"""
import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_peer  # noqa: E402  (the causal_transformer)
import peer  # noqa: E402  (optimizer hyper-parameters, result line)

BETA = 0.1


def fail(msg):
    print(f"dpo_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def sequence_logps(logits, ids, mask):
    """Summed log p of the completion tokens: logits [N, L, V], ids [N, L], mask [N, L] bool -> [N]."""
    labels, loss_mask = ids[:, 1:], mask[:, 1:]
    per_token = logits[:, :-1].log_softmax(-1).gather(2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_mask).sum(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the causal_transformer fields as JSON (dew's names)")
    ap.add_argument("--batch", type=int, default=32, help="preference pairs per step")
    ap.add_argument("--seq-len", type=int, default=48, help="tokens per row (prompt + completion)")
    ap.add_argument("--completion-len", type=int, default=10, help="the last tokens of each row: the completion")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optim", default="{}", help="dew's OptimOptions as JSON (lr, schedule, warm-up, grad_clip, ...)")
    peer.add_compile_flag(ap)
    a = ap.parse_args()
    optim = peer.parse_optim(a.optim)
    if a.device != "cpu":
        fail("the DPO peer runs on the CPU only")
    if min(a.batch, a.steps, a.threads, a.completion_len) < 1 or a.warmup < 0 or a.seq_len <= a.completion_len:
        fail("--batch, --steps, --threads, --completion-len must be >= 1, --warmup >= 0, --seq-len > --completion-len")
    try:
        fields = json.loads(a.config)
    except ValueError as e:
        fail(f"bad --config: {e}")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    policy = lm_peer.build(fields, a.seq_len)
    policy.train()
    n = sum(p.numel() for p in policy.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"causal_transformer has {n} parameters here and {a.params} in C++: the two models differ")
    reference = copy.deepcopy(policy)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    params = list(policy.parameters())
    opt = peer.adamw(params, optim)
    total = a.warmup + a.steps

    # Fixed pairs (as the C++ side): random bytes, one prompt per pair, the last completion-len tokens differ.
    B, L, C = a.batch, a.seq_len, a.completion_len
    g = torch.Generator().manual_seed(1)
    chosen = torch.randint(0, 256, (B, L), generator=g)
    rejected = torch.cat([chosen[:, :L - C], torch.randint(0, 256, (B, C), generator=g)], 1)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[:, L - C:] = True
    ids, masks = torch.cat([chosen, rejected], 0), torch.cat([mask, mask], 0)  # [2B, L]: chosen rows first

    run_policy, run_reference = peer.compiled(a, policy, reference)
    times, loss, first = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            ref = sequence_logps(run_reference(ids), ids, masks)
        pol = sequence_logps(run_policy(ids), ids, masks)
        chosen_lr, rejected_lr = pol[:B] - ref[:B], pol[B:] - ref[B:]
        l = -F.logsigmoid(BETA * (chosen_lr - rejected_lr)).mean()
        chosen_rewards, rejected_rewards = BETA * chosen_lr.detach(), BETA * rejected_lr.detach()
        metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                   "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
                   "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
                   "logps/chosen": pol[:B].detach().mean().item(), "logps/rejected": pol[B:].detach().mean().item()}
        loss = l.item()
        if not math.isfinite(loss):
            fail(f"non-finite loss {loss} at step {i}")
        t1 = time.perf_counter()
        l.backward()
        peer.clip(params, optim)
        t2 = time.perf_counter()
        peer.set_lr(opt, optim, i, total)
        opt.step()
        t3 = time.perf_counter()
        if i == 0:
            first = t3 - t0
        if i >= a.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    if not math.isfinite(loss) or not all(math.isfinite(v) for v in metrics.values()):
        fail(f"non-finite loss {loss} or metrics {metrics}")
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    print(json.dumps(peer.result(med, B, n, loss, tokens_per_s=2 * B * L / (med[0] / 1e3),
                                 **peer.compile_extra(a, first, med[0]))), flush=True)


if __name__ == "__main__":
    main()
