"""Tiny StableDiffusion3Pipeline and FluxPipeline folders made by the installed diffusers 0.42.1 / transformers 5.25.0
(torch 2.13.0), with their inputs and outputs in float32 and float64. Not run by CI; rerun by hand (deterministic,
rewrites tests/golden/sd3/pipeline and tests/golden/flux/pipeline_{schnell,dev}):

    .venv/bin/python tests/golden/sd3_flux_pipeline_reference.py

Every component is the installed class (nothing stubbed), built from a tiny config with weights moved off their
initialisation (p += 0.2 randn, sd_reference.perturb_), saved with pipeline.save_pretrained:

  sd3/pipeline: SD3Transformer2DModel, AutoencoderKL (16 latent channels, scaling 1.5305, shift 0.0609: the
    tests/golden/sd/vae_sd3 model), CLIPTextModelWithProjection x 2 (CLIP-L, CLIP-G shapes in miniature) with
    sd_reference's tiny CLIP BPE tokenizer (tokenizer_2 pads with "!" as SD3's does), T5EncoderModel (v1.1
    gated-gelu) with tests/golden/text_encoders/t5_tokenizer/spiece.model as T5Tokenizer, and
    FlowMatchEulerDiscreteScheduler(shift 3.0) (SD3 medium's).
  flux/pipeline_schnell: FluxTransformer2DModel (no guidance embedding), the same VAE, CLIPTextModel, T5EncoderModel
    and the FLUX.1-schnell scheduler (shift 1, no dynamic shifting; the pipeline passes sigmas and mu).
  flux/pipeline_dev: the same with the guidance embedding (guidance_scale 3.5) and FLUX.1-dev's scheduler
    (shift 3, use_dynamic_shifting: mu from the packed sequence length).

pipeline_io.safetensors in each folder: the token ids of each tokenizer, the prompt embeddings of encode_prompt
(float32 and float64), the initial latents (SD3: [1, 16, 8, 8]; Flux: packed [1, 16, 64]), the final latents
(before the VAE) and the image (output_type "pt", [0, 1] NCHW) of the float32 and float64 pipelines. The float64
pipeline: components deep-copied and .double(), under torch.set_default_dtype(float64), with the scheduler module
loaded again from its source with float32 -> float64 (sd_reference.f64_scheduler_class), and the transformer's
timestep / guidance sinusoid in float64 (tests/golden/f64_truth.py).
"""
import copy
import json
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sd_reference as sdr  # noqa: E402  (asserts the pinned versions)
from f64_truth import float64_sinusoids  # noqa: E402
from st_io import write_st  # noqa: E402

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import (AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FluxPipeline,  # noqa: E402
                       FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel, T5Tokenizer  # noqa: E402

PROMPT = sdr.PROMPT
NEGATIVE_PROMPT = sdr.NEGATIVE_PROMPT
STEPS = 4
SD3_GUIDANCE = 5.0
FLUX_DEV_GUIDANCE = 3.5
MAX_SEQ = 16  # max_sequence_length (T5 tokens)
PROMPT_3 = "a cat, on the moon, photographed"  # SD3's prompt_3 (T5) beside sd_reference's PROMPT_2 (CLIP-G)
NEGATIVE_PROMPT_3 = "blurry"
LATENT_HW = 8  # latents 8 x 8 -> 16 x 16 images (the VAE's factor 2)
T5_SPM = os.path.join(HERE, "text_encoders", "t5_tokenizer")
VAE_DIR = os.path.join(HERE, "sd", "vae_sd3")
META = {"versions": json.dumps({"diffusers": diffusers.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__, "numpy": np.__version__}, sort_keys=True),
        "prompt": PROMPT, "steps": str(STEPS), "max_sequence_length": str(MAX_SEQ)}


def t5_encoder(seed):
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                   dropout_rate=0.0, is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return sdr.perturb_(T5EncoderModel(cfg), seed + 1).eval()


def t5_tokenizer():
    return T5Tokenizer.from_pretrained(T5_SPM, model_max_length=MAX_SEQ, extra_ids=0, legacy=True)


def vae():
    return AutoencoderKL.from_pretrained(VAE_DIR).eval()


def copy_spiece(folder, sub):
    # transformers 5 saves the tokenizers-backed T5 tokenizer as tokenizer.json (324 kB here); real SD3 / Flux
    # folders also carry spiece.model, which is what dew reads. The folder keeps spiece.model only, from which
    # transformers builds the same tokenizer (the reload in pair() checks the whole folder runs the same).
    dst = os.path.join(folder, sub, "spiece.model")
    if not os.path.isfile(dst):
        shutil.copy(os.path.join(T5_SPM, "spiece.model"), dst)
    os.remove(os.path.join(folder, sub, "tokenizer.json"))


def run(pipe, sched, call, latents):
    pipe.scheduler = sched
    pipe.set_progress_bar_config(disable=True)
    last = []

    def grab(p, i, t, kw):
        last.append(kw["latents"].clone())
        return kw

    with torch.no_grad():
        image = pipe(**call, latents=latents, num_inference_steps=STEPS, output_type="pt",
                     callback_on_step_end=grab, callback_on_step_end_tensor_inputs=["latents"]).images
    assert len(last) == STEPS
    return last[-1], image


def pair(cls, components, folder, call, latents):
    cfg = FlowMatchEulerDiscreteScheduler.load_config(os.path.join(folder, "scheduler"))
    s64_cls, n_rep = sdr.f64_scheduler_class(FlowMatchEulerDiscreteScheduler)
    c64 = {k: (copy.deepcopy(v).double().eval() if isinstance(v, torch.nn.Module) else v)
           for k, v in components.items()}
    sch32 = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    l32, i32 = run(cls(**components), sch32, call, latents)
    with sdr.default_dtype(torch.float64), float64_sinusoids():
        sch64 = s64_cls.from_config(cfg)
        l64, i64 = run(cls(**c64), sch64, call, latents.double())
    assert l64.dtype == torch.float64 and sch64.sigmas.dtype == torch.float64
    back = DiffusionPipeline.from_pretrained(folder)
    assert type(back) is cls, type(back)
    l_again, i_again = run(back, FlowMatchEulerDiscreteScheduler.from_config(cfg), call, latents)
    d_again = float((l_again - l32).abs().max())
    print(f"  reloaded folder: final latents max |diff| {d_again:.2e}")
    assert d_again <= 1e-5 * float(l32.abs().max()), d_again
    print(f"  {cls.__name__}: sigmas {sch32.sigmas.tolist()}\n  final latents rms {float(l64.pow(2).mean().sqrt()):.4g}"
          f" f32-f64 {float((l32.double() - l64).abs().max()):.2e}; image f32-f64 "
          f"{float((i32.double() - i64).abs().max()):.2e}")
    return [("sigmas_f32", sch32.sigmas.double()), ("sigmas_f64", sch64.sigmas.clone()),
            ("timesteps_f32", sch32.timesteps.double()), ("timesteps_f64", sch64.timesteps.clone()),
            ("final_latents_f32", l32), ("final_latents_f64", l64), ("image_f32", i32), ("image_f64", i64)], n_rep


def encode_pair(cls, components, names, kwargs):
    with torch.no_grad():
        e32 = dict(zip(names, cls(**components).encode_prompt(**kwargs)))
        c64 = {k: (copy.deepcopy(v).double().eval() if isinstance(v, torch.nn.Module) else v)
               for k, v in components.items()}
        with sdr.default_dtype(torch.float64):
            e64 = dict(zip(names, cls(**c64).encode_prompt(**kwargs)))
    out = []
    for n in names:
        if torch.is_tensor(e32[n]) and e32[n].is_floating_point():
            out += [(n + "_f32", e32[n]), (n + "_f64", e64[n])]
    return out


def sd3_pipeline():
    tok_src = "/tmp/sd3_flux_reference/tokenizer_src"
    vocab = sdr.write_tokenizer_sources(tok_src)
    tokenizer, tokenizer_2, tokenizer_3 = sdr.make_tokenizer(tok_src), sdr.make_tokenizer(tok_src, "!"), t5_tokenizer()
    # CLIP-L hidden 8 + CLIP-G hidden 16 = 24 <= T5's 32 (padded); pooled 12 + 20 = 32 = pooled_projection_dim
    te1_cfg = sdr.text_config(vocab, 8, 2, 3, 16, 12)
    te2_cfg = sdr.text_config(vocab, 16, 2, 3, 32, 20, act="gelu")
    te1 = sdr.make_text_encoder(CLIPTextModelWithProjection, te1_cfg, seed=900)
    te2 = sdr.make_text_encoder(CLIPTextModelWithProjection, te2_cfg, seed=910)
    te3 = t5_encoder(920)
    torch.manual_seed(930)
    transformer = sdr.perturb_(SD3Transformer2DModel(
        sample_size=LATENT_HW, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
        pos_embed_max_size=8), 931).eval()
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    components = dict(transformer=transformer, scheduler=sched, vae=vae(), text_encoder=te1, tokenizer=tokenizer,
                      text_encoder_2=te2, tokenizer_2=tokenizer_2, text_encoder_3=te3, tokenizer_3=tokenizer_3)
    pipe = StableDiffusion3Pipeline(**components)
    folder = sdr.fresh_dir(os.path.join(HERE, "sd3", "pipeline"))
    pipe.save_pretrained(folder)
    copy_spiece(folder, "tokenizer_3")

    hw = LATENT_HW * pipe.vae_scale_factor
    latents = torch.randn(1, 16, LATENT_HW, LATENT_HW, generator=torch.Generator().manual_seed(940))
    tensors = [("prompt_ids", sdr.token_ids(tokenizer, PROMPT)), ("negative_prompt_ids", sdr.token_ids(tokenizer, NEGATIVE_PROMPT)),
               ("prompt_2_ids", sdr.token_ids(tokenizer_2, PROMPT)),
               ("negative_prompt_2_ids", sdr.token_ids(tokenizer_2, NEGATIVE_PROMPT)),
               ("prompt_3_ids", tokenizer_3(PROMPT, padding="max_length", max_length=MAX_SEQ, truncation=True,
                                            return_tensors="pt").input_ids),
               ("negative_prompt_3_ids", tokenizer_3(NEGATIVE_PROMPT, padding="max_length", max_length=MAX_SEQ,
                                                     truncation=True, return_tensors="pt").input_ids),
               ("latents", latents)]
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    tensors += encode_pair(StableDiffusion3Pipeline, components, names,
                           dict(prompt=PROMPT, prompt_2=None, prompt_3=None, device="cpu", num_images_per_prompt=1,
                                do_classifier_free_guidance=True, negative_prompt=NEGATIVE_PROMPT,
                                max_sequence_length=MAX_SEQ))
    # prompt_2 / prompt_3 (and their negatives) given apart: CLIP-G reads the second, T5 the third
    tensors += [("{}_23_{}".format(*n.rsplit("_", 1)), t)
                for n, t in encode_pair(StableDiffusion3Pipeline, components, names,
                                        dict(prompt=PROMPT, prompt_2=sdr.PROMPT_2, prompt_3=PROMPT_3, device="cpu",
                                             num_images_per_prompt=1, do_classifier_free_guidance=True,
                                             negative_prompt=NEGATIVE_PROMPT, negative_prompt_2=sdr.NEGATIVE_PROMPT_2,
                                             negative_prompt_3=NEGATIVE_PROMPT_3, max_sequence_length=MAX_SEQ))]
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=hw, width=hw, guidance_scale=SD3_GUIDANCE,
                max_sequence_length=MAX_SEQ)
    out, n_rep = pair(StableDiffusion3Pipeline, components, folder, call, latents)
    tensors += out
    meta = dict(META, pipeline="StableDiffusion3Pipeline", negative_prompt=NEGATIVE_PROMPT,
                guidance_scale=str(SD3_GUIDANCE), height=str(hw), width=str(hw),
                f64_scheduler=f"scheduling_flow_match_euler_discrete.py with float32 -> float64 ({n_rep} names)")
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def flux_pipeline(dev):
    tok_src = "/tmp/sd3_flux_reference/tokenizer_src"
    vocab = sdr.write_tokenizer_sources(tok_src)
    tokenizer, tokenizer_2 = sdr.make_tokenizer(tok_src), t5_tokenizer()
    te1_cfg = sdr.text_config(vocab, 16, 2, 2, 32, 16)
    te1 = sdr.make_text_encoder(CLIPTextModel, te1_cfg, seed=1000)
    te2 = t5_encoder(1010)
    torch.manual_seed(1020)
    transformer = sdr.perturb_(FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=dev,
        axes_dims_rope=(2, 2, 4)), 1021).eval()
    # FLUX.1-schnell's / FLUX.1-dev's scheduler_config.json
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0 if dev else 1.0, use_dynamic_shifting=dev, base_shift=0.5,
                                            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    components = dict(transformer=transformer, scheduler=sched, vae=vae(), text_encoder=te1, tokenizer=tokenizer,
                      text_encoder_2=te2, tokenizer_2=tokenizer_2, image_encoder=None, feature_extractor=None)
    pipe = FluxPipeline(**components)
    folder = sdr.fresh_dir(os.path.join(HERE, "flux", "pipeline_dev" if dev else "pipeline_schnell"))
    pipe.save_pretrained(folder)
    copy_spiece(folder, "tokenizer_2")

    hw = LATENT_HW * pipe.vae_scale_factor * 2 // 2  # vae_scale_factor 2 x the 2x2 packing: latents 8x8 -> 4x4 tokens
    g = torch.Generator().manual_seed(1040)
    latents = torch.randn(1, 16, LATENT_HW, LATENT_HW, generator=g)
    packed = FluxPipeline._pack_latents(latents, 1, 16, LATENT_HW, LATENT_HW)
    tensors = [("prompt_ids", sdr.token_ids(tokenizer, PROMPT)),
               ("prompt_2_ids", tokenizer_2(PROMPT, padding="max_length", max_length=MAX_SEQ, truncation=True,
                                            return_tensors="pt").input_ids),
               ("latents_unpacked", latents), ("latents", packed)]
    names = ("prompt_embeds", "pooled_prompt_embeds", "text_ids")
    tensors += encode_pair(FluxPipeline, components, names,
                           dict(prompt=PROMPT, prompt_2=None, device="cpu", num_images_per_prompt=1,
                                max_sequence_length=MAX_SEQ))
    guidance = FLUX_DEV_GUIDANCE if dev else 0.0
    call = dict(prompt=PROMPT, height=hw, width=hw, guidance_scale=guidance, max_sequence_length=MAX_SEQ)
    out, n_rep = pair(FluxPipeline, components, folder, call, packed)
    tensors += out
    meta = dict(META, pipeline="FluxPipeline", guidance_scale=str(guidance), height=str(hw), width=str(hw),
                transformer="FLUX.1 dev (guidance_embeds)" if dev else "FLUX.1 schnell (no guidance embedding)",
                f64_scheduler=f"scheduling_flow_match_euler_discrete.py with float32 -> float64 ({n_rep} names)")
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def main():
    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    sd3_pipeline()
    flux_pipeline(dev=False)
    flux_pipeline(dev=True)


if __name__ == "__main__":
    main()
