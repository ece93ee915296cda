"""The golden of a kohya / sd-scripts FLUX.1 LoRA file in the original (Black Forest Labs) module naming
(`lora_unet_double_blocks_0_img_attn_qkv` with q, k and v fused, `..._img_mod_lin`, `..._txt_mlp_0`,
`lora_unet_single_blocks_0_linear2`, `..._modulation_lin`), as kohya trains FLUX on the original model and ComfyUI / Forge users exchange it. Reference: diffusers' own
FluxPipeline.load_lora_weights of that file on the tiny FLUX.1 schnell folder tests/golden/flux/pipeline_schnell,
with diffusers 0.42.1 and torch 2.13.0 as installed. Not run by CI; rerun by hand (deterministic):

    .venv/bin/python tests/golden/lora_kohya_flux_reference.py

The file: for every module of the folder's transformer blocks in the original naming but the single blocks' fused
`linear1` (which diffusers' kohya reader splits at FLUX.1-dev's sizes, 3072 and 12288, whatever the model's), and
not the embedders (img_in, txt_in, time_in, vector_in) or the final layer, whose adapters diffusers 0.42.1's reader
converts without the "transformer." prefix and then drops without a word; those are tested against their
definition instead (LoraFiles.FluxOriginalFusedModulesLandOnTheirPartsByRows in tests/runs/test_lora_runs.cpp),
`.lora_down.weight` [2, in] and `.lora_up.weight` [out, 2] drawn
as 0.3 randn under torch.manual_seed(46) in the order below, and `.alpha` 4.0 (float32). The shapes come from
the diffusers modules each original module stands for (a fused one's rows are its parts' rows, in order); diffusers
refuses a file whose shapes do not fit its model.

Writes tests/golden/lora/kohya_flux/:
  flux_kohya_bfl.safetensors  the file;
  io.safetensors  `latents` (the folder's pipeline_io latents, packed [1, 16, 64]) and the images (output_type
      "pt": [0, 1], NCHW, float32) of the folder's pipeline (4 steps, 16 x 16, "a photo of a cat on the moon",
      max_sequence_length 16) on those latents: `image_base` without LoRA and `image_lora` after
      load_lora_weights(file, adapter_name="x") and set_adapters(["x"], adapter_weights=[0.5]).
"""
import os
import shutil
import sys

import diffusers
import torch
from diffusers import FluxPipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PIPE = os.path.join(HERE, "flux", "pipeline_schnell")
OUT = os.path.join(HERE, "lora", "kohya_flux")
PROMPT = "a photo of a cat on the moon"
STEPS = 4
SIZE = 16
MAX_SEQ = 16
SCALE = 0.5
RANK = 2
ALPHA = 4.0


def load():
    pipe = FluxPipeline.from_pretrained(PIPE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, latents):
    with torch.no_grad():
        return pipe(prompt=PROMPT, latents=latents, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                    max_sequence_length=MAX_SEQ, output_type="pt").images


def original_modules(transformer):
    """(original name, [diffusers modules whose rows it holds, in order])."""
    out = []
    for i, _ in enumerate(transformer.transformer_blocks):
        d = f"transformer_blocks.{i}."
        for side, attn, ff, norm, proj in (("img", "attn.to_", "ff", "norm1", "attn.to_out.0"),
                                           ("txt", "attn.add_", "ff_context", "norm1_context", "attn.to_add_out")):
            qkv = [d + attn + p for p in (("q", "k", "v") if side == "img" else ("q_proj", "k_proj", "v_proj"))]
            out += [(f"double_blocks_{i}_{side}_attn_qkv", qkv), (f"double_blocks_{i}_{side}_attn_proj", [d + proj]),
                    (f"double_blocks_{i}_{side}_mlp_0", [d + ff + ".net.0.proj"]),
                    (f"double_blocks_{i}_{side}_mlp_2", [d + ff + ".net.2"]),
                    (f"double_blocks_{i}_{side}_mod_lin", [d + norm + ".linear"])]
    for i, _ in enumerate(transformer.single_transformer_blocks):
        d = f"single_transformer_blocks.{i}."
        out += [(f"single_blocks_{i}_linear2", [d + "proj_out"]), (f"single_blocks_{i}_modulation_lin", [d + "norm.linear"])]
    return out


def main():
    torch.set_grad_enabled(False)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    io, _ = read_st(os.path.join(PIPE, "pipeline_io.safetensors"))
    latents = io["latents"]
    base = run(load(), latents)

    pipe = load()
    modules = dict(pipe.transformer.named_modules())
    torch.manual_seed(46)
    tensors = {}
    for name, parts in original_modules(pipe.transformer):
        in_features = modules[parts[0]].in_features
        rows = sum(modules[p].out_features for p in parts)
        key = "lora_unet_" + name
        tensors[key + ".lora_down.weight"] = 0.3 * torch.randn(RANK, in_features)
        tensors[key + ".lora_up.weight"] = 0.3 * torch.randn(rows, RANK)
        tensors[key + ".alpha"] = torch.tensor(ALPHA)
    lora_file = os.path.join(OUT, "flux_kohya_bfl.safetensors")
    write_st(lora_file, tensors, {"ss_network_module": "networks.lora_flux", "ss_network_dim": str(RANK),
                                  "ss_network_alpha": str(ALPHA),
                                  "source": "tests/golden/lora_kohya_flux_reference.py"})

    pipe.load_lora_weights(lora_file, adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[SCALE])
    lora = run(pipe, latents)
    assert not torch.equal(lora, base)
    print(f"{len(tensors) // 3} original modules; image rms change {float((lora - base).pow(2).mean().sqrt()):.4g}")

    write_st(os.path.join(OUT, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora)],
             {"source": f"diffusers {diffusers.__version__} FluxPipeline.load_lora_weights + set_adapters, "
                        f"torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": "tests/golden/flux/pipeline_schnell", "prompt": PROMPT, "steps": str(STEPS),
              "size": str(SIZE), "max_sequence_length": str(MAX_SEQ), "adapter_weight": str(SCALE),
              "rank": str(RANK), "alpha": str(ALPHA)})


if __name__ == "__main__":
    main()
