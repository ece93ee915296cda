"""Qwen-Image 1 transformer goldens from the installed reference: diffusers' QwenImageTransformer2DModel on a tiny
configuration, with padded prompts of different lengths (encoder_hidden_states_mask), without a mask, and the edit
layout (a condition image after the target in img_shapes). Not run by CI; rerun by hand (deterministic, rewrites
tests/golden/qwen_image/transformer_v1/):

    .venv/bin/python tests/golden/qwen_image1_reference.py

The folder: config.json + diffusion_pytorch_model.safetensors (diffusers' save_pretrained), io.safetensors (the
inputs and each output as NAME_f32 / NAME_f64) and parity.json (the cases tests/nn/test_reference_parity.cpp runs).
The model is built under torch.manual_seed, every parameter moved off its initialisation (p += 0.2 randn), run in
float32 (`*_f32`) and as a float64 deep copy (`*_f64`) on the same inputs widened to float64, with the timestep
sinusoid in float64 (f64_truth.py). The saved folder is reloaded with from_pretrained and must reproduce `*_f32`
bit for bit. img_shapes is an int64 tensor [B, n_images, 3] as `dew forward` reads it (diffusers' list of
(frame, height, width) per sample, in packed tokens); encoder_hidden_states_mask is a bool tensor.
"""
import copy
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "qwen_image", "transformer_v1")
sys.path.insert(0, HERE)
from f64_truth import float64_sinusoids  # noqa: E402
from qwen_image_reference import perturb, versions  # noqa: E402
from st_io import write_st  # noqa: E402

from diffusers import QwenImageTransformer2DModel  # noqa: E402

ABOUT = (
    "Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers forward "
    "(dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
    "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees with "
    "NAME_f64 to float64_rel (relative to the largest |value|)."
)
FLOAT64_REL = 1e-12
FLOAT64_WHY = (
    "diffusers' float64 QwenImageTransformer2DModel is not float64 throughout: the RoPE tables are complex64 "
    "(torch.polar) and apply_rotary_emb_qwen rotates q and k as x.float(), and its RMSNorms (txt_norm, the heads' "
    "norms) take the variance in float32; dew rounds at the same places, and the timestep sinusoid is float64 in the "
    "truth (tests/golden/f64_truth.py) and in dew's float64 model"
)
CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
              num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=[2, 2, 4])
B, L, LENGTHS = 2, 7, [7, 4]
TARGET, CONDITION = (1, 3, 4), (1, 2, 2)  # packed tokens: 3 x 4 target, a 2 x 2 condition image (edit layout)


def call(m, inputs):
    shapes = [[tuple(int(v) for v in img) for img in row] for row in inputs["img_shapes"]]
    kwargs = {k: v for k, v in inputs.items() if k != "img_shapes"}
    with torch.no_grad():
        return m(**kwargs, img_shapes=shapes, return_dict=False)[0]


def widen(inputs):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}


def rel(a, b):
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def main():
    torch.manual_seed(81)
    model = QwenImageTransformer2DModel(**CONFIG).eval()
    perturb(model, 82)
    g = torch.Generator().manual_seed(83)
    n_target, n_cond = TARGET[1] * TARGET[2], CONDITION[1] * CONDITION[2]
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    text = torch.randn(B, L, CONFIG["joint_attention_dim"], generator=g) * mask[..., None]
    base = dict(hidden_states=torch.randn(B, n_target, CONFIG["in_channels"], generator=g),
                encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                timestep=torch.tensor([0.3, 0.75]), img_shapes=torch.tensor([[TARGET]] * B))
    nomask = {k: v for k, v in base.items() if k != "encoder_hidden_states_mask"}
    edit = dict(base, hidden_states=torch.randn(B, n_target + n_cond, CONFIG["in_channels"], generator=g),
                img_shapes=torch.tensor([[TARGET, CONDITION]] * B))
    model64 = copy.deepcopy(model).double()
    tensors = {}
    for tag, inputs in (("", base), ("_nomask", nomask), ("_edit", edit)):
        out32 = call(model, inputs)
        with float64_sinusoids():
            out64 = call(model64, widen(inputs))
        print(f"out{tag}: shape {tuple(out32.shape)}, rel rms f32 vs f64 {rel(out32, out64):.2e}")
        tensors[f"out{tag}_f32"], tensors[f"out{tag}_f64"] = out32, out64
        for k, v in inputs.items():
            tensors[k + tag if tag == "_edit" and k in ("hidden_states", "img_shapes") else k] = v

    shutil.rmtree(OUT_DIR, ignore_errors=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    back = QwenImageTransformer2DModel.from_pretrained(OUT_DIR).eval()
    assert torch.equal(call(back, base), tensors["out_f32"]), "the saved folder does not reproduce the outputs"
    meta = dict(versions())
    meta["f64"] = "float64 deep copy (.double()) on the float32 inputs widened, its sinusoid in float64 (f64_truth.py)"
    write_st(os.path.join(OUT_DIR, "io.safetensors"), tensors, meta)
    inputs = ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes"]
    parity = {
        "about": ABOUT,
        "float64_rel": FLOAT64_REL,
        "float64_rel_why": FLOAT64_WHY,
        "cases": [
            {"method": "forward", "inputs": inputs, "outputs": {"sample": "out"}},
            {"method": "forward", "inputs": [i for i in inputs if i != "encoder_hidden_states_mask"],
             "outputs": {"sample": "out_nomask"}},
            {"method": "forward",
             "inputs": dict({i: i for i in inputs}, hidden_states="hidden_states_edit", img_shapes="img_shapes_edit"),
             "outputs": {"sample": "out_edit"}},
        ],
    }
    with open(os.path.join(OUT_DIR, "parity.json"), "w") as f:
        json.dump(parity, f, indent=2)
        f.write("\n")
    print("wrote", OUT_DIR, versions())


if __name__ == "__main__":
    main()
