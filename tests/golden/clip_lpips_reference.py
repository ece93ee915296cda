"""CLIP score and LPIPS goldens from the installed reference packages (requirements.txt: torch 2.13.0, transformers
5.25.0, torchmetrics 1.9.0, lpips 0.1.4, torchvision 0.28.0). Not run by CI; rerun by hand (deterministic, rewrites
tests/golden/clip_score/ and tests/golden/lpips/):

    .venv/bin/python tests/golden/clip_lpips_reference.py

clip_score/ (torchmetrics 1.9.0 with transformers 5: get_*_features return an output object whose pooler_output is
the projected embedding; CLIPScore gets a wrapper returning that tensor): a tiny CLIPModel (CLIPConfig with 2-layer text and vision towers, image_size 32, patch 8, projection 12)
built under torch.manual_seed (the first even seed giving a mean score > 10), every parameter moved off its initialisation (p += 0.2 randn), saved with
save_pretrained together with a CLIPProcessor (the tiny BPE tokenizer of tests/golden/sd/pipeline/tokenizer and a
CLIPImageProcessor resizing the shortest side to 32 and center-cropping 32 x 32). golden.safetensors (not
io.safetensors: the folder is no reference-parity case of tests/nn/test_reference_parity.cpp) holds the uint8
images (three of 40 x 48, one of 32 x 32, one of 56 x 40), the processor's pixel_values (float32), the text ids and
mask the processor gives, and image_embeds / text_embeds / scores (100 cos per pair) / score (torchmetrics'
CLIPScore, max(mean, 0)) as NAME_f32 (torchmetrics + transformers in float32; the f32 score is CLIPScore's own
output) and NAME_f64 (the same model as a float64 deep copy on the same pixel_values and ids). prompts.json: the
prompts.

lpips/: lpips.LPIPS(net=alex|vgg, pretrained=False, pnet_rand=True) whose every parameter is then set by a closed
form rule (so no weights are committed; dew::metrics::lpips_closed_form_init computes the same
tensors):
    parameter k (0-based, in named_parameters() order, listed in lpips/README.md), flat index i, fan_in f (product of dims 1..):
    u = ((i * 2654435761 + (k + 1) * 40503) mod 2^32) / 2^32      (exact integers)
    conv weights:      (2u - 1) * sqrt(6 / f)
    conv biases:       (2u - 1) * 0.1
    lin weights:       u * 0.1  (non-negative, as trained LPIPS weights are)
computed in float64 and cast to float32. alex.safetensors / vgg.safetensors: in0, in1 in [-1, 1] ([3, 3, 64, 64] for alex, [2, 3, 32, 32]
for vgg) and the distances [N] as d_f32 / d_f64 (the model as a float64 copy; the inputs are float32 values).
"""
import copy
import json
import os
import shutil
import sys

import lpips
import numpy as np
import PIL
import safetensors
import torch
import torchmetrics
import torchvision
import transformers
from torchmetrics.multimodal.clip_score import CLIPScore
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from st_io import write_st  # noqa: E402

VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "torchmetrics": torchmetrics.__version__,
    "torchvision": torchvision.__version__,
    "lpips": "0.1.4",
    "pillow": PIL.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
    "generator": "tests/golden/clip_lpips_reference.py",
}
META = {k: str(v) for k, v in VERSIONS.items()}

PROMPTS = ["a photo of a cat", "the moon", "a photo of a cat on the moon", "blurry, low quality", "a cat"]


def perturb_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


