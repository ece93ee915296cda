"""The goldens of `dew sample --pipeline DIR --lora FILE:SCALE` on SD3 and Flux folders (tests/runs/test_lora_runs.cpp):
diffusers' own LoRA loading on the tiny pipeline folders tests/golden/sd3/pipeline and
tests/golden/flux/pipeline_schnell, with diffusers 0.42.1, peft 0.21.2 and torch 2.13.0 as installed. Not run by CI;
rerun by hand (deterministic):

    .venv/bin/python tests/golden/lora_flow_pipeline_reference.py

Writes tests/golden/lora/sd3_lora/ and tests/golden/lora/flux_lora/:
  pytorch_lora_weights.safetensors  what the pipeline class's save_lora_weights writes for a peft LoraConfig (r 2,
      lora_alpha 4, target_modules to_q, to_v, add_k_proj, ff.net.2) added to the folder's transformer
      (add_adapter), every lora_A / lora_B set to 0.1 randn under torch.manual_seed(45), with the adapter's
      LoraConfig in the file's metadata;
  io.safetensors  `latents` (the folder's pipeline_io latents: SD3 [1, 16, 8, 8], Flux packed [1, 16, 64]) and the
      float32 images (output_type "pt": [0, 1], NCHW, 16 x 16) of the folder's pipeline on them (4 steps, prompt
      "a photo of a cat on the moon", max_sequence_length 16; SD3 with negative prompt "blurry, low quality" and
      guidance 5): `image_base` without LoRA, `image_lora` after load_lora_weights(file, adapter_name="x") and
      set_adapters(["x"], adapter_weights=[0.5]) (each adapter's scale 0.5 * alpha / r = 1).
"""
import os
import shutil
import sys

import diffusers
import peft
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_pipeline_reference import add_random_adapters  # noqa: E402
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "a photo of a cat on the moon"
NEGATIVE_PROMPT = "blurry, low quality"
STEPS = 4
SIZE = 16
MAX_SEQ = 16
SCALE = 0.5
CONFIG = dict(r=2, lora_alpha=4, target_modules=["to_q", "to_v", "add_k_proj", "ff.net.2"], init_lora_weights=False)
CASES = {
    "sd3_lora": dict(cls=StableDiffusion3Pipeline, folder="sd3/pipeline",
                     call=dict(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0)),
    "flux_lora": dict(cls=FluxPipeline, folder="flux/pipeline_schnell", call=dict(prompt=PROMPT)),
}


def load(case):
    pipe = case["cls"].from_pretrained(os.path.join(HERE, case["folder"]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, case, latents):
    with torch.no_grad():
        return pipe(**case["call"], latents=latents, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                    max_sequence_length=MAX_SEQ, output_type="pt").images


def make(name, case):
    out = os.path.join(HERE, "lora", name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    io, _ = read_st(os.path.join(HERE, case["folder"], "pipeline_io.safetensors"))
    latents = io["latents"]
    base = run(load(case), case, latents)

    # The adapters, as a user trains them with peft through diffusers, then saves them.
    pipe = load(case)
    metadata = add_random_adapters(pipe.transformer, CONFIG, 45)
    layers = sum(1 for n, _ in pipe.transformer.named_parameters() if "lora_A" in n)
    case["cls"].save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                                  transformer_lora_adapter_metadata=metadata)
    tensors, meta = read_st(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert all(k.startswith("transformer.") for k in tensors), sorted(tensors)[:4]

    # A fresh pipeline loads the file the way diffusers' users do.
    pipe = load(case)
    pipe.load_lora_weights(out, adapter_name="x")
    pipe.set_adapters(["x"], adapter_weights=[SCALE])
    lora = run(pipe, case, latents)
    assert not torch.equal(lora, base)
    print(f"{name}: {len(tensors)} adapter tensors ({layers} layers); image rms change "
          f"{float((lora - base).pow(2).mean().sqrt()):.4g}")
    write_st(os.path.join(out, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora)],
             {"source": f"diffusers {diffusers.__version__} {case['cls'].__name__}.load_lora_weights + set_adapters, "
                        f"peft {peft.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": "tests/golden/" + case["folder"], "call": repr(case["call"]), "steps": str(STEPS),
              "size": str(SIZE), "max_sequence_length": str(MAX_SEQ), "adapter_weight": str(SCALE),
              "lora_config": repr(CONFIG)})


def main():
    torch.set_grad_enabled(False)
    for name, case in CASES.items():
        make(name, case)


if __name__ == "__main__":
    main()
