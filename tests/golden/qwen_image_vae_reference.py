"""Qwen-Image 2.1 VAE goldens from the installed reference: diffusers' AutoencoderKLQwenImage21 on a tiny
configuration (three levels, residual down / up blocks, one level with the temporal factor and one without, so
both shortcut layouts run, a decoder base width other than the encoder's, 4 image channels as the release's RGBA).
Not run by CI; rerun by hand (deterministic, rewrites tests/golden/qwen_image/vae/):

    .venv/bin/python tests/golden/qwen_image_vae_reference.py

The folder: config.json + diffusion_pytorch_model.safetensors (diffusers' save_pretrained), io.safetensors (the
inputs and each output as NAME_f32 / NAME_f64) and parity.json (the cases tests/nn/test_reference_parity.cpp
runs). The model is built under torch.manual_seed, every parameter moved off its initialisation (p += 0.1 randn),
run in float32 (`*_f32`) and as a float64 deep copy (`*_f64`) on the same inputs widened to float64. The saved
folder is reloaded with from_pretrained and must reproduce `*_f32` bit for bit. Tensors in diffusers' layout:
sample [B, C, 1, H, W] (one frame), latents [B, z_dim, 1, h, w]. The decode input z is drawn wide enough that
some decoded values pass +-1 (diffusers clamps them; the test sees the clamp).
"""
import copy
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "qwen_image", "vae")
sys.path.insert(0, HERE)
from qwen_image_reference import perturb, versions  # noqa: E402
from st_io import write_st  # noqa: E402

from diffusers import AutoencoderKLQwenImage21  # noqa: E402

ABOUT = (
    "Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers forward "
    "(dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
    "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees with "
    "NAME_f64 to float64_rel (relative rms)."
)
FLOAT64_REL = 1e-10
FLOAT64_WHY = (
    "diffusers' float64 AutoencoderKLQwenImage21 is float64 throughout (F.normalize, SDPA and the convolutions in "
    "float64; its nearest upsampling goes through float32, which is exact); the tolerance leaves room for float64 "
    "rounding of another LibTorch build"
)

CONFIG = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=4,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True],
    dropout=0.0,
    latents_mean=[0.5, -0.25, 1.0, 0.125],
    latents_std=[2.0, 1.5, 3.0, 0.75],
    is_residual=True,
    in_channels=4,
    out_channels=4,
    patch_size=None,
    scale_factor_temporal=2,
    scale_factor_spatial=4,
)
B, H, W = 2, 32, 24


def forward(m, sample, z):
    with torch.no_grad():
        q = m.encode(sample).latent_dist
        return {"latent_mean": q.mean, "latent_logvar": q.logvar, "decoded": m.decode(z).sample}


def rel(a, b):
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def main():
    torch.manual_seed(0)
    model = AutoencoderKLQwenImage21(**CONFIG).eval()
    perturb(model, 1, 0.1)
    g = torch.Generator().manual_seed(2)
    sample = torch.rand(B, CONFIG["in_channels"], 1, H, W, generator=g) * 2 - 1
    z = torch.randn(B, CONFIG["z_dim"], 1, H // 4, W // 4, generator=g) * 2
    out32 = forward(model, sample, z)
    model64 = copy.deepcopy(model).double()
    out64 = forward(model64, sample.double(), z.double())
    for k in out32:
        print(f"{k}: rel rms f32 vs f64 {rel(out32[k], out64[k]):.2e}, shape {tuple(out32[k].shape)}")
    clamped = (out64["decoded"].abs() >= 1).double().mean().item()
    print(f"decoded values at the clamp: {clamped:.3f}")
    assert 0.01 < clamped < 0.9, "the decode case should see the clamp on some values, not all"

    shutil.rmtree(OUT_DIR, ignore_errors=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    back = AutoencoderKLQwenImage21.from_pretrained(OUT_DIR).eval()
    again = forward(back, sample, z)
    for k in out32:
        assert torch.equal(again[k], out32[k]), k

    tensors = {"sample": sample, "z": z}
    for k in out32:
        tensors[k + "_f32"] = out32[k]
        tensors[k + "_f64"] = out64[k]
    meta = dict(versions())
    meta.update({"config": json.dumps(CONFIG), "f64": "float64 deep copy (.double()) on the float32 inputs widened"})
    write_st(os.path.join(OUT_DIR, "io.safetensors"), tensors, meta)
    parity = {
        "about": ABOUT,
        "float64_rel": FLOAT64_REL,
        "float64_rel_why": FLOAT64_WHY,
        "cases": [
            {"method": "encode", "inputs": ["sample"],
             "outputs": {"latent_mean": "latent_mean", "latent_logvar": "latent_logvar"}},
            {"method": "decode", "inputs": ["z"], "outputs": {"sample": "decoded"}},
        ],
    }
    with open(os.path.join(OUT_DIR, "parity.json"), "w") as f:
        json.dump(parity, f, indent=2)
        f.write("\n")
    print("wrote", OUT_DIR, versions())


if __name__ == "__main__":
    main()
