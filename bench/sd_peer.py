#!/usr/bin/python3
"""Python peer of `dew bench --models sd_unet,sd_unet_lora,sd_vae,sd3,flux,qwen_image`: the real diffusers classes.

The models are diffusers' own UNet2DConditionModel, AutoencoderKL, SD3Transformer2DModel, FluxTransformer2DModel
and QwenImage21Transformer2DModel, built from the same config.json dict the C++ side builds its unet_2d_condition /
autoencoder_kl / sd3_transformer / flux_transformer / qwen_image_transformer from (--config), imported from the environment's pinned
diffusers (requirements.txt), or from a diffusers source checkout when --diffusers-src (or $DEW_DIFFUSERS_SRC)
names one (put ahead of the installed package; its own imports come from the environment). Nothing is
re-implemented.

- sd_unet: one training step of diffusers' examples/text_to_image/train_text_to_image.py (epsilon
  prediction, --use_ema, no gradient clipping): noise = randn_like(latents), timesteps = randint(0, 1000, [B]),
  noisy = DDPMScheduler(scaled_linear 0.00085..0.012).add_noise(latents, noise, timesteps),
  pred = unet(noisy, timesteps, encoder_hidden_states).sample, loss = F.mse_loss(pred, noise), backward,
  torch.optim.AdamW(unet.parameters(), lr 1e-4, betas (0.9, 0.999), weight_decay 1e-2, eps 1e-8), zero_grad,
  EMAModel(decay 0.995).step (diffusers.training_utils: decay min(0.995, (1 + step) / (10 + step))). A fixed
  batch of latents and text embeddings stands in for the VAE and the text encoder.
- sd_unet_lora: one training step of diffusers' examples/text_to_image/train_text_to_image_lora.py on the same
  UNet and batch: unet.requires_grad_(False), unet.add_adapter(peft.LoraConfig(r=4, lora_alpha=4,
  init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"])), the same noise, timesteps,
  noisy latents and MSE as sd_unet, backward, the adapters' gradient norm clipped to --max_grad_norm 1.0 (the
  script's intent: its params_to_clip is the filter the optimizer already consumed, so as written it clips
  nothing; both sides clip here), torch.optim.AdamW over the parameters that require grad (lr 1e-4, weight
  decay 1e-2), zero_grad; no EMA. The parameter count checked against --params includes the adapters.
- sd_vae: AutoencoderKL encode + decode of a batch of images without gradients, as a pipeline runs them:
  z = scaling_factor * vae.encode(x).latent_dist.sample(generator), x_hat = vae.decode(z / scaling_factor).sample.
  forward = encode (with the sample), backward = decode, optimizer 0 in the result line.
- sd3, flux: one training step of diffusers' examples/dreambooth/train_dreambooth_sd3.py /
  train_dreambooth_flux.py (flow matching, --weighting_scheme logit_normal, no output preconditioning), with the
  sigmas used as they are drawn (dew's flow preset) where the scripts index a FlowMatchEulerDiscreteScheduler
  table: u = compute_density_for_timestep_sampling("logit_normal", B, 0, 1), noisy = (1 - u) latents + u noise,
  pred = transformer(noisy, timestep=1000 u, encoder_hidden_states, pooled_projections).sample (Flux: the latents
  packed by FluxPipeline._pack_latents with _prepare_latent_image_ids and zero txt_ids, timestep u, guidance 3.5,
  the prediction unpacked by FluxPipeline._unpack_latents), loss = mean(compute_loss_weighting_for_sd3 *
  (pred - (noise - latents))^2), backward, clip_grad_norm_(1.0), torch.optim.AdamW(lr 1e-4, betas (0.9, 0.999),
  weight_decay 1e-4, eps 1e-8), zero_grad; no EMA. A fixed batch of latents, text states and pooled text stands
  in for the VAE and the text encoders. diffusers' SD3Transformer2DModel holds the last (context_pre_only) block's
  attn.add_q_proj, whose text queries feed only the discarded text output; dew's sd3_transformer does not build
  it, so that projection is left out of the count checked against --params (it still runs and trains here).
- qwen_image: the same flow step on QwenImage21Transformer2DModel (diffusers has no Qwen-Image training script):
  the latents packed as QwenImage21Pipeline._pack_latents does (a flatten: one token per latent), timestep u,
  img_shapes and img_mask of the text-only layout, the target image's tokens of the output unpacked. Then sampling
  as QwenImage21Pipeline's loop runs it (qwen_sampling): Euler steps without and with the prefix KV cache; the
  result line adds sample_ms, sample_cached_ms (ms per step) and sample_cache_max_diff.

    .venv/bin/python bench/sd_peer.py --model sd_unet --config '{"_class_name": "UNet2DConditionModel", ...}' \
        --params 4399684 --batch 8 --latent-size 16 --context-len 16 --steps 20 --warmup 5 --threads 2
    .venv/bin/python bench/sd_peer.py --model sd3 --config '{"_class_name": "SD3Transformer2DModel", ...}' \
        --params 2276032 --batch 4 --latent-size 32 --context-len 16 --steps 20 --warmup 5 --threads 2
    bench/sd_peer.py --probe      # "diffusers 0.42.1 (PATH)", or exit 3 and the reason

prints one JSON line with the keys of bench/peer.py.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peer  # noqa: E402  (the result line)

# train_text_to_image.py's defaults, and Stable Diffusion's noise schedule (its scheduler_config.json).
LR, BETAS, WEIGHT_DECAY, EPS, EMA_DECAY = 1e-4, (0.9, 0.999), 1e-2, 1e-8, 0.995
# train_text_to_image_lora.py's defaults (--rank 4, lora_alpha = rank, --max_grad_norm 1.0); dew/bench/cases.h's
# kSdLora* values.
LORA_RANK, LORA_TARGETS, LORA_GRAD_CLIP = 4, ["to_k", "to_q", "to_v", "to_out.0"], 1.0
TRAIN_TIMESTEPS, BETA_START, BETA_END = 1000, 0.00085, 0.012
# train_dreambooth_sd3.py / train_dreambooth_flux.py's defaults (--learning_rate 1e-4, --adam_weight_decay 1e-4,
# --max_grad_norm 1.0, --guidance_scale 3.5, --logit_mean 0, --logit_std 1); dew/bench/cases.h's kFlow* values.
FLOW_LR, FLOW_WEIGHT_DECAY, FLOW_GRAD_CLIP, FLOW_GUIDANCE = 1e-4, 1e-4, 1.0, 3.5


def fail(msg, code=2):
    print(f"sd_peer.py: error: {msg}", file=sys.stderr)
    sys.exit(code)


def default_src():
    return os.environ.get("DEW_DIFFUSERS_SRC") or ""


def load_diffusers(src):
    """diffusers: the installed package, or the source tree `src` put ahead of it on the path (its imports
    come from the environment); an ImportError / other exception saying why not."""
    if src:
        if not os.path.isdir(os.path.join(src, "diffusers")):
            raise ImportError(f"no diffusers package folder in {src}")
        sys.path.insert(0, src)
    import diffusers
    diffusers.utils.logging.set_verbosity_error()
    return diffusers


def unet_step(diffusers, cfg, a):
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    lora = a.model == "sd_unet_lora"
    unet = UNet2DConditionModel(**cfg)
    if lora:
        from peft import LoraConfig
        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
                                    target_modules=LORA_TARGETS))
    unet.train()
    n = sum(p.numel() for p in unet.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"UNet2DConditionModel{' with its adapters' if lora else ''} has {n} parameters here and {a.params} "
             f"in C++: the two models differ")
    scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS, beta_start=BETA_START, beta_end=BETA_END,
                              beta_schedule="scaled_linear")
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=EPS)
    ema = None if lora else EMAModel(unet.parameters(), decay=EMA_DECAY)
    run_unet = peer.compiled(a, unet)  # the same parameters; the optimizer and the EMA stay eager

    g = torch.Generator().manual_seed(1)
    S = a.latent_size
    latents = torch.randn(a.batch, cfg["in_channels"], S, S, generator=g)
    text = torch.randn(a.batch, a.context_len, cfg["cross_attention_dim"], generator=g)
    torch.manual_seed(2)  # the step's noise and timesteps, drawn as the script draws them
    times, loss, first = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, TRAIN_TIMESTEPS, (a.batch,)).long()
        noisy = scheduler.add_noise(latents, noise, timesteps)
        pred = run_unet(noisy, timesteps, text, return_dict=False)[0]
        l = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        t1 = time.perf_counter()
        l.backward()
        if lora:
            torch.nn.utils.clip_grad_norm_(params, LORA_GRAD_CLIP)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.step(unet.parameters())
        t3 = time.perf_counter()
        loss = l.item()
        if i == 0:
            first = t3 - t0
        if i >= a.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    return n, times, loss, first


def sd3_unused(model, cfg):
    """The parameters dew's sd3_transformer does not build: the pre-only last block's text query projection
    (attn.add_q_proj, and attn.norm_added_q with a qk norm), which feeds only the discarded text output."""
    last = f"transformer_blocks.{cfg.get('num_layers', 18) - 1}.attn."
    return sum(p.numel() for k, p in model.named_parameters()
               if k.startswith(last + "add_q_proj.") or k.startswith(last + "norm_added_q."))


def qwen_layout(batch, text_len, side):
    """QwenImage21Transformer2DModel's inputs of a text-only joint sequence: img_shapes (one target image of side x
    side tokens) and img_mask (False at the text, True at the target's 2 x 2 slots), as QwenImage21Pipeline builds
    them."""
    img_shapes = [[(1, side, side)]] * batch
    img_mask = torch.cat([torch.zeros(batch, text_len, dtype=torch.bool),
                          torch.ones(batch, side * side // 4, dtype=torch.bool)], dim=1)
    return img_shapes, img_mask


def qwen_sampling(model, cfg, a, channels):
    """QwenImage21Pipeline's denoising loop on the trained model (eval, no gradients, no guidance): one image of
    --latent-size^2 tokens under a --sample-text-len prompt, --sample-steps Euler steps over linspace(1, 1/n, n) then
    0, without and with the prefix KV cache (kv_cache_mode "extract" on the first step, "cached" after). One untimed
    run of each, then --sample-reps timed runs of each alternating; median ms per step of each, and the two final
    latents' max difference."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model.eval()
    g = torch.Generator().manual_seed(3)
    S, n = a.latent_size, a.sample_steps
    x0 = torch.randn(1, S * S, channels, generator=g)
    text = torch.randn(1, a.sample_text_len, cfg["context_in_dim"], generator=g)
    img_shapes, img_mask = qwen_layout(1, a.sample_text_len, S)
    sigmas = [1.0 + i * (1.0 / n - 1.0) / (n - 1) for i in range(n)] + [0.0] if n > 1 else [1.0, 0.0]

    def run(cache):
        x = x0.clone()
        kv = QwenImage21KVCache(len(model.transformer_blocks)) if cache else None
        with torch.no_grad():
            for i in range(n):
                mode = ("extract" if i == 0 else "cached") if cache else None
                v = model(hidden_states=x, timestep=torch.full((1,), sigmas[i]), encoder_hidden_states=text,
                          img_shapes=img_shapes, img_mask=img_mask, kv_cache=kv, kv_cache_mode=mode,
                          return_dict=False)[0][:, -S * S:]
                x = x + (sigmas[i + 1] - sigmas[i]) * v
        return x

    plain, cached = run(False), run(True)
    times = {False: [], True: []}
    for _ in range(a.sample_reps):
        for cache in (False, True):
            t0 = time.perf_counter()
            run(cache)
            times[cache].append(time.perf_counter() - t0)
    return {"sample_ms": statistics.median(times[False]) * 1e3 / n,
            "sample_cached_ms": statistics.median(times[True]) * 1e3 / n,
            "sample_cache_max_diff": float((plain - cached).abs().max())}


def flow_step(diffusers, cfg, a):
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    flux, qwen = a.model == "flux", a.model == "qwen_image"
    if qwen:
        from diffusers import QwenImage21Transformer2DModel
        model = QwenImage21Transformer2DModel(**cfg)
        channels = model.config.in_channels  # one token per latent position
        unused = 0
    elif flux:
        from diffusers import FluxPipeline, FluxTransformer2DModel
        model = FluxTransformer2DModel(**cfg)
        channels = model.config.in_channels // 4  # the packed 2 x 2 tokens' features are 4 x the latent channels
        unused = 0
    else:
        from diffusers import SD3Transformer2DModel
        model = SD3Transformer2DModel(**cfg)
        channels = model.config.in_channels
        unused = sd3_unused(model, cfg)
    model.train()
    n_all = sum(p.numel() for p in model.parameters())
    n = n_all - unused
    if a.params >= 0 and n != a.params:
        fail(f"{type(model).__name__} has {n} parameters here ({n_all} less {unused} dew does not build) and "
             f"{a.params} in C++: the two models differ")
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=FLOW_LR, betas=BETAS, weight_decay=FLOW_WEIGHT_DECAY, eps=EPS)
    run_model = peer.compiled(a, model)  # the same parameters; the optimizer stays eager

    g = torch.Generator().manual_seed(1)
    B, S = a.batch, a.latent_size
    if flux and S % 2:
        fail(f"--latent-size {S}: Flux packs 2 x 2 latent patches, so it must be even")
    latents = torch.randn(B, channels, S, S, generator=g)
    text = torch.randn(B, a.context_len, cfg["context_in_dim" if qwen else "joint_attention_dim"], generator=g)
    pooled = None if qwen else torch.randn(B, cfg["pooled_projection_dim"], generator=g)
    extra = {}
    if qwen:
        extra["img_shapes"], extra["img_mask"] = qwen_layout(B, a.context_len, S)
    if flux:
        # train_dreambooth_flux.py: the ids of the packed grid, zero text ids, guidance when the model embeds it
        # (FLUX.1 dev), the timestep on diffusers' [0, 1] scale (the model multiplies by 1000).
        extra["img_ids"] = FluxPipeline._prepare_latent_image_ids(B, S // 2, S // 2, latents.device, latents.dtype)
        extra["txt_ids"] = torch.zeros(a.context_len, 3)
        if model.config.guidance_embeds:
            extra["guidance"] = torch.full((B,), FLOW_GUIDANCE)
    torch.manual_seed(2)  # the step's sigmas and noise
    times, loss, first = [], 0.0, 0.0
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        noise = torch.randn_like(latents)
        u = compute_density_for_timestep_sampling("logit_normal", B, logit_mean=0.0, logit_std=1.0)
        sigmas = u.view(B, 1, 1, 1)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        if qwen:
            # QwenImage21Pipeline._pack_latents (a plain flatten), the timestep on diffusers' [0, 1] scale, the target
            # image's tokens (the last S^2 of the joint sequence) unpacked
            packed = noisy.flatten(2).transpose(1, 2)
            pred = run_model(hidden_states=packed, timestep=u, encoder_hidden_states=text, return_dict=False,
                             **extra)[0][:, -S * S:]
            pred = pred.transpose(1, 2).reshape(B, channels, S, S)
        elif flux:
            packed = FluxPipeline._pack_latents(noisy, B, channels, S, S)
            pred = run_model(hidden_states=packed, timestep=u, encoder_hidden_states=text,
                             pooled_projections=pooled, return_dict=False, **extra)[0]
            # _unpack_latents takes the image size in pixels: with vae_scale_factor 8 it gives back S x S.
            pred = FluxPipeline._unpack_latents(pred, S * 8, S * 8, 8)
        else:
            pred = run_model(hidden_states=noisy, timestep=u * 1000.0, encoder_hidden_states=text,
                             pooled_projections=pooled, return_dict=False)[0]
        weighting = compute_loss_weighting_for_sd3("logit_normal", sigmas)
        target = noise - latents
        l = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(B, -1), 1).mean()
        t1 = time.perf_counter()
        l.backward()
        torch.nn.utils.clip_grad_norm_(params, FLOW_GRAD_CLIP)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        loss = l.item()
        if i == 0:
            first = t3 - t0
        if i >= a.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    extra_result = qwen_sampling(model, cfg, a, channels) if qwen else {}
    return n, times, loss, first, extra_result


