// .npy / .npz (dew/io/npz.h) against files numpy wrote (tests/golden/fid/: np.savez and np.savez_compressed,
// tests/golden/fid_reference.py), round trips, numpy reading dew's files back, and malformed bytes.
#include <gtest/gtest.h>

#include "dew/io/npz.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace npz_test {

std::string golden_path(const std::string& name) { return std::string(DEW_SOURCE_DIR) + "/tests/golden/fid/" + name; }

void expect_arrays(const std::map<std::string, at::Tensor>& got, const std::string& what) {
  const auto g = dew::test::golden("fid/io.safetensors");
  for (const char* name : {"mu", "sigma", "f32", "i64", "fortran", "flags"}) {
    ASSERT_TRUE(got.count(name)) << what << " lacks " << name;
    const auto& want = g.at(std::string("npz.") + name);
    auto t = got.at(name);
    if (t.scalar_type() == at::kBool) t = t.to(at::kByte);
    EXPECT_EQ(t.scalar_type(), want.scalar_type()) << what << " " << name;
    EXPECT_TRUE(t.sizes() == want.sizes() && at::equal(t, want)) << what << " " << name;
  }
}

}  // namespace npz_test

TEST(Npz, ReadsNumpysSavezAndSavezCompressed) {
  for (const char* f : {"stats_savez.npz", "stats_savez_compressed.npz"})
    npz_test::expect_arrays(dew::io::read_npz(npz_test::golden_path(f)), f);
}

TEST(Npz, RoundTripsStoredAndCompressed) {
  const auto arrays = dew::io::read_npz(npz_test::golden_path("stats_savez.npz"));
  for (bool compressed : {false, true}) {
    const std::string bytes = dew::io::npz_bytes(arrays, compressed);
    npz_test::expect_arrays(dew::io::parse_npz(bytes, "round trip"), compressed ? "compressed" : "stored");
  }
  // A 0-d array and an empty one survive too.
  const auto back = dew::io::parse_npz(
      dew::io::npz_bytes({{"s", at::scalar_tensor(2.5, at::kDouble)}, {"e", at::zeros({0, 3})}}, true), "small");
  EXPECT_EQ(back.at("s").dim(), 0);
  EXPECT_EQ(back.at("s").item<double>(), 2.5);
  EXPECT_EQ(back.at("e").sizes(), (std::vector<int64_t>{0, 3}));
}

TEST(Npz, NumpyReadsDewsFiles) {
  if (std::system(DEW_PYTHON " -c 'import numpy' >/dev/null 2>&1") != 0) GTEST_SKIP() << "numpy is not available";
  dew::test::TempDir dir("npz_numpy");
  auto mu = at::arange(4, at::kDouble) / 3, sigma = at::eye(4, at::kDouble) * 2;
  for (bool compressed : {false, true}) {
    const std::string path = dir.file(compressed ? "c.npz" : "s.npz");
    dew::io::write_npz(path, {{"mu", mu}, {"sigma", sigma}}, compressed);
    const std::string cmd = std::string(DEW_PYTHON) + " -c \"import numpy as np; d = np.load('" + path +
                            "'); assert np.array_equal(d['mu'], np.arange(4) / 3); "
                            "assert np.array_equal(d['sigma'], 2 * np.eye(4))\"";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
}

TEST(Npz, MalformedBytesAreErrorsNeverCrashes) {
  for (const char* f : {"stats_savez.npz", "stats_savez_compressed.npz"}) {
    const std::string bytes = dew::test::read_bytes(npz_test::golden_path(f));
    ASSERT_FALSE(bytes.empty());
    // Every truncation.
    for (size_t n = 0; n < bytes.size(); ++n)
      EXPECT_FALSE(dew::test::error_of([&] { dew::io::parse_npz(std::string_view(bytes).substr(0, n), f); }).empty())
          << f << " cut at " << n;
    // Every byte changed: parsed (a field that does not matter) or a dew::Error, nothing else.
    for (size_t i = 0; i < bytes.size(); ++i) {
      std::string b = bytes;
      b[i] = char(b[i] ^ 0x5a);
      try {
        dew::io::parse_npz(b, f);
      } catch (const dew::Error&) {}
    }
  }
  EXPECT_NE(dew::test::error_of([] { dew::io::parse_npy("\x93NUMPY\x01\x00\x10\x00{'descr': '<c16'", "x"); }), "");
  EXPECT_NE(dew::test::error_of([] {
              dew::io::parse_npy(std::string("\x93NUMPY\x01\x00", 8) + std::string("\x46\x00", 2) +
                                     "{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999,), }" +
                                     std::string(4, ' ') + "\n",
                                 "huge");
            }),
            "");
}
