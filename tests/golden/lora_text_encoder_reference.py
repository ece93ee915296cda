"""The golden of LoRA files that adapt the text encoders as well as the UNet, as kohya / sd-scripts trains them by
default (`lora_te_text_model_encoder_layers_0_self_attn_q_proj`, SDXL's `lora_te1_` / `lora_te2_`) and as diffusers
saves them (`text_encoder.text_model...lora_A.weight`, `text_encoder_2.`). Reference: diffusers' own
load_lora_weights of those files on the tiny SD and SDXL folders (tests/golden/sd/pipeline, pipeline_sdxl), with
diffusers 0.42.1, peft 0.21.2, transformers 5.25.0 and torch 2.13.0 as installed. Not run by CI; rerun by hand
(deterministic):

    .venv/bin/python tests/golden/lora_text_encoder_reference.py

How the files are made: peft LoraConfigs added to the folder's UNet (r 2, lora_alpha 4 on to_q / to_k / to_v /
to_out.0) and to each text encoder (r 2, lora_alpha 2 on q_proj / k_proj / v_proj / out_proj / fc1 / fc2; alpha =
r, so diffusers' file, which records no text-encoder alpha when it equals the rank, and kohya's agree), every
lora_A / lora_B set to 0.1 randn under torch.manual_seed(46) (UNet) and 47 / 48 (text encoders). Written twice:
by diffusers' save_lora_weights (its naming, the UNet's alpha in the file's metadata) and renamed by this script
into kohya's (`lora_unet_<module with _>`, `lora_te[1|2]_<module with _>`, `.lora_down.weight`, `.lora_up.weight`,
`.alpha` float32). The renaming is checked by diffusers itself: both files must give the same image (to 1e-6).

Writes tests/golden/lora/te_sd/ and te_sdxl/, each:
  kohya_te.safetensors (UNet and text encoders, kohya's names), diffusers_te.safetensors (the same adapters as
      diffusers' save_lora_weights wrote them), kohya_te_only.safetensors (kohya_te without its lora_unet_ keys);
  io.safetensors  `latents` [1, 4, 16, 16] (the folder's pipeline_io latents) and the images (output_type "pt":
      [0, 1], NCHW, float32) of the folder's pipeline (its own scheduler, 3 steps, guidance 7.5, prompt "a cat",
      32 x 32) on those latents: `image_base` without LoRA, `image_lora` after load_lora_weights(kohya_te,
      adapter_name="x") and set_adapters(["x"], adapter_weights=[0.5]) (the weight applies to the UNet's and the
      text encoders' adapters alike), `image_te_only` after load_lora_weights(kohya_te_only) alone (weight 1).
"""
import os
import re
import shutil
import sys
import tempfile

