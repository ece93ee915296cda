"""Text encoder goldens from the installed reference packages (requirements.txt: torch 2.13.0, transformers 5.25.0,
sentencepiece 0.2.3): transformers' T5EncoderModel (v1.0 "relu" and v1.1 "gated-gelu"), CLIPTextModelWithProjection
configured as CLIP-G (SDXL's / SD3's text_encoder_2: gelu, eos_token_id 2, a projection wider than the states) and
CLIPTextModel configured as CLIP-L (quick_gelu, pooled at the first eos id), plus a tiny SentencePiece model with
transformers' T5Tokenizer ids for a few strings. Not run by CI; rerun by hand (deterministic, rewrites everything
under tests/golden/text_encoders/):

    .venv/bin/python tests/golden/text_encoders_reference.py

Each model folder (t5_v1_0, t5_v1_1, clip_g, clip_l) is what `save_pretrained` writes (config.json with
"architectures", model.safetensors) plus io.safetensors (inputs and every output as NAME_f32 / NAME_f64) and
parity.json, read by tests/nn/test_reference_parity.cpp through `dew forward`'s loader. Every model is built under
torch.manual_seed, every parameter moved off its initialisation (p += 0.2 randn), then run in float32 and as a float64
deep copy on the same inputs (attention through transformers' default "sdpa" path, asserted). Each saved folder is
reloaded with from_pretrained and must reproduce the float32 outputs bit for bit.

t5_tokenizer/: spiece.model, a unigram SentencePiece model trained here on a few sentences with T5's special ids
(pad 0, </s> 1, <unk> 2, no bos), and tokens.json: the texts, max_length and transformers' T5Tokenizer
(from_pretrained on that folder) input_ids / attention_mask with padding="max_length", truncation=True. The ids are
checked against the sentencepiece package's own encode + </s> here as well.
"""
import copy
import io
import json
import os
import shutil
import sys

import numpy as np
import safetensors
import sentencepiece as spm
import torch
import transformers
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel,
                          T5Tokenizer)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "text_encoders")
sys.path.insert(0, HERE)
from st_io import write_st  # noqa: E402

VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "sentencepiece": spm.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
    "generator": "tests/golden/text_encoders_reference.py",
}

ABOUT = ("Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic forward (dew "
         "forward) on the io.safetensors tensors named in `inputs` (reference input name, or {reference name: io "
         "name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden rule; a float64 load agrees "
         "with NAME_f64 to float64_rel (relative to the largest value).")


