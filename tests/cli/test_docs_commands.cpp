// The commands in README.md and docs/ run as written: every fenced shell line that calls `build/dew` names
// a real command (its --help answers) and only flags that command's --help lists (a train kind's recipe
// fields included). Nothing long is run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

struct DocCommand {
  std::string file;
  std::string line;
};

// Splits like a shell: words, with '...' and "..." quoting; stops at an unquoted # (a comment).
std::vector<std::string> shell_words(const std::string& line) {
  std::vector<std::string> out;
  std::string word;
  bool in_word = false;
  char quote = 0;
  for (char c : line) {
    if (quote) {
      if (c == quote) quote = 0;
      else word += c;
    } else if (c == '\'' || c == '"') {
      quote = c;
      in_word = true;
    } else if (c == '#' && !in_word) {
      break;
    } else if (c == ' ' || c == '\t') {
      if (in_word) out.push_back(word);
      word.clear();
      in_word = false;
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) out.push_back(word);
  return out;
}

// Every line of a fenced block (continuation lines joined) that runs dew, from README.md and docs/.
std::vector<DocCommand> doc_commands() {
  std::vector<fs::path> files{fs::path(DEW_SOURCE_DIR) / "README.md"};
  for (const auto& e : fs::recursive_directory_iterator(fs::path(DEW_SOURCE_DIR) / "docs"))
    if (e.path().extension() == ".md") files.push_back(e.path());
  std::vector<DocCommand> out;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string line, joined;
    bool fenced = false;
    while (std::getline(in, line)) {
      if (line.rfind("```", 0) == 0) {
        fenced = !fenced;
        continue;
      }
      if (!fenced) continue;
      if (!line.empty() && line.back() == '\\') {
        joined += line.substr(0, line.size() - 1) + " ";
        continue;
      }
      joined += line;
      const auto words = shell_words(joined);
      if (!words.empty() && (words[0] == "build/dew" || words[0] == "dew"))
        out.push_back({fs::relative(f, DEW_SOURCE_DIR).string(), joined});
      joined.clear();
    }
  }
  return out;
}

TEST(DocsCommands, EveryDocumentedCommandAndFlagExists) {
  const auto commands = doc_commands();
  ASSERT_GE(commands.size(), 60u);
  std::map<std::string, dew::test::CliResult> helps;
  const std::regex flag_re("--([a-z0-9][a-z0-9_.-]*)");
  for (const auto& c : commands) {
    SCOPED_TRACE(c.file + ": " + c.line);
    auto words = shell_words(c.line);
    EXPECT_EQ(words[0], "build/dew") << "docs call the program as README does: build/dew";
    ASSERT_GE(words.size(), 2u);
    std::string key = words[1];
    if ((key == "train" || key == "tune" || key == "task") && words.size() > 2 && words[2].rfind("--", 0) != 0)
      key += " " + words[2];
    auto it = helps.find(key);
    if (it == helps.end()) it = helps.emplace(key, dew::test::run_dew(key + " --help")).first;
    const auto& help = it->second;
    ASSERT_EQ(help.code, 0) << "dew " << key << " --help:\n" << help.output;
    const bool recipe = key.rfind("train ", 0) == 0;
    for (size_t i = 2; i < words.size(); ++i) {
      for (std::sregex_iterator m(words[i].begin(), words[i].end(), flag_re), end; m != end; ++m) {
        if (words[i].rfind("--", 0) != 0 && words[i].rfind("[--", 0) != 0) continue;  // a value, not a flag
        std::string flag = (*m)[1];
        if (flag == "help" || (recipe && flag == "config")) continue;
        // A recipe path is listed as a leaf ("--trainer.steps 1000") or, for free-form objects, one level up.
        bool found = false;
        for (std::string f = flag; !found && !f.empty();) {
          const std::regex listed("(^|[^a-z0-9_.-])--" + std::regex_replace(f, std::regex("\\."), "\\.") +
                                  "([^a-z0-9_-]|$)");
          found = std::regex_search(help.output, listed);
          const auto dot = f.rfind('.');
          if (!recipe || dot == std::string::npos || f != flag) break;
          f = f.substr(0, dot);
        }
        EXPECT_TRUE(found) << "--" << flag << " is not a flag of dew " << key;
      }
    }
  }
}

}  // namespace
