"""Scheduler goldens from the reference code as installed from requirements.txt: diffusers 0.42.1's DDIMScheduler,
PNDMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, LMSDiscreteScheduler and
DPMSolverMultistepScheduler, on torch 2.13.0. Not run by CI; rerun by hand (deterministic, rewrites
tests/golden/schedulers/):

    .venv/bin/python tests/golden/schedulers_reference.py

The scheduler classes are imported from the installed diffusers package; nothing of it is stubbed.

Each case (CASES below) builds a scheduler from its keyword arguments, writes `<case>.json` with
`to_json_string()` (exactly what a pipeline folder's scheduler/scheduler_config.json holds, so the C++ test
builds from that file) and, for n = 5 and 10 inference steps, runs the pipeline loop of diffusers'
StableDiffusionPipeline without guidance:

    latents = z * init_noise_sigma
    for i, t in enumerate(timesteps):
        inp = scheduler.scale_model_input(latents, t)
        out = model(inp, t)                     # 0.3 inp + 0.1 sin(t / 100), in float64, cast to inp's dtype
        latents = scheduler.step(out, t, latents, **step_kwargs).prev_sample

The model is an input of the test, not a thing tested: the C++ test computes the same function. z [1, 4, 4, 4]
and the per-step noise come from torch.Generator().manual_seed(fixed) in float32; diffusers' randn_tensor in
each scheduler module is replaced by a function returning the recorded noise of the current step (Euler
ancestral, DDIM with eta > 0 and sde-dpmsolver++ draw one tensor per step).

Two runs per case: float32 (diffusers as installed: float32 betas, alphas_cumprod, sigmas) and float64. The float64
run loads each scheduler module again from its source with every `torch.float32` and `np.float32` replaced
by float64 (betas, alphas_cumprod, the Euler sigmas and timesteps, the float32 upcasts of `sample` in the
Euler/DPM steps), under torch.set_default_dtype(torch.float64) (torch.tensor(1.0), torch.linspace without a
dtype), on z and noise widened to float64.

Output per case: tests/golden/schedulers/<case>.json (the config) and <case>.safetensors with
  z [1,4,4,4] f32; for n in (5, 10): n{n}.timesteps_f32 / n{n}.timesteps_f64 [N] f64 (the values of
  scheduler.timesteps of each run), n{n}.init_noise_sigma_f32 / _f64 [1] f64, n{n}.noise [N,1,4,4,4] f32,
  n{n}.x_f32 [N,1,4,4,4] f32 and n{n}.x_f64 f64 (latents after each step);
  metadata: class, eta (DDIM), the model formula.
Plus betas.safetensors: alphas_cumprod of scaled_linear (0.00085, 0.012), its zero-SNR rescale, linear
(1e-4, 0.02) and squaredcos_cap_v2 from the float64 DDIMScheduler (and scaled_linear's float32), T = 1000.
"""
import importlib
import inspect
import json
import math
import os
import sys
import types

import diffusers
import numpy as np
import safetensors
import scipy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "schedulers")
sys.path.insert(0, HERE)
from st_io import read_st, write_st  # noqa: E402

