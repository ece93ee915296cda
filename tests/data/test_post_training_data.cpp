// Post-training data: SFT rows and their loss masks, preference rows, prompts, the sums task, and the
// one-line FILE:LINE errors of bad files.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>
#include <set>

#include "dew/data/post_training_data.h"
#include "tests/test_util.h"

using dew::data::ChatFormat;
using dew::data::ChatTemplate;

namespace {

ChatFormat byte_plain() { return {dew::data::load_tokenizer("byte"), ChatTemplate::plain, {}}; }

std::string row_text(const at::Tensor& ids, const at::Tensor& keep) {
  std::string s;
  for (int64_t t = 0; t < ids.size(0); ++t)
    if (keep[t].item<bool>()) s += char(ids[t].item<int64_t>());
  return s;
}

}  // namespace

TEST(PostTrainingData, SftRowsMaskExactlyTheAssistantTurns) {
  dew::test::TempDir d("pt_sft");
  const std::string f = d.write(
      "c.jsonl",
      R"({"messages":[{"role":"user","content":"1+2="},{"role":"assistant","content":"3"}]})"
      "\n\n"
      R"({"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"},)"
      R"({"role":"assistant","content":"ab"},{"role":"user","content":"again"},{"role":"assistant","content":"c"}]})"
      "\n");
  auto b = dew::data::sft_rows(f, byte_plain(), 512);
  const std::string first = "<|user|>\n1+2=<|end|>\n<|assistant|>\n3<|end|>\n";
  const at::Tensor tokens = b.at("tokens"), mask = b.at("loss_mask");
  ASSERT_EQ(tokens.size(0), 2);
  // Rows pad to the longest conversation; the byte tokenizer pads with EOS (256), which carries no loss.
  const std::string second =
      "<|system|>\ns<|end|>\n<|user|>\nq<|end|>\n<|assistant|>\nab<|end|>\n<|user|>\nagain<|end|>\n"
      "<|assistant|>\nc<|end|>\n";
  EXPECT_EQ(tokens.size(1), int64_t(second.size()));
  EXPECT_EQ(row_text(tokens[0], tokens[0] < 256), first);
  EXPECT_EQ(tokens[0][int64_t(first.size())].item<int64_t>(), 256);
  EXPECT_EQ(row_text(tokens[0], mask[0]), "3<|end|>");
  EXPECT_EQ(row_text(tokens[1], mask[1]), "ab<|end|>c<|end|>");

  // Packed: both conversations in one row of max_len ids, each its own segment restarting positions.
  auto p = dew::data::sft_rows(f, byte_plain(), 200, /*pack=*/true);
  ASSERT_EQ(p.at("tokens").size(0), 1);
  EXPECT_EQ(p.at("tokens").size(1), 200);
  EXPECT_EQ(row_text(p.at("tokens")[0], p.at("loss_mask")[0]), "3<|end|>ab<|end|>c<|end|>");
  const int64_t n1 = int64_t(first.size());
  EXPECT_EQ(p.at("segment_ids")[0][n1 - 1].item<int64_t>(), 0);
  EXPECT_EQ(p.at("segment_ids")[0][n1].item<int64_t>(), 1);
  EXPECT_EQ(p.at("positions")[0][n1].item<int64_t>(), 0);
  EXPECT_EQ(p.at("segment_ids")[0][199].item<int64_t>(), 2);  // the padding tail
  // Too small to hold both: two rows.
  EXPECT_EQ(dew::data::sft_rows(f, byte_plain(), int64_t(second.size()), true).at("tokens").size(0), 2);
}

TEST(PostTrainingData, PromptCompletionRecordsAndPreferenceRows) {
  dew::test::TempDir d("pt_pairs");
  const std::string f = d.write(
      "p.jsonl",
      R"({"prompt":[{"role":"user","content":"2+2="}],"chosen":"4","rejected":[{"role":"assistant","content":"5"}]})"
      "\n"
      R"({"prompt":"Q: hi A:","chosen":" yes","rejected":" no"})"
      "\n");
  auto b = dew::data::preference_rows(f, byte_plain(), 128);
  ASSERT_EQ(b.at("ids").sizes(), (std::vector<int64_t>{2, 2, b.at("ids").size(2)}));
  const at::Tensor ids = b.at("ids"), m = b.at("completion_mask");
  EXPECT_EQ(row_text(ids[0][0], m[0][0]), "4<|end|>");
  EXPECT_EQ(row_text(ids[0][1], m[0][1]), "5<|end|>");
  // A raw-text prompt: the completion as written, then EOS (256, outside row_text's bytes).
  EXPECT_EQ(row_text(ids[1][0], m[1][0].logical_and(ids[1][0] < 256)), " yes");
  EXPECT_EQ(m[1][0].sum().item<int64_t>(), 5);
  EXPECT_EQ(b.at("index").sizes(), (std::vector<int64_t>{2}));

  auto prompts =
      dew::data::read_prompts(d.write("q.jsonl", R"({"prompt":[{"role":"user","content":"7+1="}],"answer":"8"})"
                                                 "\n"),
                              byte_plain(), 128);
  ASSERT_EQ(prompts.size(), 1u);
  EXPECT_EQ(prompts[0].text, "<|user|>\n7+1=<|end|>\n<|assistant|>\n");
  EXPECT_TRUE(prompts[0].conversational);
  EXPECT_EQ(prompts[0].record["answer"], "8");
  EXPECT_EQ(prompts[0].where, d.file("q.jsonl") + ":1");
}

