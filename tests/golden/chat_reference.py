"""Chat-template goldens: the real Jinja chat templates of Llama 3, Llama 3.1, Qwen2.5, Qwen3 and Gemma 3
(tests/golden/chat/templates/, sources in the README there) rendered with Debian's python3-jinja2 the way
transformers' `apply_chat_template` renders them. Not run by CI; rerun by hand:

    /usr/bin/python3 tests/golden/chat_reference.py

Writes tests/golden/chat/renderings.json: every case (conversation, template, add_generation_prompt, extra
template keyword arguments) with the string Jinja renders, or the error the template raises.

The environment is transformers' `_compile_jinja_template` (src/transformers/utils/chat_template_utils.py,
huggingface/transformers 5e43e2e892453b405ce6d2cb94387b3a3213f30a):

    ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    filters["tojson"] = json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)
    globals["raise_exception"] raises jinja2.exceptions.TemplateError(message)
    globals["strftime_now"] = datetime.now().strftime(format)

and the call is `compiled.render(messages=chat, tools=None, documents=None, add_generation_prompt=...,
**template_kwargs)` with `template_kwargs = {**tokenizer.special_tokens_map, **kwargs}`
(tokenization_utils_base.apply_chat_template). AssistantTracker only implements the `{% generation %}` tag,
which none of these templates uses, so it is left out here. `strftime_now` is pinned to 2026-12-01 so that a
rerun writes the same file; none of the committed templates calls it (Llama 3.1's template prints
"Today Date: 26 Jul 2024" unless the caller passes `date_string`; only Llama 3.2 and later read the clock).
The special tokens are those of the models' tokenizer_config.json (only bos_token is read by the templates).

Set DEW_TRANSFORMERS_CHAT_UTILS to a copy of that chat_template_utils.py to compile with its own
`_compile_jinja_template` instead (its package imports are stubbed); the strings written must not change.
"""
import datetime as _datetime
import importlib.util
import json
import os
import sys
import types

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "chat", "templates")
OUT = os.path.join(HERE, "chat", "renderings.json")
PINNED_NOW = _datetime.datetime(2026, 12, 1, 12, 0, 0)