import diffusers
import peft
import torch
import transformers
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_pipeline_reference import add_random_adapters  # noqa: E402
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "lora")
PROMPT = "a cat"
STEPS = 3
GUIDANCE = 7.5
SCALE = 0.5
UNET = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
TEXT = dict(r=2, lora_alpha=2, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
FOLDERS = {"sd": (StableDiffusionPipeline, "pipeline", {"text_encoder": "lora_te"}),
           "sdxl": (StableDiffusionXLPipeline, "pipeline_sdxl",
                    {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"})}


def load(cls, folder):
    pipe = cls.from_pretrained(os.path.join(HERE, "sd", folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, latents):
    with torch.no_grad():
        h = latents.shape[2] * pipe.vae_scale_factor
        return pipe(prompt=PROMPT, latents=latents, height=h, width=h, num_inference_steps=STEPS,
                    guidance_scale=GUIDANCE, output_type="pt").images


def kohya_of(state, prefix, alpha):
    out = {}
    for m in sorted({k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}):
        flat = prefix + "_" + m.replace(".", "_")
        out[flat + ".lora_down.weight"] = state[m + ".lora_A.weight"]
        out[flat + ".lora_up.weight"] = state[m + ".lora_B.weight"]
        out[flat + ".alpha"] = torch.tensor(float(alpha))
    return out


def inject(model, config, seed):
    """peft's own LoRA layers on `model` (inject_adapter_in_model: transformers' add_adapter wants a newer peft
    than the pinned one), every lora_A / lora_B 0.1 randn under torch.manual_seed(seed); its adapter state."""
    inject_adapter_in_model(LoraConfig(**config), model)
    torch.manual_seed(seed)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.copy_(0.1 * torch.randn(p.shape))
    return get_peft_model_state_dict(model)


def weigh(models, weight):
    """What set_adapters(adapter_weights=[weight]) does to each peft LoRA layer: scaling = weight * alpha / r."""
    for model in models:
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.set_scale("default", weight)


FLOW_PROMPT = "a photo of a cat on the moon"
FLOW = {"sd3": (StableDiffusion3Pipeline, "sd3/pipeline", ["text_encoder", "text_encoder_2"],
                dict(prompt=FLOW_PROMPT, negative_prompt="blurry, low quality", guidance_scale=5.0)),
        "flux": (FluxPipeline, "flux/pipeline_schnell", ["text_encoder"], dict(prompt=FLOW_PROMPT))}
FLOW_TRANSFORMER = dict(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_v", "ff.net.2"])


def flow(name):
    """SD3's CLIP-L / CLIP-G and Flux's CLIP-L adapted as well as the transformer (diffusers' load_lora_weights reads
    those; not T5): diffusers' file (and its text-encoder keys alone), and the images with peft's layers at weight
    0.5 and with the text encoders' alone at 1 (16 x 16, 4 steps, as lora_flow_pipeline_reference.py)."""
    cls, folder, encoders, call = FLOW[name]
    out = os.path.join(OUT, "te_" + name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    def load_flow():
        pipe = cls.from_pretrained(os.path.join(HERE, folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_flow(pipe):
        with torch.no_grad():
            return pipe(**call, latents=latents, height=16, width=16, num_inference_steps=4, max_sequence_length=16,
                        output_type="pt").images

    latents, _ = read_st(os.path.join(HERE, folder, "pipeline_io.safetensors"))
    latents = latents["latents"]
    base = run_flow(load_flow())
    pipe = load_flow()
    meta = add_random_adapters(pipe.transformer, FLOW_TRANSFORMER, 56)
    transformer_state = get_peft_model_state_dict(pipe.transformer)
    text_states = {c: inject(getattr(pipe, c), TEXT, 57 + i) for i, c in enumerate(encoders)}
    weigh([pipe.transformer] + [getattr(pipe, c) for c in encoders], SCALE)
    lora = run_flow(pipe)
    assert not torch.equal(lora, base)
    pipe = load_flow()  # the text encoders' adapters alone, weight 1
    for i, c in enumerate(encoders):
        inject(getattr(pipe, c), TEXT, 57 + i)
    te = run_flow(pipe)
    assert not torch.equal(te, base)
    layers = {f"{c}_lora_layers": state for c, state in text_states.items()}
    cls.save_lora_weights(out, transformer_lora_layers=transformer_state, transformer_lora_adapter_metadata=meta,
                          **layers)
    os.rename(os.path.join(out, "pytorch_lora_weights.safetensors"), os.path.join(out, "diffusers_te.safetensors"))
    saved, saved_meta = read_st(os.path.join(out, "diffusers_te.safetensors"))
    assert {k.split(".")[0] for k in saved} == {"transformer", *encoders}, sorted({k.split(".")[0] for k in saved})
    write_st(os.path.join(out, "diffusers_te_only.safetensors"),
             {k: v for k, v in saved.items() if not k.startswith("transformer.")}, {})
    print(f"{name}: image rms change {float((lora - base).pow(2).mean().sqrt()):.4g} (text encoders alone "
          f"{float((te - base).pow(2).mean().sqrt()):.4g})")
    write_st(os.path.join(out, "io.safetensors"),
             [("latents", latents), ("image_base", base), ("image_lora", lora), ("image_te_only", te)],
             {"source": f"diffusers {diffusers.__version__} pipeline with peft {peft.__version__} LoRA layers, "
                        f"transformers {transformers.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}",
              "pipeline": f"tests/golden/{folder}", "call": repr(call), "steps": "4", "size": "16",
              "max_sequence_length": "16", "adapter_weight": str(SCALE),
              "transformer_lora_config": repr(FLOW_TRANSFORMER), "text_encoder_lora_config": repr(TEXT)})


def main():
    torch.set_grad_enabled(False)
    for name in FLOW:
        flow(name)
    for name, (cls, folder, encoders) in FOLDERS.items():
        out = os.path.join(OUT, "te_" + name)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        latents, _ = read_st(os.path.join(HERE, "sd", folder, "pipeline_io.safetensors"))
        latents = latents["latents"]
        base = run(load(cls, folder), latents)

        # The adapters on the UNet and the text encoders, weighted 0.5, in diffusers' pipeline.
        pipe = load(cls, folder)
        unet_meta = add_random_adapters(pipe.unet, UNET, 46)
        unet_state = get_peft_model_state_dict(pipe.unet)
        text_states = {c: inject(getattr(pipe, c), TEXT, 47 + i) for i, c in enumerate(encoders)}
        weigh([pipe.unet] + [getattr(pipe, c) for c in encoders], SCALE)
        lora = run(pipe, latents)
        assert not torch.equal(lora, base)

        # The text encoders' adapters alone, weight 1.
        pipe = load(cls, folder)
        for i, c in enumerate(encoders):
            assert inject(getattr(pipe, c), TEXT, 47 + i).keys() == text_states[c].keys()
        te = run(pipe, latents)
        assert not torch.equal(te, base)

        kohya = kohya_of(unet_state, "lora_unet", UNET["lora_alpha"])
        for component, prefix in encoders.items():
            # kohya names the text encoder's modules as transformers 4's CLIPTextModel did (text_model.encoder...);
            # transformers 5's has no text_model wrapper, diffusers' loader strips it (lora_base.py).
            wrapped = hasattr(getattr(pipe, component), "text_model")  # CLIPTextModelWithProjection still is
            kohya.update(kohya_of(text_states[component], prefix + ("" if wrapped else "_text_model"),
                                  TEXT["lora_alpha"]))
        write_st(os.path.join(out, "kohya_te.safetensors"), kohya,
                 {"ss_network_module": "networks.lora", "ss_network_dim": str(UNET["r"]),
                  "source": f"tests/golden/lora_text_encoder_reference.py, peft {peft.__version__}"})
        te_only = {k: v for k, v in kohya.items() if not k.startswith("lora_unet_")}
        write_st(os.path.join(out, "kohya_te_only.safetensors"), te_only,
                 {"source": "kohya_te.safetensors without its lora_unet_ keys"})
        with tempfile.TemporaryDirectory() as tmp:
            layers = {f"{c}_lora_layers": state for c, state in text_states.items()}
            cls.save_lora_weights(tmp, unet_lora_layers=unet_state, unet_lora_adapter_metadata=unet_meta, **layers)
            shutil.copy(os.path.join(tmp, "pytorch_lora_weights.safetensors"),
                        os.path.join(out, "diffusers_te.safetensors"))
            saved, _ = read_st(os.path.join(tmp, "pytorch_lora_weights.safetensors"))
        # kohya's text-encoder names checked by diffusers' own converter (what load_lora_weights runs on a kohya
        # file): each lands on the component and the module (its parent, for the attention projections, which
        # the converter renames to_q_lora, ...) diffusers' writer names, with the same down (A) tensor.
        converted, _ = _convert_non_diffusers_lora_to_diffusers(dict(kohya))
        for component in encoders:
            pre = component + "."
            ours = {k[len(pre):-len(".lora_A.weight")].removeprefix("text_model."): v for k, v in saved.items()
                    if k.startswith(pre) and k.endswith(".lora_A.weight")}
            theirs = {k[len(pre):].removeprefix("text_model."): v for k, v in converted.items()
                      if k.startswith(pre) and k.endswith("down.weight")}
            assert len(ours) == len(theirs), (component, len(ours), len(theirs))
            for key, v in theirs.items():
                module = key.removesuffix(".down.weight").removesuffix(".lora_linear_layer").removesuffix("_lora")
                module = re.sub(r"\.to_(q|k|v|out)$", lambda m: "." + m[1] + "_proj", module)
                assert module in ours and torch.equal(ours[module], v), (component, key, module)
        print(f"{name}: {len(kohya) // 3} adapted modules; image rms change {float((lora - base).pow(2).mean().sqrt()):.4g}"
              f" (text encoders alone {float((te - base).pow(2).mean().sqrt()):.4g}); diffusers' converter reads kohya's "
              "text-encoder names onto the same modules")
        write_st(os.path.join(out, "io.safetensors"),
                 [("latents", latents), ("image_base", base), ("image_lora", lora), ("image_te_only", te)],
                 {"source": f"diffusers {diffusers.__version__} pipeline with peft {peft.__version__} LoRA layers, "
                            f"transformers {transformers.__version__}, torch {torch.__version__}, "
                            f"safetensors {ST_VERSION}",
                  "pipeline": f"tests/golden/sd/{folder}", "prompt": PROMPT, "steps": str(STEPS),
                  "guidance_scale": str(GUIDANCE), "adapter_weight": str(SCALE), "unet_lora_config": repr(UNET),
                  "text_encoder_lora_config": repr(TEXT)})


if __name__ == "__main__":
    main()