# ----------------------------------------------------------------------------------------------------
# CLIP score
# ----------------------------------------------------------------------------------------------------
class TensorFeatures(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def get_image_features(self, *a, **kw):
        return self.model.get_image_features(*a, **kw).pooler_output

    def get_text_features(self, *a, **kw):
        return self.model.get_text_features(*a, **kw).pooler_output


def clip_case():
    out = os.path.join(HERE, "clip_score")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(HERE, "sd", "pipeline", "tokenizer"))
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=vocab - 2, eos_token_id=vocab - 1,
                pad_token_id=1)
    vision = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, num_channels=3, hidden_act="quick_gelu")
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=12)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    g = torch.Generator().manual_seed(2)
    sizes = [(40, 48), (40, 48), (40, 48), (32, 32), (56, 40)]
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    # the first seed whose mean score is clearly positive (CLIPScore clamps a negative mean to 0, which would
    # test nothing)
    for seed in range(0, 200, 2):
        torch.manual_seed(seed)
        model = perturb_(CLIPModel(config), seed + 1).eval()
        with torch.no_grad():
            i = model.get_image_features(processor(images=images, return_tensors="pt")["pixel_values"]).pooler_output
            t = model.get_text_features(**processor(text=PROMPTS, return_tensors="pt", padding=True)).pooler_output
            mean = (100 * torch.nn.functional.cosine_similarity(i, t, dim=-1)).mean().item()
        if mean > 10:
            break
    print(f"clip_score: model seed {seed}")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # what a user does: load the folder
    model = CLIPModel.from_pretrained(out).eval()
    processor = CLIPProcessor.from_pretrained(out)

    # transformers 5 returns a BaseModelOutputWithPooling from get_image_features / get_text_features (the
    # projected embeddings in .pooler_output) where torchmetrics 1.9.0 expects the tensor: this wrapper hands
    # CLIPScore the tensor and changes nothing else.
    metric = CLIPScore(model_name_or_path=lambda: (TensorFeatures(model), processor))
    score_f32 = metric(images, PROMPTS).detach()

    with torch.no_grad():
        pix = processor(images=images, return_tensors="pt", padding=True)["pixel_values"]
        tok = processor(text=PROMPTS, return_tensors="pt", padding=True)
        ids, mask = tok["input_ids"], tok["attention_mask"]

        def feats(m, px):
            i = m.get_image_features(px)
            t = m.get_text_features(ids, mask)
            i = i if torch.is_tensor(i) else i.pooler_output
            t = t if torch.is_tensor(t) else t.pooler_output
            return i, t

        def scores(i, t):
            i = i / i.norm(p=2, dim=-1, keepdim=True)
            t = t / t.norm(p=2, dim=-1, keepdim=True)
            return 100 * (i * t).sum(-1)

        i32, t32 = feats(model, pix)
        s32 = scores(i32, t32)
        assert torch.allclose(torch.clamp(s32.mean(), min=0), score_f32, rtol=1e-6, atol=1e-5), (s32, score_f32)
        m64 = copy.deepcopy(model).double().eval()
        i64, t64 = feats(m64, pix.double())
        s64 = scores(i64, t64)
        score_f64 = torch.clamp(s64.mean(), min=0)
    tensors = {"pixel_values": pix, "input_ids": ids, "attention_mask": mask,
               "image_embeds_f32": i32, "image_embeds_f64": i64, "text_embeds_f32": t32, "text_embeds_f64": t64,
               "scores_f32": s32, "scores_f64": s64, "score_f32": score_f32.reshape(1),
               "score_f64": score_f64.reshape(1)}
    for k, im in enumerate(images):
        tensors[f"image{k}"] = im
    write_st(os.path.join(out, "golden.safetensors"), tensors, META)
    with open(os.path.join(out, "prompts.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "images": [f"image{k}" for k in range(len(images))], "versions": VERSIONS},
                  f, indent=1)
    print(f"clip_score: score f32 {score_f32.item():.6f} f64 {score_f64.item():.6f} "
          f"rms(f32 - f64) scores {(s32.double() - s64).pow(2).mean().sqrt().item():.3e}")


# ----------------------------------------------------------------------------------------------------
# LPIPS
# ----------------------------------------------------------------------------------------------------
def closed_form_(model):
    """Sets every parameter of an lpips.LPIPS by the rule in the module docstring; returns the key order."""
    keys = []
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            keys.append(name)
            i = np.arange(p.numel(), dtype=np.int64)
            u = ((i * 2654435761 + (k + 1) * 40503) % (1 << 32)).astype(np.float64) / float(1 << 32)
            fan_in = int(np.prod(p.shape[1:])) if p.dim() > 1 else 1
            if name.startswith("lin"):
                v = u * 0.1
            elif name.endswith("bias"):
                v = (2 * u - 1) * 0.1
            else:
                v = (2 * u - 1) * np.sqrt(6.0 / fan_in)
            p.copy_(torch.from_numpy(v).reshape(p.shape).to(p.dtype))
    return keys


def lpips_case(net, n, hw, seed):
    out = os.path.join(HERE, "lpips")
    model = lpips.LPIPS(net=net, pretrained=False, pnet_rand=True, verbose=False).eval()
    keys = closed_form_(model)
    g = torch.Generator().manual_seed(seed)
    in0 = torch.rand(n, 3, hw, hw, generator=g, dtype=torch.float64) * 2 - 1
    in1 = (in0 + 0.3 * torch.randn(n, 3, hw, hw, generator=g, dtype=torch.float64)).clamp(-1, 1)
    in0, in1 = in0.float().double(), in1.float().double()  # the stored float32 inputs are exactly the f64 run's
    with torch.no_grad():
        d32 = model(in0.float(), in1.float()).reshape(n)
        m64 = copy.deepcopy(model).double()
        d64 = m64(in0, in1).reshape(n)
    write_st(os.path.join(out, f"{net}.safetensors"),
             {"in0": in0.float(), "in1": in1.float(), "d_f32": d32, "d_f64": d64}, META)
    print(f"lpips {net}: d_f32 {d32.tolist()} rms(f32 - f64) {(d32.double() - d64).pow(2).mean().sqrt().item():.3e}")
    return keys


def main():
    clip_case()
    out = os.path.join(HERE, "lpips")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    keys = {"alex": lpips_case("alex", 3, 64, 3), "vgg": lpips_case("vgg", 2, 32, 4)}
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("LPIPS goldens written by tests/golden/clip_lpips_reference.py (see its docstring for the closed-form "
                "weight rule; parameters numbered in this order):\n\n")
        for net, ks in keys.items():
            f.write(f"{net}: " + ", ".join(ks) + "\n\n")
        f.write("versions: " + json.dumps(VERSIONS) + "\n")


if __name__ == "__main__":
    main()
