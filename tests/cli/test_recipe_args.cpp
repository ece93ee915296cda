// Recipes on the command line (dew/cli/recipe_args.h): --config files and --a.b values over a kind's defaults.
#include <gtest/gtest.h>

#include "dew/cli/recipe_args.h"
#include "dew/runs/run.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

TEST(RecipeArgs, AnObjectForASectionSetsItsKeysAndKeepsTheOthers) {
  const json defaults = dew::runs::default_recipe("lm");
  const std::vector<std::string> open = dew::runs::run_kind("lm").open_keys;
  // lm's trainer defaults differ from TrainerOptions{}: an object for the section must not drop them.
  const json r = dew::cli::parse_recipe_args(defaults, {"--trainer", R"({"steps": 7})"}, open).recipe;
  json expected = defaults;
  expected["trainer"]["steps"] = 7;
  EXPECT_EQ(r, expected);
  EXPECT_NE(defaults["trainer"]["val_every"], json(dew::training::TrainerOptions{}.val_every));
  // The same as the dotted flag and as a --config file.
  EXPECT_EQ(dew::cli::parse_recipe_args(defaults, {"--trainer.steps", "7"}, open).recipe, r);
  const std::string msg = error_of([&] {
    dew::cli::parse_recipe_args(defaults, {"--trainer", R"({"stepz": 7})"}, open);
  });
  EXPECT_NE(msg.find("--trainer: unknown key \"trainer.stepz\"; valid: "), std::string::npos) << msg;
  // An open object's value is replaced whole.
  const json d = dew::cli::parse_recipe_args(defaults, {"--data", R"({"name": "tokens", "dir": "t"})"}, open).recipe;
  EXPECT_EQ(d["data"], (json{{"name", "tokens"}, {"dir", "t"}}));
}

TEST(RecipeArgs, ValuesAndKeysThatAreNotUtf8AreRefusedByFlag) {
  const json defaults = dew::runs::default_recipe("diffusion");
  const std::vector<std::string> open = dew::runs::run_kind("diffusion").open_keys;
  const std::string latin1 = "runs/\xe9t\xe9";  // "runs/été" in Latin-1
  std::string msg = error_of([&] { dew::cli::parse_recipe_args(defaults, {"--run", latin1}, open); });
  EXPECT_NE(msg.find("--run: not valid UTF-8 (invalid UTF-8 byte at index 6: 0x74)"), std::string::npos) << msg;
  msg = error_of([&] { dew::cli::parse_recipe_args(defaults, {"--model.fields.\xe9", "1"}, open); });
  EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
  // UTF-8 is taken as it is.
  EXPECT_EQ(dew::cli::parse_recipe_args(defaults, {"--run", "runs/\xc3\xa9t\xc3\xa9"}, open).recipe["run"],
            "runs/\xc3\xa9t\xc3\xa9");
}
