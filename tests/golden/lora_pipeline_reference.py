"""The golden of `dew sample --pipeline DIR --lora FILE:SCALE` (tests/runs/test_lora_runs.cpp): diffusers' own LoRA
loading on the tiny SD pipeline folder tests/golden/sd/pipeline, with diffusers 0.42.1, peft 0.21.2 and torch
2.13.0 as installed. Not run by CI; rerun by hand (deterministic):

    .venv/bin/python tests/golden/lora_pipeline_reference.py

Writes tests/golden/lora/pipeline_lora/:
  pytorch_lora_weights.safetensors  what StableDiffusionPipeline.save_lora_weights writes for a peft LoraConfig
      (r 2, lora_alpha 4, target_modules to_q, to_v, conv1) added to the folder's UNet (UNet2DConditionModel.
      add_adapter), every lora_A / lora_B set to 0.1 randn under torch.manual_seed(43), with the adapter's
      LoraConfig in the file's metadata (unet_lora_adapter_metadata);
  io.safetensors  `latents` [1, 4, 16, 16] (randn, seed 44), and the images (output_type "pt": [0, 1], NCHW,
      float32) of the folder's pipeline (DDIMScheduler from its scheduler_config.json, 3 steps, guidance 7.5,
      prompt "a cat", no negative prompt) on those latents: `image_base` without LoRA, `image_lora` after
      load_lora_weights(file, adapter_name="x") and set_adapters(["x"], adapter_weights=[0.5]) (each adapter's
      scale 0.5 * alpha / r = 1).
"""
import os
import shutil
import sys

import diffusers
import peft
import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PIPE = os.path.join(HERE, "sd", "pipeline")
OUT = os.path.join(HERE, "lora", "pipeline_lora")
PROMPT = "a cat"
STEPS = 3
GUIDANCE = 7.5
SCALE = 0.5
CONFIG = dict(r=2, lora_alpha=4, target_modules=["to_q", "to_v", "conv1"], init_lora_weights=False)


def load():
    pipe = StableDiffusionPipeline.from_pretrained(PIPE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, latents):
    with torch.no_grad():
        h = latents.shape[2] * pipe.vae_scale_factor
        return pipe(prompt=PROMPT, latents=latents, height=h, width=h, num_inference_steps=STEPS,
                    guidance_scale=GUIDANCE, eta=0.0, output_type="pt").images


def add_random_adapters(model, config, seed):
    """A peft LoraConfig added to a diffusers model (add_adapter), every lora_A / lora_B set to 0.1 randn under
    torch.manual_seed(seed): the adapters as a user trains them with peft through diffusers. Returns the
    adapter's LoraConfig as a dict (what save_lora_weights stores in the file's metadata)."""
    model.add_adapter(LoraConfig(**config))
    torch.manual_seed(seed)
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    assert named, "no adapter parameters"
    for _, p in named:
        p.copy_(0.1 * torch.randn(p.shape))
    return model.peft_config["default"].to_dict()


def main():
    torch.set_grad_enabled(False)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(44))

    base = run(load(), latents)

    # The adapters, as a user trains them with peft through diffusers, then saves them.
    pipe = load()
    metadata = add_random_adapters(pipe.unet, CONFIG, 43)
    StableDiffusionPipeline.save_lora_weights(OUT, unet_lora_layers=get_peft_model_state_dict(pipe.unet),
                                              unet_lora_adapter_metadata=metadata)
    lora_file = os.path.join(OUT, "pytorch_lora_weights.safetensors")
    tensors, meta = read_st(lora_file)
    assert all(k.startswith("unet.") for k in tensors), sorted(tensors)[:4]
    assert "lora_adapter_metadata" in meta, sorted(meta)

    # A fresh pipeline loads the file the way diffusers' users do.
    pipe = load()
    pipe.load_lora_weights(OUT, adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[SCALE])
    lora = run(pipe, latents)
    assert not torch.equal(lora, base)
    print(f"{len(tensors)} adapter tensors; image rms change {float((lora - base).pow(2).mean().sqrt()):.4g}")

    write_st(os.path.join(OUT, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora)],
             {"source": f"diffusers {diffusers.__version__} StableDiffusionPipeline.load_lora_weights + set_adapters, "
                        f"peft {peft.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": "tests/golden/sd/pipeline", "prompt": PROMPT, "steps": str(STEPS),
              "guidance_scale": str(GUIDANCE), "adapter_weight": str(SCALE), "lora_config": repr(CONFIG)})


if __name__ == "__main__":
    main()
