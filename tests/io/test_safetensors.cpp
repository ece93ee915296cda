// safetensors reader and writer: round trips, the byte layout checked against hand-built bytes, and a
// table of malformed files that must each be refused with a dew::Error saying what is wrong.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"
#include "tests/test_util.h"

namespace {

using dew::io::Dtype;
using dew::io::SafetensorsFile;

// A fresh path under the test temp dir, unique per test and process.
std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "dew_st_" + info->name() + "_" + std::to_string(::getpid()) + "_" + name;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

using dew::test::read_bytes;

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// The 8-byte little-endian length field, written byte by byte (independent of the library).
std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A whole file: length field, header text, data bytes.
std::string file_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Runs f and expects a dew::Error whose message contains every one of `words`.
template <class F>
void expect_error(F f, const std::vector<std::string>& words, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no dew::Error thrown; expected one mentioning '" << words.front() << "'";
  } catch (const dew::Error& e) {
    const std::string msg = e.what();
    for (const auto& w : words)
      EXPECT_NE(msg.find(w), std::string::npos) << what << ": message lacks '" << w << "':\n  " << msg;
  }
}

void expect_bitwise_equal(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes().vec(), b.sizes().vec()) << what;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  ASSERT_EQ(ca.nbytes(), cb.nbytes()) << what;
  if (ca.nbytes() > 0) {
    EXPECT_EQ(0, std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes())) << what;
  }
}

// Random values of `type` with shape `shape`, from an explicit generator.
at::Tensor random_tensor(at::ScalarType type, at::IntArrayRef shape, at::Generator& gen) {
  switch (type) {
    case at::kDouble:
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16: return at::randn(shape, gen, at::kDouble).mul(100).to(type);
    case at::kBool: return at::randint(0, 2, shape, gen, at::kLong).to(type);
    case at::kByte: return at::randint(0, 256, shape, gen, at::kLong).to(type);
    case at::kChar: return at::randint(-128, 128, shape, gen, at::kLong).to(type);
    default: return at::randint(-100000, 100000, shape, gen, at::kLong).to(type);
  }
}

const std::vector<at::ScalarType> kTypes = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                            at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};

TEST(Safetensors, DtypeTable) {
  EXPECT_EQ(dew::io::dtype_size(Dtype::F64), 8u);
  EXPECT_EQ(dew::io::dtype_size(Dtype::BF16), 2u);
  EXPECT_EQ(dew::io::dtype_size(Dtype::BOOL), 1u);
  EXPECT_STREQ(dew::io::dtype_name(Dtype::BF16), "BF16");
  EXPECT_EQ(dew::io::dtype_from_string("I16", "test"), Dtype::I16);
  for (at::ScalarType t : kTypes) EXPECT_EQ(dew::io::scalar_type(dew::io::dtype_of(t, "test")), t) << c10::toString(t);
  expect_error([] { dew::io::dtype_of(at::kComplexFloat, "tensor x"); }, {"tensor x", "ComplexFloat", "BFloat16"},
               "complex dtype");
}

TEST(Safetensors, RoundTripEveryDtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {3, 0, 2}, {1}, {7}, {2, 3, 5}};
  std::map<std::string, at::Tensor> tensors;
  for (at::ScalarType type : kTypes) {
    for (size_t s = 0; s < shapes.size(); ++s)
      tensors[std::string(c10::toString(type)) + "/" + std::to_string(s)] = random_tensor(type, shapes[s], gen);
    // A transposed (non-contiguous) tensor is stored in its logical row-major order.
    tensors[std::string(c10::toString(type)) + "/t"] = random_tensor(type, {4, 3}, gen).t();
  }
  // Float edge values must survive bit for bit: NaN, -0, infinities, denormals.
  tensors["edge_f32"] = at::tensor({std::nanf(""), -0.0f, INFINITY, -INFINITY, 1e-45f}, at::kFloat);

  const std::string path = temp_path("all.safetensors");
  dew::io::save_safetensors(path, tensors);
  EXPECT_FALSE(exists(path + ".tmp"));
  const auto loaded = dew::io::load_safetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.count(name)) << name;
    expect_bitwise_equal(loaded.at(name), t, name);
  }
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names().size(), tensors.size());
  EXPECT_TRUE(f.contains("Float/0"));
  EXPECT_FALSE(f.contains("Float/99"));
  EXPECT_EQ(f.tensor("Half/0").dim(), 0);  // 0-d stays 0-d, not [1]
  EXPECT_TRUE(f.metadata().empty());
  ::unlink(path.c_str());
}

