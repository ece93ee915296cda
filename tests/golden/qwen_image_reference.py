"""Qwen-Image 2.1 transformer goldens from the installed reference: diffusers' QwenImage21Transformer2DModel on
tiny configurations, with and without causal_condition, padded prompts of different lengths in one batch, a
condition image inside the text (the edit layout the joint sequence supports), and the prefix KV cache (an
"extract" step, then a "cached" step from it). Not run by CI; rerun by hand (deterministic, rewrites
tests/golden/qwen_image/):

    .venv/bin/python tests/golden/qwen_image_reference.py

Each folder: config.json + diffusion_pytorch_model.safetensors (diffusers' save_pretrained), io.safetensors (the
inputs and each output as NAME_f32 / NAME_f64) and parity.json (the cases tests/nn/test_reference_parity.cpp
runs). Numerics: the model is built under torch.manual_seed, every parameter moved off its initialisation
(p += 0.2 randn), run in float32 (`*_f32`) and as a float64 deep copy (`*_f64`) on the same inputs widened to
float64. The saved folder is reloaded with from_pretrained and must reproduce `*_f32` bit for bit.

Inputs as `dew forward` reads them: img_shapes is an int64 tensor [B, n_images, 3] (diffusers' list of
(frame, height, width) per sample), img_mask and encoder_hidden_states_mask are bool tensors.
"""
import copy
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "qwen_image")
sys.path.insert(0, HERE)
from f64_truth import float64_sinusoids  # noqa: E402
from st_io import write_st  # noqa: E402

import diffusers  # noqa: E402
import safetensors  # noqa: E402
from diffusers import QwenImage21Transformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache  # noqa: E402

ABOUT = (
    "Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers forward "
    "(dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
    "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees with "
    "NAME_f64 to float64_rel (relative to the largest |value|). forward_kv_cache is dew's name for diffusers' two "
    "calls with a QwenImage21KVCache: kv_cache_mode 'extract' on the inputs, then 'cached' on cached_hidden_states "
    "and cached_timestep (outputs sample and cached_sample)."
)
FLOAT64_REL = 1e-12
FLOAT64_WHY = (
    "diffusers' float64 QwenImage21 is not float64 throughout: the RoPE tables are complex64 (torch.polar) and "
    "apply_rotary_emb_qwen rotates q and k as x.float() in the [B, S, H, D/2] x [S, 1, D/2] layout, the timestep "
    "embedding (float32 frequencies, float64 products, rounded to float32) is float64 from start to end in the "
    "truth (tests/golden/f64_truth.py) and in dew's float64 model, and txt_in's zero-centred RMSNorm computes in "
    "float32. dew rounds at the same places in the same layouts and agrees to "
    "6e-16 of the largest value (Golden/ReferenceParity, 2026-12-07)"
)

BASE = dict(
    patch_size=1,
    in_channels=8,
    out_channels=6,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    context_in_dim=12,
    mlp_ratio=3,
    axes_dims_rope=(2, 2, 4),
    eps=1e-6,
)
CASES = {
    "transformer_causal": dict(config=dict(BASE, causal_condition=True), seed=900),
    "transformer_plain": dict(config=dict(BASE, causal_condition=False), seed=901),
}
B, LAT_H, LAT_W, L = 2, 4, 6, 7  # target latent grid 4 x 6 = 24 tokens = 6 slots of 2 x 2; 7 text tokens
LENGTHS = [7, 4]  # real prompt tokens per row (right-padded)
COND_H, COND_W, COND_AT = 2, 4, 3  # a condition image of 2 x 4 tokens (2 slots) after text token 3


def versions():
    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "safetensors": safetensors.__version__}


def perturb(model, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def shapes_list(t):
    return [[tuple(int(v) for v in img) for img in row] for row in t]


def call(model, inputs, **kw):
    if next(model.parameters()).dtype == torch.float64:
        with float64_sinusoids():
            return call32(model, inputs, **kw)
    return call32(model, inputs, **kw)


def call32(model, inputs, **kw):
    args = dict(inputs)
    args["img_shapes"] = shapes_list(args["img_shapes"])
    with torch.no_grad():
        return model(**args, **kw, return_dict=False)[0]


def widen(inputs):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}


