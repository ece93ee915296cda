"""Post-training goldens from the real reference code: TRL's DPOTrainer and verl's core_algos, run under
Debian's python3-torch on small fixed inputs. Not run by CI; rerun by hand:

    /usr/bin/python3 tests/golden/post_training_reference.py

The sources are exported (git archive, to a temporary directory) at the pinned commits below (TRL main,
TRL v0.28.0 for the label-smoothed sigmoid loss that main no longer has, verl main) from git directories given by
DEW_TRL_GIT and DEW_VERL_GIT (a clone's .git or a bare mirror; defaults: the mirrors this project was set
up with). Only numeric code of those repositories runs: their heavy third-party imports (transformers,
accelerate, datasets, omegaconf, tensordict, ray, ...) are replaced by empty stub modules, which the
functions called here never touch. Nothing in this file restates a formula: every number written comes
out of the reference functions (DPOTrainer._compute_loss, DPOTrainer.get_batch_loss_metrics,
compute_grpo_outcome_advantage, compute_rloo_outcome_advantage, compute_policy_loss_vanilla, agg_loss,
kl_penalty) and torch.autograd.

Writes tests/golden/post_training/{dpo_sigmoid,dpo_label_smoothing,advantages,policy_loss,kl}.safetensors
(F64 values, I64 ids, masks and group ids; written without the safetensors package). See the README
there for what each file holds.
"""
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import types
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch

TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"        # main, 2026-07-24 (v1.9.0-26)
TRL_V028_COMMIT = "49ef33428c47235991acb4e185ea599b70c6dab4"   # tag v0.28.0: last release whose sigmoid loss
                                                                # takes label_smoothing (cDPO)
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"       # main, 2026-01-29

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "post_training")


# ---------------------------------------------------------------------------------------------------------
# Stub modules for the heavy imports. A stub module answers every attribute with _Stub, a class that can
# be subclassed, called (returns a falsy instance, or the function when used as a decorator), indexed,
# or-ed (type hints) and added to lists (class attributes of stubbed base classes).

class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, key):
        return cls

    def __add__(cls, other):
        return other

    def __radd__(cls, other):
        return other


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __init_subclass__(cls, **kwargs):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefixes):
        self.prefixes = prefixes

    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


STUBBED = [
    "transformers", "accelerate", "datasets", "peft", "liger_kernel", "deepspeed", "vllm", "wandb", "rich",
    "safetensors", "huggingface_hub", "tokenizers", "pyarrow", "pandas", "omegaconf", "tensordict", "ray",
    "flash_attn", "torch_npu", "codetiming", "hydra", "pydantic",
    # torch 1.13's FSDP does not import under Python 3.11 (a dataclass with a mutable default); only TRL's
    # model utilities import it, for FSDP wrapping this script never does.
    "torch.distributed.fsdp",
]
sys.meta_path.insert(0, _StubFinder(STUBBED))