TEST(Safetensors, MetadataRoundTrip) {
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"empty", ""}, {"unicode", "\xc3\xa9t\xc3\xa9 \xe2\x9c\x93"}, {"quote\"nl\n", "{\"json\": 1}"}};
  const std::string path = temp_path("meta.safetensors");
  dew::io::save_safetensors(path, {{"x", at::ones({2}, at::kFloat)}}, meta);
  EXPECT_EQ(SafetensorsFile::open(path).metadata(), meta);
  // Metadata alone, no tensors, is a valid file too.
  dew::io::save_safetensors(path, {}, meta);
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_TRUE(f.names().empty());
  ::unlink(path.c_str());
}

TEST(Safetensors, ZeroCopyEqualsCopy) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::map<std::string, at::Tensor> tensors;
  for (at::ScalarType type : kTypes) tensors[c10::toString(type)] = random_tensor(type, {3, 5}, gen);
  const std::string path = temp_path("zc.safetensors");
  dew::io::save_safetensors(path, tensors);

  std::map<std::string, at::Tensor> views;
  {
    const auto f = SafetensorsFile::open(path);
    for (const auto& name : f.names()) {
      const at::Tensor view = f.tensor(name, /*copy=*/false);
      expect_bitwise_equal(view, f.tensor(name, /*copy=*/true), name);
      // The writer aligns every tensor, so each view aliases the mapping: two views share memory.
      EXPECT_EQ(view.data_ptr(), f.tensor(name, false).data_ptr()) << name;
      EXPECT_NE(view.data_ptr(), f.tensor(name, true).data_ptr()) << name;
      views[name] = view;
    }
  }
  // The views keep the mapping alive after the SafetensorsFile is gone.
  for (const auto& [name, v] : views) expect_bitwise_equal(v, tensors.at(name), name + " after close");

  // Writes to a view are private (copy-on-write) and never reach the file.
  const std::string before = read_bytes(path);
  views.at("Float").fill_(42.0f);
  EXPECT_EQ(read_bytes(path), before);
  expect_bitwise_equal(SafetensorsFile::open(path).tensor("Float"), tensors.at("Float"), "file after view write");

  // Saving over the mapped file replaces it by rename: the live views still see the old bytes.
  dew::io::save_safetensors(path, {{"Float", at::zeros({3, 5}, at::kFloat)}});
  expect_bitwise_equal(views.at("Double"), tensors.at("Double"), "view after overwrite");
  EXPECT_EQ(dew::io::load_safetensors(path).at("Float").sum().item<float>(), 0.0f);
  ::unlink(path.c_str());
}

// The layout written by hand from the format description, so reader and writer are not only checked
// against each other.
TEST(Safetensors, HandBuiltFileReads) {
  // 1.5f = 0x3FC00000, -2.0f = 0xC0000000, int16 258 = 0x0102, -1 = 0xFFFF, bool 1 0 1.
  const std::string data = std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8) + std::string("\x02\x01\xff\xff", 4) +
                           std::string("\x01\x00\x01", 3);
  // Deliberately unpadded: data starts at an odd offset, so zero-copy must fall back to copies.
  const std::string header = R"({"b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]},)"
                             R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("m":{"data_offsets":[12,15],"shape":[3],"dtype":"BOOL"},)"
                             R"("__metadata__":{"k":"v"}})";
  ASSERT_EQ((8 + header.size()) % 2, 1u) << "the data section should start at an odd offset";
  const std::string path = temp_path("hand.safetensors");
  write_bytes(path, file_bytes(header, data));

  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.header().data_start, 8 + header.size());
  EXPECT_EQ(f.header().data_size, data.size());
  ASSERT_EQ(f.header().tensors.size(), 3u);
  EXPECT_EQ(f.header().tensors[0].name, "a");  // data order
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b", "m"}));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"k", "v"}}));
  for (bool copy : {true, false}) {
    const at::Tensor a = f.tensor("a", copy), b = f.tensor("b", copy), m = f.tensor("m", copy);
    EXPECT_EQ(a.scalar_type(), at::kFloat);
    EXPECT_EQ(a.sizes().vec(), std::vector<int64_t>({2}));
    EXPECT_EQ(a[0].item<float>(), 1.5f);
    EXPECT_EQ(a[1].item<float>(), -2.0f);
    EXPECT_EQ(b.scalar_type(), at::kShort);
    EXPECT_EQ(b.sizes().vec(), std::vector<int64_t>({1, 2}));
    EXPECT_EQ(b[0][0].item<int16_t>(), 258);
    EXPECT_EQ(b[0][1].item<int16_t>(), -1);
    EXPECT_EQ(m.scalar_type(), at::kBool);
    EXPECT_TRUE(m[0].item<bool>());
    EXPECT_FALSE(m[1].item<bool>());
    EXPECT_TRUE(m[2].item<bool>());
  }
  ::unlink(path.c_str());
}