def vae_step(diffusers, cfg, a):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**cfg)
    vae.eval()
    n = sum(p.numel() for p in vae.parameters())
    if a.params >= 0 and n != a.params:
        fail(f"AutoencoderKL has {n} parameters here and {a.params} in C++: the two models differ")
    g = torch.Generator().manual_seed(1)
    x = torch.rand(a.batch, cfg["in_channels"], a.image_size, a.image_size, generator=g) * 2 - 1
    sample_gen = torch.Generator().manual_seed(2)
    sf = vae.config.scaling_factor
    times, out = [], 0.0
    with torch.no_grad():
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            z = vae.encode(x).latent_dist.sample(generator=sample_gen) * sf
            t1 = time.perf_counter()
            x_hat = vae.decode(z / sf).sample
            t2 = time.perf_counter()
            out = float(x_hat.float().pow(2).mean())
            if i >= a.warmup:
                times.append((t2 - t0, t1 - t0, t2 - t1, 0.0))
    return n, times, out, 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["sd_unet", "sd_unet_lora", "sd_vae", "sd3", "flux", "qwen_image"])
    ap.add_argument("--probe", action="store_true", help="only import diffusers: print its version and path")
    ap.add_argument("--diffusers-src", default=default_src(),
                    help="the `src` folder of a diffusers checkout to import instead of the installed "
                         "diffusers (default: $DEW_DIFFUSERS_SRC, else the installed package)")
    ap.add_argument("--config", help="the diffusers config.json dict of the model, as JSON")
    ap.add_argument("--params", type=int, default=-1, help="parameter count of the C++ model, to check")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--latent-size", type=int, default=16, help="sd_unet(_lora), sd3, flux: side of the latents")
    ap.add_argument("--context-len", type=int, default=16, help="sd_unet(_lora), sd3, flux: text tokens")
    ap.add_argument("--image-size", type=int, default=64, help="sd_vae: side of the images")
    ap.add_argument("--sample-text-len", type=int, default=128, help="qwen_image: prompt tokens while sampling")
    ap.add_argument("--sample-steps", type=int, default=8, help="qwen_image: Euler steps of a sampling run")
    ap.add_argument("--sample-reps", type=int, default=3, help="qwen_image: timed sampling runs of each kind")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu")
    peer.add_compile_flag(ap)
    a = ap.parse_args()
    try:
        diffusers = load_diffusers(a.diffusers_src)
    except Exception as e:  # noqa: BLE001  (any failure to import is "unavailable", with its reason)
        print(f"diffusers cannot be imported from {a.diffusers_src or 'the environment'}: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        sys.exit(3)
    if a.probe:
        print(f"diffusers {diffusers.__version__} ({os.path.dirname(os.path.dirname(diffusers.__file__))})")
        return
    if a.model is None or a.config is None:
        fail("--model and --config are required (or --probe)")
    if a.device != "cpu":
        fail("the Stable Diffusion peer runs on the CPU only")
    if a.compile and a.model == "sd_vae":
        fail("--compile: only the training steps (sd_unet, sd_unet_lora, sd3, flux, qwen_image) run compiled")
    if min(a.batch, a.steps, a.threads, a.latent_size, a.context_len, a.image_size, a.sample_text_len,
           a.sample_steps, a.sample_reps) < 1 or a.warmup < 0:
        fail("--batch, --steps, --threads, --latent-size, --context-len, --image-size, --sample-* must be >= 1, "
             "--warmup >= 0")
    if a.model == "qwen_image" and a.latent_size % 2:
        fail(f"--latent-size {a.latent_size}: Qwen-Image's text-only layout counts 2 x 2 slots, so it must be even")
    try:
        cfg = {k: v for k, v in json.loads(a.config).items() if not k.startswith("_")}
    except (ValueError, AttributeError) as e:
        fail(f"bad --config: {e}")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    step = {"sd_unet": unet_step, "sd_unet_lora": unet_step, "sd_vae": vae_step, "sd3": flow_step,
            "flux": flow_step, "qwen_image": flow_step}[a.model]
    n, times, loss, first, *more = step(diffusers, cfg, a)
    if not math.isfinite(loss):
        fail(f"non-finite loss {loss}")
    med = [statistics.median(t[k] for t in times) * 1e3 for k in range(4)]
    result = peer.result(med, a.batch, n, loss, **peer.compile_extra(a, first, med[0]))
    if more:
        result.update(more[0])  # qwen_image: the sampling measurements
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
