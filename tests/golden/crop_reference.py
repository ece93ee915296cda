"""Resized-crop golden from torchvision's own RandomResizedCrop (get_params, then functional.resized_crop on
tensors, antialias at its default, True), run in the project's environment (requirements.txt: torch 2.13.0,
torchvision 0.28.0; the versions are recorded in the output's metadata). Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/crop_reference.py

RandomResizedCrop draws from torch's global generator: torch.empty(1).uniform_(a, b) for the area fraction
and the log-aspect, torch.randint(0, n, (1,)) for the corner. Two stubs replace those draws by a scripted
list of 32-bit integers u, used as dew's loader uses its own generator's: uniform_(a, b) fills
a + (b - a) * u / 2^32 and randint(0, n) gives u % n. Nothing else is replaced; the box and the resized
image are torchvision's. The C++ test (tests/data/test_data.cpp, DataLoader.ResizedCropMatchesTorchvision)
feeds the same draws to dew::data::random_resized_crop_box and the box to dew::data::resized_crop.

Output: tests/golden/crop/torchvision_crop.safetensors (write_st of tests/golden/st_io.py, the safetensors
package). For each case C:
  C.draws I64 [40] (the scripted u), C.used I64 [] (how many torchvision consumed),
  C.box I64 [4] (top, left, height, width), C.image (the input, [..., H, W]), C.out (torchvision's output)
  __metadata__: torch, torchvision, safetensors, cases (JSON: name, scale, ratio, dtype, shape).
"""
import json
import os
import sys

import numpy as np
import torch
import torchvision
from torchvision import transforms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_io import VERSION as ST_VERSION, write_st  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crop", "torchvision_crop.safetensors")

# name, image shape [..., H, W], dtype, scale, ratio
CASES = [
    ("u8_28", (1, 28, 28), torch.uint8, (0.3, 1.0), (3 / 4, 4 / 3)),
    ("u8_clip", (1, 2, 28, 28), torch.uint8, (0.3, 1.0), (3 / 4, 4 / 3)),
    ("u8_small_scale", (1, 28, 28), torch.uint8, (0.08, 0.2), (3 / 4, 4 / 3)),
    ("f64_rect", (3, 20, 24), torch.float64, (0.08, 1.0), (3 / 4, 4 / 3)),
    ("f32_wide_ratio", (2, 16, 16), torch.float32, (0.5, 0.6), (0.5, 2.0)),
    ("u8_retry", (1, 12, 40), torch.uint8, (0.2, 0.5), (0.5, 1.0)),  # most tries too tall, a later one fits
    ("u8_fallback", (1, 10, 40), torch.uint8, (0.9, 1.0), (0.5, 1.0)),  # every try too tall: centred crop
]


class Script:
    def __init__(self, draws):
        self.draws, self.k = [int(d) for d in draws], 0

    def next(self):
        u = self.draws[self.k]
        self.k += 1
        return u


def main():
    state = {}

    def uniform_(self, a=0.0, b=1.0, generator=None):
        u = state["script"].next()
        a, b = float(a), float(b)
        return self.fill_(a + (b - a) * (u / 2.0 ** 32))

    def randint(low, high=None, size=None, **kwargs):
        if high is None:
            low, high = 0, low
        return torch.tensor([int(low) + state["script"].next() % (int(high) - int(low))])

    torch.Tensor.uniform_ = uniform_
    torch.randint = randint

    rs = np.random.RandomState(20261206)
    tensors, meta_cases = [], []
    for name, shape, dtype, scale, ratio in CASES:
        draws = rs.randint(0, 2 ** 32, size=40, dtype=np.uint64)
        if dtype == torch.uint8:
            image = torch.from_numpy(rs.randint(0, 256, size=shape).astype(np.uint8))
        else:
            image = torch.from_numpy(rs.standard_normal(shape)).to(dtype)
        h, w = shape[-2], shape[-1]
        crop = transforms.RandomResizedCrop((h, w), scale=scale, ratio=ratio)
        state["script"] = Script(draws)
        box = crop.get_params(image, crop.scale, crop.ratio)
        used = state["script"].k
        state["script"] = Script(draws)
        out = crop(image)  # the module's own forward: get_params on the same draws, then resized_crop
        assert state["script"].k == used
        tensors += [
            (f"{name}.draws", torch.from_numpy(draws.astype(np.int64))),
            (f"{name}.used", torch.tensor(used, dtype=torch.int64)),
            (f"{name}.box", torch.tensor(box, dtype=torch.int64)),
            (f"{name}.image", image),
            (f"{name}.out", out),
        ]
        meta_cases.append({"name": name, "scale": list(scale), "ratio": list(ratio), "dtype": str(dtype),
                           "shape": list(shape)})
        print(name, "box", box, "used", used)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    write_st(OUT, tensors, {"torch": torch.__version__, "torchvision": torchvision.__version__,
                            "safetensors": ST_VERSION, "cases": json.dumps(meta_cases)})
    print("wrote", OUT)


if __name__ == "__main__":
    main()