// The writer's bytes, decoded here without the library's reader.
TEST(Safetensors, WrittenByteLayout) {
  const std::string path = temp_path("layout.safetensors");
  dew::io::save_safetensors(path,
                            {{"z", at::tensor({1.5f, -2.0f}, at::kFloat)},
                             {"a", at::tensor({int16_t(258), int16_t(-1), int16_t(3)}, at::kShort)},
                             {"d", at::tensor({0.5}, at::kDouble)}},
                            {{"format", "pt"}});
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<uint8_t>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "header padded to a multiple of 8";
  ASSERT_LE(8 + n, bytes.size());
  const std::string text = bytes.substr(8, n);
  const size_t last = text.find_last_not_of(' ');
  EXPECT_EQ(text[last], '}');
  const auto h = nlohmann::json::parse(text);
  EXPECT_EQ(h["__metadata__"], nlohmann::json({{"format", "pt"}}));
  // Largest elements first, then names: d (8 bytes), z (4), a (2): each start is a multiple of its size.
  EXPECT_EQ(h["d"]["dtype"], "F64");
  EXPECT_EQ(h["d"]["data_offsets"], nlohmann::json::array({0, 8}));
  EXPECT_EQ(h["z"]["dtype"], "F32");
  EXPECT_EQ(h["z"]["shape"], nlohmann::json::array({2}));
  EXPECT_EQ(h["z"]["data_offsets"], nlohmann::json::array({8, 16}));
  EXPECT_EQ(h["a"]["dtype"], "I16");
  EXPECT_EQ(h["a"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(h["a"]["data_offsets"], nlohmann::json::array({16, 22}));
  const std::string data = bytes.substr(8 + n);
  EXPECT_EQ(data, std::string("\x00\x00\x00\x00\x00\x00\xe0\x3f", 8) +
                      std::string("\x00\x00\xc0\x3f\x00\x00\x00\xc0", 8) + std::string("\x02\x01\xff\xff\x03\x00", 6));
  ::unlink(path.c_str());
}

struct BadFile {
  const char* what;
  std::string bytes;
  std::vector<std::string> words;  // each must appear in the error message
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b, uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(b) + "," + std::to_string(e) + "]}";
}

TEST(Safetensors, MalformedFilesAreRefused) {
  const std::string d8(8, '\0'), d12(12, '\0');
  const std::vector<BadFile> cases = {
      {"empty file", "", {"truncated", "0 bytes"}},
      {"truncated file", std::string("\x10\x00\x00", 3), {"truncated", "3 bytes"}},
      {"header length past end", le64(1000) + "{}" + d8, {"past the end", "1000"}},
      {"absurd header length", le64(uint64_t(1) << 40) + "{}", {"absurd", "1099511627776"}},
      {"non-JSON header", file_bytes("{\"a\": nope", ""), {"not valid JSON"}},
      {"header not an object", file_bytes("[1, 2]", ""), {"JSON object", "list"}},
      {"entry not an object", file_bytes("{\"a\": 3}", ""), {"\"a\"", "must be an object"}},
      {"unknown dtype",
       file_bytes("{" + entry("w", "F8_E4M3", "[2]", 0, 2) + "}", std::string(2, '\0')),
       {"unknown dtype", "F8_E4M3", "\"w\"", "BF16"}},
      {"dtype not a string",
       file_bytes(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')),
       {"dtype", "must be a string", "int 4"}},
      {"unknown field",
       file_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", std::string(4, '\0')),
       {"unknown field", "\"x\""}},
      {"missing field", file_bytes(R"({"w":{"dtype":"F32","shape":[1]}})", ""), {"missing field", "data_offsets"}},
      {"negative dimension", file_bytes("{" + entry("w", "F32", "[-2]", 0, 8) + "}", d8), {"shape", ">= 0", "-2"}},
      {"float dimension", file_bytes("{" + entry("w", "F32", "[2.0]", 0, 8) + "}", d8), {"shape", "float"}},
      {"shape x dtype size mismatch",
       file_bytes("{" + entry("w", "F32", "[3]", 0, 8) + "}", d8),
       {"size mismatch", "12 bytes", "8 bytes", "\"w\""}},
      {"out-of-range offsets",
       file_bytes("{" + entry("w", "F32", "[4]", 0, 16) + "}", d8),
       {"out of range", "16", "8 bytes"}},
      {"reversed offsets", file_bytes("{" + entry("w", "U8", "[0]", 8, 0) + "}", d8), {"reversed", "[8, 0]"}},
      {"negative offset",
       file_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", d8),
       {"data_offsets", ">= 0", "-1"}},
      {"offsets not a pair",
       file_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", d8),
       {"data_offsets", "two integers"}},
      {"overlapping offsets",
       file_bytes("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}", d12),
       {"overlap", "\"a\"", "\"b\""}},
      {"gap between tensors",
       file_bytes("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) + "}", d12),
       {"gap", "[4, 8)"}},
      {"trailing bytes", file_bytes("{" + entry("a", "F32", "[1]", 0, 4) + "}", d8), {"cover", "8 bytes"}},
      {"absurd shape overflow",
       file_bytes("{" + entry("w", "F32", "[4611686018427387904, 4611686018427387904]", 0, 4) + "}",
                  std::string(4, '\0')),
       {"overflow", "4611686018427387904"}},
      {"overflow hidden by a zero dimension",
       file_bytes("{" + entry("w", "F32", "[0, 4611686018427387904, 4]", 0, 0) + "}", ""),
       {"overflow"}},
      {"byte size overflow",
       file_bytes("{" + entry("w", "F64", "[4611686018427387904]", 0, 8) + "}", d8),
       {"overflow", "uint64"}},
      {"dimension beyond int64",
       file_bytes("{" + entry("w", "U8", "[18446744073709551615]", 0, 8) + "}", d8),
       {"at most 9223372036854775807"}},
      {"metadata with a non-string value",
       file_bytes(R"({"__metadata__":{"k":1}})", ""),
       {"__metadata__", "\"k\"", "must be a string", "int 1"}},
      {"metadata not an object", file_bytes(R"({"__metadata__":["k"]})", ""), {"__metadata__", "object"}},
  };
  for (const BadFile& c : cases) {
    const std::string path = temp_path("bad.safetensors");
    write_bytes(path, c.bytes);
    std::vector<std::string> words = c.words;
    words.push_back(path);  // every message names the file
    expect_error([&] { SafetensorsFile::open(path); }, words, c.what);
    // The parser alone, on exactly these bytes (ASan checks it stays inside them).
    std::vector<uint8_t> buf(c.bytes.begin(), c.bytes.end());
    expect_error([&] { dew::io::parse_header(buf.data(), buf.size(), "mem"); }, {"'mem'"}, c.what);
    ::unlink(path.c_str());
  }
}

TEST(Safetensors, ReaderErrors) {
  expect_error([] { SafetensorsFile::open("/nonexistent/dir/x.safetensors"); },
               {"/nonexistent/dir/x.safetensors", "cannot open", "No such file"}, "missing file");
  expect_error([] { SafetensorsFile::open(::testing::TempDir()); }, {"not a regular file"}, "directory");

  const std::string path = temp_path("names.safetensors");
  dew::io::save_safetensors(path, {{"enc.w", at::ones({1})}, {"enc.b", at::ones({1})}});
  const auto f = SafetensorsFile::open(path);
  expect_error([&] { f.tensor("enc.weight"); }, {"no tensor \"enc.weight\"", "available (2)", "\"enc.b\"", "\"enc.w\""},
               "unknown name");

  // A BOOL byte other than 0/1 is refused when the tensor is read (it would be UB in LibTorch kernels).
  write_bytes(path, file_bytes("{" + entry("m", "BOOL", "[2]", 0, 2) + "}", std::string("\x01\x02", 2)));
  expect_error([&] { SafetensorsFile::open(path).tensor("m"); }, {"\"m\"", "BOOL", "byte 2", "0 or 1"}, "bool byte");
  ::unlink(path.c_str());
}

TEST(Safetensors, WriterErrors) {
  const std::string path = temp_path("w.safetensors");
  expect_error(
      [&] {
        dew::io::save_safetensors(path, {{"c", at::ones({2}, at::kComplexFloat)}});
      },
      {"\"c\"", "ComplexFloat", "cannot be stored"}, "complex tensor");
  expect_error(
      [&] {
        dew::io::save_safetensors(path, {{"__metadata__", at::ones({2})}});
      },
      {"reserved"}, "reserved name");
  expect_error(
      [&] {
        dew::io::save_safetensors(path, {{"u", at::Tensor()}});
      },
      {"\"u\"", "undefined"}, "undefined tensor");
  expect_error(
      [&] {
        dew::io::save_safetensors(path, {{"x", at::ones({1})}}, {{"k", "\xff\xfe"}});
      },
      {"UTF-8"}, "invalid UTF-8 metadata");
  EXPECT_FALSE(exists(path));
  EXPECT_FALSE(exists(path + ".tmp"));
  expect_error(
      [] {
        dew::io::save_safetensors("/nonexistent/dir/x.safetensors", {{"x", at::ones({1})}});
      },
      {"cannot create", "/nonexistent/dir/x.safetensors.tmp", "No such file"}, "missing directory");

  // Overwriting replaces the old content whole.
  dew::io::save_safetensors(path, {{"old", at::ones({100})}});
  dew::io::save_safetensors(path, {{"new", at::ones({1})}});
  EXPECT_EQ(SafetensorsFile::open(path).names(), std::vector<std::string>{"new"});
  EXPECT_FALSE(exists(path + ".tmp"));
  ::unlink(path.c_str());
}

}  // namespace
