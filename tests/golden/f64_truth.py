"""The float64 truth's timestep sinusoid, for the golden generators under tests/golden/ (not run by CI).

diffusers computes the sinusoidal timestep embedding in float32 even in a float64 model (get_timestep_embedding
casts to float32; QwenImage21TemporalTimesteps keeps float32 frequencies and rounds its result to float32).
LibTorch sends float32 exp / sin / cos through oneMKL's vector math, whose kernel (and so the last bit of each
value) depends on the CPU: an Intel CPU gets the AVX-512 kernels, an AMD CPU the generic ones. One ulp of a
frequency, times a timestep of up to 1000, moves the embedding by up to 6e-5, and a "float64" output made on one
kind of CPU then differed from the same model's on the other by 1e-5 (the sd3 / flux / qwen_image goldens made on
an AMD EPYC failed on a Sapphire Rapids Xeon). Inside float64_sinusoids() the float64 runs compute the sinusoid in
float64 from start to end instead, so the truth is float64 on every CPU; the float32 runs are the reference as
installed.
"""
import contextlib
import math

import torch
import diffusers.models.embeddings as embeddings


def timestep_embedding_f64(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                           max_period=10000):
    """get_timestep_embedding's formula with every step in float64."""
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64, device=timesteps.device)
    args = scale * (timesteps[:, None].double() * torch.exp(exponent / (half - downscale_freq_shift))[None, :])
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


def qwen21_temporal_forward_f64(self, timestep):
    """QwenImage21TemporalTimesteps.forward with its frequencies, products and result in float64 (1000 t stays the
    float32 product diffusers forms: one IEEE rounding, the same on every CPU)."""
    half = self.timestep_dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64, device=timestep.device) / half)
    args = (self.time_factor * timestep.float()).double()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if self.timestep_dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


@contextlib.contextmanager
def float64_sinusoids():
    """Within: diffusers' timestep sinusoids (get_timestep_embedding, QwenImage21TemporalTimesteps) in float64."""
    from diffusers.models.transformers import transformer_qwenimage21 as q21

    saved = embeddings.get_timestep_embedding, q21.QwenImage21TemporalTimesteps.forward
    embeddings.get_timestep_embedding = timestep_embedding_f64
    q21.QwenImage21TemporalTimesteps.forward = qwen21_temporal_forward_f64
    try:
        yield
    finally:
        embeddings.get_timestep_embedding, q21.QwenImage21TemporalTimesteps.forward = saved
