"""The golden of a kohya / sd-scripts SDXL LoRA file in the original (SGM / LDM) UNet naming
(`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`, `..._in_layers_2`, `lora_unet_middle_block_1_...`,
`lora_unet_output_blocks_...`), as kohya trains SDXL on its own copy of the original UNet and ComfyUI / A1111 users
exchange it. Reference: diffusers' own StableDiffusionXLPipeline.load_lora_weights of that file on the tiny SDXL
folder tests/golden/sd/pipeline_sdxl, with diffusers 0.42.1, peft 0.21.2 and torch 2.13.0 as installed. Not run by
CI; rerun by hand (deterministic):

    .venv/bin/python tests/golden/lora_kohya_sgm_reference.py

How the file is made: a peft LoraConfig (r 2, lora_alpha 4, every kind of layer kohya's LoCon trains in the SDXL
UNet: attention projections, proj_in / proj_out, feed-forward, resnet convs, time-embedding projections, shortcut,
down- and upsampler convs, conv_in / conv_out, the time and added-condition embeddings) added to the folder's UNet,
every lora_A / lora_B set to 0.1 randn under torch.manual_seed(45); the adapters renamed from diffusers' module
names to the original UNet's names by this script (diffusers has no writer for that naming) with
`.lora_down.weight`, `.lora_up.weight` and `.alpha` (float32, = lora_alpha). That renaming is checked by diffusers
itself: the pipeline that loads the original-named file must give the same image (to 1e-6) as the one that loads
the same adapters saved by diffusers' save_lora_weights (its own naming).

Writes tests/golden/lora/kohya_sgm/:
  sdxl_kohya_sgm.safetensors  the original-named kohya file;
  io.safetensors  `latents` [1, 4, 16, 16] (the folder's pipeline_io latents) and the images (output_type "pt":
      [0, 1], NCHW, float32) of the folder's pipeline (its EulerDiscreteScheduler, 3 steps, guidance 7.5, prompt
      "a cat", no negative prompt, 32 x 32) on those latents: `image_base` without LoRA and `image_lora` after
      load_lora_weights(file, adapter_name="x") and set_adapters(["x"], adapter_weights=[0.5]).
"""
import os
import re
import shutil
import sys
import tempfile

import diffusers
import peft
import torch
from diffusers import StableDiffusionXLPipeline
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_pipeline_reference import add_random_adapters  # noqa: E402
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PIPE = os.path.join(HERE, "sd", "pipeline_sdxl")
OUT = os.path.join(HERE, "lora", "kohya_sgm")
PROMPT = "a cat"
STEPS = 3
GUIDANCE = 7.5
SCALE = 0.5
CONFIG = dict(r=2, lora_alpha=4, init_lora_weights=False,
              target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                              "conv1", "conv2", "time_emb_proj", "conv_shortcut", "conv", "conv_in", "conv_out",
                              "linear_1", "linear_2"])


def load():
    pipe = StableDiffusionXLPipeline.from_pretrained(PIPE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, latents):
    with torch.no_grad():
        h = latents.shape[2] * pipe.vae_scale_factor
        return pipe(prompt=PROMPT, latents=latents, height=h, width=h, num_inference_steps=STEPS,
                    guidance_scale=GUIDANCE, output_type="pt").images


def sgm_name(module, unet_config):
    """The original UNet's name of a diffusers UNet2DConditionModel module (dots kept)."""
    per = unet_config["layers_per_block"] + 1
    resnet = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}
    fixed = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2"}
    if module in fixed:
        return fixed[module]

    def in_resnet(rest):
        return resnet[rest]

    m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.(.+)", module)
    if m:
        b, kind, k, rest = int(m[1]), m[2], int(m[3]), m[4]
        if kind == "downsamplers":
            return f"input_blocks.{1 + b * per + per - 1}.0.op"
        i = 1 + b * per + k
        return f"input_blocks.{i}.0.{in_resnet(rest)}" if kind == "resnets" else f"input_blocks.{i}.1.{rest}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module)
    if m:
        kind, k, rest = m[1], int(m[2]), m[3]
        return f"middle_block.1.{rest}" if kind == "attentions" else f"middle_block.{2 * k}.{in_resnet(rest)}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.(.+)", module)
    if m:
        b, kind, k, rest = int(m[1]), m[2], int(m[3]), m[4]
        has_attn = unet_config["up_block_types"][b].startswith("CrossAttn")
        if kind == "upsamplers":
            return f"output_blocks.{b * per + per - 1}.{2 if has_attn else 1}.{rest}"
        i = b * per + k
        return f"output_blocks.{i}.0.{in_resnet(rest)}" if kind == "resnets" else f"output_blocks.{i}.1.{rest}"
    raise ValueError(f"no original name for {module}")


def main():
    torch.set_grad_enabled(False)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    latents, _ = read_st(os.path.join(PIPE, "pipeline_io.safetensors"))
    latents = latents["latents"]

    base = run(load(), latents)

    pipe = load()
    metadata = add_random_adapters(pipe.unet, CONFIG, 45)
    state = get_peft_model_state_dict(pipe.unet)
    config = dict(pipe.unet.config)
    with tempfile.TemporaryDirectory() as tmp:
        # diffusers' own naming, for the check below
        StableDiffusionXLPipeline.save_lora_weights(tmp, unet_lora_layers=state, unet_lora_adapter_metadata=metadata)
        ref = load()
        ref.load_lora_weights(tmp, adapter_name="x")
        ref.set_adapters(["x"], adapter_weights=[SCALE])
        via_diffusers_names = run(ref, latents)

    kohya, modules = {}, sorted({k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")})
    for m in modules:
        flat = "lora_unet_" + sgm_name(m, config).replace(".", "_")
        kohya[flat + ".lora_down.weight"] = state[m + ".lora_A.weight"]
        kohya[flat + ".lora_up.weight"] = state[m + ".lora_B.weight"]
        kohya[flat + ".alpha"] = torch.tensor(float(CONFIG["lora_alpha"]))
    lora_file = os.path.join(OUT, "sdxl_kohya_sgm.safetensors")
    write_st(lora_file, kohya, {"ss_network_module": "networks.lora", "ss_network_dim": str(CONFIG["r"]),
                                "ss_network_alpha": str(CONFIG["lora_alpha"]),
                                "source": f"tests/golden/lora_kohya_sgm_reference.py, peft {peft.__version__}"})

    pipe = load()
    pipe.load_lora_weights(lora_file, adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[SCALE])
    lora = run(pipe, latents)
    assert not torch.equal(lora, base)
    diff = float((lora - via_diffusers_names).abs().max())
    assert diff < 1e-6, f"the original-named file loads differently from diffusers' naming: {diff}"
    print(f"{len(modules)} adapted modules; image rms change {float((lora - base).pow(2).mean().sqrt()):.4g}; "
          f"max difference to diffusers' naming {diff:.3g}")

    write_st(os.path.join(OUT, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora)],
             {"source": f"diffusers {diffusers.__version__} StableDiffusionXLPipeline.load_lora_weights + set_adapters, "
                        f"peft {peft.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": "tests/golden/sd/pipeline_sdxl", "prompt": PROMPT, "steps": str(STEPS),
              "guidance_scale": str(GUIDANCE), "adapter_weight": str(SCALE), "lora_config": repr(CONFIG)})


if __name__ == "__main__":
    main()