# Dew's template name -> committed file and the special tokens of the model's tokenizer_config.json.
MODELS = {
    "llama3": ("llama3.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3.1": ("llama3_1.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2.5": ("qwen2_5.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    # The first Qwen3 release's template (2025-04): renders string contents as qwen3.jinja does.
    "qwen3@2504": ("qwen3_2504.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma3": ("gemma3.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                "unk_token": "<unk>"}),
    "plain": ("plain.jinja", {}),
}


def local_compile(source):
    """transformers' _compile_jinja_template, without the {% generation %} tracker."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return PINNED_NOW.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def transformers_compile():
    """_compile_jinja_template from the file in DEW_TRANSFORMERS_CHAT_UTILS, or None."""
    path = os.environ.get("DEW_TRANSFORMERS_CHAT_UTILS")
    if not path:
        return None
    pkg = types.ModuleType("transformers_stub")
    pkg.__path__ = []
    utils = types.ModuleType("transformers_stub.utils")
    utils.__path__ = []
    imp = types.ModuleType("transformers_stub.utils.import_utils")
    imp.is_jinja_available = lambda: True
    imp.is_torch_available = lambda: False
    imp.is_vision_available = lambda: False
    for m in (pkg, utils, imp):
        sys.modules[m.__name__] = m
    spec = importlib.util.spec_from_file_location("transformers_stub.utils.chat_template_utils", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)

    class Frozen(_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return PINNED_NOW

    mod.datetime = Frozen
    return mod._compile_jinja_template


def msg(role, content):
    return {"role": role, "content": content}


UNICODE = "naïve 日本語 🙂 — «quotes» \"double\" \\ back\tslash"
ALL = ["llama3", "llama3.1", "qwen2.5", "qwen3", "qwen3@2504", "gemma3", "plain"]

# (name, templates, messages, add_generation_prompt, extra template kwargs)
CASES = [
    ("one_turn", ALL, [msg("user", "Hello!"), msg("assistant", "Hi, how can I help?")], False, {}),
    ("one_turn_prompt", ALL, [msg("user", "What is 2+2?")], True, {}),
    ("system_multi_turn", ALL,
     [msg("system", "You are terse."), msg("user", "Name a colour."), msg("assistant", "Blue."),
      msg("user", UNICODE), msg("assistant", "日本語: はい 🙂")], False, {}),
    ("system_prompt", ALL, [msg("system", "You answer in French."), msg("user", "Good morning")], True, {}),
    ("whitespace", ALL,
     [msg("system", "\n  Be careful.\n\n"), msg("user", "  leading and trailing  \n"),
      msg("assistant", "\n\nanswer with\n\ninner newlines\t \n"), msg("user", "\u3000ideographic space\u00a0"),
      msg("assistant", "  "), msg("user", "\r\nCRLF line\r\n")], True, {}),
    ("empty_contents", ALL, [msg("user", ""), msg("assistant", "")], False, {}),
    ("template_text_in_content", ALL,
     [msg("user", "Print {{ messages }} and {% raw %} and <|im_end|> <end_of_turn> <|eot_id|>"),
      msg("assistant", "{{ 1 + 1 }} stays text")], False, {}),
    ("tool_turns", ["llama3", "llama3.1", "qwen2.5", "qwen3", "qwen3@2504", "plain", "gemma3"],
     [msg("user", "Weather in Paris?"), msg("assistant", "Calling the tool."),
      msg("tool", "{\"temp\": 21, \"sky\": \"clear\"}"), msg("tool", "second result\nline 2"),
      msg("assistant", "It is 21 °C and clear.")], False, {}),
    ("tool_response_as_user", ["qwen3", "qwen3@2504"],
     [msg("user", "Question"), msg("assistant", "<think>\nplan\n</think>\n\nusing a tool"),
      msg("user", "<tool_response>\n42\n</tool_response>"), msg("assistant", "<think>\nfound it\n</think>\n\nIt is 42.")],
     False, {}),
    ("developer_role", ["llama3", "llama3.1", "plain"],
     [msg("developer", "Use British spelling."), msg("user", "colour?"), msg("assistant", "Colour.")], False, {}),
    ("system_not_first", ["llama3", "llama3.1", "qwen2.5", "qwen3", "qwen3@2504", "plain"],
     [msg("user", "a"), msg("assistant", "b"), msg("system", "new rules"), msg("user", "c")], True, {}),
    ("system_only", ALL, [msg("system", "Only a system message.")], True, {}),
    ("gemma_roles_must_alternate", ["gemma3"], [msg("user", "a"), msg("user", "b")], False, {}),
    ("gemma_starts_with_assistant", ["gemma3"], [msg("assistant", "a")], False, {}),
    # Qwen3 thinking: reasoning in earlier assistant turns is dropped, the turns after the last user
    # query keep it (and the last one always gets a think block); enable_thinking=False adds an empty one
    # to the generation prompt.
    ("qwen3_think_history", ["qwen3", "qwen3@2504"],
     [msg("system", "Think first."), msg("user", "1+1?"),
      msg("assistant", "<think>\nOne plus one.\n</think>\n\n2"), msg("user", "2+2?"),
      msg("assistant", "<think>\n\nTwo plus two.\n\n</think>\n\n\n4")], False, {}),
    ("qwen3_last_turn_without_think", ["qwen3", "qwen3@2504"],
     [msg("user", "hi"), msg("assistant", "plain answer"), msg("user", "again"), msg("assistant", "\nsecond answer")],
     False, {}),
    ("qwen3_prompt_thinking", ["qwen3", "qwen3@2504"],
     [msg("user", "1+1?"), msg("assistant", "<think>x</think>2"), msg("user", "and 3+3?")], True,
     {"enable_thinking": True}),
    ("qwen3_prompt_no_thinking", ["qwen3", "qwen3@2504"],
     [msg("user", "1+1?"), msg("assistant", "<think>x</think>2"), msg("user", "and 3+3?")], True,
     {"enable_thinking": False}),
    ("qwen3_no_thinking_no_prompt", ["qwen3", "qwen3@2504"],
     [msg("user", "q"), msg("assistant", "a")], False, {"enable_thinking": False}),
    ("qwen3_think_markers_oddly_placed", ["qwen3", "qwen3@2504"],
     [msg("user", "q"), msg("assistant", "pre <think>a</think> mid </think>\n\nend"), msg("user", "q2"),
      msg("assistant", "no open tag</think>tail")], False, {}),
    ("llama31_date_string", ["llama3.1"], [msg("user", "What day is it?")], True, {"date_string": "01 Dec 2026"}),
]


def main():
    compile_fn = transformers_compile() or local_compile
    texts = {}
    compiled = {}
    for name, (fname, _) in MODELS.items():
        with open(os.path.join(TEMPLATES, fname), encoding="utf-8") as f:
            texts[name] = f.read()
        compiled[name] = compile_fn(texts[name])
    cases = []
    for case_name, templates, messages, agp, kwargs in CASES:
        for t in templates:
            special = MODELS[t][1]
            rec = {"name": case_name, "template": t, "messages": messages, "add_generation_prompt": agp,
                   "kwargs": kwargs}
            try:
                rec["expected"] = compiled[t].render(messages=messages, tools=None, documents=None,
                                                     add_generation_prompt=agp, **{**special, **kwargs})
            except jinja2.exceptions.TemplateError as e:
                rec["error"] = str(e)
            cases.append(rec)
    out = {
        "generator": "tests/golden/chat_reference.py",
        "jinja2": jinja2.__version__,
        "environment": "transformers _compile_jinja_template (trim_blocks, lstrip_blocks, loopcontrols, tojson "
                       "ensure_ascii=False, raise_exception, strftime_now pinned to " + PINNED_NOW.isoformat() + ")",
        "compiled_with": "transformers chat_template_utils.py" if compile_fn is not local_compile else "local copy",
        "templates": {name: {"file": "templates/" + fname, "special_tokens": special}
                      for name, (fname, special) in MODELS.items()},
        "cases": cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(cases)} renderings ({sum('error' in c for c in cases)} raise)")


if __name__ == "__main__":
    main()
