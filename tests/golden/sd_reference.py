"""Stable Diffusion goldens from the reference code as installed from requirements.txt: diffusers 0.42.1
(UNet2DConditionModel, AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline,
StableDiffusionXLPipeline) and transformers 5.25.0 (CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer), on
torch 2.13.0 (CPU) and tiny configurations. Not run by CI; rerun by hand (deterministic, rewrites everything under
tests/golden/sd/):

    .venv/bin/python tests/golden/sd_reference.py

Nothing is stubbed, patched or fetched: the packages are imported as installed, safetensors files are written and
read by the safetensors package (tests/golden/st_io.py), folders by the libraries' own save_pretrained.

Attention: what a user of these packages gets by default on torch 2. diffusers' Attention modules use
AttnProcessor2_0 (F.scaled_dot_product_attention; asserted), transformers' CLIP uses attn_implementation "sdpa"
(asserted). SDPA runs in float64 on the CPU, so the float64 runs are float64 all through the attention: unlike
the classic AttnProcessor of the earlier goldens (torch 1.13), AttnProcessor2_0 does not apply upcast_attention /
upcast_softmax (those cast to float32 only to protect half precision), and transformers' eager CLIP attention
(which forces a float32 softmax) is not used.

Numerics: every model is built under torch.manual_seed, every parameter moved off its initialisation
(p += 0.2 randn; norm weights become 1 + 0.2 randn), then run in float32 (`*_f32`) and as a float64 deep copy
(`*_f64`) on the same inputs widened to float64, under torch.set_default_dtype(torch.float64) (the reference
makes some tensors, e.g. masks and scheduler constants, in the default dtype). For the pipelines the float64 run
also uses float64 schedulers: the scheduler module's own source with every torch.float32 / np.float32 replaced by
float64 (betas, alphas_cumprod, Euler's sigmas/timesteps and the Euler step's float32 upcast), see
f64_scheduler_class. The reference's other float32-forced step, the UNet's sinusoidal timestep embedding, is
left as it is (README lists it).

The pipelines reuse the unet_sd / unet_sdxl / vae models, so their unet/ and vae/ files are byte-identical to
those folders' (one git blob each). Every saved folder is reloaded with the libraries' from_pretrained
(UNet2DConditionModel, AutoencoderKL, DiffusionPipeline) and must reproduce the float32 outputs bit for bit.
See tests/golden/sd/README.md for the files, tensors and settings.
"""
import contextlib
import copy
import inspect
import json
import os
import shutil
import sys
import types

import numpy as np
import safetensors
import torch
import torch.nn as nn
import transformers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

import diffusers
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "sd")
sys.path.insert(0, HERE)
from st_io import write_st  # noqa: E402

PINNED = {"torch": "2.13.0", "diffusers": "0.42.1", "transformers": "5.25.0", "safetensors": "0.8.0"}
VERSIONS = {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__}
for _pkg, _ver in PINNED.items():
    assert VERSIONS[_pkg].split("+")[0] == _ver, f"{_pkg} {VERSIONS[_pkg]} installed, requirements.txt pins {_ver}"

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--import-only":
    print("imports ok", VERSIONS)
    sys.exit(0)

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
SOURCE = f"diffusers {diffusers.__version__}"
CLIP_SOURCE = f"transformers {transformers.__version__} CLIPTextModel / CLIPTextModelWithProjection / CLIPTokenizer"
COMMON_META = {
    "torch": torch.__version__,
    "versions": json.dumps(VERSIONS, sort_keys=True),
    "attention": "diffusers AttnProcessor2_0 (F.scaled_dot_product_attention, diffusers' default on torch 2; "
                 "upcast_attention / upcast_softmax do not apply), CLIP attn_implementation sdpa (transformers' "
                 "default)",
    "perturbation": "every parameter p += 0.2 * randn (torch.Generator seeded per case)",
    "f64": "float64 deep copy (.double()) on the float32 inputs widened, under torch.set_default_dtype(float64)",
}


