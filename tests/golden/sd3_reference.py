"""SD3 / SD3.5 transformer goldens from the installed diffusers (SD3Transformer2DModel), run in the project's
environment on tiny configurations. Not run by CI; rerun by hand (deterministic, rewrites tests/golden/sd3/):

    .venv/bin/python tests/golden/sd3_reference.py

For each case: the model is built under torch.manual_seed(seed) with diffusers' own initialisation, then every
parameter is moved off it (p += 0.2 randn from a seeded torch.Generator, in named_parameters() order; the stored
position table pos_embed.pos_embed is a buffer and stays as diffusers computes it). The folder is written by
diffusers' save_pretrained (config.json, diffusion_pytorch_model.safetensors) and reloaded with from_pretrained,
which must reproduce the float32 output bit for bit. io.safetensors (tests/golden/st_io.py) holds the inputs
hidden_states, encoder_hidden_states, pooled_projections, timestep (float32) and out_f32 (the float32 model) /
out_f64 (a .double() deep copy on the same inputs widened to float64, its timestep sinusoid in float64 too:
tests/golden/f64_truth.py) = model(...).sample; parity.json names the case for tests/nn/test_reference_parity.cpp. Versions of torch, diffusers and safetensors go into io's
__metadata__ and the README.
"""
import copy
import json
import os
import shutil
import sys

import diffusers
import safetensors
import torch
from diffusers import SD3Transformer2DModel

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "sd3")
sys.path.insert(0, HERE)
from f64_truth import float64_sinusoids  # noqa: E402
from st_io import write_st  # noqa: E402

ABOUT = ("Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers forward "
         "(dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
         "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees "
         "with NAME_f64 to float64_rel (relative rms).")
F64_WHY = ("the float64 truth computes the timestep sinusoid in float64 (tests/golden/f64_truth.py), and so does "
           "dew's float64 model; what stays float32 in diffusers' float64 model is the qk rms_norm's mean square "
           "(sd35), which dew rounds at the same place. float64_rel is 1e-12, or 5e-8 with qk rms_norm, whose float32 "
           "reduction may round differently under another LibTorch CPU kernel set (AVX2 against AVX-512)")

# name, seed, config (diffusers keys; the rest are SD3Transformer2DModel's defaults), latent shape, text length
CASES = [
    ("transformer_sd3", 0,
     dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
          num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10,
          pos_embed_max_size=8),
     (2, 4, 8, 12), 5),  # a 4 x 6 patch grid cropped from the 8 x 8 table
    ("transformer_sd35", 1,
     dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
          num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10,
          pos_embed_max_size=6, dual_attention_layers=(0, 1), qk_norm="rms_norm"),
     (2, 4, 8, 8), 7),  # 4 x 4 from 6 x 6
    ("transformer_sd3_qk_layer_norm", 2,
     dict(sample_size=8, patch_size=2, in_channels=4, out_channels=2, num_layers=2, attention_head_dim=8,
          num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10,
          pos_embed_max_size=6, dual_attention_layers=(1,), qk_norm="layer_norm"),
     (2, 4, 12, 8), 4),  # 6 x 4 from 6 x 6
]


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def make(name, seed, config, shape, text_len):
    folder = os.path.join(OUT_DIR, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**config).eval()
    perturb(model, 1000 + seed)
    g = torch.Generator().manual_seed(2000 + seed)
    inputs = {
        "hidden_states": torch.randn(shape, generator=g),
        "encoder_hidden_states": torch.randn((shape[0], text_len, config["joint_attention_dim"]), generator=g),
        "pooled_projections": torch.randn((shape[0], config["pooled_projection_dim"]), generator=g),
        "timestep": torch.tensor([500.0, 250.0]),
    }
    out32 = run(model, inputs)
    model64 = copy.deepcopy(model).double()
    inputs64 = {k: v.double() for k, v in inputs.items()}
    with float64_sinusoids():
        out64 = run(model64, inputs64)

    model.save_pretrained(folder)
    back = SD3Transformer2DModel.from_pretrained(folder).eval()
    assert torch.equal(run(back, inputs), out32), f"{name}: the reloaded folder does not reproduce out_f32"

    rel32 = ((out32.double() - out64).pow(2).mean().sqrt() / out64.pow(2).mean().sqrt()).item()
    f64_rel = 5e-8 if config.get("qk_norm") == "rms_norm" else 1e-12
    versions = {"torch": torch.__version__, "diffusers": diffusers.__version__, "safetensors": safetensors.__version__}
    meta = dict(versions, source="diffusers.SD3Transformer2DModel", config=json.dumps(config), seed=str(seed),
                inputs="hidden_states, encoder_hidden_states, pooled_projections, timestep",
                outputs="out = model(**inputs).sample", perturbation="p += 0.2 randn (torch.Generator seed "
                f"{1000 + seed}, named_parameters order)", f64="a .double() deep copy on float64 inputs, its timestep sinusoid in float64 (f64_truth.py)",
                rel_f32_f64=f"{rel32:.3e}")
    write_st(os.path.join(folder, "io.safetensors"),
             dict(inputs, out_f32=out32.contiguous(), out_f64=out64.contiguous()), meta)
    parity = {"about": ABOUT, "float64_rel": f64_rel, "float64_rel_why": F64_WHY,
              "cases": [{"method": "forward",
                         "inputs": ["hidden_states", "timestep", "encoder_hidden_states", "pooled_projections"],
                         "outputs": {"sample": "out"}}]}
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump(parity, f, indent=2)
        f.write("\n")
    n = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name}: {n} parameters, {size} bytes; out {tuple(out32.shape)}; f32 vs f64 relative rms {rel32:.3e}; "
          f"float64_rel {f64_rel}")
    return versions


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    torch.set_num_threads(1)  # deterministic reductions
    for case in CASES:
        versions = make(*case)
    print("versions:", versions)


if __name__ == "__main__":
    main()