def make_inputs(cfg, g, cond_image):
    text_mask = torch.tensor([[i < n for i in range(L)] for n in LENGTHS])
    target = LAT_H * LAT_W
    if cond_image:
        # VLM sequence: 3 text, 2 condition slots, 4 text, then the target's 6 slots (the pipeline appends them).
        slots = COND_H * COND_W // 4
        vlm = [False] * COND_AT + [True] * slots + [False] * (L - COND_AT) + [True] * (target // 4)
        shapes = [[(1, COND_H, COND_W), (1, LAT_H, LAT_W)]] * B
        n_img = COND_H * COND_W + target
        # encoder states cover the VLM sequence up to the target (text and condition slots alike)
        enc_len = L + slots
        enc_mask = torch.ones(B, enc_len, dtype=torch.bool)
        text_cols = [i for i in range(enc_len) if not vlm[i]]
        for b in range(B):
            for j, col in enumerate(text_cols):
                enc_mask[b, col] = bool(text_mask[b, j])
    else:
        vlm = [False] * L + [True] * (target // 4)
        shapes = [[(1, LAT_H, LAT_W)]] * B
        n_img = target
        enc_len = L
        enc_mask = text_mask
    return {
        "hidden_states": torch.randn(B, n_img, cfg["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(B, enc_len, cfg["context_in_dim"], generator=g),
        "encoder_hidden_states_mask": enc_mask,
        "timestep": torch.tensor([0.3, 0.85]),
        "img_shapes": torch.tensor(shapes, dtype=torch.int64),
        "img_mask": torch.tensor([vlm] * B, dtype=torch.bool),
    }


def rel(a, b):
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def write_case(name, spec):
    folder = os.path.join(OUT_DIR, name)
    shutil.rmtree(folder, ignore_errors=True)
    cfg = spec["config"]
    torch.manual_seed(spec["seed"])
    model = QwenImage21Transformer2DModel(**cfg).eval()
    perturb(model, spec["seed"] + 1)
    model64 = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(spec["seed"] + 2)

    tensors, cases = {}, []
    # the text-to-image layout, padded prompts of lengths 7 and 4
    inputs = make_inputs(cfg, g, cond_image=False)
    tensors.update(inputs)
    out32, out64 = call(model, inputs), call(model64, widen(inputs))
    tensors.update({"out_f32": out32, "out_f64": out64})
    cases.append({"method": "forward", "inputs": list(inputs), "outputs": {"sample": "out"}})
    # no mask: every text token attended
    nomask = {k: v for k, v in inputs.items() if k != "encoder_hidden_states_mask"}
    tensors.update({"out_nomask_f32": call(model, nomask), "out_nomask_f64": call(model64, widen(nomask))})
    cases.append({"method": "forward", "inputs": list(nomask), "outputs": {"sample": "out_nomask"}})
    # a condition image inside the text (two image blocks)
    cond = make_inputs(cfg, g, cond_image=True)
    tensors.update({k + "_cond": v for k, v in cond.items()})
    c32, c64 = call(model, cond), call(model64, widen(cond))
    tensors.update({"out_cond_f32": c32, "out_cond_f64": c64})
    cases.append(
        {"method": "forward", "inputs": {k: k + "_cond" for k in cond}, "outputs": {"sample": "out_cond"}}
    )
    print(f"{name}: rel rms f32 vs f64 {rel(out32, out64):.2e}, cond {rel(c32, c64):.2e}")

    if cfg["causal_condition"]:
        # the KV cache: extract on the first step, then a cached step at another time on new latents
        nxt = {"cached_hidden_states": torch.randn(B, LAT_H * LAT_W, cfg["in_channels"], generator=g),
               "cached_timestep": torch.tensor([0.2, 0.6])}
        tensors.update(nxt)
        for m, suffix in ((model, "_f32"), (model64, "_f64")):
            inp = inputs if m is model else widen(inputs)
            cache = QwenImage21KVCache(cfg["num_layers"])
            ext = call(m, inp, kv_cache=cache, kv_cache_mode="extract")
            step = dict(inp)
            step["hidden_states"] = nxt["cached_hidden_states"].to(ext.dtype)
            step["timestep"] = nxt["cached_timestep"]
            cached = call(m, step, kv_cache=cache, kv_cache_mode="cached")
            full = call(m, step)
            err = (cached - full[:, -LAT_H * LAT_W:]).abs().max().item()
            print(f"{name}{suffix}: cached step vs full forward max |diff| {err:.2e}")
            assert torch.equal(ext, out32 if m is model else out64)
            tensors["kv_sample" + suffix] = ext
            tensors["kv_cached_sample" + suffix] = cached
        cases.append(
            {
                "method": "forward_kv_cache",
                "inputs": list(inputs) + list(nxt),
                "outputs": {"sample": "kv_sample", "cached_sample": "kv_cached_sample"},
            }
        )

    model.save_pretrained(folder, safe_serialization=True)
    reloaded = QwenImage21Transformer2DModel.from_pretrained(folder).eval()
    assert torch.equal(call(reloaded, inputs), out32), name

    meta = dict(versions())
    meta.update(
        {
            "source": f"diffusers {diffusers.__version__} QwenImage21Transformer2DModel",
            "case": name,
            "config": json.dumps(cfg),
            "seed": str(spec["seed"]),
            "perturbation": "every parameter p += 0.2 * randn (torch.Generator seeded with seed + 1)",
            "f64": "float64 deep copy (.double()) on the float32 inputs widened, its sinusoid in float64 (f64_truth.py)",
            "inputs": f"B {B}, target latents {LAT_H} x {LAT_W} tokens, {L} text tokens right-padded to real "
            f"lengths {LENGTHS}; *_cond: a {COND_H} x {COND_W} condition image after text token {COND_AT}; "
            "timestep [0.3, 0.85]; cached_*: the cached step's latents and timestep [0.2, 0.6]",
            "outputs": "out = model(**inputs).sample over the joint sequence [B, text + image, out_channels]; "
            "out_nomask without encoder_hidden_states_mask; kv_sample / kv_cached_sample the extract and cached "
            "calls",
        }
    )
    write_st(os.path.join(folder, "io.safetensors"), tensors, meta)
    parity = {"about": ABOUT, "float64_rel": FLOAT64_REL, "float64_rel_why": FLOAT64_WHY, "cases": cases}
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump(parity, f, indent=2)
        f.write("\n")


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, spec in CASES.items():
        write_case(name, spec)
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write(
            "# Qwen-Image 2.1 transformer goldens\n\n"
            "Written by `tests/golden/qwen_image_reference.py` from the installed diffusers "
            f"{diffusers.__version__} (torch {torch.__version__}, safetensors {safetensors.__version__}); read by "
            "tests/nn/test_reference_parity.cpp (parity.json in each folder) and tests/nn/test_qwen_image_transformer.cpp.\n\n"
            "- `transformer_causal`: causal_condition true; padded prompts (lengths 7 and 4), no mask, a condition "
            "image inside the text, and the KV cache (extract, then a cached step).\n"
            "- `transformer_plain`: causal_condition false; the same forward cases.\n"
        )


if __name__ == "__main__":
    main()
