// Chat data and chat templates (docs/post_training.md): conversations read from JSON lines, rendered natively
// (C++ string building, no Jinja engine) byte for byte as the Jinja chat templates that Llama 3, Llama 3.1,
// Qwen2.5, Qwen3 and Gemma 3 ship in tokenizer_config.json render under transformers' apply_chat_template,
// plus Dew's "plain" template for byte models. A rendering carries the byte span of each assistant turn
// (its content as rendered and its end-of-turn marker), from which SFT builds its loss mask. The goldens
// are in tests/golden/chat/ (renderings.json, made by tests/golden/chat_reference.py with Debian's jinja2
// from the real template texts in tests/golden/chat/templates/).
//
//   auto convs = dew::data::read_chat_jsonl("chat.jsonl");          // {"messages": [{"role", "content"}]}
//   auto tpl = dew::data::recognise_chat_template("models/Qwen3-0.6B");        // ChatTemplate::qwen3
//   dew::data::ChatRenderOptions o;
//   o.add_generation_prompt = true;                                   // end with "<|im_start|>assistant\n"
//   auto r = dew::data::render_chat(convs[0], tpl, o);               // r.text, r.assistant_spans
//   auto byte_mask = dew::data::assistant_byte_mask(r);              // [r.text.size()] 0/1
//   auto t = dew::data::tokenize_chat(*tok, r);                      // t.ids, t.mask (byte-level tokenizers)
//
// The plain template (Phi-3's layout with every role and no BOS/EOS), one block per message:
//   <|ROLE|>\nCONTENT<|end|>\n            e.g. "<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n"
// and "<|assistant|>\n" as the generation prompt; contents are written as they are (no trimming); the
// assistant span is CONTENT<|end|>. Its Jinja form is tests/golden/chat/templates/plain.jinja (also
// chat_template_jinja(ChatTemplate::plain)), rendered by the goldens like the others.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace dew {
namespace data {

class Tokenizer;

/// The roles a chat message may have ("system", "user", "assistant", "tool", "developer").
enum class ChatRole { system, user, assistant, tool, developer };

/// The name of a role as it appears in chat JSON ("assistant").
const char* chat_role_name(ChatRole role);

/// The role of `name`; anything else is a dew::Error listing the roles.
ChatRole parse_chat_role(const std::string& name);

/// One message: a role and its text (UTF-8).
struct ChatMessage {
  ChatRole role;
  std::string content;
};

/// A conversation: messages in order.
using Conversation = std::vector<ChatMessage>;

/// The conversations of a JSON-lines file, one object {"messages": [{"role": R, "content": "text"}, ...]}
/// per line (other keys are ignored; blank lines are skipped). A line that is not JSON, has no "messages"
/// array, an empty one, a message without a string "role" and "content" or with an unknown role is a
/// dew::Error "FILE:LINE: what is wrong".
std::vector<Conversation> read_chat_jsonl(const std::string& path);

/// The conversation of one parsed {"messages": [...]} record (JSON text); errors start with `where`
/// ("FILE:LINE").
Conversation parse_chat_record(const std::string& json_text, const std::string& where);

/// The conversation of a "messages" value (a parsed JSON list of {"role", "content"} objects), checked as
/// parse_chat_record checks it; the prompt / chosen / rejected lists of post-training data use it.
Conversation parse_chat_messages(const nlohmann::json& messages, const std::string& where);

/// The chat templates Dew renders.
enum class ChatTemplate {
  llama3,    // Meta-Llama-3-*-Instruct: <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>, BOS first
  llama3_1,  // Llama-3.1-*-Instruct: Llama 3 plus a system header "Cutting Knowledge Date / Today Date"
  qwen2_5,   // Qwen2.5-*-Instruct: ChatML with "You are Qwen, created by Alibaba Cloud..." as default system
  qwen3,     // Qwen3-*: ChatML, no default system, <think> blocks and enable_thinking
  gemma3,    // gemma-3-*-it: <start_of_turn>user|model ... <end_of_turn>, system folded into the first user turn
  plain,     // Dew's template for byte models (above)
};

/// The name of a template: "llama3", "llama3.1", "qwen2.5", "qwen3", "gemma3", "plain".
const char* chat_template_name(ChatTemplate t);

/// The template called `name` (one of chat_template_name's); anything else is a dew::Error listing them.
ChatTemplate parse_chat_template(const std::string& name);

/// Every template, in the order of the enum.
const std::vector<ChatTemplate>& chat_templates();

/// The marker that ends an assistant turn: "<|eot_id|>", "<|im_end|>", "<end_of_turn>" or "<|end|>" (the
/// text a generator stops at).
const char* chat_end_of_turn(ChatTemplate t);

/// Options of render_chat: what apply_chat_template's arguments and template keywords control.
struct ChatRenderOptions {
  bool add_generation_prompt = false;       // end with the header of a new assistant turn
  bool enable_thinking = true;              // qwen3: false puts "<think>\n\n</think>\n\n" after the generation prompt
  std::string date_string = "26 Jul 2024";  // llama3.1: the "Today Date:" line (the template's default)
};

/// A byte range [begin, end) of a rendering.
struct ChatSpan {
  int64_t begin = 0;
  int64_t end = 0;
};

/// A rendered conversation and where its assistant turns are.
struct ChatRendering {
  std::string text;                       // the prompt/training text, special tokens written out
  std::vector<ChatSpan> assistant_spans;  // one per assistant message, in order: everything the turn renders
                                          // after its role header, through its end-of-turn marker
};

/// `conv` rendered as template `t` does under transformers' apply_chat_template (the special tokens of
/// the model's tokenizer_config.json: BOS "<|begin_of_text|>" for Llama, "<bos>" for Gemma; no tools).
/// What each template does to a content is kept: Llama and Gemma trim whitespace (Python's str.strip),
/// Qwen and plain write it as it is, Llama 3.1 writes tool results as JSON strings under an "ipython"
/// header, Qwen groups consecutive tool results into one user turn of <tool_response> blocks, Qwen3
/// drops the reasoning (a "<think>...</think>" part) of assistant turns before the last user query.
/// Errors (dew::Error): an empty conversation; gemma3 when roles do not alternate user/assistant
/// starting with user after an optional system message (the template raises the same); a developer
/// message for qwen2.5 or qwen3 (their templates drop it silently; Dew refuses rather than lose it).
ChatRendering render_chat(const Conversation& conv, ChatTemplate t, const ChatRenderOptions& options = {});

/// Per byte of r.text: 1 inside an assistant span, else 0.
std::vector<uint8_t> assistant_byte_mask(const ChatRendering& r);

/// Token ids of a rendering with a per-token loss mask.
struct ChatTokens {
  std::vector<int64_t> ids;   // tok.encode(r.text) (no BOS added: the text already has the template's)
  std::vector<uint8_t> mask;  // 1 where the token's bytes overlap an assistant span
};

/// r.text encoded by `tok`, and which tokens touch an assistant span. The byte offsets of the tokens come
/// from decoding each id alone, which spells the text back byte for byte for the byte tokenizer and
/// byte-level BPE (hf_bpe); a tokenizer whose pieces do not (SentencePiece drops a leading space when
/// decoding) is a dew::Error naming it.
ChatTokens tokenize_chat(const Tokenizer& tok, const ChatRendering& r);

/// A known template text: which template it renders and where the text comes from.
struct KnownChatTemplate {
  ChatTemplate templ;
  std::string variant;  // "llama3", "llama3.1", "qwen2.5", "qwen3", "qwen3@2504", "gemma3", "plain"
  std::string text;     // the Jinja source as shipped (tests/golden/chat/templates/)
};

/// The template texts Dew recognises: the one of each template, and the first Qwen3 release's (2504).
const std::vector<KnownChatTemplate>& known_chat_templates();

/// The Jinja text of a template as its models ship it today (plain: Dew's own), e.g. for an export.
const std::string& chat_template_jinja(ChatTemplate t);

/// Which known template `jinja_text` is. Rule: equal to a known text after the two normalisations Jinja
/// makes itself (line endings "\r\n" and "\r" become "\n"; one newline at the very end is dropped), so a
/// recognised template renders exactly as Dew does. Anything else is a one-line dew::Error starting with
/// `where`, saying when the text differs from a known one only in whitespace (which can change the output,
/// so it is refused too) and listing the known templates.
ChatTemplate recognise_chat_template_text(const std::string& jinja_text, const std::string& where);

/// The chat template of a model folder (or of a tokenizer_config.json file): chat_template.jinja when the
/// folder has one (transformers reads it first), else tokenizer_config.json's "chat_template" (a string,
/// or a list of {"name", "template"} of which "default" is taken), recognised as above. A folder without a
/// template or with an unknown one is a one-line dew::Error naming the folder.
ChatTemplate recognise_chat_template(const std::string& model_dir);

}  // namespace data
}  // namespace dew
