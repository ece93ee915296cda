// The reference-parity suite: every golden model folder under tests/golden/ (config.json with its
// `_class_name` or transformers' `architectures`, the reference's weights, io.safetensors with the inputs and
// the reference's float32 and float64 outputs, and parity.json naming the cases) is loaded as a user's folder
// through the family table (interop::load_diffusers_folder) and run through the generic forward
// (interop::diffusers_forward, what `dew forward` runs). Each output obeys rms(dew - f64) <= 2 rms(ref_f32 -
// f64); a float64 load agrees with the float64 truth to the folder's float64_rel. A family with a reference class and a golden folder but no
// passing case fails here, and so does a golden folder without parity.json.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "dew/interop/diffusers_forward.h"
#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "tests/golden_util.h"

namespace fs = std::filesystem;
using dew::json;

namespace {

const fs::path kGolden = fs::path(DEW_SOURCE_DIR) / "tests" / "golden";

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// Golden model folders: those holding config.json and io.safetensors (pipeline components, whose tensors
// live in the pipeline's own file, hold no io.safetensors).
std::vector<std::string> golden_folders() {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(kGolden))
    if (e.is_directory() && fs::exists(e.path() / "config.json") && fs::exists(e.path() / "io.safetensors"))
      out.push_back(fs::relative(e.path(), kGolden).string());
  std::sort(out.begin(), out.end());
  return out;
}

// The reference input name -> io.safetensors name of a case (a list names both alike).
std::map<std::string, std::string> case_inputs(const json& c) {
  std::map<std::string, std::string> m;
  if (c.at("inputs").is_array())
    for (const auto& n : c.at("inputs")) m[n.get<std::string>()] = n.get<std::string>();
  else
    for (auto it = c.at("inputs").begin(); it != c.at("inputs").end(); ++it)
      m[it.key()] = it.value().get<std::string>();
  return m;
}

class ReferenceParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceParity, EveryCaseObeysTheGoldenRuleInFloat32AndAgreesInFloat64) {
  const fs::path folder = kGolden / GetParam();
  ASSERT_TRUE(fs::exists(folder / "parity.json")) << folder << ": a golden folder needs parity.json naming its cases";
  const json parity = read_json(folder / "parity.json");
  const auto io = dew::io::load_safetensors((folder / "io.safetensors").string());
  ASSERT_FALSE(parity.at("cases").empty()) << folder;
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    dew::interop::DiffusersLoadOptions o;
    o.dtype = dtype;
    const auto model = dew::interop::load_diffusers_folder(folder.string(), o);
    // Every tensor of the checkpoint loaded, none left at initialisation.
    EXPECT_TRUE(model.report.unexpected.empty()) << model.report.summary();
    EXPECT_TRUE(model.report.kept.empty()) << model.report.summary();
    // Every parameter loaded (the loaded buffers a checkpoint carries, e.g. SD3's position table, come on top).
    const std::set<std::string> loaded(model.report.loaded.begin(), model.report.loaded.end());
    for (const auto& p : model.module->named_parameters())
      EXPECT_TRUE(loaded.count(p.key())) << p.key() << " not loaded: " << model.report.summary();
    for (const auto& p : model.module->parameters()) ASSERT_EQ(p.scalar_type(), dtype);
    std::printf("%s: %s as %s (%s)\n", GetParam().c_str(), model.class_name.c_str(), model.family.c_str(),
                dtype == at::kFloat ? "float32" : "float64");
    for (const auto& c : parity.at("cases")) {
      const std::string method = c.at("method");
      std::map<std::string, at::Tensor> inputs;
      for (const auto& [ref, name] : case_inputs(c)) {
        ASSERT_TRUE(io.count(name)) << folder << ": io.safetensors has no " << name;
        inputs[ref] = io.at(name);
      }
      const auto out = dew::interop::diffusers_forward(model, inputs, method);
      for (auto it = c.at("outputs").begin(); it != c.at("outputs").end(); ++it) {
        const std::string what = GetParam() + " " + method + " " + it.key();
        const std::string name = it.value();
        ASSERT_TRUE(out.count(it.key())) << what << ": not an output of " << method;
        ASSERT_TRUE(io.count(name + "_f32") && io.count(name + "_f64")) << what << ": io.safetensors lacks " << name;
        if (dtype == at::kFloat) {
          EXPECT_EQ(out.at(it.key()).scalar_type(), at::kFloat) << what;
          dew::test::expect_golden(what, out.at(it.key()), io.at(name + "_f32"), io.at(name + "_f64"));
        } else {
          EXPECT_EQ(out.at(it.key()).scalar_type(), at::kDouble) << what;
          dew::test::expect_close_f64(what + " (float64)", out.at(it.key()), io.at(name + "_f64"),
                                      parity.at("float64_rel").get<double>());
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, ReferenceParity, ::testing::ValuesIn(golden_folders()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(ReferenceParitySuite, EveryReferenceClassOfTheFamilyTableHasAGoldenFolder) {
  // A family that imports a diffusers (or transformers) class is covered by at least one golden folder of that
  // class.
  std::set<std::string> covered;
  for (const auto& f : golden_folders())
    covered.insert(dew::interop::reference_class_of(read_json(kGolden / f / "config.json")));
  for (const auto& [cls, family] : dew::interop::diffusers_classes())
    EXPECT_TRUE(covered.count(cls)) << cls << " (" << family << ") has no golden folder under tests/golden/";
  EXPECT_EQ(covered.size(), dew::interop::diffusers_classes().size());
}

}  // namespace
