"""Flux goldens from the installed reference: diffusers' FluxTransformer2DModel (Flux.1 dev with the guidance
embedding, schnell without) on tiny configurations, and FluxPipeline's latent packing and id grids. Not run by
CI; rerun by hand (deterministic, rewrites tests/golden/flux/):

    .venv/bin/python tests/golden/flux_reference.py

Each folder: config.json + diffusion_pytorch_model.safetensors (diffusers' save_pretrained), io.safetensors (the
inputs and each output as NAME_f32 / NAME_f64) and parity.json (the cases tests/nn/test_reference_parity.cpp
runs). Numerics: the model is built under torch.manual_seed, every parameter moved off its initialisation
(p += 0.2 randn; RMSNorm weights become 1 + 0.2 randn), run in float32 (`*_f32`) and as a float64 deep copy
(`*_f64`) on the same inputs widened to float64. The saved folder is reloaded with from_pretrained and must
reproduce `*_f32` bit for bit. FluxPipeline._pack_latents / _unpack_latents / _prepare_latent_image_ids are
checked against the packing written here (the C++ library functions follow the same formulas).
"""
import copy
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "flux")
sys.path.insert(0, HERE)
from f64_truth import float64_sinusoids  # noqa: E402
from st_io import write_st  # noqa: E402

import diffusers  # noqa: E402
import safetensors  # noqa: E402
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402

ABOUT = (
    "Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers forward "
    "(dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
    "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees with "
    "NAME_f64 to float64_rel (relative to the largest |value|)."
)
FLOAT64_REL = 5e-8
FLOAT64_WHY = (
    "diffusers' float64 Flux is not float64 throughout: FluxPosEmbed takes ids.float() and returns float32 tables, "
    "and apply_rotary_emb rotates q and k as x.float() (so they are rounded to float32 in every attention); dew "
    "rounds at the same places. Its timestep / guidance sinusoid, float32 in diffusers, is float64 in the truth "
    "(tests/golden/f64_truth.py) and in dew's float64 model; even rotating q and k in float64 "
    "instead moves these outputs by at most 1.3e-8 of their largest value (measured with diffusers patched)"
)

# Tiny configurations: inner width 2 heads x 8, axes_dims_rope summing to the head width, 2 double-stream and 2
# single-stream blocks. The packed in_channels 16 are 4 latent channels; schnell also has out_channels 8 (2).
BASE = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    pooled_projection_dim=10,
    axes_dims_rope=(2, 2, 4),
)
CASES = {
    "transformer_dev": dict(config=dict(BASE, guidance_embeds=True), seed=700),
    "transformer_schnell": dict(config=dict(BASE, guidance_embeds=False, out_channels=8), seed=701),
}
B, LAT_H, LAT_W, L = 2, 6, 10, 7  # latent grid 6 x 10 -> packed 3 x 5 = 15 tokens (non-square); 7 text tokens


def versions():
    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "safetensors": safetensors.__version__,
    }


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def pack(latents):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2 x 2 patches, channels outermost within a patch."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens, h, w):
    b, s, c4 = tokens.shape
    return tokens.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def image_ids(h2, w2):
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = torch.arange(h2)[:, None]
    ids[..., 2] = torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