# ----------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def perturb_(model, seed):
    """Move every parameter off its initialisation: p += 0.2 randn (norm weights become 1 + 0.2 randn)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def check_attention(model):
    atts = [m for m in model.modules() if isinstance(m, Attention)]
    bad = [type(m.processor).__name__ for m in atts if type(m.processor) is not AttnProcessor2_0]
    assert not bad, bad
    return len(atts)


def widen(v):
    return v.double() if torch.is_tensor(v) and v.is_floating_point() else v


def run_f32_f64(model, fn, inputs):
    """fn(model, **inputs) -> {name: tensor}; returns ({name_f32: ...}, {name_f64: ...}) and the f64 model."""
    model.eval()
    with torch.no_grad():
        out32 = fn(model, **inputs)
        m64 = copy.deepcopy(model).double().eval()
        with default_dtype(torch.float64):
            out64 = fn(m64, **{k: widen(v) for k, v in inputs.items()})
    for k in out32:
        assert out32[k].dtype == torch.float32 and out64[k].dtype == torch.float64, (k, out32[k].dtype, out64[k].dtype)
    return out32, out64


def rel_err(a, b):
    return float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300))


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def io_tensors(inputs, out32, out64):
    t = [(k, v) for k, v in inputs.items()]
    for k in out32:
        t += [(k + "_f32", out32[k]), (k + "_f64", out64[k])]
    return t


def summary(name, out32, out64):
    for k in out32:
        print(f"  {name}.{k}: shape {tuple(out32[k].shape)} rms {float(out64[k].pow(2).mean().sqrt()):.4g} "
              f"rel rms(f32 - f64) {rel_err(out32[k], out64[k]):.3g}")


# ----------------------------------------------------------------------------------------------------
# UNet2DConditionModel cases
# ----------------------------------------------------------------------------------------------------
SD_BLOCKS = dict(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
XL_BLOCKS = dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))

UNET_CASES = {
    # SD 1.x: conv proj_in/proj_out, attention_head_dim (= number of heads in diffusers' legacy naming) an int
    "unet_sd": dict(seed=100, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **SD_BLOCKS, block_out_channels=(16, 32), layers_per_block=2,
        norm_num_groups=8, cross_attention_dim=16, attention_head_dim=4, use_linear_projection=False)),
    # SD inpainting: 9 input channels (4 noisy latents + 1 mask + 4 masked-image latents)
    "unet_inpaint": dict(seed=200, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=9, out_channels=4, **SD_BLOCKS, block_out_channels=(8, 16), layers_per_block=2,
        norm_num_groups=4, cross_attention_dim=16, attention_head_dim=2, use_linear_projection=False)),
    # SD 2.x: linear proj_in/proj_out, per-level attention_head_dim list, upcast_attention
    "unet_sd2": dict(seed=300, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **SD_BLOCKS, block_out_channels=(8, 16), layers_per_block=2,
        norm_num_groups=4, cross_attention_dim=24, attention_head_dim=[2, 4], use_linear_projection=True,
        upcast_attention=True, flip_sin_to_cos=True, freq_shift=0)),
    # SDXL: three levels, transformer depth per level, text_time added conditioning
    "unet_sdxl": dict(seed=400, hw=16, ctx_len=10, sdxl_pooled=32, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **XL_BLOCKS, block_out_channels=(8, 16, 16), layers_per_block=1,
        norm_num_groups=4, cross_attention_dim=32, attention_head_dim=[2, 2, 4], transformer_layers_per_block=[1, 1, 2],
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8)),
}

SDXL_TIME_IDS = [[64.0, 64.0, 0.0, 0.0, 64.0, 64.0], [48.0, 80.0, 4.0, 8.0, 64.0, 56.0]]


def unet_forward(m, sample, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
    added = None if text_embeds is None else {"text_embeds": text_embeds, "time_ids": time_ids}
    return {"out": m(sample, timestep, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added).sample}


PARITY_ABOUT = ("Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers "
                "forward (dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or "
                "{reference name: io name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden "
                "rule; a float64 load agrees with NAME_f64 to float64_rel (relative rms).")


def write_parity(folder, cases, float64_rel, why):
    """parity.json: the cases the reference-parity suite runs on this folder, and its float64 tolerance."""
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump({"about": PARITY_ABOUT, "float64_rel": float64_rel, "float64_rel_why": why, "cases": cases}, f,
                  indent=2)
        f.write("\n")


def make_unet(case):
    torch.manual_seed(case["seed"])
    return perturb_(UNet2DConditionModel(**case["config"]), case["seed"] + 1).eval()


def unet_inputs(case, batch=2):
    cfg = case["config"]
    g = torch.Generator().manual_seed(case["seed"] + 2)
    inputs = {
        "sample": torch.randn(batch, cfg["in_channels"], case["hw"], case["hw"], generator=g),
        "timestep": torch.tensor([999.0, 261.0][:batch], dtype=torch.float32),
        "encoder_hidden_states": torch.randn(batch, case["ctx_len"], cfg["cross_attention_dim"], generator=g),
    }
    if case.get("sdxl_pooled"):
        inputs["text_embeds"] = torch.randn(batch, case["sdxl_pooled"], generator=g)
        inputs["time_ids"] = torch.tensor(SDXL_TIME_IDS[:batch], dtype=torch.float32)
    return inputs


def run_unet_case(name, case):
    model = make_unet(case)
    n_att = check_attention(model)
    inputs = unet_inputs(case)
    out32, out64 = run_f32_f64(model, unet_forward, inputs)
    folder = fresh_dir(os.path.join(OUT_DIR, name))
    model.save_pretrained(folder)
    back = UNet2DConditionModel.from_pretrained(folder).eval()
    check_attention(back)
    with torch.no_grad():
        assert torch.equal(unet_forward(back, **inputs)["out"], out32["out"]), name
    meta = dict(COMMON_META, source=SOURCE + " UNet2DConditionModel", case=name,
                config=json.dumps(case["config"]), seed=str(case["seed"]), attention_modules=str(n_att),
                inputs="sample randn; timestep float32 [999, 261] (one per row); encoder_hidden_states randn"
                       + ("; text_embeds randn; time_ids (orig_h, orig_w, crop_top, crop_left, target_h, target_w)"
                          if case.get("sdxl_pooled") else ""),
                outputs="out = model(sample, timestep, encoder_hidden_states"
                        + (", added_cond_kwargs={text_embeds, time_ids}" if case.get("sdxl_pooled") else "")
                        + ").sample")
    write_st(os.path.join(folder, "io.safetensors"), io_tensors(inputs, out32, out64), meta)
    # upcast_attention does not apply under AttnProcessor2_0 (SDPA), so unet_sd2's float64 run is float64 in its
    # attention too; what stays float32 in every UNet is the sinusoidal timestep embedding.
    rel, why = 5e-8, ("diffusers computes the timestep embedding in float32 even in its float64 model, and "
                      "float32 exp / sin / cos differ in the last bit between LibTorch builds "
                      "(tests/golden_util.h kUnetFloat64Rel)")
    write_parity(folder, [{"method": "forward", "inputs": list(inputs), "outputs": {"sample": "out"}}], rel, why)
    summary(name, out32, out64)
    return model


# ----------------------------------------------------------------------------------------------------
# AutoencoderKL cases
# ----------------------------------------------------------------------------------------------------
VAE_CASES = {
    "vae": dict(seed=500, config=dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
        norm_num_groups=8, sample_size=32, scaling_factor=0.18215)),
    "vae_sd3": dict(seed=600, config=dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=16,
        norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
        use_post_quant_conv=False)),
}
VAE_FLOAT64_REL = 1e-10  # dew --dtype float64 vs this float64 truth measured at ~1e-15 relative
VAE_TILING = dict(tile_sample_min_size=32, tile_latent_min_size=16, tile_overlap_factor=0.25)
VAE_TILED_LATENT = {"vae": (32, 32), "vae_sd3": (16, 24)}  # latent H, W of z_tiled (tiles of 16 every 12)


def vae_forward(m, sample, z, z_tiled=None):
    dist = m.encode(sample).latent_dist
    out = {"latent_mean": dist.mean, "latent_logvar": dist.logvar, "decoded": m.decode(z).sample}
    if z_tiled is not None:
        m.enable_tiling()
        for k, v in VAE_TILING.items():
            setattr(m, k, v)
        out["tiled_decoded"] = m.decode(z_tiled).sample
        m.disable_tiling()
    return out


def run_vae_case(name, case):
    cfg = case["config"]
    torch.manual_seed(case["seed"])
    model = perturb_(AutoencoderKL(**cfg), case["seed"] + 1).eval()
    n_att = check_attention(model)
    g = torch.Generator().manual_seed(case["seed"] + 2)
    f = 2 ** (len(cfg["block_out_channels"]) - 1)
    inputs = {
        "sample": torch.rand(2, 3, 16, 16, generator=g) * 2 - 1,
        "z": torch.randn(2, cfg["latent_channels"], 16 // f, 16 // f, generator=g),
        "z_tiled": torch.randn(1, cfg["latent_channels"], *VAE_TILED_LATENT[name], generator=g),
    }
    out32, out64 = run_f32_f64(model, vae_forward, inputs)
    folder = fresh_dir(os.path.join(OUT_DIR, name))
    model.save_pretrained(folder)
    back = AutoencoderKL.from_pretrained(folder).eval()
    with torch.no_grad():
        again = vae_forward(back, **inputs)
    for k in out32:
        assert torch.equal(again[k], out32[k]), (name, k)
    meta = dict(COMMON_META, source=SOURCE + " AutoencoderKL", case=name, config=json.dumps(cfg),
                seed=str(case["seed"]), attention_modules=str(n_att),
                inputs="sample = 2 rand - 1 (image in [-1, 1]); z randn; z_tiled randn",
                outputs="latent_mean/latent_logvar = encode(sample).latent_dist.mean/.logvar (logvar clamped to "
                        "[-30, 20]); decoded = decode(z).sample; tiled_decoded = decode(z_tiled).sample after "
                        "enable_tiling() with the tiling attributes below",
                tiling=json.dumps(VAE_TILING))
    write_st(os.path.join(folder, "io.safetensors"), io_tensors(inputs, out32, out64), meta)
    write_parity(folder, [
        {"method": "encode", "inputs": ["sample"],
         "outputs": {"latent_mean": "latent_mean", "latent_logvar": "latent_logvar"}},
        {"method": "decode", "inputs": ["z"], "outputs": {"sample": "decoded"}},
        {"method": "tiled_decode", "inputs": {"z": "z_tiled"}, "outputs": {"sample": "tiled_decoded"}},
    ], VAE_FLOAT64_REL, "diffusers' float64 AutoencoderKL is float64 throughout (its mid-block attention runs "
                        "SDPA in float64: upcast_softmax does not apply under AttnProcessor2_0); the tolerance "
                        "leaves room for float64 rounding of another LibTorch build")
    summary(name, out32, out64)
    return model


# ----------------------------------------------------------------------------------------------------
# float64 schedulers
# ----------------------------------------------------------------------------------------------------
_F64_CLASSES = {}


def f64_scheduler_class(cls):
    """The scheduler's own module source with every `torch.float32` / `np.float32` replaced by the float64
    counterpart, executed as a sibling module: betas/alphas_cumprod (DDIM, Euler), Euler's sigmas and timesteps
    (set_timesteps) and Euler.step's `sample.to(torch.float32)` upcast become float64. Nothing else changes."""
    if cls in _F64_CLASSES:
        return _F64_CLASSES[cls]
    mod = sys.modules[cls.__module__]
    src = inspect.getsource(mod)
    n = src.count("torch.float32") + src.count("np.float32")
    src = src.replace("torch.float32", "torch.float64").replace("np.float32", "np.float64")
    m = types.ModuleType(cls.__module__ + "_f64")
    m.__package__ = mod.__package__
    m.__file__ = mod.__file__
    sys.modules[m.__name__] = m
    exec(compile(src, f"{mod.__file__} (float32 -> float64, {n} replacements)", "exec"), m.__dict__)
    _F64_CLASSES[cls] = (getattr(m, cls.__name__), n)
    return _F64_CLASSES[cls]


