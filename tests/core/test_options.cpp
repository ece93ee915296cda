#include <gtest/gtest.h>

#include "tests/test_util.h"

#include "dew/core/registry.h"
#include "dew/core/rng.h"
#include "dew/runs/registries.h"

namespace {

struct Inner {
  double lr = 0.1;
  template <class V>
  void visit(V& v) {
    v("lr", lr, "learning rate");
  }
};

struct Opts {
  int64_t layers = 4;
  double ratio = 2.5;
  bool flag = false;
  std::string mode = "a";
  std::vector<int64_t> depths{1, 2};
  std::optional<double> gamma;
  std::pair<double, double> interval{0.0, 1.0};
  Inner inner;
  template <class V>
  void visit(V& v) {
    v("layers", layers, "number of layers");
    v("ratio", ratio, "a ratio");
    v("flag", flag, "a flag");
    v.choice("mode", mode, {"a", "b"}, "a mode");
    v("depths", depths, "per-level depths");
    v("gamma", gamma, "optional");
    v("interval", interval, "pair");
    v("inner", inner, "nested");
  }
};

using dew::json;
using dew::test::error_of;

}  // namespace

TEST(Options, RoundTripKeepsEveryField) {
  Opts o;
  o.layers = 7;
  o.gamma = 5.0;
  o.depths = {3, 4, 5};
  o.inner.lr = 0.25;
  o.mode = "b";
  auto j = dew::to_json(o);
  EXPECT_EQ(j["layers"], 7);
  EXPECT_EQ(j["gamma"], 5.0);
  EXPECT_EQ(j["inner"]["lr"], 0.25);
  auto back = dew::from_json<Opts>(j);
  EXPECT_EQ(back.layers, 7);
  EXPECT_EQ(*back.gamma, 5.0);
  EXPECT_EQ(back.depths, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(back.inner.lr, 0.25);
  EXPECT_EQ(back.mode, "b");
  EXPECT_EQ(dew::to_json(back), j);
}

TEST(Options, MissingFieldsTakeDefaults) {
  auto o = dew::from_json<Opts>(dew::json{{"ratio", 3}});
  EXPECT_EQ(o.layers, 4);
  EXPECT_EQ(o.ratio, 3.0);  // an integer is accepted for a float field
  EXPECT_FALSE(o.gamma.has_value());
}

TEST(Options, UnknownFieldNamesTheValidOnes) {
  auto msg = error_of([] { dew::from_json<Opts>(dew::json{{"layerz", 3}}, "model"); });
  EXPECT_NE(msg.find("unknown field \"layerz\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("layers"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model"), std::string::npos) << msg;
  auto nested = error_of([] { dew::from_json<Opts>(dew::json{{"inner", {{"lrr", 1}}}}); });
  EXPECT_NE(nested.find("inner"), std::string::npos) << nested;
  EXPECT_NE(nested.find("lr"), std::string::npos) << nested;
}

TEST(Options, WrongTypesAreNamed) {
  auto m1 = error_of([] { dew::from_json<Opts>(dew::json{{"layers", "four"}}); });
  EXPECT_NE(m1.find("layers: expected an integer, got string \"four\""), std::string::npos) << m1;
  auto m2 = error_of([] { dew::from_json<Opts>(dew::json{{"layers", 2.5}}); });
  EXPECT_NE(m2.find("layers"), std::string::npos) << m2;
  auto m3 = error_of([] { dew::from_json<Opts>(dew::json{{"flag", 1}}); });
  EXPECT_NE(m3.find("flag: expected bool"), std::string::npos) << m3;
  auto m4 = error_of([] { dew::from_json<Opts>(dew::json{{"depths", {1, "x"}}}); });
  EXPECT_NE(m4.find("depths[1]"), std::string::npos) << m4;
  auto m5 = error_of([] { dew::from_json<Opts>(dew::json{{"mode", "c"}}); });
  EXPECT_NE(m5.find("accepted: a, b"), std::string::npos) << m5;
  auto m6 = error_of([] { dew::from_json<Opts>(dew::json{{"interval", {1}}}); });
  EXPECT_NE(m6.find("interval"), std::string::npos) << m6;
}

TEST(Options, FieldListingHasTypesAndDefaults) {
  auto f = dew::fields_of<Opts>();
  ASSERT_EQ(f.size(), 8u);
  EXPECT_EQ(f[0].name, "layers");
  EXPECT_EQ(f[0].type, "int");
  EXPECT_EQ(f[0].default_value, 4);
  EXPECT_EQ(f[3].choices, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(f[4].type, "list[int]");
  EXPECT_EQ(f[5].type, "float | null");
  EXPECT_EQ(f[6].type, "[float, float]");
  auto text = dew::format_fields(f);
  EXPECT_NE(text.find("layers"), std::string::npos);
  EXPECT_NE(text.find("number of layers"), std::string::npos);
}

namespace {
struct WithSection {
  int64_t steps = 1;
  dew::Omittable<Inner> section;
  template <class V>
  void visit(V& v) {
    v("steps", steps, "steps");
    v("section", section, "written only when present");
  }
};
}  // namespace

TEST(Options, OmittableFieldsAreLeftOutWhenEmptyAndReadAbsentOrNullAsEmpty) {
  WithSection w;
  EXPECT_EQ(dew::to_json(w), (json{{"steps", 1}}));  // no "section" key, not null
  EXPECT_FALSE(dew::from_json<WithSection>(json{{"steps", 2}}).section.has_value());
  EXPECT_FALSE(dew::from_json<WithSection>(json{{"section", nullptr}}).section.has_value());
  const auto read = dew::from_json<WithSection>(json{{"section", {{"lr", 0.5}}}});
  ASSERT_TRUE(read.section.has_value());
  EXPECT_EQ(read.section->lr, 0.5);
  EXPECT_EQ(dew::to_json(read), (json{{"steps", 1}, {"section", {{"lr", 0.5}}}}));
  w.section = Inner{};
  EXPECT_EQ(dew::to_json(w)["section"], (json{{"lr", 0.1}}));
  w.section.reset();
  EXPECT_FALSE(dew::to_json(w).contains("section"));
  // Inside the section, fields are checked as everywhere.
  const std::string msg = error_of([] { dew::from_json<WithSection>(json{{"section", {{"lr", "x"}}}}); });
  EXPECT_NE(msg.find("section.lr: expected a number"), std::string::npos) << msg;
  EXPECT_EQ(dew::fields_of<WithSection>()[1].type, "object | absent");
}

namespace {
struct Thing {
  virtual ~Thing() = default;
  int64_t value = 0;
};
struct ThingOpts {
  int64_t value = 1;
  template <class V>
  void visit(V& v) {
    v("value", value, "the value");
  }
};
}  // namespace

TEST(Registry, BuildsByNameListsAndRejects) {
  dew::Registry<Thing> r("thing");
  r.add<ThingOpts>("a", "first", [](const ThingOpts& o) {
    auto t = std::make_shared<Thing>();
    t->value = o.value;
    return t;
  });
  EXPECT_EQ(r.build("a", dew::json::object())->value, 1);
  EXPECT_EQ(r.build(dew::json{{"name", "a"}, {"value", 9}})->value, 9);
  EXPECT_EQ(r.build(dew::json("a"))->value, 1);
  auto unknown = error_of([&] { r.build("b", dew::json::object()); });
  EXPECT_NE(unknown.find("unknown thing \"b\"; registered: a"), std::string::npos) << unknown;
  auto field = error_of([&] { r.build(dew::json{{"name", "a"}, {"valu", 9}}); });
  EXPECT_NE(field.find("thing \"a\": unknown field \"valu\"; valid fields: value"), std::string::npos) << field;
  ASSERT_EQ(r.entries().size(), 1u);
  EXPECT_EQ(r.entries()[0].fields[0].default_value, 1);
}

TEST(Registry, LibraryRegistriesAreListed) {
  auto all = dew::all_registries();
  std::set<std::string> kinds;
  for (auto* r : all) kinds.insert(r->kind());
  EXPECT_EQ(kinds.size(), all.size()) << "one registry per kind";
  for (auto k :
       {"model", "language_model", "text_encoder", "encoder", "predictor", "autoencoder", "dataset", "lm_dataset",
        "tokenizer", "preset", "schedule", "transform", "weighting", "solver", "objective", "metric"})
    EXPECT_TRUE(kinds.count(k)) << k;
  for (auto* r : all) EXPECT_FALSE(r->entries().empty()) << r->kind();
}

TEST(Rng, DerivationSeparatesSeedStepAndPurpose) {
  auto a = dew::rng::derive(1, 0, "noise");
  EXPECT_EQ(a, dew::rng::derive(1, 0, "noise"));
  EXPECT_NE(a, dew::rng::derive(2, 0, "noise"));
  EXPECT_NE(a, dew::rng::derive(1, 1, "noise"));
  EXPECT_NE(a, dew::rng::derive(1, 0, "data"));
  auto g1 = dew::rng::generator(7, 3, "x");
  auto g2 = dew::rng::generator(7, 3, "x");
  auto g3 = dew::rng::generator(7, 4, "x");
  auto t1 = at::randn({64}, g1);
  EXPECT_TRUE(at::equal(t1, at::randn({64}, g2)));
  EXPECT_FALSE(at::equal(t1, at::randn({64}, g3)));
  // Streams of neighbouring steps are uncorrelated.
  auto corr = (t1 * at::randn({64}, dew::rng::generator(7, 4, "x"))).mean().item<double>();
  EXPECT_LT(std::abs(corr), 0.5);
}