def check_pipeline_packing():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, 12)
    packed = FluxPipeline._pack_latents(x, 3, 5, 8, 12)
    assert torch.equal(packed, pack(x))
    # _unpack_latents takes the image size and the VAE factor: latent 8 x 12 is image 64 x 96 at factor 8
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 96, 8), x)
    assert torch.equal(unpack(packed, 8, 12), x)
    ids = FluxPipeline._prepare_latent_image_ids(3, 4, 6, "cpu", torch.float32)
    assert torch.equal(ids, image_ids(4, 6)), ids


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def write_case(name, spec):
    folder = os.path.join(OUT_DIR, name)
    shutil.rmtree(folder, ignore_errors=True)
    cfg = spec["config"]
    torch.manual_seed(spec["seed"])
    model = FluxTransformer2DModel(**cfg).eval()
    perturb(model, spec["seed"] + 1)
    dev = cfg["guidance_embeds"]

    g = torch.Generator().manual_seed(spec["seed"] + 2)
    latents = torch.randn(B, cfg["in_channels"] // 4, LAT_H, LAT_W, generator=g)
    inputs = {
        "hidden_states": pack(latents),
        "encoder_hidden_states": torch.randn(B, L, cfg["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(B, cfg["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([0.3, 0.85]),  # in [0, 1], as FluxPipeline passes timestep / 1000
        "img_ids": image_ids(LAT_H // 2, LAT_W // 2),
        "txt_ids": torch.zeros(L, 3),
    }
    if dev:
        inputs["guidance"] = torch.tensor([3.5, 1.25])  # FluxPipeline's guidance_scale, scaled by 1000 inside
    # A second case: image ids offset on axis 0 (as Flux Kontext's reference images) and text ids off zero, so
    # every RoPE axis rotates.
    shifted = dict(inputs)
    shifted["img_ids"] = inputs["img_ids"] + torch.tensor([1.0, 0.0, 0.0])
    shifted["txt_ids"] = torch.stack([torch.zeros(L), torch.arange(L, dtype=torch.float32), torch.zeros(L)], 1)

    out32 = run(model, inputs)
    shifted32 = run(model, shifted)
    model64 = copy.deepcopy(model).double()
    with float64_sinusoids():
        out64 = run(model64, {k: v.double() for k, v in inputs.items()})
        shifted64 = run(model64, {k: v.double() for k, v in shifted.items()})
    rel = lambda a, b: ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()  # noqa: E731
    print(f"{name}: out rel rms f32 vs f64 {rel(out32, out64):.2e}, shifted {rel(shifted32, shifted64):.2e}")

    model.save_pretrained(folder, safe_serialization=True)
    reloaded = FluxTransformer2DModel.from_pretrained(folder).eval()
    assert torch.equal(run(reloaded, inputs), out32), name
    assert torch.equal(run(reloaded, shifted), shifted32), name

    tensors = dict(inputs)
    tensors["img_ids_shifted"] = shifted["img_ids"]
    tensors["txt_ids_shifted"] = shifted["txt_ids"]
    tensors.update(
        {"out_f32": out32, "out_f64": out64, "out_shifted_f32": shifted32, "out_shifted_f64": shifted64}
    )
    meta = dict(versions())
    meta.update(
        {
            "source": f"diffusers {diffusers.__version__} FluxTransformer2DModel",
            "case": name,
            "config": json.dumps(cfg),
            "seed": str(spec["seed"]),
            "perturbation": "every parameter p += 0.2 * randn (torch.Generator seeded with seed + 1)",
            "f64": "float64 deep copy (.double()) on the float32 inputs widened, its sinusoids in float64 (f64_truth.py)",
            "inputs": "hidden_states = FluxPipeline._pack_latents(randn [2, C, 6, 10]); encoder_hidden_states, "
            "pooled_projections randn; timestep [0.3, 0.85]; img_ids _prepare_latent_image_ids(3, 5); txt_ids "
            "zeros" + ("; guidance [3.5, 1.25]" if dev else ""),
            "outputs": "out = model(**inputs).sample (packed [2, 15, 4 C_out]); out_shifted with img_ids_shifted "
            "(axis 0 + 1) and txt_ids_shifted (axis 1 = token index)",
        }
    )
    write_st(os.path.join(folder, "io.safetensors"), tensors, meta)

    names = list(inputs)
    shifted_inputs = {n: n for n in names}
    shifted_inputs.update({"img_ids": "img_ids_shifted", "txt_ids": "txt_ids_shifted"})
    parity = {
        "about": ABOUT,
        "float64_rel": FLOAT64_REL,
        "float64_rel_why": FLOAT64_WHY,
        "cases": [
            {"method": "forward", "inputs": names, "outputs": {"sample": "out"}},
            {"method": "forward", "inputs": shifted_inputs, "outputs": {"sample": "out_shifted"}},
        ],
    }
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump(parity, f, indent=2)
        f.write("\n")


def main():
    check_pipeline_packing()
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, spec in CASES.items():
        write_case(name, spec)
    print("versions:", versions())


if __name__ == "__main__":
    main()
