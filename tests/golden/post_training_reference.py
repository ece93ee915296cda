"""Post-training goldens from the real reference code: TRL's DPOTrainer (the installed trl, requirements.txt) and
verl's core_algos, on small fixed inputs. Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/post_training_reference.py

TRL: the installed package (trl 1.16.0 with transformers 5.25.0, torch 2.13.0; asserted), nothing stubbed. Its
DPOTrainer._compute_loss scores the completions through the fused LM head that trl.trainer.utils.add_fused_lm_head
patches onto the model (DPOTrainer.__init__ does the same). The model here is a small torch module whose backbone
returns the fixed "logits" as its last hidden state and whose LM head is the identity (V x V, float): the fused
head's projection then reproduces the logits exactly, so TRL's own chunked log-softmax, gather, DPO loss, metrics
and autograd produce every number written.

verl is not a pip package: its core_algos come from a checkout (git archive of DEW_VERL_GIT, a clone's .git or a
bare mirror; default /work/.mirror/volcengine+verl/repo, `fetch` brings it) at the pinned commit below, imported
with the installed packages. verl's own dependencies that the pinned environment does not carry (omegaconf,
tensordict, ray, codetiming, hydra, ... ; listed in VERL_ONLY_DEPS and stubbed only when absent) and
transformers (installed, but verl at that commit needs transformers < 5 at import; VERL_INCOMPATIBLE) are replaced
by empty modules only while verl is imported, which the functions called here (compute_grpo_outcome_advantage,
compute_rloo_outcome_advantage, compute_policy_loss_vanilla, agg_loss, kl_penalty) never touch. This is the one
place left where a golden script stubs anything: verl is not in the pinned stack and its import graph pulls in
its distributed-training dependencies.

Nothing in this file restates a formula: every number written comes out of the reference functions and
torch.autograd.

Writes tests/golden/post_training/{dpo_sigmoid,advantages,policy_loss,kl}.safetensors (F64 values, I64 ids,
masks and group ids; written by the safetensors package). dpo_label_smoothing.safetensors is kept as committed:
it comes from TRL v0.28.0's sigmoid loss with label_smoothing (conservative DPO), which later TRL releases no
longer have (label_smoothing now feeds only the robust / exo_pair losses), and v0.28.0 does not import with
transformers 5; its generator is this script as of commit 9f8ba45 (git history). See the README there for what
each file holds.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch
import transformers
import trl
from trl.trainer import dpo_trainer as trl_dpo
from trl.trainer import utils as trl_utils
from trl.trainer.utils import add_fused_lm_head

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_io import VERSION as ST_VERSION, write_st  # noqa: E402

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"       # main, 2026-01-29
PINNED = {"trl": "1.16.0", "transformers": "5.25.0", "torch": "2.13.0"}
VERSIONS = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "numpy": np.__version__, "safetensors": ST_VERSION}
for _pkg, _ver in PINNED.items():
    assert VERSIONS[_pkg].split("+")[0] == _ver, f"{_pkg} {VERSIONS[_pkg]} installed, requirements.txt pins {_ver}"

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "post_training")


# ---------------------------------------------------------------------------------------------------------
# verl's own dependencies outside the pinned environment: empty modules, installed only for the ones that are
# absent, only while verl is imported. A stub module answers every attribute with _Stub, a class that can be
# subclassed, called (returns a falsy instance, or the function when used as a decorator), indexed, or-ed (type
# hints) and added to lists (class attributes of stubbed base classes).
VERL_ONLY_DEPS = ["omegaconf", "tensordict", "ray", "codetiming", "hydra", "flash_attn", "torch_npu", "vllm",
                  "deepspeed", "liger_kernel", "wandb"]
# Installed, but a version verl@VERL_COMMIT does not import with: its model utilities import
# transformers.AutoModelForVision2Seq, which transformers 5 removed. core_algos' functions never use transformers.
VERL_INCOMPATIBLE = ["transformers"]

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




def export(env, default, commit, tag):
    git_dir = os.environ.get(env, default)
    dest = tempfile.mkdtemp(prefix=f"dew_{tag}_")
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def import_verl(root):
    """verl.trainer.ppo.core_algos from the checkout at `root`, with VERL_ONLY_DEPS that are absent and
    VERL_INCOMPATIBLE stubbed meanwhile (the real modules are put back afterwards)."""
    absent = [m for m in VERL_ONLY_DEPS if importlib.util.find_spec(m) is None] + VERL_INCOMPATIBLE
    match = lambda name: any(name == p or name.startswith(p + ".") for p in absent)
    saved = {n: m for n, m in sys.modules.items() if match(n)}
    for n in saved:
        del sys.modules[n]
    finder = _StubFinder(absent)
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, root)
    try:
        ca = importlib.import_module("verl.trainer.ppo.core_algos")
    finally:
        sys.path.remove(root)
        sys.meta_path.remove(finder)
        for n in [n for n in sys.modules if match(n)]:  # the stubs go; verl's own modules stay loaded
            del sys.modules[n]
        sys.modules.update(saved)
    assert os.path.abspath(ca.__file__).startswith(root), ca.__file__
    return ca, absent


class Strict:
    """Mixin for a reference trainer made without __init__: attributes this script did not set raise instead
    of falling through to transformers.Trainer."""

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


class _Backbone(torch.nn.Module):
    def __init__(self, hidden, expected_ids):
        super().__init__()
        self.hidden, self.expected_ids, self.calls = hidden, expected_ids, 0

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        assert torch.equal(input_ids, self.expected_ids), "the reference fed the model other ids than planned"
        self.calls += 1
        return SimpleNamespace(last_hidden_state=self.hidden)


class FixedLM(torch.nn.Module):
    """A causal LM with fixed logits: the backbone returns them as the last hidden state [N, S, V] and the LM head
    is the V x V identity, so logits = hidden @ I^T = the given values, exactly. TRL's add_fused_lm_head patches
    its forward as DPOTrainer.__init__ patches a real model's."""

    def __init__(self, logits, expected_ids):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.base_model = _Backbone(logits, expected_ids)
        V = logits.shape[-1]
        self.lm_head = torch.nn.Linear(V, V, bias=False, dtype=logits.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(V, dtype=logits.dtype))
        self.lm_head.weight.requires_grad_(False)
        self.is_gradient_checkpointing = False

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        raise AssertionError("DPOTrainer only calls the fused forward")

    @property
    def calls(self):
        return self.base_model.calls


