"""FID goldens (tests/golden/fid/) from the installed reference packages: pytorch-fid 0.3.0 (InceptionV3 pool3
features, calculate_frechet_distance), clean-fid 0.1.35 (its "clean" PIL bicubic resize) and numpy (np.savez /
np.savez_compressed .npz files). Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/fid_reference.py

Weights. pytorch-fid's InceptionV3 has 21.8M parameters (~90 MB), too large to commit, so its weights are a
closed-form rule that tests/metrics/test_fid.cpp computes too (fid_test::rule_weights). The model is pytorch-fid's
own: `pytorch_fid.inception.InceptionV3([3])` builds torchvision's Inception3 patched with FIDInceptionA/C/E_1/E_2
and calls `load_state_dict_from_url(FID_WEIGHTS_URL)`; this script points that one function at the rule's state
dict instead of the download (nothing else is replaced; load_state_dict runs strict). The rule, over the names of
the state dict sorted as strings, without `*.num_batches_tracked` (0) and `fc.*` (zeros; not part of pool3), with
k the name's position in that list and t = sin(0.7 i + k) over the flattened index i (float64):
    *.conv.weight       1.5 / sqrt(fan_in) * t        (fan_in = numel / out_channels)
    *.bn.weight         1 + 0.2 t
    *.bn.bias           0.1 t
    *.bn.running_mean   0.1 t
    *.bn.running_var    1 + 0.5 t^2
Features: the model in float64 on float64 images (NAME_f64) and in float32 on the images cast to float32 (NAME_f32).

Output tests/golden/fid/:
  io.safetensors
    images_a F64 [2, 3, 32, 32], images_b F64 [1, 1, 20, 24] (grayscale: pytorch-fid's loader converts to RGB,
      i.e. repeats the channel), images_c F64 [1, 3, 40, 28]; all in [0, 1]
    feat_{a,b,c}_{f32,f64} [n, 2048]: InceptionV3([3])(images)[0] flattened
    fd.CASE.{x,y} F64 [N, D] features; fd.CASE.{mu1,sigma1,mu2,sigma2} F64 (np.mean, np.cov(rowvar=False), as
      pytorch-fid's calculate_activation_statistics); fd.CASE_f64 F64 [] calculate_frechet_distance on them;
      fd.CASE_f32 F64 [] the same on the statistics cast to float32 (the rule's float32 yardstick);
      fd.CASE_noretry F64 []: |mu1-mu2|^2 + tr s1 + tr s2 - 2 sum sqrt(max(eig(s1 s2), 0)), the value without the
      eps retry (differs from _f64 only where pytorch-fid retried)
    resize.CASE.in U8 [H, W, 3], resize.CASE.out F32 [h, w, 3]: clean-fid's make_resizer("PIL", False, "bicubic",
      (w, h)) (build_resizer("clean") is this with (299, 299))
  stats_savez.npz, stats_savez_compressed.npz: np.savez / np.savez_compressed of mu F64 [5], sigma F64 [5, 5],
    f32 F32 [2, 3], i64 I64 [4], fortran F64 [3, 2] (Fortran order), flags bool [3]; the same arrays in
    io.safetensors as npz.NAME (bool as U8).
  __metadata__: versions, the rule, the FD cases (which retried).
"""
import io
import json
import math
import os
import sys
import warnings
from contextlib import redirect_stdout

import numpy as np
import scipy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fid")
sys.path.insert(0, HERE)
from st_io import VERSION as ST_VERSION, write_st  # noqa: E402

import cleanfid  # noqa: E402
import pytorch_fid  # noqa: E402
import pytorch_fid.inception as pinc  # noqa: E402
from cleanfid.resize import make_resizer  # noqa: E402
from pytorch_fid.fid_score import calculate_frechet_distance  # noqa: E402


def rule_value(name, shape, k):
    n = int(np.prod(shape))
    t = torch.sin(0.7 * torch.arange(n, dtype=torch.float64) + k)
    if name.endswith("conv.weight"):
        v = 1.5 / math.sqrt(n / shape[0]) * t
    elif name.endswith("bn.weight"):
        v = 1 + 0.2 * t
    elif name.endswith("bn.bias"):
        v = 0.1 * t
    elif name.endswith("bn.running_mean"):
        v = 0.1 * t
    elif name.endswith("bn.running_var"):
        v = 1 + 0.5 * t * t
    else:
        raise ValueError(name)
    return v.reshape(shape)


def build_model():
    # The names and shapes of the state dict pytorch-fid loads: build fid_inception_v3() once with loading
    # switched off, read its state_dict(), then build the real model through the (redirected) URL loader.
    orig = torch.nn.Module.load_state_dict
    torch.nn.Module.load_state_dict = lambda self, sd, *a, **k: None
    pinc.load_state_dict_from_url = lambda *a, **k: {}
    try:
        template = pinc.fid_inception_v3().state_dict()
    finally:
        torch.nn.Module.load_state_dict = orig
    keys = sorted(k for k in template if not k.endswith("num_batches_tracked") and not k.startswith("fc."))
    sd = {k: torch.zeros_like(v) for k, v in template.items()}
    for i, k in enumerate(keys):
        sd[k] = rule_value(k, tuple(template[k].shape), i).to(template[k].dtype)
    pinc.load_state_dict_from_url = lambda *a, **k: sd
    return pinc.InceptionV3([3]).eval(), len(keys)


