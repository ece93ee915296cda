"""The golden of Qwen-Image 2.1's text path: diffusers' own get_qwenimage21_prompt_embeds (the modular
QwenImage21 pipeline's text encoder step) on a tiny transformers Qwen3VLForConditionalGeneration and a
Qwen3VLProcessor, text-only prompts. Installed versions: diffusers 0.42.1, transformers 5.25.0, tokenizers 0.23.3,
torch 2.13.0. Not run by CI; rerun by hand (deterministic; rewrites tests/golden/qwen_image/text_path/):

    .venv/bin/python tests/golden/qwen3_vl_text_reference.py

What it builds: a byte-level BPE tokenizer.json trained here (tokenizers' BpeTrainer, 300 tokens, on a few
sentences) with Qwen's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>,
<|image_pad|>, <|video_pad|>), a processor whose chat template renders a system message as Qwen3-VL's does
("<|im_start|>system\\n{text}<|im_end|>\\n": what diffusers tokenizes to count the system tokens it drops), and
a Qwen3-VL with a 2-layer text model (hidden 32, 4 heads of 8, 2 key-value heads, SwiGLU 64, q/k RMS norms,
interleaved M-RoPE sections [2, 1, 1], theta 10000, eps 1e-6) and a 1-block vision tower (unused by text
prompts), built under torch.manual_seed(61) with every parameter moved off its initialisation (p += 0.2 randn).
The prompts, of different lengths, one of them empty (diffusers turns it into " "), go through the function in
float32 and again with the model in float64.

Writes tests/golden/qwen_image/text_path/:
  text_encoder/  config.json + model.safetensors (save_pretrained), the model's float32 weights;
  tokenizer/     tokenizer.json + tokenizer_config.json (save_pretrained);
  io.safetensors  prompt_embeds_f32 / _f64 [B, L, 32] (right-padded with zeros), prompt_embeds_mask [B, L] int64;
                  metadata: the prompts (JSON), drop_idx (the system tokens dropped), the versions.
"""
import copy
import json
import os
import shutil
import sys

import diffusers
import tokenizers
import torch
import transformers
from diffusers.modular_pipelines.qwenimage21.encoders import QWENIMAGE21_SYSTEM_PROMPT, get_qwenimage21_prompt_embeds
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "qwen_image", "text_path")
sys.path.insert(0, HERE)
from st_io import VERSION as ST_VERSION, write_st  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
PROMPTS = ["a cat", "A photo of a small red fox sitting in fresh snow, golden hour.", ""]
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% for c in message['content'] %}{{ c['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")
CORPUS = ["a cat sitting on a mat", "a photo of a small red fox in fresh snow", "golden hour light over the hills",
          QWENIMAGE21_SYSTEM_PROMPT, "system user assistant", "Comprehend analyze provided prompt",
          "the quick brown fox jumps over the lazy dog"] * 4


def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])


def main():
    torch.set_grad_enabled(False)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    tok = tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tok,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=TEMPLATE)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         max_position_embeddings=128,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(61)
    model = Qwen3VLForConditionalGeneration(config).eval()
    for p in model.parameters():
        p.add_(0.2 * torch.randn(p.shape))
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation

    embeds, mask, _ = get_qwenimage21_prompt_embeds(model, processor, PROMPTS, device="cpu")
    embeds64, mask64, _ = get_qwenimage21_prompt_embeds(copy.deepcopy(model).double(), processor, PROMPTS, device="cpu")
    assert torch.equal(mask, mask64)
    sys_message = [{"role": "system", "content": [{"type": "text", "text": QWENIMAGE21_SYSTEM_PROMPT}]}]
    drop_idx = len(processor.apply_chat_template(sys_message, tokenize=True, return_dict=False)[0])
    system = f"<|im_start|>system\n{QWENIMAGE21_SYSTEM_PROMPT}<|im_end|>\n"
    assert drop_idx == len(tok(system)["input_ids"]), "the chat template renders the system message differently"

    model.save_pretrained(os.path.join(OUT, "text_encoder"))
    tok.save_pretrained(os.path.join(OUT, "tokenizer"))
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(OUT, "text_encoder")).eval()
    again, _, _ = get_qwenimage21_prompt_embeds(reloaded, processor, PROMPTS, device="cpu")
    assert torch.equal(again, embeds), "the saved folder does not reproduce the outputs"
    print(f"embeds {tuple(embeds.shape)}, real tokens {mask.sum(1).tolist()}, drop_idx {drop_idx}, "
          f"|f32 - f64| max {float((embeds.double() - embeds64).abs().max()):.3g}")
    write_st(os.path.join(OUT, "io.safetensors"),
             [("prompt_embeds_f32", embeds), ("prompt_embeds_f64", embeds64), ("prompt_embeds_mask", mask)],
             {"prompts": json.dumps(PROMPTS), "drop_idx": str(drop_idx),
              "source": f"diffusers {diffusers.__version__} get_qwenimage21_prompt_embeds, transformers "
                        f"{transformers.__version__} Qwen3VLForConditionalGeneration, tokenizers "
                        f"{tokenizers.__version__}, torch {torch.__version__}, safetensors {ST_VERSION}"})


if __name__ == "__main__":
    main()
