"""Stable Diffusion goldens from the reference code: huggingface/diffusers v0.34.0 (UNet2DConditionModel,
AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline) and
transformers' CLIP text encoder and tokenizer, run under Debian's python3-torch 1.13 on tiny configurations.
Not run by CI; rerun by hand (deterministic, rewrites everything under tests/golden/sd/):

    /usr/bin/python3 tests/golden/sd_reference.py

Reference code (imported from checkouts outside this project, never copied into it):
- diffusers: DIFFUSERS_SRC (a checkout's `src` parent); when unset, `git archive v0.34.0 src` of the bare mirror
  DIFFUSERS_MIRROR (default /work/.mirror/huggingface+diffusers/repo) is extracted into /tmp/diffusers_src.
- transformers' CLIP: TRANSFORMERS_CLIP_SRC (default /tmp/transformers_clip) must hold
  transformers/models/clip/{modeling,configuration,tokenization}_clip.py and transformers/modeling_attn_mask_utils.py
  from huggingface/transformers (the whole repository is too big to fetch here; the files were transcribed from the
  stored copies, commits listed in CLIP_COMMITS below and in that folder's SOURCES.txt). modeling_clip.py is the
  4.4x version (commit 679021a6b0ded09d623a96e2bd2f822c5a548872) whose eager CLIPAttention computes the softmax in
  the input dtype (newer versions force softmax to float32, which would spoil a float64 truth).

Stubs (this environment has no huggingface_hub, safetensors or transformers package; PIL, regex, filelock, requests,
numpy, packaging, tqdm are Debian's python3-* packages):
- from tests/golden/diffusers_stubs.py (shared with bench/sd_peer.py): fake `*.dist-info/METADATA` for
  huggingface_hub 0.27.0, safetensors 0.4.5 and transformers 4.47.0 in /tmp/sd_reference_stubs/site so
  diffusers' importlib.metadata checks see the stub modules as installed (the version numbers are labels only);
  huggingface_hub: constants, error classes, `validate_hf_hub_args` as the identity decorator, a one-shard
  `split_torch_state_dict_into_shards`, every network function raising; safetensors:
  `safetensors.torch.save_file/load_file/load` and `safe_open` on tests/golden/st_io.py; the torch >= 2.1 names
  diffusers touches at import: `torch.compiler.disable` (identity decorator) and sentinel `torch.float8_e4m3fn` /
  `torch.float8_e5m2` (torchao quantizer tables only);
- transformers internals used by the CLIP files: ACT2FN (quick_gelu x*sigmoid(1.702x), gelu = F.gelu, as
  transformers' activations), ModelOutput/BaseModelOutput*, the `_is_*` character helpers of tokenization_utils
  (verbatim), and small PreTrainedModel / PretrainedConfig / PreTrainedTokenizer classes (nn.Module holding the
  config, post_init = apply(_init_weights), "eager" attention as real transformers picks on torch < 2.1.1,
  save/from_pretrained writing/reading config.json + model.safetensors and the tokenizer files, tokenizer __call__
  with right truncation to max_length - 2 and right padding with pad_token_id, as transformers does for one
  sequence). The BPE itself (bytes_to_unicode, bpe, _tokenize, save_vocabulary) is the real CLIPTokenizer code.
torch 1.13 has no F.scaled_dot_product_attention, so diffusers' Attention picks the classic AttnProcessor
(baddbmm scores, softmax, bmm); the script asserts that every attention module uses it, and that CLIP layers use
the eager CLIPAttention.

Numerics: every model is built under torch.manual_seed, every parameter moved off its initialisation
(p += 0.2 randn; norm weights become 1 + 0.2 randn), then run in float32 (`*_f32`) and as a float64 deep copy
(`*_f64`) on the same inputs widened to float64. The float64 runs happen under
torch.set_default_dtype(torch.float64): transformers' causal mask fills a default-dtype tensor with
finfo(float64).min, which overflows (RuntimeError) with a float32 default. For the pipelines the float64 run also
uses float64 schedulers: the scheduler module's own source with every torch.float32 / np.float32 replaced by
float64 (betas, alphas_cumprod, Euler's sigmas/timesteps and the Euler step's float32 upcast), see
f64_scheduler_class. The reference's other float32-forced steps are left as they are (README lists them).

The pipelines reuse the unet_sd / unet_sdxl / vae models, so their unet/ and vae/ files are byte-identical to
those folders' (one git blob each). Every saved folder is reloaded with diffusers' from_pretrained
(UNet2DConditionModel, AutoencoderKL, DiffusionPipeline) and must reproduce the float32 outputs bit for bit.
See tests/golden/sd/README.md for the files, tensors and settings.
"""
import contextlib
import copy
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import types
import unicodedata
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "sd")
sys.path.insert(0, HERE)
import diffusers_stubs  # noqa: E402  (the stubs diffusers needs here; bench/sd_peer.py uses them too)
from diffusers_stubs import module as _module  # noqa: E402
from st_io import read_st, write_st  # noqa: E402

DIFFUSERS_TAG = "v0.34.0"
DIFFUSERS_MIRROR = os.environ.get("DIFFUSERS_MIRROR", "/work/.mirror/huggingface+diffusers/repo")
TRANSFORMERS_CLIP_SRC = os.environ.get("TRANSFORMERS_CLIP_SRC", "/tmp/transformers_clip")
STUB_SITE = "/tmp/sd_reference_stubs/site"
STUB_VERSIONS = {"huggingface_hub": "0.27.0", "safetensors": "0.4.5", "transformers": "4.47.0"}
CLIP_COMMITS = {
    "models/clip/modeling_clip.py": "679021a6b0ded09d623a96e2bd2f822c5a548872",
    "models/clip/configuration_clip.py": "01841b341b64ab547cd2e30f09cb9c74929f50f2",
    "models/clip/tokenization_clip.py": "01f287b3d817b48b7bf61c408b269e3c93a24c97",
    "modeling_attn_mask_utils.py": "000b2cd5cd86a00c28595ba16bfb0be5542ed686",
}


# ----------------------------------------------------------------------------------------------------
# stubs
# ----------------------------------------------------------------------------------------------------
def _placeholder_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"__module__": modname, "__doc__": f"placeholder from the {modname} stub"})
        setattr(sys.modules[modname], name, cls)
        return cls

    return __getattr__


