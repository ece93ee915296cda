"""LoRA goldens from the installed peft (peft 0.21.2 with torch 2.13.0; asserted). Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/lora_reference.py

A tiny torch model with Conv2d (3x3, 3x3 stride 2, 1x1) and Linear layers (the names below; tests/nn/test_lora.cpp
builds the same tree in dew, calling its layers through nn::conv / nn::dense). peft.get_peft_model applies a
LoraConfig; the base and adapter weights are then moved off their initialisation (seeded p += 0.2 * randn on
every parameter; B starts at zero, so without this the adapters would do nothing). The same float32 weights run
in float32 and, converted, in float64.

Cases (each a LoraConfig):
  list:  target_modules=["q_proj", "v_proj", "conv_in", "proj", "out"] (names: full name or "." + entry suffix,
         so "proj" matches the conv "proj" but not "attn.q_proj"), r=4, lora_alpha=8
  regex: target_modules=r".*(conv_down|v_proj)" (a full regex match), r=2, lora_alpha=3, use_rslora=True

Writes tests/golden/lora/lora.safetensors:
  w.NAME                  base weights (float32, dew's names: no "base_layer")
  CASE.NAME.lora_A.weight / CASE.NAME.lora_B.weight   adapter weights (float32)
  x, g                    input [2, 3, 8, 8] and the output cotangent [2, 16, 4]
  CASE.y_f32 / _f64       the adapted model's output
  CASE.base_y_f64         the base model's output (adapters disabled)
  CASE.merged.NAME_f64    each adapted layer's weight after merge_adapter (float64)
  CASE.grad.NAME.lora_A.weight_f32 / _f64 (and lora_B)   d(sum(y * g)) / d(adapter weight)
and tests/golden/lora/peft_adapter/ (adapter_config.json + adapter_model.safetensors) written by PeftModel's
save_pretrained for the list case: the file layout that dew's PEFT import reads; and
tests/golden/lora/kohya_from_diffusers.safetensors: the list case's adapters as "unet.<module>..." converted by
the installed diffusers' convert_state_dict_to_kohya (lora_unet_<module>.lora_down/up.weight and .alpha = rank,
so scale 1).
"""
import json
import os
import shutil

import diffusers
import peft
import torch
from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
from torch import nn

from st_io import VERSION as ST_VERSION
from st_io import write_st

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert peft.__version__ == "0.21.2", peft.__version__
assert diffusers.__version__ == "0.42.1", diffusers.__version__

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "lora")


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 16)
        self.v_proj = nn.Linear(8, 16, bias=False)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.proj = nn.Conv2d(8, 8, 1)
        self.attn = Attn()
        self.out = nn.Linear(16, 4)

    def forward(self, x):  # x: [B, 3, 8, 8] -> [B, 16, 4]
        h = nn.functional.silu(self.conv_in(x))
        h = nn.functional.silu(self.conv_down(h))
        h = self.proj(h)  # [B, 8, 4, 4]
        t = h.flatten(2).transpose(1, 2)  # [B, 16, 8]
        t = nn.functional.silu(self.attn.q_proj(t)) * self.attn.v_proj(t)
        return self.out(t)


CASES = {
    "list": dict(target_modules=["q_proj", "v_proj", "conv_in", "proj", "out"], r=4, lora_alpha=8),
    "regex": dict(target_modules=r".*(conv_down|v_proj)", r=2, lora_alpha=3, use_rslora=True),
}


def dew_name(peft_name):
    """PEFT's in-memory parameter name -> dew's (and PEFT's saved) name."""
    n = peft_name.removeprefix("base_model.model.")
    return n.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    base = Tiny()
    with torch.no_grad():
        for p in base.parameters():
            p += 0.2 * torch.randn_like(p)
    x = torch.randn(2, 3, 8, 8)
    g = torch.randn(2, 16, 4)
    tensors = {"x": x, "g": g}
    for n, p in base.state_dict().items():
        tensors["w." + n] = p.clone()

    for case, cfg in CASES.items():
        gen = torch.Generator().manual_seed(1 + len(case))
        models = {}
        for dt in (torch.float32, torch.float64):
            m = Tiny()
            m.load_state_dict(base.state_dict())
            models[dt] = peft.get_peft_model(m.to(dt), peft.LoraConfig(**cfg))
        # Off init: the float32 adapter weights, shared by both precisions.
        lora32 = {}
        with torch.no_grad():
            for n, p in models[torch.float32].named_parameters():
                if "lora_" in n:
                    p += 0.2 * torch.randn(p.shape, generator=gen)
                    lora32[n] = p.detach().clone()
            for n, p in models[torch.float64].named_parameters():
                if "lora_" in n:
                    p.copy_(lora32[n].double())
        for n, p in lora32.items():
            tensors[f"{case}.{dew_name(n)}"] = p
        for dt, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
            model = models[dt]
            model.train()  # dropout 0: train and eval agree; gradients need train mode in no way but are taken here
            y = model(x.to(dt))
            (y * g.to(dt)).sum().backward()
            tensors[f"{case}.y_{suffix}"] = y.detach()
            for n, p in model.named_parameters():
                if "lora_" in n:
                    tensors[f"{case}.grad.{dew_name(n)}_{suffix}"] = p.grad.detach().clone()
        m64 = models[torch.float64]
        with torch.no_grad(), m64.disable_adapter():
            tensors[f"{case}.base_y_f64"] = m64(x.double()).detach()
        m64.merge_adapter()
        for n, p in m64.named_parameters():
            if ".base_layer.weight" in n:
                tensors[f"{case}.merged.{dew_name(n)}_f64"] = p.detach().clone()
        m64.unmerge_adapter()

        if case == "list":
            folder = os.path.join(OUT, "peft_adapter")
            shutil.rmtree(folder, ignore_errors=True)
            models[torch.float32].save_pretrained(folder)
            os.remove(os.path.join(folder, "README.md"))  # the model card template: not an input of dew
            # The kohya layout as diffusers converts a PEFT UNet state dict ("unet.<module>.lora_A.weight").
            peft_sd = {"unet." + dew_name(n): p.detach().clone() for n, p in models[torch.float32].named_parameters()
                       if "lora_" in n}
            write_st(os.path.join(OUT, "kohya_from_diffusers.safetensors"), convert_state_dict_to_kohya(peft_sd),
                     {"diffusers": diffusers.__version__, "generator": "tests/golden/lora_reference.py"})

    meta = {"peft": peft.__version__, "torch": torch.__version__, "safetensors": ST_VERSION,
            "cases": json.dumps(CASES), "generator": "tests/golden/lora_reference.py"}
    write_st(os.path.join(OUT, "lora.safetensors"), tensors, meta)
    print("wrote", OUT, len(tensors), "tensors")


if __name__ == "__main__":
    main()
