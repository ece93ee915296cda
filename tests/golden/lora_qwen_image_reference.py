"""The golden of `dew sample --pipeline DIR --lora FILE:SCALE` on a QwenImage21Pipeline folder
(tests/runs/test_lora_runs.cpp): diffusers' own LoRA loading (QwenImageLoraLoaderMixin) on the tiny folder
tests/golden/qwen_image/pipeline, with diffusers 0.42.1, peft 0.21.2 and torch 2.13.0 as installed. Not run by CI;
rerun by hand after qwen_image_pipeline_reference.py (deterministic):

    .venv/bin/python tests/golden/lora_qwen_image_reference.py

Writes tests/golden/lora/qwen_image_lora/:
  pytorch_lora_weights.safetensors  what QwenImage21Pipeline.save_lora_weights writes for a peft LoraConfig (r 2,
      lora_alpha 4, target_modules to_q, to_v, img_mlp.out, txt_in.in_layer) added to the folder's transformer
      (add_adapter), every lora_A / lora_B set to 0.1 randn under torch.manual_seed(46), with the adapter's
      LoraConfig in the file's metadata;
  io.safetensors  `latents` (the first row of the folder's pipeline_io latents, packed [1, 8, 4]) and the float32
      RGBA images (output_type "pt": [0, 1], NCHW, 64 x 32) of the folder's pipeline on them (3 steps, prompt "a
      cat", negative prompt "blurry", true_cfg_scale 4): `image_base` without LoRA, `image_lora` after
      load_lora_weights(file, adapter_name="x") and set_adapters(["x"], adapter_weights=[0.5]).
"""
import os
import shutil
import sys

import diffusers
import peft
import torch
from diffusers import QwenImage21Pipeline
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_pipeline_reference import add_random_adapters  # noqa: E402
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDER = os.path.join(HERE, "qwen_image", "pipeline")
OUT = os.path.join(HERE, "lora", "qwen_image_lora")
CALL = dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=4.0, height=64, width=32, num_inference_steps=3)
SCALE = 0.5
CONFIG = dict(r=2, lora_alpha=4, target_modules=["to_q", "to_v", "img_mlp.out", "txt_in.in_layer"],
              init_lora_weights=False)


def load():
    pipe = QwenImage21Pipeline.from_pretrained(FOLDER)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, latents):
    with torch.no_grad():
        return pipe(**CALL, latents=latents, output_type="pt").images


def main():
    torch.set_grad_enabled(False)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    io, _ = read_st(os.path.join(FOLDER, "pipeline_io.safetensors"))
    latents = io["latents"][:1].clone()
    base = run(load(), latents)

    pipe = load()
    metadata = add_random_adapters(pipe.transformer, CONFIG, 46)
    layers = sum(1 for n, _ in pipe.transformer.named_parameters() if "lora_A" in n)
    QwenImage21Pipeline.save_lora_weights(OUT, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                                          transformer_lora_adapter_metadata=metadata)
    tensors, _ = read_st(os.path.join(OUT, "pytorch_lora_weights.safetensors"))
    assert all(k.startswith("transformer.") for k in tensors), sorted(tensors)[:4]

    pipe = load()
    pipe.load_lora_weights(OUT, adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[SCALE])
    lora = run(pipe, latents)
    assert not torch.equal(lora, base)
    print(f"qwen_image_lora: {len(tensors)} adapter tensors ({layers} layers); image rms change "
          f"{float((lora - base).pow(2).mean().sqrt()):.4g}")
    write_st(os.path.join(OUT, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora)],
             {"source": f"diffusers {diffusers.__version__} QwenImage21Pipeline.load_lora_weights + set_adapters, "
                        f"peft {peft.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": "tests/golden/qwen_image/pipeline", "call": repr(CALL), "adapter_weight": str(SCALE),
              "lora_config": repr(CONFIG)})


if __name__ == "__main__":
    main()