def export(env, default, commit, tag):
    git_dir = os.environ.get(env, default)
    dest = tempfile.mkdtemp(prefix=f"dew_{tag}_")
    archive = subprocess.run(["git", "-C", git_dir, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def import_from(root, module):
    """Imports `module` from the source tree at `root`, dropping any earlier copy of its top package."""
    top = module.split(".")[0]
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(root)


class Strict:
    """Mixin for a reference trainer made without __init__: attributes this script did not set raise instead
    of falling through to the stubbed transformers.Trainer base."""

    def __getattr__(self, name):
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (set it in the probe)")


def probe(cls, **attrs):
    p = type("Probe" + cls.__name__, (Strict, cls), {})
    obj = object.__new__(p)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


class FakeAccelerator:
    """Single process: gathers are identities; gather() records what it is given (TRL passes the per-pair
    rewards through it)."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.gathered = []

    def gather_for_metrics(self, x):
        return x

    def gather(self, x):
        self.gathered.append(x)
        return x


class FakeLM:
    """A causal LM whose forward returns fixed logits for the ids it is expected to see."""

    def __init__(self, logits, expected_ids):
        self.logits = logits
        self.expected_ids = expected_ids
        self.training = True
        self.is_gradient_checkpointing = False
        self.calls = 0

    def __call__(self, input_ids, **kwargs):
        assert torch.equal(input_ids, self.expected_ids), "the reference fed the model other ids than planned"
        self.calls += 1
        return SimpleNamespace(logits=self.logits)


# ---------------------------------------------------------------------------------------------------------
# safetensors writer (the format is: u64 LE header length, JSON header, raw little-endian data).

def save(name, tensors, metadata):
    header, blobs, offset = {}, [], 0
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        t = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
        dtype = "F64" if t.dtype == torch.float64 else "I64"
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
        header[key] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(OUT, name + ".safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print(f"wrote {path}: {', '.join(sorted(tensors))}")


def scalar(x):
    return torch.tensor(float(x), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# DPO, TRL main: DPOTrainer._compute_loss on a concatenated batch [chosen rows; rejected rows].

def pair_masks():
    """Completion masks and attention masks [B=4, 2, S=7]: a prompt, then the chosen (k = 0) and rejected
    (k = 1) completions, right padded. Pair 0's chosen row is full; pair 2's chosen completion has a second
    user turn inside it (a multi-turn mask with a hole)."""
    mask = torch.tensor([[[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]],
                         [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1]],
                         [[0, 1, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0]],
                         [[0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]]], dtype=torch.int64)
    attn = torch.tensor([[[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]],
                         [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]],
                         [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]],
                         [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]], dtype=torch.int64)
    return mask, attn


def dpo_trl_main(trl_root):
    d = import_from(trl_root, "trl.trainer.dpo_trainer")
    gen = torch.Generator().manual_seed(16)
    B, S, V, beta = 4, 7, 11, 0.1
    ids = torch.randint(0, V, (B, 2, S), generator=gen)
    mask, attn = pair_masks()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))   # pad id 0 after each row
    for b, p in enumerate([2, 3, 1, 4]):                          # a pair shares its prompt
        ids[b, 1, :p] = ids[b, 0, :p]
    policy0 = 2.0 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)
    reference0 = policy0 + 0.7 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)

    def run(dtype):
        policy = policy0.clone().to(dtype).requires_grad_(True)
        reference = reference0.to(dtype)
        flat = lambda x: torch.cat([x[:, 0], x[:, 1]], dim=0)   # [B, 2, ...] -> TRL's [2B, ...]
        acc = FakeAccelerator()
        model = FakeLM(flat(policy), flat(ids))
        ref_model = FakeLM(flat(reference), flat(ids))
        trainer = probe(d.DPOTrainer, accelerator=acc, model=model, ref_model=ref_model,
                        args=SimpleNamespace(gradient_checkpointing_kwargs=None), aux_loss_enabled=False,
                        ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                        loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                        _total_train_tokens=0)
        inputs = {"input_ids": flat(ids), "attention_mask": flat(attn), "completion_mask": flat(mask)}
        loss = d.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
        loss.backward()
        assert model.calls == 1 and ref_model.calls == 1
        chosen_rewards, rejected_rewards = acc.gathered[0], acc.gathered[1]
        chosen_logps, rejected_logps = acc.gathered[4], acc.gathered[5]
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        return loss, policy.grad, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, metrics

    loss, grad, cr, rr, cl, rl, metrics = run(torch.float64)
    loss32, grad32, *_ = run(torch.float32)
    out = {"policy_logits": policy0, "reference_logits": reference0, "ids": ids, "completion_mask": mask,
           "beta": scalar(beta), "label_smoothing": scalar(0.0), "loss": loss, "grad_policy_logits": grad,
           "chosen_rewards": cr, "rejected_rewards": rr, "chosen_logps": cl, "rejected_logps": rl,
           "loss_f32": loss32.to(torch.float64), "grad_policy_logits_f32": grad32.to(torch.float64)}
    for name in ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"]:
        out["metric." + name.replace("/", ".")] = scalar(metrics[name])
    print(f"dpo (TRL main): loss {loss.item():.17g}, accuracies {metrics['rewards/accuracies']}")
    save("dpo_sigmoid", out, {"reference": f"huggingface/trl@{TRL_COMMIT}",
                              "function": "trl/trainer/dpo_trainer.py DPOTrainer._compute_loss, loss_type sigmoid"})


# ---------------------------------------------------------------------------------------------------------
# DPO with label smoothing (cDPO), TRL v0.28.0: DPOTrainer.get_batch_loss_metrics (concatenated_forward
# from prompt / chosen / rejected ids, then dpo_loss).

def dpo_trl_v028(trl_root):
    d = import_from(trl_root, "trl.trainer.dpo_trainer")
    gen = torch.Generator().manual_seed(28)
    B, P, C, V, beta, ls, pad = 3, 2, 4, 11, 0.5, 0.1, 0
    S = P + C
    prompt = torch.randint(1, V, (B, P), generator=gen)
    lens = torch.tensor([[4, 2], [3, 4], [1, 3]])                # completion lengths (chosen, rejected)
    comp = torch.randint(1, V, (B, 2, C), generator=gen)
    comp_mask = (torch.arange(C).view(1, 1, C) < lens.unsqueeze(-1)).to(torch.int64)
    comp = torch.where(comp_mask.bool(), comp, torch.full_like(comp, pad))
    ids = torch.cat([prompt.unsqueeze(1).expand(B, 2, P), comp], dim=-1)             # [B, 2, S]
    mask = torch.cat([torch.zeros(B, 2, P, dtype=torch.int64), comp_mask], dim=-1)   # completion mask
    policy0 = 2.0 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)
    reference0 = policy0 + 0.7 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)

    policy = policy0.clone().requires_grad_(True)
    flat = lambda x: torch.cat([x[:, 0], x[:, 1]], dim=0)
    acc = FakeAccelerator()
    model = FakeLM(flat(policy), flat(ids))
    ref_model = FakeLM(flat(reference0), flat(ids))
    trainer = probe(d.DPOTrainer, accelerator=acc, model=model, ref_model=ref_model, pad_token_id=pad,
                    args=SimpleNamespace(use_liger_kernel=False, rpo_alpha=None, ld_alpha=None),
                    aux_loss_enabled=False, is_encoder_decoder=False, max_length=None, truncation_mode="keep_end",
                    use_logits_to_keep=False, padding_free=False, use_weighting=False, loss_type=["sigmoid"],
                    loss_weights=None, reference_free=False, f_divergence_type=d.FDivergenceType.REVERSE_KL,
                    f_divergence_params=None, beta=beta, label_smoothing=ls, _peft_has_been_casted_to_bf16=False)
    batch = {"prompt_input_ids": prompt, "prompt_attention_mask": torch.ones(B, P, dtype=torch.int64),
             "chosen_input_ids": comp[:, 0], "chosen_attention_mask": comp_mask[:, 0],
             "rejected_input_ids": comp[:, 1], "rejected_attention_mask": comp_mask[:, 1]}
    loss, metrics = d.DPOTrainer.get_batch_loss_metrics(trainer, model, batch, "train")
    loss.backward()
    assert model.calls == 1 and ref_model.calls == 1
    out = {"policy_logits": policy0, "reference_logits": reference0, "ids": ids, "completion_mask": mask,
           "beta": scalar(beta), "label_smoothing": scalar(ls), "loss": loss, "grad_policy_logits": policy.grad}
    for name in ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"]:
        out["metric." + name.replace("/", ".")] = scalar(metrics[name])
    print(f"dpo (TRL v0.28.0, label smoothing {ls}): loss {loss.item():.17g}")
    save("dpo_label_smoothing", out, {
        "reference": f"huggingface/trl@{TRL_V028_COMMIT} (v0.28.0)",
        "function": "trl/trainer/dpo_trainer.py DPOTrainer.get_batch_loss_metrics (concatenated_forward, "
                    "dpo_loss), loss_type sigmoid with label_smoothing"})


# ---------------------------------------------------------------------------------------------------------
# verl: outcome advantages, the PPO-clip policy loss, agg_loss and the k3 KL.

def advantages(ca):
    # 12 completions: group 0 and 1 with 4 each (interleaved), group 2 a single completion, group 3 three
    # completions with equal scores (std 0).
    index = np.array([10, 11, 10, 11, 12, 10, 11, 10, 11, 13, 13, 13])
    scores = torch.tensor([1.0, 0.0, 0.25, 1.0, 0.7, -0.5, 1.0, 2.0, 0.5, 0.3, 0.3, 0.3], dtype=torch.float64)
    N, T = len(index), 5
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3, 2, 1, 4, 5])
    mask = (torch.arange(T).view(1, T) < lengths.view(N, 1)).to(torch.int64)
    rewards = torch.zeros(N, T, dtype=torch.float64)
    rewards[torch.arange(N), lengths - 1] = scores                    # the outcome reward on the last token
    out = {"scores": scores, "group_ids": torch.from_numpy(index).to(torch.int64), "response_mask": mask,
           "token_level_rewards": rewards}
    out["grpo"], _ = ca.compute_grpo_outcome_advantage(rewards.clone(), mask, index, epsilon=1e-6,
                                                       norm_adv_by_std_in_grpo=True)
    out["grpo_no_std"], _ = ca.compute_grpo_outcome_advantage(rewards.clone(), mask, index, epsilon=1e-6,
                                                              norm_adv_by_std_in_grpo=False)
    out["rloo"], _ = ca.compute_rloo_outcome_advantage(rewards.clone(), mask, index, epsilon=1e-6)
    out["grpo_f32"], _ = ca.compute_grpo_outcome_advantage(rewards.float(), mask, index, epsilon=1e-6,
                                                           norm_adv_by_std_in_grpo=True)
    save("advantages", out, {"reference": f"volcengine/verl@{VERL_COMMIT}",
                             "function": "verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage "
                                         "(epsilon 1e-6), compute_rloo_outcome_advantage"})


class ActorConfigProbe(SimpleNamespace):
    """What compute_policy_loss_vanilla reads of an ActorConfig."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def branches(log_ratio, adv, mask):
    """Checks that the inputs cover every case of the clipped objective (a coverage check, not a golden)."""
    r, m = log_ratio.exp(), mask.bool()
    for lo, hi in [(0.2, 0.28), (0.2, 0.2)]:
        cases = {"A>0, r>1+eps_high (clipped)": (adv > 0) & (r > 1 + hi),
                 "A>0, r<1-eps_low (unclipped)": (adv > 0) & (r < 1 - lo),
                 "A<0, r<1-eps_low (clipped)": (adv < 0) & (r < 1 - lo),
                 "A<0, 1+eps_high<r<3 (unclipped)": (adv < 0) & (r > 1 + hi) & (r < 3),
                 "A<0, r>3 (dual clip)": (adv < 0) & (r > 3),
                 "inside the band": (r > 1 - lo) & (r < 1 + hi) & (adv != 0),
                 "A=0": adv == 0,
                 "log-ratio beyond +-20": log_ratio.abs() > 20}
        for name, hit in cases.items():
            assert (hit & m).any(), f"no masked-in token for {name} at eps {lo}/{hi}"
    assert ((adv > 0) & (r > 1.2) & (r < 1.28) & m).any(), "no token clipped at eps_high 0.2 but not at 0.28"


def policy_inputs():
    # Rows of (log-ratio log pi - log pi_old, advantage), chosen to hit every branch with eps_low 0.2 and
    # eps_high 0.28 (and 0.2): A > 0 with the ratio above 1 + eps_high (clipped) and below 1 - eps_low
    # (unclipped); A < 0 with the ratio below 1 - eps_low (clipped), between 1 + eps_high and 3 (unclipped),
    # above 3 (dual clip) and with the log-ratio beyond +-20 (clamped); ratios inside the band; A = 0.
    # Entries outside the mask carry extreme values that must not count. Row 3 is fully masked.
    log_ratio = torch.tensor([
        [0.35, -0.40, 0.05, -0.10, 1.50, 0.00],
        [-0.35, 0.30, 1.25, 25.0, 0.15, 30.0],
        [-22.0, 0.60, -0.05, 0.25, -0.30, 0.10],
        [9.0, -9.0, 0.5, 0.5, 0.5, 0.5],
        [0.20, 2.00, -0.60, 0.22, 0.27, 0.00],
    ], dtype=torch.float64)
    adv = torch.tensor([
        [1.3, 0.8, -0.4, 0.9, 2.0, 0.0],
        [-1.1, -0.7, -0.9, -0.5, 0.6, 4.0],
        [0.7, 0.0, -1.6, 1.2, -0.3, 0.2],
        [1.0, -1.0, 1.0, -1.0, 1.0, -1.0],
        [-0.8, -1.4, 0.5, 0.6, 1.1, 0.9],
    ], dtype=torch.float64)
    mask = torch.tensor([
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ], dtype=torch.int64)
    branches(log_ratio, adv, mask)
    gen = torch.Generator().manual_seed(5)
    old = -2.5 * torch.rand(log_ratio.shape, generator=gen, dtype=torch.float64) - 0.05
    return old, old + log_ratio, adv, mask


def policy_loss(ca):
    old, logp0, adv, mask = policy_inputs()
    out = {"old_log_prob": old, "log_prob": logp0, "advantages": adv, "response_mask": mask}
    cases = [("token_mean", "token-mean", 0.2, 0.28), ("seq_mean_token_mean", "seq-mean-token-mean", 0.2, 0.28),
             ("token_mean_sym", "token-mean", 0.2, 0.2)]
    for tag, mode, lo, hi in cases:
        config = ActorConfigProbe(clip_ratio=0.2, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=3.0,
                                  global_batch_info={})
        for dtype, suffix in [(torch.float64, ""), (torch.float32, "_f32")]:
            logp = logp0.clone().to(dtype).requires_grad_(True)
            loss, m = ca.compute_policy_loss_vanilla(old.to(dtype), logp, adv.to(dtype), mask, loss_agg_mode=mode,
                                                     config=config)
            loss.backward()
            out[f"{tag}.loss{suffix}"] = loss.detach().to(torch.float64)
            out[f"{tag}.grad_log_prob{suffix}"] = logp.grad.to(torch.float64)
            if dtype == torch.float64:
                out[f"{tag}.clipfrac"] = scalar(m["actor/pg_clipfrac"])
                out[f"{tag}.clipfrac_lower"] = scalar(m["actor/pg_clipfrac_lower"])
                out[f"{tag}.ppo_kl"] = scalar(m["actor/ppo_kl"])
                out[f"{tag}.eps_low"], out[f"{tag}.eps_high"] = scalar(lo), scalar(hi)
                print(f"policy loss {tag}: {loss.item():.17g}, clipfrac {m['actor/pg_clipfrac']}, "
                      f"lower {m['actor/pg_clipfrac_lower']}, ppo_kl {m['actor/ppo_kl']}")
    save("policy_loss", out, {"reference": f"volcengine/verl@{VERL_COMMIT}",
                              "function": "verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla "
                                          "(clip_ratio_c 3.0), agg_loss"})


def kl(ca):
    # d = ref - log pi: small and moderate values, values where k3 > 10 (clamped to 10) and d beyond +-20.
    # The last row is outside the mask (a sequence without tokens for the agg_loss modes).
    d = torch.tensor([
        [0.0, 0.1, -0.3, 0.8, -1.2, 2.0],
        [2.6, -3.0, 25.0, -24.0, 0.45, -0.05],
        [1.7, -2.2, 0.02, 3.5, -0.9, 0.3],
        [0.4, -0.6, 5.0, 0.2, -0.1, 0.0],
    ], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    logp0 = -3.0 * torch.rand(d.shape, generator=gen, dtype=torch.float64)
    ref0 = logp0 + d
    weight = torch.randn(d.shape, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
                        dtype=torch.int64)
    logp, ref = logp0.clone().requires_grad_(True), ref0.clone().requires_grad_(True)
    k3 = ca.kl_penalty(logp, ref, "low_var_kl")
    (k3 * weight).sum().backward()
    out = {"log_prob": logp0, "ref_log_prob": ref0, "weight": weight, "response_mask": mask, "k3": k3.detach(),
           "grad_log_prob": logp.grad, "grad_ref_log_prob": ref.grad}
    for tag, mode in [("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean"),
                      ("seq_mean_token_sum", "seq-mean-token-sum")]:
        logp = logp0.clone().requires_grad_(True)
        kl_loss = ca.agg_loss(loss_mat=ca.kl_penalty(logp, ref0, "low_var_kl"), loss_mask=mask, loss_agg_mode=mode)
        kl_loss.backward()
        out[f"kl_loss.{tag}"] = kl_loss.detach()
        out[f"kl_loss.{tag}.grad_log_prob"] = logp.grad
    save("kl", out, {"reference": f"volcengine/verl@{VERL_COMMIT}",
                     "function": "verl/trainer/ppo/core_algos.py kl_penalty(low_var_kl), agg_loss"})


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    trees = []
    try:
        trees.append(export("DEW_TRL_GIT", "/work/.mirror/huggingface+trl/repo", TRL_COMMIT, "trl"))
        dpo_trl_main(trees[-1])
        trees.append(export("DEW_TRL_GIT", "/work/.mirror/huggingface+trl/repo", TRL_V028_COMMIT, "trl028"))
        dpo_trl_v028(trees[-1])
        trees.append(export("DEW_VERL_GIT", "/work/.mirror/volcengine+verl/repo", VERL_COMMIT, "verl"))
        ca = import_from(trees[-1], "verl.trainer.ppo.core_algos")
        advantages(ca)
        policy_loss(ca)
        kl(ca)
    finally:
        for tree in trees:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main()
