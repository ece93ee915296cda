"""Chat-template goldens: the real Jinja chat templates of Llama 3, Llama 3.1, Qwen2.5, Qwen3 and Gemma 3
(tests/golden/chat/templates/, sources in the README there) rendered by the installed transformers (5.25.0,
requirements.txt) exactly as `apply_chat_template` renders them. Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/chat_reference.py

Writes tests/golden/chat/renderings.json: every case (conversation, template, add_generation_prompt, extra
template keyword arguments) with the string the template renders, or the error it raises.

The renderer is transformers' own `render_jinja_template` (transformers/utils/chat_template_utils.py), the
function `PreTrainedTokenizerBase.apply_chat_template` calls, with `template_kwargs = {**special_tokens_map,
**kwargs}` as apply_chat_template builds them (tools None, documents None, no continue_final_message, no
assistant mask). Its environment is `_compile_jinja_template`'s: ImmutableSandboxedEnvironment(trim_blocks,
lstrip_blocks, AssistantTracker + loopcontrols), tojson with ensure_ascii=False, raise_exception, strftime_now,
dict and a namespace that refuses underscore names. The special tokens are those of the models'
tokenizer_config.json (only bos_token is read by the templates).

Determinism: `strftime_now` reads `datetime.now()` through the module's `datetime` name; the script sets that
name to a datetime subclass whose now() is 2026-12-01 12:00 so that a rerun writes the same file. None of the
committed templates calls it (Llama 3.1's template prints "Today Date: 26 Jul 2024" unless the caller passes
`date_string`; only Llama 3.2 and later read the clock). Nothing else is replaced.
"""
import datetime as _datetime
import json
import os

import jinja2
import transformers
from transformers.utils import chat_template_utils

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


class _PinnedClock(_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return PINNED_NOW


def render(template_text, messages, add_generation_prompt, template_kwargs):
    """transformers' render_jinja_template for one conversation, as apply_chat_template calls it."""
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=None, documents=None, chat_template=template_text,
        return_assistant_tokens_mask=False, continue_final_message=False,
        add_generation_prompt=add_generation_prompt, **template_kwargs)
    return rendered[0]


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
    chat_template_utils.datetime = _PinnedClock  # strftime_now's clock (see the docstring)
    texts = {}
    for name, (fname, _) in MODELS.items():
        with open(os.path.join(TEMPLATES, fname), encoding="utf-8") as f:
            texts[name] = f.read()
    cases = []
    for case_name, templates, messages, agp, kwargs in CASES:
        for t in templates:
            special = MODELS[t][1]
            rec = {"name": case_name, "template": t, "messages": messages, "add_generation_prompt": agp,
                   "kwargs": kwargs}
            try:
                rec["expected"] = render(texts[t], messages, agp, {**special, **kwargs})
            except jinja2.exceptions.TemplateError as e:
                rec["error"] = str(e)
            cases.append(rec)
    out = {
        "generator": "tests/golden/chat_reference.py",
        "jinja2": jinja2.__version__,
        "transformers": transformers.__version__,
        "environment": "transformers render_jinja_template / _compile_jinja_template (trim_blocks, lstrip_blocks, "
                       "AssistantTracker, loopcontrols, tojson ensure_ascii=False, raise_exception, dict, namespace, "
                       "strftime_now pinned to " + PINNED_NOW.isoformat() + ")",
        "compiled_with": "transformers " + transformers.__version__ + " chat_template_utils.render_jinja_template",
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
