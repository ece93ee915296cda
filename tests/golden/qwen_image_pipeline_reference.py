"""A tiny QwenImage21Pipeline folder made by the installed diffusers 0.42.1 / transformers 5.25.0 (torch 2.13.0), with
its inputs and outputs in float32 and float64. Not run by CI; rerun by hand after qwen3_vl_text_reference.py
(deterministic; rewrites tests/golden/qwen_image/pipeline/):

    .venv/bin/python tests/golden/qwen_image_pipeline_reference.py

Every component is the installed class (nothing stubbed), saved with pipeline.save_pretrained:
  transformer/  QwenImage21Transformer2DModel: 2 blocks, 2 heads of 8, context_in_dim 32, 4 latent channels,
                causal_condition (so the pipeline runs its prefix KV cache), weights moved off their initialisation
                (p += 0.2 randn);
  vae/          AutoencoderKLQwenImage21 with the pipeline's 16x (five levels of width 4, one resnet each, the
                release's temporal pattern), 4 channels (RGBA), per-channel latent statistics, p += 0.1 randn;
  text_encoder/ the Qwen3VLForConditionalGeneration of tests/golden/qwen_image/text_path (files copied: one blob);
  processor/    a Qwen3VLProcessor over that folder's byte-level BPE tokenizer, with the chat template
                qwen3_vl_text_reference.py uses;
  scheduler/    FlowMatchEulerDiscreteScheduler with Qwen-Image's published settings (dynamic exponential shifting,
                base_shift = max_shift = log 3, shift_terminal 0.02, image_seq_len 256 .. 8192).

pipeline_io.safetensors: two prompts of different lengths (right-padded states), a negative prompt and
true_cfg_scale 4, 3 steps of sigmas linspace(1, 1/3, 3) with mu of the 8 latent tokens (a 64 x 32 image), the
initial latents as the pipeline draws them (packed [2, 8, 4]), the prompt embeddings and masks of encode_prompt, the
scheduler's sigmas, the final latents (packed) and the image (output_type "pt", [2, 4, 64, 32] in [0, 1]) of the
float32 and the float64 pipeline, the same float32 run without the KV cache (use_kv_cache False), and the image of
the first prompt alone with the first row of latents (image_first_prompt_*: another image than the batch's first
row: the transformer's output for a row changes with the batch's padded text length). The float64
pipeline: components deep-copied and .double(), under torch.set_default_dtype(float64), with the scheduler module
loaded again from its source with float32 -> float64 (sd_reference.f64_scheduler_class), the transformer's
timestep sinusoid in float64 and its RoPE tables and rotations in complex128 (f64_truth.py: diffusers keeps them in
complex64, whose float32 cos / sin differ in the last bit between Intel's and AMD's oneMKL kernels; three guided
steps amplify that past the float32 run's own error, so the truth is made float64 there).
"""
import copy
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sd_reference as sdr  # noqa: E402  (asserts the pinned versions)
from f64_truth import float64_qwen21_rope, float64_sinusoids  # noqa: E402
from qwen3_vl_text_reference import TEMPLATE  # noqa: E402
from st_io import write_st  # noqa: E402

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import (AutoencoderKLQwenImage21, DiffusionPipeline, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       QwenImage21Pipeline, QwenImage21Transformer2DModel)
from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration,  # noqa: E402
                          Qwen3VLProcessor)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # noqa: E402

OUT = os.path.join(HERE, "qwen_image", "pipeline")
TEXT = os.path.join(HERE, "qwen_image", "text_path")
PROMPTS = ["a cat", "A photo of a small red fox sitting in fresh snow, golden hour."]
NEGATIVE = "blurry"
STEPS, GUIDANCE, HEIGHT, WIDTH = 3, 4.0, 64, 32
SCHEDULER = dict(base_image_seq_len=256, base_shift=math.log(3), max_image_seq_len=8192, max_shift=math.log(3),
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                 use_dynamic_shifting=True)
TRANSFORMER = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                   num_attention_heads=2, context_in_dim=32, mlp_ratio=2, axes_dims_rope=[2, 2, 4], eps=1e-6,
                   causal_condition=True)
VAE = dict(base_dim=4, decoder_base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
           temperal_downsample=[False, True, True, True], latents_mean=[0.25, -0.5, 0.0, 1.0],
           latents_std=[1.5, 2.0, 0.5, 1.0], in_channels=4, out_channels=4)


def perturb(model, seed, scale):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def components():
    torch.manual_seed(71)
    transformer = perturb(QwenImage21Transformer2DModel(**TRANSFORMER), 72, 0.2)
    torch.manual_seed(73)
    vae = perturb(AutoencoderKLQwenImage21(**VAE), 74, 0.1)
    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(TEXT, "text_encoder")).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(TEXT, "tokenizer"))
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tok,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=TEMPLATE)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                transformer=transformer)


