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


def _qwen21_rope_params_f64(index, dim, theta=10000):
    """QwenImage21Rope.rope_params with the angles and their unit complex numbers in float64 (complex128)."""
    freqs = torch.outer(index.double(), 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return torch.polar(torch.ones_like(freqs), freqs)


def _apply_rotary_emb_qwen_f64(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """apply_rotary_emb_qwen (use_real False) rotating a float64 x in complex128 instead of x.float()."""
    assert not use_real, "only the complex form is patched"
    x_rotated = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


@contextlib.contextmanager
def float64_qwen21_rope(transformer):
    """Within: a float64 QwenImage21Transformer2DModel's rotary tables and rotations in float64 (complex128), so the
    truth of a pipeline golden does not carry the float32 cos / sin of the CPU that made it (oneMKL's kernels differ
    in the last bit between Intel and AMD CPUs, and a few denoising steps with guidance amplify that past the float32
    reference's own error). The transformer goldens keep diffusers' complex64 tables, which dew's float64 model
    reproduces."""
    from diffusers.models.transformers import transformer_qwenimage21 as q21

    rope = transformer.pos_embed
    saved = rope.freqs, q21.apply_rotary_emb_qwen
    rope.freqs = [torch.cat([_qwen21_rope_params_f64(torch.arange(8192), dim, rope.theta),
                             _qwen21_rope_params_f64(torch.arange(1024).flip(0) * -1 - 1, dim, rope.theta)], dim=0)
                  for dim in rope.axes_dim]
    q21.apply_rotary_emb_qwen = _apply_rotary_emb_qwen_f64
    try:
        yield
    finally:
        rope.freqs, q21.apply_rotary_emb_qwen = saved