# ----------------------------------------------------------------------------------------------------
# tiny CLIP tokenizer and text encoders
# ----------------------------------------------------------------------------------------------------
# BPE merges in rank order (each one's parts exist when it applies); the vocabulary is built as OpenAI's CLIP
# builds its own: the 256 byte symbols, the same with "</w>", one entry per merge, <|startoftext|>, <|endoftext|>.
MERGES = [
    "t h", "th e</w>", "o o", "m oo", "moo n</w>", "o n</w>", "o f</w>", "c a", "ca t</w>", "p h", "o t", "ph ot",
    "phot o</w>", "l o", "lo w</w>", "q u", "a l", "qu al", "i t", "r r", "b l", "u rr", "bl urr",
]
PROMPT = "a photo of a cat on the moon"
NEGATIVE_PROMPT = "blurry, low quality"
PROMPT_2 = "the moon, a photo"          # SDXL second prompt (tokenizer_2 / text_encoder_2)
NEGATIVE_PROMPT_2 = "low quality"


def write_tokenizer_sources(folder):
    """vocab.json + merges.txt of the tiny BPE (the inputs CLIPTokenizer is constructed from)."""
    os.makedirs(folder, exist_ok=True)
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in MERGES]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(set(vocab)) == len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return len(vocab)


def make_tokenizer(src_folder, pad_token="<|endoftext|>"):
    """CLIPTokenizer (transformers 5: the tokenizers-backed one) loaded from the vocab.json + merges.txt folder."""
    return CLIPTokenizer.from_pretrained(src_folder, pad_token=pad_token, model_max_length=77)