def run(pipe, latents, use_kv_cache=True, prompts=PROMPTS):
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=prompts, negative_prompt=[NEGATIVE] * len(prompts), true_cfg_scale=GUIDANCE, height=HEIGHT, width=WIDTH,
                num_inference_steps=STEPS, latents=latents, use_kv_cache=use_kv_cache)
    with torch.no_grad():
        final = pipe(**call, output_type="latent").images
        image = pipe(**call, output_type="pt").images
    return final, image


def main():
    c32 = components()
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    pipe = QwenImage21Pipeline(**c32)
    pipe.save_pretrained(OUT)
    # the text encoder's files as text_path holds them (one git blob)
    shutil.rmtree(os.path.join(OUT, "text_encoder"))
    shutil.copytree(os.path.join(TEXT, "text_encoder"), os.path.join(OUT, "text_encoder"))

    g = torch.Generator().manual_seed(75)
    tokens = (HEIGHT // 16) * (WIDTH // 16)
    latents = torch.randn(len(PROMPTS), tokens, TRANSFORMER["in_channels"], generator=g)
    with torch.no_grad():
        e32, m32, _ = pipe.encode_prompt(PROMPTS, device="cpu")
        n32, nm32, _ = pipe.encode_prompt([NEGATIVE] * len(PROMPTS), device="cpu")
    l32, i32 = run(pipe, latents)
    nc_l32, nc_i32 = run(pipe, latents, use_kv_cache=False)
    # the first prompt alone (what `dew sample --pipeline` runs): its row differs from the batch's (the transformer's
    # output for a row changes with the batch's padded text length)
    _, one32 = run(pipe, latents[:1], prompts=PROMPTS[:1])
    sigmas32 = pipe.scheduler.sigmas.double().clone()

    s64_cls, n_rep = sdr.f64_scheduler_class(FlowMatchEulerDiscreteScheduler)
    c64 = {k: (copy.deepcopy(v).double().eval() if isinstance(v, torch.nn.Module) else v) for k, v in c32.items()}
    with sdr.default_dtype(torch.float64), float64_sinusoids(), float64_qwen21_rope(c64["transformer"]):
        c64["scheduler"] = s64_cls.from_config(c32["scheduler"].config)
        pipe64 = QwenImage21Pipeline(**c64)
        with torch.no_grad():
            e64, _, _ = pipe64.encode_prompt(PROMPTS, device="cpu")
            n64, _, _ = pipe64.encode_prompt([NEGATIVE] * len(PROMPTS), device="cpu")
        l64, i64 = run(pipe64, latents.double())
        _, one64 = run(pipe64, latents[:1].double(), prompts=PROMPTS[:1])
        sigmas64 = pipe64.scheduler.sigmas.clone()
    assert l64.dtype == torch.float64

    back = DiffusionPipeline.from_pretrained(OUT)
    assert type(back) is QwenImage21Pipeline, type(back)
    l_again, _ = run(back, latents)
    assert torch.equal(l_again, l32), "the saved folder does not reproduce the run"
    print(f"sigmas {sigmas32.tolist()}; embeds {tuple(e32.shape)} mask {m32.sum(1).tolist()}; final latents rms "
          f"{float(l64.pow(2).mean().sqrt()):.4g} f32-f64 {float((l32.double() - l64).abs().max()):.2e}; image "
          f"f32-f64 {float((i32.double() - i64).abs().max()):.2e}; no cache - cache "
          f"{float((nc_l32 - l32).abs().max()):.2e}")
    meta = {"versions": json.dumps({"diffusers": diffusers.__version__, "transformers": transformers.__version__,
                                    "torch": torch.__version__, "numpy": np.__version__}, sort_keys=True),
            "prompts": json.dumps(PROMPTS), "negative_prompt": NEGATIVE, "steps": str(STEPS),
            "true_cfg_scale": str(GUIDANCE), "height": str(HEIGHT), "width": str(WIDTH),
            "f64_scheduler": f"scheduling_flow_match_euler_discrete.py with float32 -> float64 ({n_rep} names)"}
    write_st(os.path.join(OUT, "pipeline_io.safetensors"),
             [("latents", latents), ("prompt_embeds_f32", e32), ("prompt_embeds_f64", e64),
              ("prompt_embeds_mask", m32 if m32 is not None else torch.ones(e32.shape[:2], dtype=torch.long)),
              ("negative_prompt_embeds_f32", n32), ("negative_prompt_embeds_f64", n64),
              ("sigmas_f32", sigmas32), ("sigmas_f64", sigmas64),
              ("final_latents_f32", l32), ("final_latents_f64", l64), ("image_f32", i32), ("image_f64", i64),
              ("final_latents_no_cache_f32", nc_l32), ("image_no_cache_f32", nc_i32),
              ("image_first_prompt_f32", one32), ("image_first_prompt_f64", one64)], meta)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