def perturb(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


def padded_ids(lengths, length, vocab_lo, vocab_hi, end_id, pad_id, seed):
    """Rows of random ids in [vocab_lo, vocab_hi) of the given real lengths, each ending with end_id, padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), length), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(lengths), length), dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n - 1] = torch.randint(vocab_lo, vocab_hi, (n - 1,), generator=g)
        ids[i, n - 1] = end_id
        mask[i, :n] = 1
    return ids, mask


def run_both(model, calls):
    """calls: {case: kwargs} -> ({out name: f32}, {out name: f64}) with outputs from `extract`."""
    m64 = copy.deepcopy(model).double()
    out32, out64 = {}, {}
    with torch.no_grad():
        for name, (kwargs, extract) in calls.items():
            for m, dest in ((model, out32), (m64, out64)):
                for k, v in extract(m, **kwargs).items():
                    dest[f"{k}{name}"] = v.detach().clone()
    for k in out32:
        assert out32[k].dtype == torch.float32 and out64[k].dtype == torch.float64, k
    return out32, out64


def write_folder(name, model, inputs, out32, out64, cases, float64_rel, float64_rel_why, reload_cls, calls):
    folder = os.path.join(OUT, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    tensors = dict(inputs)
    for k in out32:
        tensors[f"{k}_f32"] = out32[k]
        tensors[f"{k}_f64"] = out64[k]
    write_st(os.path.join(folder, "io.safetensors"), tensors, dict(VERSIONS))
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump({"about": ABOUT, "float64_rel": float64_rel, "float64_rel_why": float64_rel_why, "cases": cases},
                  f, indent=2)
        f.write("\n")
    # The saved folder reproduces the float32 outputs exactly.
    back = reload_cls.from_pretrained(folder).eval()
    with torch.no_grad():
        for case, (kwargs, extract) in calls.items():
            for k, v in extract(back, **kwargs).items():
                assert torch.equal(v, out32[f"{k}{case}"]), (name, k, case)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name}: {sorted(os.listdir(folder))}, {size} bytes")


# ---- T5 ----

def t5_case(name, feed_forward_proj, seed):
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj=feed_forward_proj, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = T5EncoderModel(config).eval()
    perturb(model, seed + 1)
    # Masked: rows of 10, 7 and 4 real tokens (the last one </s>), padded with 0. Unmasked: 18 real tokens, beyond
    # relative_attention_max_distance, so the last buckets are shared.
    ids, mask = padded_ids([10, 7, 4], 10, 3, 64, end_id=1, pad_id=0, seed=seed + 2)
    ids_full, _ = padded_ids([18, 18], 18, 3, 64, end_id=1, pad_id=0, seed=seed + 3)

    def extract(m, **kw):
        return {"last_hidden_state": m(**kw).last_hidden_state}

    calls = {"": ({"input_ids": ids, "attention_mask": mask}, extract),
             "_nomask": ({"input_ids": ids_full}, extract)}
    out32, out64 = run_both(model, calls)
    cases = [
        {"method": "forward", "inputs": ["input_ids", "attention_mask"],
         "outputs": {"last_hidden_state": "last_hidden_state"}},
        {"method": "forward", "inputs": {"input_ids": "input_ids_full"},
         "outputs": {"last_hidden_state": "last_hidden_state_nomask"}},
    ]
    write_folder(name, model, {"input_ids": ids, "attention_mask": mask, "input_ids_full": ids_full}, out32, out64,
                 cases, 1e-12, "float64 throughout; T5's layer norm takes the mean of squares in float32 in both",
                 T5EncoderModel, calls)


# ---- CLIP ----

def clip_case(name, cls, config, end_id, pad_id, seed):
    torch.manual_seed(seed)
    model = cls(config).eval()
    perturb(model, seed + 1)
    ids, mask = padded_ids([9, 6, 3], 9, 3, config.vocab_size - 2, end_id=end_id, pad_id=pad_id, seed=seed + 2)

    def extract(m, **kw):
        out = m(**kw, output_hidden_states=True)
        r = {"last_hidden_state": out.last_hidden_state, "penultimate_hidden_state": out.hidden_states[-2]}
        if hasattr(out, "text_embeds"):
            r["text_embeds"] = out.text_embeds
            r["pooler_output"] = m.text_model(**kw).pooler_output
        else:
            r["pooler_output"] = out.pooler_output
        return r

    calls = {"": ({"input_ids": ids, "attention_mask": mask}, extract), "_nomask": ({"input_ids": ids}, extract)}
    out32, out64 = run_both(model, calls)
    names = ["last_hidden_state", "pooler_output", "penultimate_hidden_state"]
    if cls is CLIPTextModelWithProjection:
        names.append("text_embeds")
    cases = [
        {"method": "forward", "inputs": ["input_ids", "attention_mask"], "outputs": {n: n for n in names}},
        # SD3 and SDXL run CLIP without the attention mask: padding is attended to (causally, after the eos).
        {"method": "forward", "inputs": ["input_ids"], "outputs": {n: n + "_nomask" for n in names}},
    ]
    write_folder(name, model, {"input_ids": ids, "attention_mask": mask}, out32, out64, cases, 1e-12,
                 "float64 throughout (sdpa's softmax in the input dtype)", cls, calls)


# ---- the T5 tokenizer ----

CORPUS = [
    "a photo of a cat sitting on a red chair",
    "a painting of a dog in the snow",
    "the cat and the dog play in the garden",
    "an astronaut riding a horse on the moon",
    "a bowl of red apples on a wooden table",
    "two dogs running on the beach at sunset",
]
TEXTS = [
    "a photo of a cat",
    "A red dog, on the MOON!",
    "  spaces   between words  ",
    "",
    "an astronaut riding a horse on the moon while two dogs play in the garden at sunset",
    "caf\u00e9 \u00fcber na\u00efve",
]


def tokenizer_case():
    folder = os.path.join(OUT, "t5_tokenizer")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=40,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=1.0, num_threads=1, seed_sentencepiece_size=1000,
                                   minloglevel=2)
    with open(os.path.join(folder, "spiece.model"), "wb") as f:
        f.write(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tok = T5Tokenizer.from_pretrained(folder)
    max_length = 12
    enc = tok(TEXTS, padding="max_length", truncation=True, max_length=max_length)
    for text, ids in zip(TEXTS, enc["input_ids"]):
        want = (sp.encode(text)[:max_length - 1] + [1])
        want += [0] * (max_length - len(want))
        assert ids == want, (text, ids, want)
    with open(os.path.join(folder, "tokens.json"), "w") as f:
        json.dump({"about": "transformers' T5Tokenizer.from_pretrained(this folder)(texts, padding='max_length', "
                            "truncation=True, max_length=max_length); equal to sentencepiece's encode + </s> "
                            "(id 1), padded with <pad> (id 0)",
                   "versions": VERSIONS, "vocab_size": sp.get_piece_size(), "max_length": max_length,
                   "texts": TEXTS, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                  f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"t5_tokenizer: vocab {sp.get_piece_size()}, ids {enc['input_ids']}")


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    t5_case("t5_v1_0", "relu", 100)
    t5_case("t5_v1_1", "gated-gelu", 200)
    clip_g = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, max_position_embeddings=16, hidden_act="gelu", projection_dim=24,
                            bos_token_id=0, eos_token_id=2, pad_token_id=1)
    # eos_token_id 2 (CLIP-G's config): pooled at argmax(ids), so each row ends with the largest id, 63.
    clip_case("clip_g", CLIPTextModelWithProjection, clip_g, end_id=63, pad_id=0, seed=300)
    clip_l = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, hidden_act="quick_gelu",
                            bos_token_id=62, eos_token_id=63, pad_token_id=1)
    clip_case("clip_l", CLIPTextModel, clip_l, end_id=63, pad_id=63, seed=400)
    tokenizer_case()


if __name__ == "__main__":
    main()