def _install_transformers_stub():
    root = os.path.join(TRANSFORMERS_CLIP_SRC, "transformers")
    for rel in CLIP_COMMITS:
        if not os.path.isfile(os.path.join(root, rel)):
            sys.exit(f"missing {os.path.join(root, rel)}: TRANSFORMERS_CLIP_SRC must hold transformers' CLIP files "
                     f"(huggingface/transformers {CLIP_COMMITS})")
    tf = _module("transformers", package=True, __version__=STUB_VERSIONS["transformers"])
    tf.__path__ = [root]
    tf.__getattr__ = _placeholder_getattr("transformers")

    # --- transformers.utils
    def _identity_decorator_factory(*args, **kwargs):
        return lambda fn: fn

    class _Logging:
        @staticmethod
        def get_logger(name):
            lg = logging.getLogger(name)
            if not hasattr(lg, "warning_once"):
                lg.warning_once = lg.warning
            return lg

    _module("transformers.utils", package=True, ModelOutput=ModelOutput, logging=_Logging,
            add_code_sample_docstrings=_identity_decorator_factory, add_start_docstrings=_identity_decorator_factory,
            add_start_docstrings_to_model_forward=_identity_decorator_factory,
            replace_return_docstrings=_identity_decorator_factory,
            is_flash_attn_2_available=lambda: False, is_flash_attn_greater_or_equal_2_10=lambda: False,
            torch_int=int, FLAX_WEIGHTS_NAME="flax_model.msgpack", SAFE_WEIGHTS_NAME="model.safetensors",
            WEIGHTS_NAME="pytorch_model.bin")
    _module("transformers.pytorch_utils", is_torch_greater_or_equal_than_2_2=False)
    _module("transformers.activations", ACT2FN=_ACT2FN())
    _module("transformers.modeling_outputs", BaseModelOutput=BaseModelOutput,
            BaseModelOutputWithPooling=BaseModelOutputWithPooling, ImageClassifierOutput=ImageClassifierOutput)
    _module("transformers.configuration_utils", PretrainedConfig=PretrainedConfig)
    _module("transformers.onnx", OnnxConfig=type("OnnxConfig", (), {}))
    _module("transformers.modeling_utils", PreTrainedModel=PreTrainedModel)
    _module("transformers.tokenization_utils", AddedToken=AddedToken, PreTrainedTokenizer=PreTrainedTokenizer,
            _is_control=_is_control, _is_punctuation=_is_punctuation, _is_whitespace=_is_whitespace)
    _module("transformers.tokenization_utils_base", PreTrainedTokenizerBase=PreTrainedTokenizerBase,
            AddedToken=AddedToken, BatchEncoding=BatchEncoding)
    tf.PreTrainedModel = PreTrainedModel
    tf.PretrainedConfig = PretrainedConfig
    tf.PreTrainedTokenizer = PreTrainedTokenizer
    tf.PreTrainedTokenizerBase = PreTrainedTokenizerBase

    from transformers.models.clip import configuration_clip, modeling_clip, tokenization_clip  # noqa: E402

    for mod in (configuration_clip, modeling_clip, tokenization_clip):
        for n in mod.__all__:
            setattr(tf, n, getattr(mod, n))
    return modeling_clip, configuration_clip, tokenization_clip


# --- transformers internals (stubs; the `_is_*` helpers are verbatim from transformers' tokenization_utils.py)
class QuickGELUActivation(nn.Module):
    def forward(self, input):
        return input * torch.sigmoid(1.702 * input)


class GELUActivation(nn.Module):
    def forward(self, input):
        return F.gelu(input)


class _ACT2FN(dict):
    """transformers' ClassInstantier: a new module per lookup."""

    _classes = {"quick_gelu": QuickGELUActivation, "gelu": GELUActivation}

    def __getitem__(self, key):
        return self._classes[key]()


class ModelOutput:
    """transformers' ModelOutput behaviour: fields that are not None, indexable by name or position."""

    def keys(self):
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, k):
        if isinstance(k, str):
            return getattr(self, k)
        return self.to_tuple()[k]

    def to_tuple(self):
        return tuple(getattr(self, k) for k in self.keys())


@dataclass
class BaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor = None
    hidden_states: tuple = None
    attentions: tuple = None


@dataclass
class BaseModelOutputWithPooling(ModelOutput):
    last_hidden_state: torch.Tensor = None
    pooler_output: torch.Tensor = None
    hidden_states: tuple = None
    attentions: tuple = None


@dataclass
class ImageClassifierOutput(ModelOutput):
    loss: torch.Tensor = None
    logits: torch.Tensor = None
    hidden_states: tuple = None
    attentions: tuple = None


class PretrainedConfig:
    """The PretrainedConfig attributes the CLIP code reads, with transformers' defaults, and config.json in
    transformers' use_diff form (class attributes + base attributes that differ from PretrainedConfig(), sorted,
    indent 2)."""

    model_type = ""
    base_config_key = ""
    sub_configs = {}
    is_composition = False
    _BASE_DEFAULTS = dict(return_dict=True, output_hidden_states=False, output_attentions=False, torchscript=False,
                          torch_dtype=None, tie_word_embeddings=True, is_encoder_decoder=False, is_decoder=False,
                          architectures=None, problem_type=None, bos_token_id=None, pad_token_id=None,
                          eos_token_id=None)

    def __init__(self, **kwargs):
        for k, v in self._BASE_DEFAULTS.items():
            setattr(self, k, kwargs.pop(k, v))
        if isinstance(self.torch_dtype, str):
            self.torch_dtype = getattr(torch, self.torch_dtype)
        self._name_or_path = str(kwargs.pop("name_or_path", ""))
        self._attn_implementation_internal = kwargs.pop("attn_implementation", None)
        kwargs.pop("transformers_version", None)
        kwargs.pop("model_type", None)
        for k, v in kwargs.items():
            setattr(self, k, v)

    @property
    def name_or_path(self):
        return self._name_or_path

    @property
    def use_return_dict(self):
        return self.return_dict and not self.torchscript

    @property
    def _attn_implementation(self):
        return "eager" if self._attn_implementation_internal is None else self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        self._attn_implementation_internal = value

    def to_dict(self):
        out = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_attn_implementation_internal"})
        out["model_type"] = self.__class__.model_type
        out["transformers_version"] = STUB_VERSIONS["transformers"]
        if isinstance(out.get("torch_dtype"), torch.dtype):
            out["torch_dtype"] = str(out["torch_dtype"]).split(".")[1]
        return out

    def to_diff_dict(self):
        base = PretrainedConfig().to_dict()
        own = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items()
                if k not in base or k == "transformers_version" or v != base[k] or (k in own and v != own[k])}

    def to_json_string(self):
        return json.dumps(self.to_diff_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, "config.json"), "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def from_pretrained(cls, path, subfolder="", **kwargs):
        p = os.path.join(path, subfolder or "", "config.json")
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
        d.pop("_name_or_path", None)
        return cls(name_or_path=os.path.join(path, subfolder or ""), **d)


