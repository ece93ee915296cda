"""The committed tiny SD3 and FLUX.1-schnell pipeline folders (sd3_flux_pipeline_reference.py) run by the installed
diffusers 0.42.1 in bfloat16 (DiffusionPipeline.from_pretrained(..., torch_dtype=torch.bfloat16): every weight and
activation bf16), from the same prompt and initial latents as their float32 / float64 runs. The bf16 outputs are the
peer for `dew sample --pipeline --weights-dtype bfloat16`: dew's error against the float64 pipeline must be at most
twice diffusers' bf16 error (tests/interop/test_flow_pipeline.cpp). Not run by CI; rerun by hand (deterministic):

    .venv/bin/python tests/golden/pipeline_bf16_reference.py

Writes pipeline_bf16.safetensors (final_latents_bf16, image_bf16, as float32) beside pipeline_io.safetensors in
tests/golden/sd3/pipeline and tests/golden/flux/pipeline_schnell.
"""
import os
import sys

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sd3_flux_pipeline_reference as ref  # noqa: E402  (asserts the pinned versions)
from st_io import write_st  # noqa: E402

import diffusers  # noqa: E402
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler  # noqa: E402


def bf16_run(sub, call):
    folder = os.path.join(HERE, sub)
    io = load_file(os.path.join(folder, "pipeline_io.safetensors"))
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    latents, image = ref.run(pipe, sched, call, io["latents"].to(torch.bfloat16))
    f64, i64 = io["final_latents_f64"], io["image_f64"]
    for name, ours, truth in (("final latents", latents, f64), ("image", image, i64)):
        e16 = float((ours.double() - truth).pow(2).mean().sqrt())
        e32 = float((io[("final_latents" if name != "image" else "image") + "_f32"].double() - truth).pow(2).mean().sqrt())
        print(f"  {sub} {name}: rms(bf16 - f64) {e16:.3e}, rms(f32 - f64) {e32:.3e}")
    meta = dict(ref.META, pipeline=type(pipe).__name__, torch_dtype="bfloat16",
                note="DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16), latents of pipeline_io")
    write_st(os.path.join(folder, "pipeline_bf16.safetensors"),
             [("final_latents_bf16", latents.float()), ("image_bf16", image.float())], meta)


def main():
    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    hw = ref.LATENT_HW * 2  # the tiny VAE's factor 2
    bf16_run(os.path.join("sd3", "pipeline"),
             dict(prompt=ref.PROMPT, negative_prompt=ref.NEGATIVE_PROMPT, height=hw, width=hw,
                  guidance_scale=ref.SD3_GUIDANCE, max_sequence_length=ref.MAX_SEQ))
    bf16_run(os.path.join("flux", "pipeline_schnell"),
             dict(prompt=ref.PROMPT, height=hw, width=hw, guidance_scale=0.0, max_sequence_length=ref.MAX_SEQ))


if __name__ == "__main__":
    main()