def text_config(vocab_size, hidden, heads, layers, inter, projection_dim, act="quick_gelu"):
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, projection_dim=projection_dim,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77, hidden_act=act,
        layer_norm_eps=1e-5, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=1)


def make_text_encoder(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation  # the default
    return perturb_(model, seed + 1).eval()


# ----------------------------------------------------------------------------------------------------
# pipelines (their unet/vae are the unet_sd, unet_sdxl and vae cases' models: byte-identical files, one git blob)
# ----------------------------------------------------------------------------------------------------
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
# (SD 1.5's DDIM settings; schedulers for the runs are made from the saved folder's scheduler_config.json)
STEPS = 5
GUIDANCE = 7.5
LATENT_HW = 16  # pipeline latents [1, 4, 16, 16]; the vae case's vae_scale_factor 2 makes 32 x 32 images


def run_pipeline(pipe, latents, scheduler, call_kwargs):
    """Runs pipe(...) with `scheduler`; returns the final latents and the image ([0, 1], NCHW)."""
    pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    steps = []

    def grab(p, i, t, kw):
        steps.append(kw["latents"].clone())
        return kw

    with torch.no_grad():
        image = pipe(**call_kwargs, latents=latents, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                     output_type="pt", callback_on_step_end=grab, callback_on_step_end_tensor_inputs=["latents"]
                     ).images
    assert len(steps) == STEPS
    return {"latents": steps[-1], "image": image}


def pipeline_pair(cls, components, latents, call_kwargs, scheduler_cls, folder):
    """The f32 pipeline and a float64 one (deep-copied .double() models, float64 scheduler class); both schedulers
    are scheduler_cls.from_config(<folder>/scheduler/scheduler_config.json), as a user of the folder makes them."""
    sched_cfg = scheduler_cls.load_config(os.path.join(folder, "scheduler"))
    sch32 = scheduler_cls.from_config(sched_cfg)
    sch64_cls, n_rep = f64_scheduler_class(scheduler_cls)
    sch64 = sch64_cls.from_config(sched_cfg)
    c64 = {k: (copy.deepcopy(v).double().eval() if isinstance(v, nn.Module) else v) for k, v in components.items()}
    out32 = run_pipeline(cls(**components), latents, sch32, call_kwargs)
    with default_dtype(torch.float64):
        out64 = run_pipeline(cls(**c64), latents.double(), sch64, call_kwargs)
    assert sch64.alphas_cumprod.dtype == torch.float64
    extra = {"timesteps": sch32.timesteps.clone()}
    if hasattr(sch32, "sigmas"):
        assert sch64.sigmas.dtype == torch.float64
        extra["sigmas_f32"], extra["sigmas_f64"] = sch32.sigmas.clone(), sch64.sigmas.clone()
    return out32, out64, extra, n_rep


def scheduler_tensors(tag, out32, out64, extra):
    t = [(f"{tag}_timesteps", extra["timesteps"])]
    if "sigmas_f32" in extra:
        t += [(f"{tag}_sigmas_f32", extra["sigmas_f32"]), (f"{tag}_sigmas_f64", extra["sigmas_f64"])]
    for k in ("latents", "image"):
        t += [(f"{tag}_{k}_f32", out32[k]), (f"{tag}_{k}_f64", out64[k])]
    return t


def token_ids(tokenizer, text):
    return tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def sd_pipeline(models):
    tok_src = "/tmp/sd_reference/tokenizer_src"
    vocab_size = write_tokenizer_sources(tok_src)
    tokenizer = make_tokenizer(tok_src)
    te_config = text_config(vocab_size, 16, 4, 2, 64, 16)  # hidden 16 = unet_sd's cross_attention_dim
    text_encoder = make_text_encoder(CLIPTextModel, te_config, seed=700)
    unet, vae = models["unet_sd"], models["vae"]
    components = dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                      scheduler=DDIMScheduler(**SCHEDULER_CONFIG), safety_checker=None, feature_extractor=None,
                      image_encoder=None, requires_safety_checker=False)
    pipe = StableDiffusionPipeline(**components)
    folder = fresh_dir(os.path.join(OUT_DIR, "pipeline"))
    pipe.save_pretrained(folder)

    height = width = LATENT_HW * pipe.vae_scale_factor
    g = torch.Generator().manual_seed(730)
    latents = torch.randn(1, 4, LATENT_HW, LATENT_HW, generator=g)
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=height, width=width, eta=0.0)
    with torch.no_grad():
        pe32, ne32 = pipe.encode_prompt(PROMPT, "cpu", 1, True, negative_prompt=NEGATIVE_PROMPT)
        te64 = copy.deepcopy(text_encoder).double().eval()
        with default_dtype(torch.float64):
            pe64, ne64 = StableDiffusionPipeline(**dict(components, text_encoder=te64)).encode_prompt(
                PROMPT, "cpu", 1, True, negative_prompt=NEGATIVE_PROMPT)
    tensors = [("prompt_ids", token_ids(tokenizer, PROMPT)),
               ("negative_prompt_ids", token_ids(tokenizer, NEGATIVE_PROMPT)),
               ("prompt_embeds_f32", pe32), ("prompt_embeds_f64", pe64),
               ("negative_prompt_embeds_f32", ne32), ("negative_prompt_embeds_f64", ne64), ("latents", latents)]
    summary("pipeline", {"prompt_embeds": pe32, "negative_prompt_embeds": ne32},
            {"prompt_embeds": pe64, "negative_prompt_embeds": ne64})
    reps, first = {}, None
    for tag, cls in (("ddim", DDIMScheduler), ("euler", EulerDiscreteScheduler)):
        out32, out64, extra, reps[tag] = pipeline_pair(StableDiffusionPipeline, components, latents, call, cls, folder)
        tensors += scheduler_tensors(tag, out32, out64, extra)
        summary(f"pipeline.{tag}", out32, out64)
        first = first or out32

    # the saved folder reloads through diffusers (DiffusionPipeline.from_pretrained) and reproduces the DDIM run
    back = DiffusionPipeline.from_pretrained(folder)
    assert type(back) is StableDiffusionPipeline and type(back.scheduler) is DDIMScheduler, type(back)
    assert back.safety_checker is None and back.feature_extractor is None
    again = run_pipeline(back, latents, back.scheduler, call)
    assert torch.equal(again["image"], first["image"]) and torch.equal(again["latents"], first["latents"])

    meta = dict(COMMON_META, source=f"{SOURCE} StableDiffusionPipeline; {CLIP_SOURCE}", prompt=PROMPT,
                negative_prompt=NEGATIVE_PROMPT, steps=str(STEPS), guidance_scale=str(GUIDANCE), eta="0.0",
                height=str(height), width=str(width), output_type="pt (image in [0, 1], NCHW)",
                schedulers="ddim: DDIMScheduler.from_config(scheduler/scheduler_config.json); euler: "
                           "EulerDiscreteScheduler.from_config(the same file: timestep_spacing leading, "
                           "steps_offset 1)",
                f64_scheduler="the scheduler module's source with torch.float32/np.float32 -> float64 "
                              f"({reps['ddim']} replacements in scheduling_ddim.py, {reps['euler']} in "
                              "scheduling_euler_discrete.py)",
                models="unet = unet_sd, vae = vae (same weights); text_encoder CLIPTextModel "
                       + json.dumps(te_config.to_diff_dict(), sort_keys=True),
                scheduler_config=json.dumps(SCHEDULER_CONFIG), merges=json.dumps(MERGES))
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def sdxl_pipeline(models):
    tok_src = "/tmp/sd_reference/tokenizer_src"
    vocab_size = write_tokenizer_sources(tok_src)
    tokenizer = make_tokenizer(tok_src)
    tokenizer_2 = make_tokenizer(tok_src, pad_token="!")  # SDXL's tokenizer_2 pads with "!" (id 0)
    # hidden 16 + 16 = unet_sdxl's cross_attention_dim 32; projection_dim 32 = its pooled text_embeds width
    te1_config = text_config(vocab_size, 16, 2, 2, 64, 16)
    te2_config = text_config(vocab_size, 16, 2, 2, 64, 32, act="gelu")
    text_encoder = make_text_encoder(CLIPTextModel, te1_config, seed=800)
    text_encoder_2 = make_text_encoder(CLIPTextModelWithProjection, te2_config, seed=810)
    unet, vae = models["unet_sdxl"], models["vae"]
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading")
    components = dict(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                      tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, image_encoder=None,
                      feature_extractor=None, force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe = StableDiffusionXLPipeline(**components)
    folder = fresh_dir(os.path.join(OUT_DIR, "pipeline_sdxl"))
    pipe.save_pretrained(folder)

    height = width = LATENT_HW * pipe.vae_scale_factor
    g = torch.Generator().manual_seed(840)
    latents = torch.randn(1, 4, LATENT_HW, LATENT_HW, generator=g)
    call = dict(prompt=PROMPT, prompt_2=PROMPT_2, negative_prompt=NEGATIVE_PROMPT,
                negative_prompt_2=NEGATIVE_PROMPT_2, height=height, width=width)
    tensors = [("prompt_ids", token_ids(tokenizer, PROMPT)),
               ("negative_prompt_ids", token_ids(tokenizer, NEGATIVE_PROMPT)),
               ("prompt_2_ids", token_ids(tokenizer_2, PROMPT_2)),
               ("negative_prompt_2_ids", token_ids(tokenizer_2, NEGATIVE_PROMPT_2))]
    enc_kw = dict(prompt=PROMPT, prompt_2=PROMPT_2, device="cpu", num_images_per_prompt=1,
                  do_classifier_free_guidance=True, negative_prompt=NEGATIVE_PROMPT,
                  negative_prompt_2=NEGATIVE_PROMPT_2)
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    with torch.no_grad():
        e32 = dict(zip(names, pipe.encode_prompt(**enc_kw)))
        c64 = dict(components, text_encoder=copy.deepcopy(text_encoder).double().eval(),
                   text_encoder_2=copy.deepcopy(text_encoder_2).double().eval())
        with default_dtype(torch.float64):
            e64 = dict(zip(names, StableDiffusionXLPipeline(**c64).encode_prompt(**enc_kw)))
    for n in names:
        tensors += [(n + "_f32", e32[n]), (n + "_f64", e64[n])]
    summary("pipeline_sdxl", e32, e64)
    tensors.append(("latents", latents))
    out32, out64, extra, n_rep = pipeline_pair(StableDiffusionXLPipeline, components, latents, call,
                                               EulerDiscreteScheduler, folder)
    tensors += scheduler_tensors("euler", out32, out64, extra)
    summary("pipeline_sdxl.euler", out32, out64)

    back = DiffusionPipeline.from_pretrained(folder)
    assert type(back) is StableDiffusionXLPipeline and type(back.scheduler) is EulerDiscreteScheduler
    again = run_pipeline(back, latents, back.scheduler, call)
    assert torch.equal(again["image"], out32["image"]) and torch.equal(again["latents"], out32["latents"])

    meta = dict(COMMON_META, source=f"{SOURCE} StableDiffusionXLPipeline; {CLIP_SOURCE}", prompt=PROMPT,
                prompt_2=PROMPT_2, negative_prompt=NEGATIVE_PROMPT, negative_prompt_2=NEGATIVE_PROMPT_2,
                steps=str(STEPS), guidance_scale=str(GUIDANCE), height=str(height), width=str(width),
                add_time_ids=json.dumps([height, width, 0, 0, height, width]) + " for both CFG halves",
                output_type="pt (image in [0, 1], NCHW)",
                scheduler="the folder's EulerDiscreteScheduler (scaled_linear, timestep_spacing leading, "
                          "steps_offset 1)",
                f64_scheduler=f"scheduling_euler_discrete.py source with float32 -> float64 ({n_rep} replacements)",
                models="unet = unet_sdxl, vae = vae (same weights); text_encoder CLIPTextModel "
                       + json.dumps(te1_config.to_diff_dict(), sort_keys=True)
                       + "; text_encoder_2 CLIPTextModelWithProjection "
                       + json.dumps(te2_config.to_diff_dict(), sort_keys=True),
                merges=json.dumps(MERGES))
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    print(f"versions {VERSIONS}")
    models = {}
    for name, case in UNET_CASES.items():
        print(name)
        models[name] = run_unet_case(name, case)
    for name, case in VAE_CASES.items():
        print(name)
        models[name] = run_vae_case(name, case)
    print("pipeline")
    sd_pipeline(models)
    print("pipeline_sdxl")
    sdxl_pipeline(models)
    total, blobs = 0, {}
    for root, _, files in sorted(os.walk(OUT_DIR)):
        for f in sorted(files):
            path = os.path.join(root, f)
            total += os.path.getsize(path)
            with open(path, "rb") as fh:
                blobs[hash(fh.read())] = os.path.getsize(path)
    print(f"total {total / 1e6:.2f} MB under {OUT_DIR} ({sum(blobs.values()) / 1e6:.2f} MB of distinct files)")


if __name__ == "__main__":
    main()