class PreTrainedModel(nn.Module):
    config_class = None
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = None
    _keep_in_fp32_modules = None

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        if config._attn_implementation_internal is None:
            config._attn_implementation = "eager"  # what transformers picks with torch < 2.1.1 (no sdpa)
        self.config = config
        self.name_or_path = config.name_or_path

    def post_init(self):
        self.apply(self._init_weights)

    @classmethod
    def _from_config(cls, config, **kwargs):
        config = copy.deepcopy(config)
        attn = kwargs.pop("attn_implementation", None)
        if attn is not None:
            config._attn_implementation = attn
        kwargs.pop("torch_dtype", None)
        return cls(config, **kwargs)

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    @property
    def device(self):
        return next(self.parameters()).device

    def save_pretrained(self, save_directory, safe_serialization=True, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        self.config.architectures = [self.__class__.__name__]
        self.config.torch_dtype = self.dtype
        self.config.save_pretrained(save_directory)
        sd = self.state_dict()
        write_st(os.path.join(save_directory, "model.safetensors"), sorted((k, v.contiguous()) for k, v in sd.items()),
                 {"format": "pt"})

    @classmethod
    def from_pretrained(cls, path, *args, subfolder="", torch_dtype=None, config=None, **kwargs):
        folder = os.path.join(path, subfolder or "")
        if config is None:
            config = cls.config_class.from_pretrained(folder)
        model = cls(config)
        sd, _ = read_st(os.path.join(folder, "model.safetensors"))
        model.load_state_dict(sd, strict=True)
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        return model.eval()


def _is_whitespace(char):
    """Checks whether `char` is a whitespace character."""
    # \t, \n, and \r are technically contorl characters but we treat them
    # as whitespace since they are generally considered as such.
    if char == " " or char == "\t" or char == "\n" or char == "\r":
        return True
    cat = unicodedata.category(char)
    if cat == "Zs":
        return True
    return False


def _is_control(char):
    """Checks whether `char` is a control character."""
    # These are technically control characters but we count them as whitespace
    # characters.
    if char == "\t" or char == "\n" or char == "\r":
        return False
    cat = unicodedata.category(char)
    if cat.startswith("C"):
        return True
    return False


def _is_punctuation(char):
    """Checks whether `char` is a punctuation character."""
    cp = ord(char)
    # We treat all non-letter/number ASCII as punctuation.
    # Characters such as "^", "$", and "`" are not in the Unicode
    # Punctuation class but we treat them as punctuation anyways, for
    # consistency.
    if (cp >= 33 and cp <= 47) or (cp >= 58 and cp <= 64) or (cp >= 91 and cp <= 96) or (cp >= 123 and cp <= 126):
        return True
    cat = unicodedata.category(char)
    if cat.startswith("P"):
        return True
    return False


class AddedToken:
    def __init__(self, content, single_word=False, lstrip=False, rstrip=False, special=False, normalized=None):
        self.content = content
        self.single_word = single_word
        self.lstrip = lstrip
        self.rstrip = rstrip
        self.special = special
        self.normalized = normalized if normalized is not None else not special

    def __str__(self):
        return self.content

    def __repr__(self):
        return f"AddedToken({self.content!r})"

    def as_dict(self):
        return {"content": self.content, "lstrip": self.lstrip, "normalized": self.normalized,
                "rstrip": self.rstrip, "single_word": self.single_word}


class BatchEncoding(dict):
    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class PreTrainedTokenizerBase:
    pass


class PreTrainedTokenizer(PreTrainedTokenizerBase):
    """Slow-tokenizer plumbing around the real CLIPTokenizer methods (_tokenize, bpe, _convert_token_to_id,
    build_inputs_with_special_tokens, save_vocabulary). Splits text on the special tokens first (as transformers'
    added-token trie does), truncates on the right to max_length - 2 before adding <|startoftext|> ... <|endoftext|>,
    pads on the right with pad_token_id."""

    vocab_files_names = {}
    model_input_names = ["input_ids", "attention_mask"]
    SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(self, **kwargs):
        self.init_kwargs = copy.deepcopy(kwargs)
        self.model_max_length = kwargs.pop("model_max_length", int(1e30))
        self.name_or_path = kwargs.pop("name_or_path", "")
        self.clean_up_tokenization_spaces = kwargs.pop("clean_up_tokenization_spaces", True)
        self.padding_side = kwargs.pop("padding_side", "right")
        self.truncation_side = kwargs.pop("truncation_side", "right")
        self.special_tokens = {}
        for k in self.SPECIAL_TOKENS:
            v = kwargs.pop(k, None)
            if v is not None:
                self.special_tokens[k] = v if isinstance(v, AddedToken) else AddedToken(v)
        self.extra_init_kwargs = kwargs
        self.added_tokens_encoder = {}
        for tok in self.special_tokens.values():
            self.added_tokens_encoder.setdefault(str(tok), self._convert_token_to_id(str(tok)))

    def __getattr__(self, name):
        sp = self.__dict__.get("special_tokens", {})
        if name in sp:
            return str(sp[name])
        if name.endswith("_id") and name[:-3] in sp:
            return self.convert_tokens_to_ids(str(sp[name[:-3]]))
        raise AttributeError(name)

    @property
    def all_special_tokens(self):
        return sorted(set(str(t) for t in self.special_tokens.values()))

    def __len__(self):
        return len(self.get_vocab())

    def tokenize(self, text, **kwargs):
        specials = self.all_special_tokens
        if not specials or not any(s in text for s in specials):
            return self._tokenize(text)
        pieces = re.split("(" + "|".join(re.escape(s) for s in specials) + ")", text)
        out = []
        for p in pieces:
            if p in specials:
                out.append(p)
            elif p.strip():
                out.extend(self._tokenize(p.strip()))
        return out

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.added_tokens_encoder.get(tokens, self._convert_token_to_id(tokens))
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        return [self._convert_id_to_token(int(i)) for i in ids]

    def __call__(self, text, padding=False, truncation=None, max_length=None, return_tensors=None,
                 add_special_tokens=True, **kwargs):
        assert not kwargs, kwargs
        texts = [text] if isinstance(text, str) else list(text)
        if (truncation or padding == "max_length") and max_length is None:
            max_length = self.model_max_length
        rows = []
        for t in texts:
            ids = self.convert_tokens_to_ids(self.tokenize(t))
            n_special = 2 if add_special_tokens else 0
            if truncation and len(ids) + n_special > max_length:
                ids = ids[:max_length - n_special]
            rows.append(self.build_inputs_with_special_tokens(ids) if add_special_tokens else ids)
        if padding == "max_length":
            target = max_length
        elif padding in (True, "longest"):
            target = max(len(r) for r in rows)
        else:
            target = None
        masks = [[1] * len(r) for r in rows]
        if target is not None:
            masks = [m + [0] * (target - len(r)) for m, r in zip(masks, rows)]
            rows = [r + [self.pad_token_id] * (target - len(r)) for r in rows]
        if return_tensors == "pt":
            rows, masks = torch.tensor(rows, dtype=torch.int64), torch.tensor(masks, dtype=torch.int64)
        elif isinstance(text, str):
            rows, masks = rows[0], masks[0]
        return BatchEncoding(input_ids=rows, attention_mask=masks)

    def batch_decode(self, sequences, skip_special_tokens=False, **kwargs):
        out = []
        for seq in sequences:
            toks = self.convert_ids_to_tokens(seq)
            if skip_special_tokens:
                toks = [t for t in toks if t not in self.all_special_tokens]
            out.append(self.convert_tokens_to_string(toks))
        return out

    def save_pretrained(self, save_directory, **kwargs):
        """tokenizer_config.json and special_tokens_map.json in the form transformers 4.4x writes them, then the
        real save_vocabulary (vocab.json, merges.txt)."""
        os.makedirs(save_directory, exist_ok=True)
        decoder = {}
        for tok in self.special_tokens.values():
            decoder[str(self.convert_tokens_to_ids(str(tok)))] = dict(tok.as_dict(), special=True)
        cfg = dict(self.extra_init_kwargs)
        cfg.update({k: str(v) for k, v in self.special_tokens.items()})
        cfg.update({"added_tokens_decoder": dict(sorted(decoder.items(), key=lambda kv: int(kv[0]))),
                    "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
                    "model_max_length": self.model_max_length, "tokenizer_class": self.__class__.__name__})
        with open(os.path.join(save_directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        smap = {k: (v.as_dict() if k != "pad_token" else str(v)) for k, v in self.special_tokens.items()}
        with open(os.path.join(save_directory, "special_tokens_map.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(smap, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        return self.save_vocabulary(save_directory)

    @classmethod
    def from_pretrained(cls, path, subfolder="", **kwargs):
        folder = os.path.join(path, subfolder or "")
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        for k in ("added_tokens_decoder", "tokenizer_class"):
            cfg.pop(k, None)
        files = {k: os.path.join(folder, v) for k, v in cls.vocab_files_names.items()}
        return cls(**files, name_or_path=folder, **cfg)


# ----------------------------------------------------------------------------------------------------
# reference imports
# ----------------------------------------------------------------------------------------------------
def _diffusers_checkout():
    commit = subprocess.check_output(["git", "--git-dir", DIFFUSERS_MIRROR, "rev-parse", DIFFUSERS_TAG + "^{commit}"],
                                     text=True).strip()
    src = os.environ.get("DIFFUSERS_SRC")
    if not src:
        src = "/tmp/diffusers_src"
        if not os.path.isfile(os.path.join(src, "src", "diffusers", "__init__.py")):
            os.makedirs(src, exist_ok=True)
            archive = subprocess.Popen(["git", "--git-dir", DIFFUSERS_MIRROR, "archive", DIFFUSERS_TAG, "src"],
                                       stdout=subprocess.PIPE)
            subprocess.check_call(["tar", "-x", "-C", src], stdin=archive.stdout)
            assert archive.wait() == 0
    return os.path.abspath(os.path.join(src, "src")), commit


assert not hasattr(F, "scaled_dot_product_attention"), "expected torch 1.13 (no SDPA): the goldens use AttnProcessor"
diffusers_stubs.install(STUB_SITE, STUB_VERSIONS)  # torch shims, fake dist-info, hub + safetensors stubs
clip_modeling, clip_configuration, clip_tokenization = _install_transformers_stub()
DIFFUSERS_PATH, DIFFUSERS_COMMIT = _diffusers_checkout()
sys.path.insert(0, DIFFUSERS_PATH)

import diffusers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.models.attention_processor import Attention, AttnProcessor  # noqa: E402

assert diffusers.__version__ == "0.34.0", diffusers.__version__

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--import-only":
    print("imports ok", diffusers.__file__, DIFFUSERS_COMMIT)
    sys.exit(0)

diffusers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()
SOURCE = f"huggingface/diffusers {DIFFUSERS_TAG} ({DIFFUSERS_COMMIT})"
CLIP_SOURCE = "huggingface/transformers " + ", ".join(f"{k}@{v[:12]}" for k, v in CLIP_COMMITS.items())
COMMON_META = {
    "torch": torch.__version__,
    "attention": "diffusers AttnProcessor (classic baddbmm/softmax/bmm; torch 1.13 has no SDPA), CLIP eager attention",
    "perturbation": "every parameter p += 0.2 * randn (torch.Generator seeded per case)",
    "f64": "float64 deep copy (.double()) on the float32 inputs widened, under torch.set_default_dtype(float64)",
}


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def perturb_(model, seed):
    """Move every parameter off its initialisation: p += 0.2 randn (norm weights become 1 + 0.2 randn)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def check_attention(model):
    atts = [m for m in model.modules() if isinstance(m, Attention)]
    bad = [type(m.processor).__name__ for m in atts if type(m.processor) is not AttnProcessor]
    assert not bad, bad
    return len(atts)


def widen(v):
    return v.double() if torch.is_tensor(v) and v.is_floating_point() else v


def run_f32_f64(model, fn, inputs):
    """fn(model, **inputs) -> {name: tensor}; returns ({name_f32: ...}, {name_f64: ...}) and the f64 model."""
    model.eval()
    with torch.no_grad():
        out32 = fn(model, **inputs)
        m64 = copy.deepcopy(model).double().eval()
        with default_dtype(torch.float64):
            out64 = fn(m64, **{k: widen(v) for k, v in inputs.items()})
    for k in out32:
        assert out32[k].dtype == torch.float32 and out64[k].dtype == torch.float64, (k, out32[k].dtype, out64[k].dtype)
    return out32, out64


def rel_err(a, b):
    return float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300))


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def io_tensors(inputs, out32, out64):
    t = [(k, v) for k, v in inputs.items()]
    for k in out32:
        t += [(k + "_f32", out32[k]), (k + "_f64", out64[k])]
    return t


def summary(name, out32, out64):
    for k in out32:
        print(f"  {name}.{k}: shape {tuple(out32[k].shape)} rms {float(out64[k].pow(2).mean().sqrt()):.4g} "
              f"rel rms(f32 - f64) {rel_err(out32[k], out64[k]):.3g}")


# ----------------------------------------------------------------------------------------------------
# UNet2DConditionModel cases
# ----------------------------------------------------------------------------------------------------
SD_BLOCKS = dict(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
XL_BLOCKS = dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))

UNET_CASES = {
    # SD 1.x: conv proj_in/proj_out, attention_head_dim (= number of heads in diffusers' legacy naming) an int
    "unet_sd": dict(seed=100, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **SD_BLOCKS, block_out_channels=(16, 32), layers_per_block=2,
        norm_num_groups=8, cross_attention_dim=16, attention_head_dim=4, use_linear_projection=False)),
    # SD inpainting: 9 input channels (4 noisy latents + 1 mask + 4 masked-image latents)
    "unet_inpaint": dict(seed=200, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=9, out_channels=4, **SD_BLOCKS, block_out_channels=(8, 16), layers_per_block=2,
        norm_num_groups=4, cross_attention_dim=16, attention_head_dim=2, use_linear_projection=False)),
    # SD 2.x: linear proj_in/proj_out, per-level attention_head_dim list, upcast_attention
    "unet_sd2": dict(seed=300, hw=16, ctx_len=10, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **SD_BLOCKS, block_out_channels=(8, 16), layers_per_block=2,
        norm_num_groups=4, cross_attention_dim=24, attention_head_dim=[2, 4], use_linear_projection=True,
        upcast_attention=True, flip_sin_to_cos=True, freq_shift=0)),
    # SDXL: three levels, transformer depth per level, text_time added conditioning
    "unet_sdxl": dict(seed=400, hw=16, ctx_len=10, sdxl_pooled=32, config=dict(
        sample_size=16, in_channels=4, out_channels=4, **XL_BLOCKS, block_out_channels=(8, 16, 16), layers_per_block=1,
        norm_num_groups=4, cross_attention_dim=32, attention_head_dim=[2, 2, 4], transformer_layers_per_block=[1, 1, 2],
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8)),
}

SDXL_TIME_IDS = [[64.0, 64.0, 0.0, 0.0, 64.0, 64.0], [48.0, 80.0, 4.0, 8.0, 64.0, 56.0]]


def unet_forward(m, sample, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
    added = None if text_embeds is None else {"text_embeds": text_embeds, "time_ids": time_ids}
    return {"out": m(sample, timestep, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added).sample}


PARITY_ABOUT = ("Read by tests/nn/test_reference_parity.cpp: each case runs `method` through the generic diffusers "
                "forward (dew forward) on the io.safetensors tensors named in `inputs` (reference input name, or "
                "{reference name: io name}), and compares each output with io's NAME_f32 / NAME_f64 by the golden "
                "rule; a float64 load agrees with NAME_f64 to float64_rel (relative rms).")


def write_parity(folder, cases, float64_rel, why):
    """parity.json: the cases the reference-parity suite runs on this folder, and its float64 tolerance."""
    with open(os.path.join(folder, "parity.json"), "w") as f:
        json.dump({"about": PARITY_ABOUT, "float64_rel": float64_rel, "float64_rel_why": why, "cases": cases}, f,
                  indent=2)
        f.write("\n")


def make_unet(case):
    torch.manual_seed(case["seed"])
    return perturb_(UNet2DConditionModel(**case["config"]), case["seed"] + 1).eval()


def unet_inputs(case, batch=2):
    cfg = case["config"]
    g = torch.Generator().manual_seed(case["seed"] + 2)
    inputs = {
        "sample": torch.randn(batch, cfg["in_channels"], case["hw"], case["hw"], generator=g),
        "timestep": torch.tensor([999.0, 261.0][:batch], dtype=torch.float32),
        "encoder_hidden_states": torch.randn(batch, case["ctx_len"], cfg["cross_attention_dim"], generator=g),
    }
    if case.get("sdxl_pooled"):
        inputs["text_embeds"] = torch.randn(batch, case["sdxl_pooled"], generator=g)
        inputs["time_ids"] = torch.tensor(SDXL_TIME_IDS[:batch], dtype=torch.float32)
    return inputs


def run_unet_case(name, case):
    model = make_unet(case)
    n_att = check_attention(model)
    inputs = unet_inputs(case)
    out32, out64 = run_f32_f64(model, unet_forward, inputs)
    folder = fresh_dir(os.path.join(OUT_DIR, name))
    model.save_pretrained(folder)
    back = UNet2DConditionModel.from_pretrained(folder).eval()
    check_attention(back)
    with torch.no_grad():
        assert torch.equal(unet_forward(back, **inputs)["out"], out32["out"]), name
    meta = dict(COMMON_META, source=SOURCE + " UNet2DConditionModel", case=name,
                config=json.dumps(case["config"]), seed=str(case["seed"]), attention_modules=str(n_att),
                inputs="sample randn; timestep float32 [999, 261] (one per row); encoder_hidden_states randn"
                       + ("; text_embeds randn; time_ids (orig_h, orig_w, crop_top, crop_left, target_h, target_w)"
                          if case.get("sdxl_pooled") else ""),
                outputs="out = model(sample, timestep, encoder_hidden_states"
                        + (", added_cond_kwargs={text_embeds, time_ids}" if case.get("sdxl_pooled") else "")
                        + ").sample")
    write_st(os.path.join(folder, "io.safetensors"), io_tensors(inputs, out32, out64), meta)
    if case["config"].get("upcast_attention"):
        rel, why = 1e-6, ("upcast_attention: diffusers computes the scores in float32 even in its float64 model "
                          "(q.float(), k.float())")
    else:
        rel, why = 5e-8, ("diffusers computes the timestep embedding in float32 even in its float64 model, and "
                          "float32 exp / sin / cos differ in the last bit between LibTorch builds "
                          "(tests/golden_util.h kUnetFloat64Rel)")
    write_parity(folder, [{"method": "forward", "inputs": list(inputs), "outputs": {"sample": "out"}}], rel, why)
    summary(name, out32, out64)
    return model


# ----------------------------------------------------------------------------------------------------
# AutoencoderKL cases
# ----------------------------------------------------------------------------------------------------
VAE_CASES = {
    "vae": dict(seed=500, config=dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
        norm_num_groups=8, sample_size=32, scaling_factor=0.18215)),
    "vae_sd3": dict(seed=600, config=dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=16,
        norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
        use_post_quant_conv=False)),
}
VAE_TILING = dict(tile_sample_min_size=32, tile_latent_min_size=16, tile_overlap_factor=0.25)
VAE_TILED_LATENT = {"vae": (32, 32), "vae_sd3": (16, 24)}  # latent H, W of z_tiled (tiles of 16 every 12)


def vae_forward(m, sample, z, z_tiled=None):
    dist = m.encode(sample).latent_dist
    out = {"latent_mean": dist.mean, "latent_logvar": dist.logvar, "decoded": m.decode(z).sample}
    if z_tiled is not None:
        m.enable_tiling()
        for k, v in VAE_TILING.items():
            setattr(m, k, v)
        out["tiled_decoded"] = m.decode(z_tiled).sample
        m.disable_tiling()
    return out


def run_vae_case(name, case):
    cfg = case["config"]
    torch.manual_seed(case["seed"])
    model = perturb_(AutoencoderKL(**cfg), case["seed"] + 1).eval()
    n_att = check_attention(model)
    g = torch.Generator().manual_seed(case["seed"] + 2)
    f = 2 ** (len(cfg["block_out_channels"]) - 1)
    inputs = {
        "sample": torch.rand(2, 3, 16, 16, generator=g) * 2 - 1,
        "z": torch.randn(2, cfg["latent_channels"], 16 // f, 16 // f, generator=g),
        "z_tiled": torch.randn(1, cfg["latent_channels"], *VAE_TILED_LATENT[name], generator=g),
    }
    out32, out64 = run_f32_f64(model, vae_forward, inputs)
    folder = fresh_dir(os.path.join(OUT_DIR, name))
    model.save_pretrained(folder)
    back = AutoencoderKL.from_pretrained(folder).eval()
    with torch.no_grad():
        again = vae_forward(back, **inputs)
    for k in out32:
        assert torch.equal(again[k], out32[k]), (name, k)
    meta = dict(COMMON_META, source=SOURCE + " AutoencoderKL", case=name, config=json.dumps(cfg),
                seed=str(case["seed"]), attention_modules=str(n_att),
                inputs="sample = 2 rand - 1 (image in [-1, 1]); z randn; z_tiled randn",
                outputs="latent_mean/latent_logvar = encode(sample).latent_dist.mean/.logvar (logvar clamped to "
                        "[-30, 20]); decoded = decode(z).sample; tiled_decoded = decode(z_tiled).sample after "
                        "enable_tiling() with the tiling attributes below",
                tiling=json.dumps(VAE_TILING))
    write_st(os.path.join(folder, "io.safetensors"), io_tensors(inputs, out32, out64), meta)
    write_parity(folder, [
        {"method": "encode", "inputs": ["sample"],
         "outputs": {"latent_mean": "latent_mean", "latent_logvar": "latent_logvar"}},
        {"method": "decode", "inputs": ["z"], "outputs": {"sample": "decoded"}},
        {"method": "tiled_decode", "inputs": {"z": "z_tiled"}, "outputs": {"sample": "tiled_decoded"}},
    ], 2e-7, "the mid-block attention's upcast_softmax casts the scores with .float(), to float32 even in "
             "diffusers' float64 model")
    summary(name, out32, out64)
    return model


# ----------------------------------------------------------------------------------------------------
# float64 schedulers
# ----------------------------------------------------------------------------------------------------
_F64_CLASSES = {}


def f64_scheduler_class(cls):
    """The scheduler's own module source with every `torch.float32` / `np.float32` replaced by the float64
    counterpart, executed as a sibling module: betas/alphas_cumprod (DDIM, Euler), Euler's sigmas and timesteps
    (set_timesteps) and Euler.step's `sample.to(torch.float32)` upcast become float64. Nothing else changes."""
    if cls in _F64_CLASSES:
        return _F64_CLASSES[cls]
    mod = sys.modules[cls.__module__]
    src = inspect.getsource(mod)
    n = src.count("torch.float32") + src.count("np.float32")
    src = src.replace("torch.float32", "torch.float64").replace("np.float32", "np.float64")
    m = types.ModuleType(cls.__module__ + "_f64")
    m.__package__ = mod.__package__
    m.__file__ = mod.__file__
    sys.modules[m.__name__] = m
    exec(compile(src, f"{mod.__file__} (float32 -> float64, {n} replacements)", "exec"), m.__dict__)
    _F64_CLASSES[cls] = (getattr(m, cls.__name__), n)
    return _F64_CLASSES[cls]


# ----------------------------------------------------------------------------------------------------
# tiny CLIP tokenizer and text encoders
# ----------------------------------------------------------------------------------------------------
# BPE merges in rank order (each one's parts exist when it applies); the vocabulary is built as OpenAI's CLIP
# builds its own: the 256 byte symbols, the same with "</w>", one entry per merge, <|startoftext|>, <|endoftext|>.
MERGES = [
    "t h", "th e</w>", "o o", "m oo", "moo n</w>", "o n</w>", "o f</w>", "c a", "ca t</w>", "p h", "o t", "ph ot",
    "phot o</w>", "l o", "lo w</w>", "q u", "a l", "qu al", "i t", "r r", "b l", "u rr", "bl urr",
]
PROMPT = "a photo of a cat on the moon"
NEGATIVE_PROMPT = "blurry, low quality"
PROMPT_2 = "the moon, a photo"          # SDXL second prompt (tokenizer_2 / text_encoder_2)
NEGATIVE_PROMPT_2 = "low quality"


def write_tokenizer_sources(folder):
    """vocab.json + merges.txt of the tiny BPE (the inputs CLIPTokenizer is constructed from)."""
    os.makedirs(folder, exist_ok=True)
    symbols = list(clip_tokenization.bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in MERGES]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(set(vocab)) == len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return len(vocab)


def make_tokenizer(src_folder, pad_token="<|endoftext|>"):
    return clip_tokenization.CLIPTokenizer(
        vocab_file=os.path.join(src_folder, "vocab.json"), merges_file=os.path.join(src_folder, "merges.txt"),
        pad_token=pad_token, model_max_length=77, do_lower_case=True)


def text_config(vocab_size, hidden, heads, layers, inter, projection_dim, act="quick_gelu"):
    return clip_configuration.CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, projection_dim=projection_dim,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77, hidden_act=act,
        layer_norm_eps=1e-5, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=1)


def make_text_encoder(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config)
    assert all(type(l.self_attn) is clip_modeling.CLIPAttention for l in model.text_model.encoder.layers)
    return perturb_(model, seed + 1).eval()


# ----------------------------------------------------------------------------------------------------
# pipelines (their unet/vae are the unet_sd, unet_sdxl and vae cases' models: byte-identical files, one git blob)
# ----------------------------------------------------------------------------------------------------
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
# (SD 1.5's DDIM settings; schedulers for the runs are made from the saved folder's scheduler_config.json)
STEPS = 5
GUIDANCE = 7.5
LATENT_HW = 16  # pipeline latents [1, 4, 16, 16]; the vae case's vae_scale_factor 2 makes 32 x 32 images


def run_pipeline(pipe, latents, scheduler, call_kwargs):
    """Runs pipe(...) with `scheduler`; returns the final latents and the image ([0, 1], NCHW)."""
    pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    steps = []

    def grab(p, i, t, kw):
        steps.append(kw["latents"].clone())
        return kw

    with torch.no_grad():
        image = pipe(**call_kwargs, latents=latents, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                     output_type="pt", callback_on_step_end=grab, callback_on_step_end_tensor_inputs=["latents"]
                     ).images
    assert len(steps) == STEPS
    return {"latents": steps[-1], "image": image}


def pipeline_pair(cls, components, latents, call_kwargs, scheduler_cls, folder):
    """The f32 pipeline and a float64 one (deep-copied .double() models, float64 scheduler class); both schedulers
    are scheduler_cls.from_config(<folder>/scheduler/scheduler_config.json), as a user of the folder makes them."""
    sched_cfg = scheduler_cls.load_config(os.path.join(folder, "scheduler"))
    sch32 = scheduler_cls.from_config(sched_cfg)
    sch64_cls, n_rep = f64_scheduler_class(scheduler_cls)
    sch64 = sch64_cls.from_config(sched_cfg)
    c64 = {k: (copy.deepcopy(v).double().eval() if isinstance(v, nn.Module) else v) for k, v in components.items()}
    out32 = run_pipeline(cls(**components), latents, sch32, call_kwargs)
    with default_dtype(torch.float64):
        out64 = run_pipeline(cls(**c64), latents.double(), sch64, call_kwargs)
    assert sch64.alphas_cumprod.dtype == torch.float64
    extra = {"timesteps": sch32.timesteps.clone()}
    if hasattr(sch32, "sigmas"):
        assert sch64.sigmas.dtype == torch.float64
        extra["sigmas_f32"], extra["sigmas_f64"] = sch32.sigmas.clone(), sch64.sigmas.clone()
    return out32, out64, extra, n_rep


def scheduler_tensors(tag, out32, out64, extra):
    t = [(f"{tag}_timesteps", extra["timesteps"])]
    if "sigmas_f32" in extra:
        t += [(f"{tag}_sigmas_f32", extra["sigmas_f32"]), (f"{tag}_sigmas_f64", extra["sigmas_f64"])]
    for k in ("latents", "image"):
        t += [(f"{tag}_{k}_f32", out32[k]), (f"{tag}_{k}_f64", out64[k])]
    return t


def token_ids(tokenizer, text):
    return tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def sd_pipeline(models):
    tok_src = "/tmp/sd_reference_stubs/tokenizer_src"
    vocab_size = write_tokenizer_sources(tok_src)
    tokenizer = make_tokenizer(tok_src)
    te_config = text_config(vocab_size, 16, 4, 2, 64, 16)  # hidden 16 = unet_sd's cross_attention_dim
    text_encoder = make_text_encoder(clip_modeling.CLIPTextModel, te_config, seed=700)
    unet, vae = models["unet_sd"], models["vae"]
    components = dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                      scheduler=DDIMScheduler(**SCHEDULER_CONFIG), safety_checker=None, feature_extractor=None,
                      image_encoder=None, requires_safety_checker=False)
    pipe = StableDiffusionPipeline(**components)
    folder = fresh_dir(os.path.join(OUT_DIR, "pipeline"))
    pipe.save_pretrained(folder)

    height = width = LATENT_HW * pipe.vae_scale_factor
    g = torch.Generator().manual_seed(730)
    latents = torch.randn(1, 4, LATENT_HW, LATENT_HW, generator=g)
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=height, width=width, eta=0.0)
    with torch.no_grad():
        pe32, ne32 = pipe.encode_prompt(PROMPT, "cpu", 1, True, negative_prompt=NEGATIVE_PROMPT)
        te64 = copy.deepcopy(text_encoder).double().eval()
        with default_dtype(torch.float64):
            pe64, ne64 = StableDiffusionPipeline(**dict(components, text_encoder=te64)).encode_prompt(
                PROMPT, "cpu", 1, True, negative_prompt=NEGATIVE_PROMPT)
    tensors = [("prompt_ids", token_ids(tokenizer, PROMPT)),
               ("negative_prompt_ids", token_ids(tokenizer, NEGATIVE_PROMPT)),
               ("prompt_embeds_f32", pe32), ("prompt_embeds_f64", pe64),
               ("negative_prompt_embeds_f32", ne32), ("negative_prompt_embeds_f64", ne64), ("latents", latents)]
    summary("pipeline", {"prompt_embeds": pe32, "negative_prompt_embeds": ne32},
            {"prompt_embeds": pe64, "negative_prompt_embeds": ne64})
    reps, first = {}, None
    for tag, cls in (("ddim", DDIMScheduler), ("euler", EulerDiscreteScheduler)):
        out32, out64, extra, reps[tag] = pipeline_pair(StableDiffusionPipeline, components, latents, call, cls, folder)
        tensors += scheduler_tensors(tag, out32, out64, extra)
        summary(f"pipeline.{tag}", out32, out64)
        first = first or out32

    # the saved folder reloads through diffusers (DiffusionPipeline.from_pretrained) and reproduces the DDIM run
    back = DiffusionPipeline.from_pretrained(folder)
    assert type(back) is StableDiffusionPipeline and type(back.scheduler) is DDIMScheduler, type(back)
    assert back.safety_checker is None and back.feature_extractor is None
    again = run_pipeline(back, latents, back.scheduler, call)
    assert torch.equal(again["image"], first["image"]) and torch.equal(again["latents"], first["latents"])

    meta = dict(COMMON_META, source=f"{SOURCE} StableDiffusionPipeline; {CLIP_SOURCE}", prompt=PROMPT,
                negative_prompt=NEGATIVE_PROMPT, steps=str(STEPS), guidance_scale=str(GUIDANCE), eta="0.0",
                height=str(height), width=str(width), output_type="pt (image in [0, 1], NCHW)",
                schedulers="ddim: DDIMScheduler.from_config(scheduler/scheduler_config.json); euler: "
                           "EulerDiscreteScheduler.from_config(the same file: timestep_spacing leading, "
                           "steps_offset 1)",
                f64_scheduler="the scheduler module's source with torch.float32/np.float32 -> float64 "
                              f"({reps['ddim']} replacements in scheduling_ddim.py, {reps['euler']} in "
                              "scheduling_euler_discrete.py)",
                models="unet = unet_sd, vae = vae (same weights); text_encoder CLIPTextModel "
                       + json.dumps(te_config.to_diff_dict(), sort_keys=True),
                scheduler_config=json.dumps(SCHEDULER_CONFIG), merges=json.dumps(MERGES))
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def sdxl_pipeline(models):
    tok_src = "/tmp/sd_reference_stubs/tokenizer_src"
    vocab_size = write_tokenizer_sources(tok_src)
    tokenizer = make_tokenizer(tok_src)
    tokenizer_2 = make_tokenizer(tok_src, pad_token="!")  # SDXL's tokenizer_2 pads with "!" (id 0)
    # hidden 16 + 16 = unet_sdxl's cross_attention_dim 32; projection_dim 32 = its pooled text_embeds width
    te1_config = text_config(vocab_size, 16, 2, 2, 64, 16)
    te2_config = text_config(vocab_size, 16, 2, 2, 64, 32, act="gelu")
    text_encoder = make_text_encoder(clip_modeling.CLIPTextModel, te1_config, seed=800)
    text_encoder_2 = make_text_encoder(clip_modeling.CLIPTextModelWithProjection, te2_config, seed=810)
    unet, vae = models["unet_sdxl"], models["vae"]
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading")
    components = dict(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                      tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, image_encoder=None,
                      feature_extractor=None, force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe = StableDiffusionXLPipeline(**components)
    folder = fresh_dir(os.path.join(OUT_DIR, "pipeline_sdxl"))
    pipe.save_pretrained(folder)

    height = width = LATENT_HW * pipe.vae_scale_factor
    g = torch.Generator().manual_seed(840)
    latents = torch.randn(1, 4, LATENT_HW, LATENT_HW, generator=g)
    call = dict(prompt=PROMPT, prompt_2=PROMPT_2, negative_prompt=NEGATIVE_PROMPT,
                negative_prompt_2=NEGATIVE_PROMPT_2, height=height, width=width)
    tensors = [("prompt_ids", token_ids(tokenizer, PROMPT)),
               ("negative_prompt_ids", token_ids(tokenizer, NEGATIVE_PROMPT)),
               ("prompt_2_ids", token_ids(tokenizer_2, PROMPT_2)),
               ("negative_prompt_2_ids", token_ids(tokenizer_2, NEGATIVE_PROMPT_2))]
    enc_kw = dict(prompt=PROMPT, prompt_2=PROMPT_2, device="cpu", num_images_per_prompt=1,
                  do_classifier_free_guidance=True, negative_prompt=NEGATIVE_PROMPT,
                  negative_prompt_2=NEGATIVE_PROMPT_2)
    names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    with torch.no_grad():
        e32 = dict(zip(names, pipe.encode_prompt(**enc_kw)))
        c64 = dict(components, text_encoder=copy.deepcopy(text_encoder).double().eval(),
                   text_encoder_2=copy.deepcopy(text_encoder_2).double().eval())
        with default_dtype(torch.float64):
            e64 = dict(zip(names, StableDiffusionXLPipeline(**c64).encode_prompt(**enc_kw)))
    for n in names:
        tensors += [(n + "_f32", e32[n]), (n + "_f64", e64[n])]
    summary("pipeline_sdxl", e32, e64)
    tensors.append(("latents", latents))
    out32, out64, extra, n_rep = pipeline_pair(StableDiffusionXLPipeline, components, latents, call,
                                               EulerDiscreteScheduler, folder)
    tensors += scheduler_tensors("euler", out32, out64, extra)
    summary("pipeline_sdxl.euler", out32, out64)

    back = DiffusionPipeline.from_pretrained(folder)
    assert type(back) is StableDiffusionXLPipeline and type(back.scheduler) is EulerDiscreteScheduler
    again = run_pipeline(back, latents, back.scheduler, call)
    assert torch.equal(again["image"], out32["image"]) and torch.equal(again["latents"], out32["latents"])

    meta = dict(COMMON_META, source=f"{SOURCE} StableDiffusionXLPipeline; {CLIP_SOURCE}", prompt=PROMPT,
                prompt_2=PROMPT_2, negative_prompt=NEGATIVE_PROMPT, negative_prompt_2=NEGATIVE_PROMPT_2,
                steps=str(STEPS), guidance_scale=str(GUIDANCE), height=str(height), width=str(width),
                add_time_ids=json.dumps([height, width, 0, 0, height, width]) + " for both CFG halves",
                output_type="pt (image in [0, 1], NCHW)",
                scheduler="the folder's EulerDiscreteScheduler (scaled_linear, timestep_spacing leading, "
                          "steps_offset 1)",
                f64_scheduler=f"scheduling_euler_discrete.py source with float32 -> float64 ({n_rep} replacements)",
                models="unet = unet_sdxl, vae = vae (same weights); text_encoder CLIPTextModel "
                       + json.dumps(te1_config.to_diff_dict(), sort_keys=True)
                       + "; text_encoder_2 CLIPTextModelWithProjection "
                       + json.dumps(te2_config.to_diff_dict(), sort_keys=True),
                merges=json.dumps(MERGES))
    write_st(os.path.join(folder, "pipeline_io.safetensors"), tensors, meta)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    print(f"diffusers {diffusers.__version__} from {DIFFUSERS_PATH} ({DIFFUSERS_COMMIT}); torch {torch.__version__}")
    models = {}
    for name, case in UNET_CASES.items():
        print(name)
        models[name] = run_unet_case(name, case)
    for name, case in VAE_CASES.items():
        print(name)
        models[name] = run_vae_case(name, case)
    print("pipeline")
    sd_pipeline(models)
    print("pipeline_sdxl")
    sdxl_pipeline(models)
    total, blobs = 0, {}
    for root, _, files in sorted(os.walk(OUT_DIR)):
        for f in sorted(files):
            path = os.path.join(root, f)
            total += os.path.getsize(path)
            with open(path, "rb") as fh:
                blobs[hash(fh.read())] = os.path.getsize(path)
    print(f"total {total / 1e6:.2f} MB under {OUT_DIR} ({sum(blobs.values()) / 1e6:.2f} MB of distinct files)")


if __name__ == "__main__":
    main()
