"""FlowMatchEulerDiscreteScheduler goldens (SD3 / SD3.5 / Flux) from the installed diffusers 0.42.1 on torch 2.13.0.
Not run by CI; rerun by hand (deterministic, adds tests/golden/schedulers/flow_*):

    .venv/bin/python tests/golden/flow_scheduler_reference.py

Reuses the machinery of tests/golden/schedulers_reference.py: the scheduler class is imported from the installed
diffusers (nothing stubbed), and the float64 run loads scheduling_flow_match_euler_discrete.py again from its
source with every `torch.float32` / `np.float32` replaced by float64 (the __init__ sigmas, the float32 cast of
custom sigmas, the shifted sigmas, the float32 upcast of `sample` in step), under
torch.set_default_dtype(torch.float64), on z widened to float64.

The loop is the one of StableDiffusion3Pipeline / FluxPipeline without guidance:

    scheduler.set_timesteps(n, sigmas=SIGMAS, mu=MU)   # as the pipeline passes them (see CASES)
    latents = z
    for t in scheduler.timesteps:
        out = model(latents, t)          # 0.3 x + 0.1 sin(t / 100) in float64, cast to x's dtype
        latents = scheduler.step(out, t, latents).prev_sample

SIGMAS: None (SD3) or FluxPipeline's np.linspace(1.0, 1 / n, n). MU: None, or the pipelines' calculate_shift
(imported from diffusers.pipelines.flux.pipeline_flux) of IMAGE_SEQ_LEN with the config's base/max sequence
lengths and shifts.

Output per case: flow_<case>.json (to_json_string(), a pipeline's scheduler/scheduler_config.json) and
flow_<case>.safetensors with z [1,4,4,4] f32; for n in (4, 9): n{n}.mu [1] f64 (NaN: none passed),
n{n}.sigmas_in [n] f64 (empty: none passed), n{n}.timesteps_f32 / _f64 [n] f64, n{n}.sigmas_f32 / _f64
[n+1] f64 (scheduler.sigmas), n{n}.x_f32 [n,1,4,4,4] f32, n{n}.x_f64 f64 (latents after each step).
"""
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from schedulers_reference import OUT_DIR, VERSIONS, model, scheduler_module  # noqa: E402  (asserts the pins)
from st_io import read_st, write_st  # noqa: E402

import diffusers  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # noqa: E402

IMAGE_SEQ_LEN = 1024  # a 1024x1024 SD3 / Flux image: (1024 / 8 / 2)^2 = 4096; 1024 is 512x512
FLUX_SIGMAS = "flux"  # FluxPipeline's np.linspace(1.0, 1 / n, n)
CASES = {
    # SD3 medium's scheduler: shift 3, no dynamic shifting, no sigmas passed
    "sd3": (dict(shift=3.0), None, False),
    # SD3 with use_dynamic_shifting (StableDiffusion3Pipeline computes mu, passes no sigmas)
    "sd3_dynamic": (dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15), None, True),
    # FLUX.1-schnell's scheduler: shift 1, no dynamic shifting; FluxPipeline passes its sigmas (and mu, unused)
    "flux_schnell": (dict(shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15), FLUX_SIGMAS, True),
    # FLUX.1-dev's scheduler: dynamic shifting with mu from the image sequence length, on FluxPipeline's sigmas
    "flux_dev": (dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15), FLUX_SIGMAS, True),
    # the linear time shift and shift_terminal (LTX-Video's stretch), on dynamic shifting
    "linear_terminal": (dict(use_dynamic_shifting=True, time_shift_type="linear", shift_terminal=0.1,
                             base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05),
                        None, True),
}
CLS = "FlowMatchEulerDiscreteScheduler"
MODULE = "scheduling_flow_match_euler_discrete"


def run(cls, kwargs, n, sigmas, mu, z, dtype):
    sched = cls(**kwargs)
    sched.set_timesteps(n, sigmas=sigmas, mu=mu)
    ts, sig = sched.timesteps.clone(), sched.sigmas.clone()
    x = z.to(dtype)
    xs = []
    for t in sched.timesteps:
        x = sched.step(model(x, t), t, x).prev_sample
        assert x.dtype == dtype, (x.dtype, dtype)
        xs.append(x.clone())
    return ts, sig, torch.stack(xs)


def main():
    diffusers.utils.logging.set_verbosity_error()
    print("versions", VERSIONS)
    c32 = getattr(scheduler_module(MODULE, False), CLS)
    m64 = scheduler_module(MODULE, True)
    c64 = getattr(m64, CLS)
    print(f"{CLS}: float64 copy replaces {m64.F32_REPLACED} float32 names")
    g = torch.Generator().manual_seed(20251206)
    z = torch.randn(1, 4, 4, 4, generator=g)
    summary = []
    for case, (kwargs, sigmas_kind, pass_mu) in CASES.items():
        config = c32(**kwargs).to_json_string()
        cfg = json.loads(config)
        with open(os.path.join(OUT_DIR, f"flow_{case}.json"), "w") as f:
            f.write(config)
        tensors = [("z", z)]
        for n in (4, 9):
            sigmas = np.linspace(1.0, 1 / n, n) if sigmas_kind == FLUX_SIGMAS else None
            mu = calculate_shift(IMAGE_SEQ_LEN, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                                 cfg["max_shift"]) if pass_mu else None
            ts32, s32, x32 = run(c32, kwargs, n, sigmas, mu, z, torch.float32)
            torch.set_default_dtype(torch.float64)
            try:
                ts64, s64, x64 = run(c64, kwargs, n, sigmas, mu, z, torch.float64)
            finally:
                torch.set_default_dtype(torch.float32)
            assert len(ts32) == len(ts64) == n
            tensors += [
                (f"n{n}.mu", torch.tensor([math.nan if mu is None else mu], dtype=torch.float64)),
                (f"n{n}.sigmas_in", torch.tensor([] if sigmas is None else list(sigmas), dtype=torch.float64)),
                (f"n{n}.timesteps_f32", ts32.double()), (f"n{n}.timesteps_f64", ts64.double()),
                (f"n{n}.sigmas_f32", s32.double()), (f"n{n}.sigmas_f64", s64.double()),
                (f"n{n}.x_f32", x32), (f"n{n}.x_f64", x64),
            ]
            err = (x32[-1].double() - x64[-1]).abs().max().item()
            summary.append(f"flow_{case:18s} n={n} mu={mu}  sigmas {[round(float(s), 4) for s in s64]}"
                           f"  max|f32 - f64| {err:.2e}")
        meta = {"class": CLS, "model": "0.3 x + 0.1 sin(t / 100), float64, cast to x's dtype",
                "image_seq_len": str(IMAGE_SEQ_LEN), "sigmas": str(sigmas_kind),
                "source": f"diffusers {diffusers.__version__}", "versions": json.dumps(VERSIONS, sort_keys=True)}
        path = os.path.join(OUT_DIR, f"flow_{case}.safetensors")
        write_st(path, tensors, meta)
        back, _ = read_st(path)
        assert all(torch.allclose(back[k], v, rtol=0, atol=0, equal_nan=True) for k, v in tensors)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