PINNED = {"diffusers": "0.42.1", "torch": "2.13.0"}
VERSIONS = {"diffusers": diffusers.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__, "scipy": scipy.__version__}
for _pkg, _ver in PINNED.items():
    assert VERSIONS[_pkg].split("+")[0] == _ver, f"{_pkg} {VERSIONS[_pkg]} installed, requirements.txt pins {_ver}"

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
CASES = {
    # SD 1.5's DDIM (the usual DDIM config of SD pipelines)
    "ddim_sd15": ("DDIMScheduler", dict(SD, steps_offset=1, set_alpha_to_one=False, clip_sample=False,
                                        timestep_spacing="leading"), {}),
    # DDIM eta 1 with clipping of x0 (diffusers' default clip_sample true), linspace spacing
    "ddim_eta_clip": ("DDIMScheduler", dict(SD, clip_sample=True, clip_sample_range=1.0, timestep_spacing="linspace"),
                      {"eta": 1.0}),
    # zero terminal SNR with trailing spacing and v prediction (Lin et al. 2024)
    "ddim_zsnr_v": ("DDIMScheduler", dict(SD, timestep_spacing="trailing", rescale_betas_zero_snr=True,
                                          prediction_type="v_prediction", clip_sample=False), {}),
    # x0 prediction on the DDPM linear betas
    "ddim_sample_linear": ("DDIMScheduler", dict(prediction_type="sample", clip_sample=False,
                                                 set_alpha_to_one=True), {}),
    # SD 1.5's PNDM (the scheduler SD 1.5 ships with)
    "pndm_sd15": ("PNDMScheduler", dict(SD, skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False), {}),
    # PNDM with its pseudo Runge-Kutta warm-up, v prediction
    "pndm_prk_v": ("PNDMScheduler", dict(SD, skip_prk_steps=False, prediction_type="v_prediction",
                                         timestep_spacing="linspace"), {}),
    # SDXL's Euler (leading, steps_offset 1)
    "euler_sdxl": ("EulerDiscreteScheduler", dict(SD, steps_offset=1, timestep_spacing="leading"), {}),
    "euler_karras": ("EulerDiscreteScheduler", dict(SD, use_karras_sigmas=True), {}),
    "euler_zsnr_v_trailing": ("EulerDiscreteScheduler", dict(SD, rescale_betas_zero_snr=True, timestep_spacing="trailing",
                                                             prediction_type="v_prediction"), {}),
    "euler_log_linear_sigma_min": ("EulerDiscreteScheduler", dict(SD, interpolation_type="log_linear",
                                                                   final_sigmas_type="sigma_min"), {}),
    "euler_continuous_v": ("EulerDiscreteScheduler", dict(SD, prediction_type="v_prediction", timestep_type="continuous",
                                                          use_karras_sigmas=True), {}),
    "euler_a_sd": ("EulerAncestralDiscreteScheduler", dict(SD, steps_offset=1, timestep_spacing="leading"), {}),
    "euler_a_v_linear": ("EulerAncestralDiscreteScheduler", dict(prediction_type="v_prediction"), {}),
    "lms_sd": ("LMSDiscreteScheduler", dict(SD), {}),
    "lms_karras": ("LMSDiscreteScheduler", dict(SD, use_karras_sigmas=True), {}),
    # DPM++ 2M and DPM++ 2M Karras (the DPMSolverMultistepScheduler defaults with SD's betas)
    "dpmpp_2m": ("DPMSolverMultistepScheduler", dict(SD), {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True), {}),
    "dpmpp_2m_sde_karras": ("DPMSolverMultistepScheduler", dict(SD, algorithm_type="sde-dpmsolver++",
                                                                use_karras_sigmas=True), {}),
    "dpmpp_3m_heun_v_leading": ("DPMSolverMultistepScheduler", dict(SD, solver_order=3, solver_type="heun",
                                                                    prediction_type="v_prediction",
                                                                    timestep_spacing="leading", steps_offset=1,
                                                                    final_sigmas_type="sigma_min",
                                                                    lower_order_final=False), {}),
    "dpmpp_2m_zsnr_trailing_sample": ("DPMSolverMultistepScheduler", dict(SD, rescale_betas_zero_snr=True,
                                                                          timestep_spacing="trailing",
                                                                          prediction_type="sample",
                                                                          euler_at_final=True), {}),
}
MODULES = {
    "DDIMScheduler": "scheduling_ddim",
    "PNDMScheduler": "scheduling_pndm",
    "EulerDiscreteScheduler": "scheduling_euler_discrete",
    "EulerAncestralDiscreteScheduler": "scheduling_euler_ancestral_discrete",
    "LMSDiscreteScheduler": "scheduling_lms_discrete",
    "DPMSolverMultistepScheduler": "scheduling_dpmsolver_multistep",
}
MODEL = "0.3 x + 0.1 sin(t / 100), computed in float64 from the scaled input x and timesteps[i], cast to x's dtype"


def scheduler_module(name, f64):
    """The installed module (f64 False) or its source with torch.float32 / np.float32 replaced by float64, executed
    as a sibling module of the package (so its relative imports resolve to the installed diffusers)."""
    full = "diffusers.schedulers." + name
    mod = importlib.import_module(full)
    if not f64:
        return mod
    src = inspect.getsource(mod)
    n = src.count("torch.float32") + src.count("np.float32")
    src = src.replace("torch.float32", "torch.float64").replace("np.float32", "np.float64")
    m = types.ModuleType(full + "_f64")
    m.__file__, m.__package__ = mod.__file__, "diffusers.schedulers"
    sys.modules[m.__name__] = m
    exec(compile(src, mod.__file__ + " (float32 -> float64)", "exec"), m.__dict__)
    m.F32_REPLACED = n
    return m


class Noise:
    """Replaces randn_tensor in a scheduler module: returns the recorded noise of the current step."""

    def __init__(self, module):
        self.current = None
        self.draws = 0
        module.randn_tensor = self

    def __call__(self, shape, generator=None, device=None, dtype=None, layout=None):
        assert self.current is not None and tuple(shape) == tuple(self.current.shape), shape
        self.draws += 1
        return self.current.to(dtype or self.current.dtype)


def model(x, t):
    return (0.3 * x.double() + 0.1 * math.sin(float(t) / 100)).to(x.dtype)


