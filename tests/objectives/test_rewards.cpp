// The GRPO rewards: exact, format and length on hand cases, the parsing of a reward list, and the external
// command: rewards computed from the JSON it reads, and each way it can fail (exit status, signal, line count,
// a bad or non-finite line, a timeout, a command that does not read a large batch) as one dew::Error.
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dew/objectives/rewards.h"
#include "tests/test_util.h"

namespace pt = dew::post_training;
using dew::json;
using dew::test::error_of;

namespace {

pt::RewardInput input(const std::string& completion, json record = json::object(), int64_t tokens = 0) {
  pt::RewardInput in;
  in.prompt = "Q: what is 41 * 2?\nA:";
  in.completion = completion;
  in.record = std::move(record);
  in.completion_tokens = tokens;
  return in;
}

std::vector<double> score(const pt::RewardPtr& r, const std::vector<pt::RewardInput>& inputs) {
  return r->score(inputs);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The message of the error a command reward raises on `inputs`.
std::string command_error(const std::string& command, const std::vector<pt::RewardInput>& inputs,
                          pt::RewardOptions o = {}) {
  auto r = pt::make_command_reward(command, o);
  return error_of([&] { r->score(inputs); });
}

std::vector<pt::RewardInput> three() {
  return {input("a", {{"answer", "1"}}, 1), input("bb", {{"answer", "2"}}, 2), input("ccc", {{"answer", "3"}}, 3)};
}

}  // namespace

TEST(Rewards, ExactHandCases) {
  auto r = pt::make_reward("exact", {});
  EXPECT_EQ(r->name(), "exact");
  json a82 = {{"prompt", "41 * 2?"}, {"answer", "82"}};
  std::vector<pt::RewardInput> in = {
      input("41 * 2 = 82", a82),              // plain
      input("first 41, then 2: so 82", a82),  // the last number wins
      input("I think 80. No: 82", a82),       // the last number wins over an earlier wrong one
      input("82 is wrong, it is 83", a82),    // the last number is wrong
      input("The answer is 82.0", a82),       // 82.0 == 82
      input("no number here", a82),           // no match
      input("  82  ", {{"answer", " 82 "}}),  // trimmed
      input("total: 1,234 apples", {{"answer", "1234"}}),
      input("total: 1234", {{"answer", "1,234"}}),
      input("it costs 82, I think", a82),     // the match "82," loses its comma
      input("x = -3.5", {{"answer", -3.5}}),  // a numeric answer field
      input("x = 7", {{"answer", 7}}),
      input("x = 7", {{"answer", "seven"}}),  // text compares as text
  };
  std::vector<double> want = {1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0};
  EXPECT_EQ(score(r, in), want);
}

TEST(Rewards, ExactCustomExtractAndField) {
  pt::RewardOptions o;
  o.extract = "<answer>([^<]*)</answer>";
  o.answer_field = "solution";
  auto r = pt::make_reward("exact", o);
  std::vector<pt::RewardInput> in = {
      input("<answer>Paris</answer> or <answer> Lyon </answer>", {{"solution", "Lyon"}}),
      input("<answer>Paris</answer>", {{"solution", "Lyon"}}),
      input("Lyon", {{"solution", "Lyon"}}),
  };
  EXPECT_EQ(score(r, in), (std::vector<double>{1, 0, 0}));
  // No group: the whole match.
  o.extract = "[A-Z][a-z]+";
  EXPECT_EQ(score(pt::make_reward("exact", o), in), (std::vector<double>{1, 0, 1}));
}

TEST(Rewards, ExactErrors) {
  auto r = pt::make_reward("exact", {});
  for (json record :
       {json{{"prompt", "p"}}, json{{"answer", nullptr}}, json{{"answer", true}}, json("82"), json(nullptr)}) {
    std::string e = error_of([&] { r->score({input("82", record)}); });
    EXPECT_TRUE(contains(e, "reward exact")) << e;
    EXPECT_TRUE(contains(e, "\"answer\"")) << e;
  }
  std::string e = error_of([&] { r->score({input("82", {{"prompt", std::string(500, 'x')}})}); });
  EXPECT_LT(e.size(), 300u) << e;  // the record dump is cut
  pt::RewardOptions o;
  o.extract = "([0-9]";
  e = error_of([&] { pt::make_reward("exact", o); });
  EXPECT_TRUE(contains(e, "extract")) << e;
  EXPECT_TRUE(contains(e, "([0-9]")) << e;
}

TEST(Rewards, Format) {
  pt::RewardOptions o;
  o.format = "<think>[\\s\\S]*</think>\\s*answer: [0-9]+";
  auto r = pt::make_reward("format", o);
  EXPECT_EQ(r->name(), "format");
  std::vector<pt::RewardInput> in = {
      input("<think>41 * 2\nis 82</think>\nanswer: 82"), input("answer: 82"),
      input("<think>x</think> answer: 82 and more"),  // the whole completion must match
  };
  EXPECT_EQ(score(r, in), (std::vector<double>{1, 0, 0}));

  // A long completion (std::regex recurses per character; 100 000 would overflow an 8 MiB stack).
  std::string body(100000, 'a');
  EXPECT_EQ(score(r, {input("<think>" + body + "</think> answer: 1")}), (std::vector<double>{1}));
  std::string e = error_of([&] { r->score({input(std::string(1 << 19, 'a'))}); });
  EXPECT_TRUE(contains(e, "reward format: completion 0 has 524288 bytes")) << e;

  o.format = "";
  e = error_of([&] { pt::make_reward("format", o); });
  EXPECT_TRUE(contains(e, "format is empty")) << e;
  o.format = "<think>(";
  e = error_of([&] { pt::make_reward("format", o); });
  EXPECT_TRUE(contains(e, "reward format: format is not a valid ECMAScript regex \"<think>(\"")) << e;
}

TEST(Rewards, Length) {
  pt::RewardOptions o;
  o.length_target = 10;
  o.length_scale = 0.5;
  auto r = pt::make_reward("length", o);
  EXPECT_EQ(r->name(), "length");
  EXPECT_EQ(score(r, {input("", {}, 0), input("", {}, 10), input("", {}, 11), input("", {}, 30)}),
            (std::vector<double>{0, 0, -0.5, -10}));
  EXPECT_DOUBLE_EQ(score(pt::make_reward("length", {}), {input("", {}, 100)}).at(0), -1.0);  // defaults: 0, 0.01
  EXPECT_TRUE(contains(error_of([&] { r->score({input("", {}, -1)}); }), "completion_tokens -1"));
  o.length_target = -1;
  EXPECT_TRUE(contains(error_of([&] { pt::make_reward("length", o); }), "length_target"));
}

TEST(Rewards, OptionsAsJson) {
  auto o = dew::from_json<pt::RewardOptions>(json{{"format", "x"}, {"timeout_s", 2}});
  EXPECT_EQ(o.format, "x");
  EXPECT_EQ(o.timeout_s, 2);
  EXPECT_EQ(o.answer_field, "answer");
  EXPECT_EQ(dew::fields_of<pt::RewardOptions>().size(), 6u);
  EXPECT_TRUE(contains(error_of([] { dew::from_json<pt::RewardOptions>(json{{"formt", "x"}}); }), "unknown field"));
}

TEST(Rewards, MakeRewards) {
  pt::RewardOptions o;
  o.format = ".*";
  auto rs = pt::make_rewards("exact,format", "", o);
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_EQ(rs[0]->name(), "exact");
  EXPECT_EQ(rs[1]->name(), "format");
  rs = pt::make_rewards("length, exact", "cat", o);
  ASSERT_EQ(rs.size(), 3u);
  EXPECT_EQ(rs[0]->name(), "length");
  EXPECT_EQ(rs[1]->name(), "exact");
  EXPECT_EQ(rs[2]->name(), "command");
  rs = pt::make_rewards("", "cat", o);
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_EQ(rs[0]->name(), "command");
  EXPECT_EQ(pt::builtin_rewards(), (std::vector<std::string>{"exact", "format", "length"}));

  std::string e = error_of([&] { pt::make_rewards("exact,bleu", "", o); });
  EXPECT_TRUE(contains(e, "\"bleu\"")) << e;
  EXPECT_TRUE(contains(e, "exact, format, length")) << e;
  e = error_of([&] { pt::make_rewards("exact,exact", "", o); });
  EXPECT_TRUE(contains(e, "\"exact\" is named twice")) << e;
  for (std::string names : {"exact,,format", "exact,", ",exact"}) {
    e = error_of([&] { pt::make_rewards(names, "", o); });
    EXPECT_TRUE(contains(e, "an empty name")) << names << ": " << e;
  }
  e = error_of([&] { pt::make_rewards("", "", o); });
  EXPECT_TRUE(contains(e, "none given")) << e;
  e = error_of([&] { pt::make_rewards("format", "", {}); });  // format without a pattern
  EXPECT_TRUE(contains(e, "format is empty")) << e;
}

TEST(Rewards, CommandComputesFromJson) {
  // reward = len(completion) + 10 completion_tokens + answer, from the JSON lines it reads.
  std::string py =
      "/usr/bin/python3 -c 'import sys, json\n"
      "for line in sys.stdin:\n"
      "    d = json.loads(line)\n"
      "    assert d[\"prompt\"].startswith(\"Q:\")\n"
      "    print(len(d[\"completion\"]) + 10 * d[\"completion_tokens\"] + float(d[\"record\"][\"answer\"]))'";
  auto r = pt::make_command_reward(py, {});
  EXPECT_EQ(r->name(), "command");
  EXPECT_EQ(score(r, three()), (std::vector<double>{12, 24, 36}));
  EXPECT_TRUE(score(r, {}).empty());

  // Plain awk, an object per line; NR is the 1-based input index.
  auto obj = pt::make_command_reward("awk '{ printf \"{\\\"reward\\\": %g}\\n\", NR * 0.5 }'", {});
  EXPECT_EQ(score(obj, three()), (std::vector<double>{0.5, 1.0, 1.5}));
  // Numbers with spaces and a final line without a newline.
  auto sh = pt::make_command_reward("cat > /dev/null; printf ' 1\\n-2.5e1 \\n3'", {});
  EXPECT_EQ(score(sh, three()), (std::vector<double>{1, -25, 3}));
}

TEST(Rewards, CommandLargeBatch) {
  // 10 000 inputs (over 1 MB each way): stdin and stdout are served together, so no deadlock.
  std::vector<pt::RewardInput> many;
  for (int i = 0; i < 10000; ++i) many.push_back(input("completion " + std::to_string(i), {{"answer", i}}, i));
  auto r = pt::make_command_reward("awk '{ print NR }'", {});
  auto got = score(r, many);
  ASSERT_EQ(got.size(), 10000u);
  EXPECT_EQ(got.front(), 1);
  EXPECT_EQ(got.back(), 10000);
  // Invalid UTF-8 in a completion (a cut multi-byte character) is replaced, not an error.
  EXPECT_EQ(score(r, {input("caf\xc3")}), (std::vector<double>{1}));
}

TEST(Rewards, CommandErrors) {
  auto in = three();
  std::string e = command_error("cat > /dev/null; exit 3", in);
  EXPECT_EQ(e, "reward command \"cat > /dev/null; exit 3\": exit status 3");
  e = command_error("definitely-not-a-command-dew", in);
  EXPECT_TRUE(contains(e, "exit status 127 (command not found)")) << e;
  e = command_error("kill -9 $$", in);
  EXPECT_TRUE(contains(e, "killed by signal 9")) << e;
  e = command_error("cat > /dev/null; echo 1", in);
  EXPECT_TRUE(contains(e, "wrote 1 line for 3 inputs")) << e;
  e = command_error("awk '{ print 1; print 2 }'", in);
  EXPECT_TRUE(contains(e, "wrote 6 lines for 3 inputs")) << e;
  e = command_error("awk 'NR == 2 { print \"oops\"; next } { print 1 }'", in);
  EXPECT_TRUE(contains(e, "line 2 is not a number or an object with a numeric \"reward\": \"oops\"")) << e;
  e = command_error("awk '{ print \"{\\\"score\\\": 1}\" }'", in);
  EXPECT_TRUE(contains(e, "line 1 is not a number")) << e;
  e = command_error("awk 'NR == 3 { print \"" + std::string(200, 'x') + "\"; next } { print 1 }'", in);
  EXPECT_TRUE(contains(e, "line 3")) << e;
  EXPECT_LT(e.size(), 400u) << e;  // the line is cut
  e = command_error("awk '{ print \"nan\" }'", in);
  EXPECT_TRUE(contains(e, "line 1 has a non-finite reward: \"nan\"")) << e;
  e = command_error("awk 'NR == 2 { print \"-inf\"; next } { print 1 }'", in);
  EXPECT_TRUE(contains(e, "line 2 has a non-finite reward")) << e;
  // A multi-line command stays on one line in the message.
  e = command_error("cat > /dev/null\nexit 4", in);
  EXPECT_EQ(e, "reward command \"cat > /dev/null\\nexit 4\": exit status 4");

  pt::RewardOptions o;
  o.timeout_s = 0;
  EXPECT_TRUE(contains(error_of([&] { pt::make_command_reward("cat", o); }), "timeout_s must be > 0"));
  EXPECT_TRUE(contains(error_of([&] { pt::make_command_reward("  ", {}); }), "the command is empty"));
}

TEST(Rewards, CommandTimeout) {
  pt::RewardOptions o;
  o.timeout_s = 0.5;
  auto t0 = std::chrono::steady_clock::now();
  std::string e = command_error("sleep 5", three(), o);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(contains(e, "reward command \"sleep 5\": timed out after 0.5 s")) << e;
  EXPECT_LT(s, 2.0);
  // A child that keeps the output open after the shell is gone dies with the process group.
  t0 = std::chrono::steady_clock::now();
  e = command_error("cat > /dev/null; sleep 5 & echo 1", three(), o);
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(contains(e, "timed out")) << e;
  EXPECT_LT(s, 2.0);
}

TEST(Rewards, CommandThatDoesNotReadItsInput) {
  std::vector<pt::RewardInput> many;
  for (int i = 0; i < 10000; ++i) many.push_back(input("completion " + std::to_string(i), {{"answer", i}}, i));
  std::string e = command_error("exit 0", many);
  EXPECT_TRUE(contains(e, "wrote 0 lines for 10000 inputs")) << e;
  e = command_error("echo 1; exit 2", many);
  EXPECT_EQ(e, "reward command \"echo 1; exit 2\": exit status 2");
  // Still alive, and SIGPIPE is back as it was: not blocked in this thread.
  sigset_t mask;
  pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  EXPECT_FALSE(sigismember(&mask, SIGPIPE));
}