def float64_lm_head(model, outputs=("log_probs",)):
    """The fused forward's contract (per-token fields at the positions whose next-token label is not -100, zero
    elsewhere) computed in the model's dtype with TRL's own non-fused helpers. TRL 1.16's fused head
    (add_fused_lm_head -> trl.kernels.ChunkedLogProbFunction) accumulates in float32 buffers even for a float64
    model, which would leave the float64 truth float32-accurate; the float32 run uses the fused head itself."""

    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        assert fused_lm_head and labels is not None
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        logits = hidden @ self.lm_head.weight.t()
        labels = labels[:, 1:]
        mask = labels != -100
        log_probs = trl_utils.selective_log_softmax(logits, labels.clamp(min=0)).masked_fill(~mask, 0)
        entropy = trl_utils.entropy_from_logits(logits).masked_fill(~mask, 0)
        mean_logits = logits.mean(-1).masked_fill(~mask, 0)
        is_top1 = (logits.argmax(-1) == labels) & mask
        return trl_utils.FusedCausalLMOutput(loss=-log_probs.sum() / mask.sum().clamp(min=1), log_probs=log_probs,
                                             entropy=entropy, log_sum_sq_probs=None, mean_logits=mean_logits,
                                             is_top1=is_top1, label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


# ---------------------------------------------------------------------------------------------------------
# safetensors: tests/golden/st_io.py (the safetensors package).

def save(name, tensors, metadata):
    """Floats as F64, integers as I64, with the metadata and the package versions."""
    out = {}
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        out[key] = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
    meta = {k: str(v) for k, v in metadata.items()}
    meta["versions"] = json.dumps(VERSIONS, sort_keys=True)
    path = os.path.join(OUT, name + ".safetensors")
    write_st(path, out, meta)
    print(f"wrote {path}: {', '.join(sorted(tensors))}")


def scalar(x):
    return torch.tensor(float(x), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# DPO, the installed TRL: DPOTrainer._compute_loss on a concatenated batch [chosen rows; rejected rows].

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


def dpo_trl():
    d = trl_dpo
    gen = torch.Generator().manual_seed(16)
    B, S, V, beta = 4, 7, 11, 0.1
    ids = torch.randint(0, V, (B, 2, S), generator=gen)
    mask, attn = pair_masks()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))   # pad id 0 after each row
    for b, p in enumerate([2, 3, 1, 4]):                          # a pair shares its prompt
        ids[b, 1, :p] = ids[b, 0, :p]
    policy0 = 2.0 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)
    reference0 = policy0 + 0.7 * torch.randn(B, 2, S, V, generator=gen, dtype=torch.float64)

    def run(dtype, head):
        policy = policy0.clone().to(dtype).requires_grad_(True)
        reference = reference0.to(dtype)
        flat = lambda x: torch.cat([x[:, 0], x[:, 1]], dim=0)   # [B, 2, ...] -> TRL's [2B, ...]
        acc = FakeAccelerator()
        model = FixedLM(flat(policy), flat(ids))
        ref_model = FixedLM(flat(reference), flat(ids))
        # what DPOTrainer.__init__ patches (use_weighting False: no log_sum_sq_probs), or the float64 head below
        head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        head(ref_model)
        trainer = probe(d.DPOTrainer, accelerator=acc, model=model, ref_model=ref_model,
                        args=SimpleNamespace(gradient_checkpointing_kwargs=None), aux_loss_enabled=False,
                        ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                        loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                        _total_train_tokens=0, _tp_size=1)
        inputs = {"input_ids": flat(ids), "attention_mask": flat(attn), "completion_mask": flat(mask)}
        loss = d.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
        loss.backward()
        assert model.calls == 1 and ref_model.calls == 1
        chosen_rewards, rejected_rewards = acc.gathered[0], acc.gathered[1]
        chosen_logps, rejected_logps = acc.gathered[4], acc.gathered[5]
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        return loss, policy.grad, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, metrics

    loss, grad, cr, rr, cl, rl, metrics = run(torch.float64, float64_lm_head)
    loss32, grad32, *_ = run(torch.float32, add_fused_lm_head)
    # The installed fused head on the float64 model: float32 inside, so it agrees with the truth to float32 only.
    loss_fused64, grad_fused64, *_ = run(torch.float64, add_fused_lm_head)
    rel = lambda a, b: float((a.detach() - b.detach()).norm() / b.detach().norm())
    print(f"dpo: TRL's fused head on the float64 model vs the float64 truth: loss {rel(loss_fused64, loss):.2e}, "
          f"grad {rel(grad_fused64, grad):.2e} (float32 kernel); float32 run vs truth: loss "
          f"{rel(loss32.double(), loss):.2e}, grad {rel(grad32.double(), grad):.2e}")
    assert rel(loss_fused64, loss) < 1e-5 and rel(grad_fused64, grad) < 1e-5
    out = {"policy_logits": policy0, "reference_logits": reference0, "ids": ids, "completion_mask": mask,
           "beta": scalar(beta), "label_smoothing": scalar(0.0), "loss": loss, "grad_policy_logits": grad,
           "chosen_rewards": cr, "rejected_rewards": rr, "chosen_logps": cl, "rejected_logps": rl,
           "loss_f32": loss32.to(torch.float64), "grad_policy_logits_f32": grad32.to(torch.float64)}
    for name in ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"]:
        out["metric." + name.replace("/", ".")] = scalar(metrics[name])
    print(f"dpo (TRL {trl.__version__}): loss {loss.item():.17g}, accuracies {metrics['rewards/accuracies']}")
    save("dpo_sigmoid", out, {"reference": f"trl {trl.__version__} (installed)",
                              "function": "trl/trainer/dpo_trainer.py DPOTrainer._compute_loss, loss_type sigmoid, "
                                          "(model: fixed logits as the hidden state, identity LM head); float32 "
                                          "run through trl.trainer.utils.add_fused_lm_head as DPOTrainer patches "
                                          "it, float64 run through float64_lm_head (TRL's selective_log_softmax "
                                          "and entropy_from_logits in float64: the fused kernel is float32 inside)"})


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
    print("versions", VERSIONS)
    dpo_trl()
    tree = export("DEW_VERL_GIT", "/work/.mirror/volcengine+verl/repo", VERL_COMMIT, "verl")
    try:
        ca, absent = import_verl(tree)
        print("verl: stubbed while importing it:", ", ".join(absent))
        advantages(ca)
        policy_loss(ca)
        kl(ca)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main()