def run(cls, kwargs, step_kwargs, n, z, noise, dtype):
    sched = cls(**kwargs)
    rec = Noise(sys.modules[cls.__module__])
    sched.set_timesteps(n)
    ts = sched.timesteps.clone()
    sigma0 = float(sched.init_noise_sigma)
    x = z.to(dtype) * sched.init_noise_sigma
    xs = []
    for i, t in enumerate(sched.timesteps):
        rec.current = noise[i].to(dtype)
        inp = sched.scale_model_input(x, t)
        out = model(inp, t)
        x = sched.step(out, t, x, **step_kwargs).prev_sample
        assert x.dtype == dtype, (x.dtype, dtype)
        xs.append(x.clone())
    return ts, sigma0, torch.stack(xs), rec.draws


def main():
    diffusers.utils.logging.set_verbosity_error()
    print("versions", VERSIONS)
    os.makedirs(OUT_DIR, exist_ok=True)
    classes = {}
    for cname, mname in MODULES.items():
        m32 = scheduler_module(mname, False)
        m64 = scheduler_module(mname, True)
        classes[cname] = (getattr(m32, cname), getattr(m64, cname))
        print(f"{cname}: float64 copy replaces {m64.F32_REPLACED} float32 names")

    g = torch.Generator().manual_seed(20250601)
    z = torch.randn(1, 4, 4, 4, generator=g)
    summary = []
    for case, (cname, kwargs, step_kwargs) in CASES.items():
        c32, c64 = classes[cname]
        config = c32(**kwargs).to_json_string()
        with open(os.path.join(OUT_DIR, case + ".json"), "w") as f:
            f.write(config)
        tensors = [("z", z)]
        for n in (5, 10):
            noise = torch.randn(n + 16, 1, 4, 4, 4, generator=g)  # enough for PNDM's extra steps
            ts32, s32, x32, d32 = run(c32, kwargs, step_kwargs, n, z, noise, torch.float32)
            torch.set_default_dtype(torch.float64)
            try:
                ts64, s64, x64, d64 = run(c64, kwargs, step_kwargs, n, z, noise, torch.float64)
            finally:
                torch.set_default_dtype(torch.float32)
            N = len(ts32)
            assert len(ts64) == N and d32 == d64, (case, n)
            tensors += [
                (f"n{n}.timesteps_f32", ts32.double()), (f"n{n}.timesteps_f64", ts64.double()),
                (f"n{n}.init_noise_sigma_f32", torch.tensor([s32], dtype=torch.float64)),
                (f"n{n}.init_noise_sigma_f64", torch.tensor([s64], dtype=torch.float64)),
                (f"n{n}.noise", noise[:N].clone()), (f"n{n}.x_f32", x32), (f"n{n}.x_f64", x64),
            ]
            err = (x32[-1].double() - x64[-1]).abs().max().item()
            summary.append(f"{case:32s} n={n:2d} N={N:2d} noise draws {d32:2d}  |x_N| {x64[-1].abs().max().item():9.3e}"
                           f"  max|f32 - f64| {err:.2e}")
        meta = {"class": cname, "eta": str(step_kwargs.get("eta", 0.0)), "model": MODEL, "source": f"diffusers {diffusers.__version__}",
                "versions": json.dumps(VERSIONS, sort_keys=True)}
        path = os.path.join(OUT_DIR, case + ".safetensors")
        write_st(path, tensors, meta)
        back, _ = read_st(path)
        assert all(torch.equal(back[k], v) for k, v in tensors)

    # alphas_cumprod of the beta schedules (DDIMScheduler keeps them as diffusers computes them).
    d32, d64 = classes["DDIMScheduler"]
    torch.set_default_dtype(torch.float64)
    try:
        ab = {
            "scaled_linear_f64": d64(**SD).alphas_cumprod,
            "scaled_linear_zsnr_f64": d64(**SD, rescale_betas_zero_snr=True).alphas_cumprod,
            "linear_f64": d64().alphas_cumprod,
            "squaredcos_cap_v2_f64": d64(beta_schedule="squaredcos_cap_v2").alphas_cumprod,
        }
    finally:
        torch.set_default_dtype(torch.float32)
    ab["scaled_linear_f32"] = d32(**SD).alphas_cumprod
    write_st(os.path.join(OUT_DIR, "betas.safetensors"), [(k, v.clone()) for k, v in ab.items()],
             {"what": "DDIMScheduler.alphas_cumprod, T = 1000", "source": f"diffusers {diffusers.__version__}",
                "versions": json.dumps(VERSIONS, sort_keys=True)})
    print("\n".join(summary))


if __name__ == "__main__":
    main()