def features(model, x):
    with torch.no_grad():
        f64 = model.double()(x.double())[0].flatten(1)
        f32 = model.float()(x.float())[0].flatten(1)
    return f32, f64


def fd_noretry(mu1, s1, mu2, s2):
    ev = np.linalg.eigvals(s1 @ s2)
    return float((mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.maximum(ev.real, 0)).sum())


def main():
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(42)
    t = {}
    meta_cases = {}

    model, nkeys = build_model()
    sets = {
        "a": torch.rand(2, 3, 32, 32, generator=g, dtype=torch.float64),
        "b": torch.rand(1, 1, 20, 24, generator=g, dtype=torch.float64),
        "c": torch.rand(1, 3, 40, 28, generator=g, dtype=torch.float64),
    }
    for name, x in sets.items():
        t[f"images_{name}"] = x
        rgb = x.repeat(1, 3, 1, 1) if x.shape[1] == 1 else x
        f32, f64 = features(model, rgb)
        t[f"feat_{name}_f32"], t[f"feat_{name}_f64"] = f32, f64

    rng = np.random.default_rng(7)
    fd_inputs = {
        # full rank: N > D
        "full": (np.abs(rng.standard_normal((40, 16))), np.abs(rng.standard_normal((30, 16))) + 0.3),
        # N < D: both covariances singular; scipy 1.17's sqrtm stays finite (tiny imaginary parts), no retry
        "singular": (np.abs(rng.standard_normal((6, 16))), np.abs(rng.standard_normal((5, 16)))),
        # rank-1 covariances (found by a random search): the product's Schur form has exact zeros on its diagonal,
        # scipy's sqrtm returns non-finite values and pytorch-fid retries with 1e-6 I added to both
        "retry": (np.array([[0.2362104543017174, 0.2362104543017174, 0.0], [0.2362104543017174, 0.0, 0.2362104543017174]]),
                  np.array([[1.0, 2.0, 1.0], [2.0, 1.0, 2.0]])),
    }
    for case, (x, y) in fd_inputs.items():
        mu1, s1 = np.mean(x, axis=0), np.cov(x, rowvar=False)
        mu2, s2 = np.mean(y, axis=0), np.cov(y, rowvar=False)
        buf = io.StringIO()
        with warnings.catch_warnings(), redirect_stdout(buf):
            warnings.simplefilter("ignore")
            f64 = calculate_frechet_distance(mu1, s1, mu2, s2)
            f32 = calculate_frechet_distance(*(a.astype(np.float32) for a in (mu1, s1, mu2, s2)))
        retried = "singular product" in buf.getvalue()
        for k, v in {"x": x, "y": y, "mu1": mu1, "sigma1": s1, "mu2": mu2, "sigma2": s2}.items():
            t[f"fd.{case}.{k}"] = torch.from_numpy(np.ascontiguousarray(v))
        t[f"fd.{case}_f64"] = torch.tensor(float(f64), dtype=torch.float64)
        t[f"fd.{case}_f32"] = torch.tensor(float(f32), dtype=torch.float64)
        t[f"fd.{case}_noretry"] = torch.tensor(fd_noretry(mu1, s1, mu2, s2), dtype=torch.float64)
        meta_cases[case] = {"fid_f64": float(f64), "fid_f32": float(f32), "retried": retried,
                            "noretry": fd_noretry(mu1, s1, mu2, s2)}

    rs = np.random.default_rng(3)
    for case, (h, w, oh, ow) in {"down": (17, 13, 7, 5), "up": (6, 9, 11, 8), "mixed": (30, 40, 29, 23),
                                 "wide": (12, 31, 12, 10)}.items():
        img = rs.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = make_resizer("PIL", False, "bicubic", (ow, oh))(img)
        t[f"resize.{case}.in"] = torch.from_numpy(img)
        t[f"resize.{case}.out"] = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))

    arrays = {
        "mu": rng.standard_normal(5),
        "sigma": np.cov(rng.standard_normal((9, 5)), rowvar=False),
        "f32": rng.standard_normal((2, 3)).astype(np.float32),
        "i64": np.array([1, -2, 3, 1 << 40], dtype=np.int64),
        "fortran": np.asfortranarray(rng.standard_normal((3, 2))),
        "flags": np.array([True, False, True]),
    }
    np.savez(os.path.join(OUT, "stats_savez.npz"), **arrays)
    np.savez_compressed(os.path.join(OUT, "stats_savez_compressed.npz"), **arrays)
    for k, v in arrays.items():
        t[f"npz.{k}"] = torch.from_numpy(np.ascontiguousarray(v.astype(np.uint8) if v.dtype == bool else v))

    versions = {"pytorch_fid": pytorch_fid.__version__, "clean_fid": "0.1.35", "torch": torch.__version__,
                "numpy": np.__version__, "scipy": scipy.__version__, "safetensors": ST_VERSION}
    meta = {"versions": json.dumps(versions), "weight_rule": f"sin(0.7 i + k) rule over {nkeys} sorted names",
            "fd_cases": json.dumps(meta_cases)}
    write_st(os.path.join(OUT, "io.safetensors"), t, meta)
    print(json.dumps(meta_cases, indent=1))
    print({k: float(v.abs().mean()) for k, v in t.items() if k.startswith("feat_") and k.endswith("f64")})


if __name__ == "__main__":
    main()