TEST(PostTrainingData, BadFilesNameTheFileAndLine) {
  dew::test::TempDir d("pt_bad");
  auto fmt = byte_plain();
  struct Case {
    std::string text, needle;
    int kind;  // 0 sft, 1 pairs, 2 prompts
  };
  const std::string ok = R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]})";
  const std::vector<Case> cases = {
      {ok + "\nnot json\n", "c.jsonl:2: not JSON", 0},
      {R"({"messages":[{"role":"robot","content":"a"}]})", "c.jsonl:1:", 0},
      {R"({"messages":[{"role":"user","content":"a"}]})", "c.jsonl:1: no assistant message", 0},
      {R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"  "}]})",
       "c.jsonl:1: an empty assistant", 0},
      {R"({"messages":[{"role":"user","content":")" + std::string(300, 'x') +
           R"("},{"role":"assistant","content":"b"}]})",
       "c.jsonl:1: the conversation is 340 tokens, longer than the model's context of 100", 0},
      {"\n" + std::string(R"({"prompt":"p","chosen":"a"})"), "c.jsonl:2: no \"rejected\"", 1},
      {R"({"prompt":"p","chosen":"a","rejected":""})", "c.jsonl:1: \"rejected\" is an empty completion", 1},
      {R"({"prompt":[{"role":"user","content":"p"},{"role":"assistant","content":"x"}],"chosen":"a","rejected":"b"})",
       "c.jsonl:1: the prompt's messages end with an assistant turn", 1},
      {R"({"prompt":"p","chosen":[{"role":"user","content":"a"}],"rejected":"b"})",
       "c.jsonl:1: \"chosen\" must be a text or one assistant message", 1},
      {R"({"answer":"1"})", "c.jsonl:1: no \"prompt\"", 2},
      {R"({"prompt":")" + std::string(120, 'x') + R"("})", "c.jsonl:1: the prompt is 120 tokens, which leaves no room",
       2},
      {"", "c.jsonl: no records", 2},
  };
  for (const auto& c : cases) {
    const std::string f = d.write("c.jsonl", c.text);
    const std::string e = dew::test::error_of([&] {
      if (c.kind == 0) dew::data::sft_rows(f, fmt, 100);
      if (c.kind == 1) dew::data::preference_rows(f, fmt, 100);
      if (c.kind == 2) dew::data::read_prompts(f, fmt, 100);
    });
    EXPECT_NE(e.find(c.needle), std::string::npos) << "file:\n" << c.text.substr(0, 200) << "\nerror: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(PostTrainingData, SumsTaskHoldsOutAFixedSplitWithCorrectAnswers) {
  dew::test::TempDir d("pt_sums");
  EXPECT_EQ(dew::data::write_sums_task(d.file("t"), 2, 500, 3), 8100 - 500);
  auto fmt = byte_plain();
  auto train = dew::data::read_prompts(d.file("t/train_prompts.jsonl"), fmt, 64);
  auto test = dew::data::read_prompts(d.file("t/test_prompts.jsonl"), fmt, 64);
  ASSERT_EQ(train.size(), 7600u);
  ASSERT_EQ(test.size(), 500u);
  std::set<std::string> seen;
  for (const auto* set : {&train, &test})
    for (const auto& p : *set) {
      const std::string q = p.record["prompt"][0]["content"];
      const auto plus = q.find('+');
      const int a = std::stoi(q.substr(0, plus)), b = std::stoi(q.substr(plus + 1));
      EXPECT_TRUE(a >= 10 && a <= 99 && b >= 10 && b <= 99) << q;
      EXPECT_EQ(p.record["answer"], std::to_string(a + b)) << q;
      EXPECT_TRUE(seen.insert(q).second) << "twice: " << q;  // train and test are disjoint
    }
  auto sft = dew::data::sft_rows(d.file("t/sft.jsonl"), fmt, 65);
  EXPECT_EQ(sft.at("tokens").size(0), 7600);
  // The seed decides the split; the same seed gives the same files.
  dew::data::write_sums_task(d.file("u"), 2, 500, 3);
  dew::data::write_sums_task(d.file("v"), 2, 500, 4);
  auto slurp = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EXPECT_EQ(slurp(d.file("t/test_prompts.jsonl")), slurp(d.file("u/test_prompts.jsonl")));
  EXPECT_NE(slurp(d.file("t/test_prompts.jsonl")), slurp(d.file("v/test_prompts.jsonl")));
}
