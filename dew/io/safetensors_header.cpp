#include "dew/io/safetensors_header.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "dew/core/error.h"

namespace dew {
namespace io {
namespace {

// nlohmann directly, not dew/core/options.h: this file stays free of LibTorch headers so that
// scripts/fuzz can build it alone.
using json = nlohmann::json;

struct DtypeInfo {
  Dtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::F64, "F64", 8}, {Dtype::F32, "F32", 4},   {Dtype::F16, "F16", 2}, {Dtype::BF16, "BF16", 2},
    {Dtype::I64, "I64", 8}, {Dtype::I32, "I32", 4},   {Dtype::I16, "I16", 2}, {Dtype::I8, "I8", 1},
    {Dtype::U8, "U8", 1},   {Dtype::BOOL, "BOOL", 1},
};

const DtypeInfo& info(Dtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d;
  fail("safetensors: invalid Dtype value ", static_cast<int>(dtype));
}

constexpr size_t kMaxShown = 80;  // characters of a user-supplied value quoted in a message

// Cuts `s` to about kMaxShown bytes without splitting a UTF-8 sequence: names and values come from the file.
std::string clip(std::string s) {
  if (s.size() <= kMaxShown) return s;
  size_t cut = kMaxShown - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

// A tensor or key name as JSON shows it: quoted, control characters escaped, clipped.
std::string quote(const std::string& s) { return clip(json(s).dump()); }

// Bounded rendering: a hostile header can nest arrays millions deep, and json::dump() recurses.
void render(const json& j, int depth, std::string& out) {
  if (out.size() > kMaxShown) return;
  if (j.is_array() || j.is_object()) {
    const bool array = j.is_array();
    out += array ? "[" : "{";
    if (depth >= 3 && !j.empty()) {
      out += "...";
    } else {
      size_t i = 0;
      for (auto it = j.begin(); it != j.end(); ++it, ++i) {
        if (i) out += ", ";
        if (out.size() > kMaxShown) {
          out += "...";
          break;
        }
        if (!array) out += clip(json(it.key()).dump()) + ": ";
        render(*it, depth + 1, out);
      }
    }
    out += array ? "]" : "}";
  } else {
    out += clip(j.dump());
  }
}

// "list [1, -2]", "string \"x\"": the kind and a clipped rendering of a value for messages.
std::string describe(const json& j) {
  const char* kind = j.is_null()             ? "null"
                     : j.is_boolean()        ? "bool"
                     : j.is_number_integer() ? "int"
                     : j.is_number()         ? "float"
                     : j.is_string()         ? "string"
                     : j.is_array()          ? "list"
                                             : "object";
  std::string text;
  render(j, 0, text);
  return std::string(kind) + " " + clip(text);
}

std::string accepted_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) s += std::string(s.empty() ? "" : ", ") + d.name;
  return s;
}

// A JSON integer >= 0 that fits `limit`; anything else fails naming `where`.
uint64_t non_negative(const json& j, uint64_t limit, const std::string& where) {
  // nlohmann stores literals >= 0 as unsigned, negative ones as signed, and integers beyond uint64 as float.
  DEW_CHECK(j.is_number_unsigned(), where, " must be an integer >= 0, got ", describe(j));
  const uint64_t v = j.get<uint64_t>();
  DEW_CHECK(v <= limit, where, " must be at most ", limit, ", got ", v);
  return v;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return clip(s + "]");
}

TensorEntry parse_entry(const std::string& name, const json& v, uint64_t data_size, const std::string& file) {
  const std::string where = file + ": tensor " + quote(name);
  DEW_CHECK(v.is_object(), where, " must be an object {\"dtype\", \"shape\", \"data_offsets\"}, got ", describe(v));
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string& k = it.key();
    DEW_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", where, ": unknown field ", quote(k),
              "; accepted: dtype, shape, data_offsets");
  }
  for (const char* k : {"dtype", "shape", "data_offsets"})
    DEW_CHECK(v.contains(k), where, ": missing field \"", k, "\"; required: dtype, shape, data_offsets");

  TensorEntry e;
  e.name = name;
  const json& dtype = v.at("dtype");
  DEW_CHECK(dtype.is_string(), where, " field \"dtype\" must be a string (", accepted_dtypes(), "), got ",
            describe(dtype));
  e.dtype = dtype_from_string(dtype.get<std::string>(), where + " field \"dtype\"");

  const json& shape = v.at("shape");
  DEW_CHECK(shape.is_array(), where, " field \"shape\" must be a list of integers >= 0, got ", describe(shape));
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::string at = where + " field \"shape\" entry " + std::to_string(i);
    e.shape.push_back(
        static_cast<int64_t>(non_negative(shape[i], static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), at)));
  }

  const json& offsets = v.at("data_offsets");
  DEW_CHECK(offsets.is_array() && offsets.size() == 2, where,
            " field \"data_offsets\" must be a list [begin, end] of two integers >= 0, got ", describe(offsets));
  const uint64_t any = std::numeric_limits<uint64_t>::max();
  e.begin = non_negative(offsets[0], any, where + " field \"data_offsets\" begin");
  e.end = non_negative(offsets[1], any, where + " field \"data_offsets\" end");
  DEW_CHECK(e.begin <= e.end, where, " field \"data_offsets\" [", e.begin, ", ", e.end,
            "] is reversed; accepted: begin <= end");
  DEW_CHECK(e.end <= data_size, where, " field \"data_offsets\" [", e.begin, ", ", e.end,
            "] is out of range: the data section holds ", data_size,
            " bytes; accepted: end <= data section size (is the file truncated?)");

  // The element count must fit int64 even when a zero dimension makes it 0: LibTorch computes strides
  // as products of the other dimensions, so [0, 2^62, 2^62] would overflow there.
  int64_t product = 1;
  bool empty = false;
  for (int64_t d : e.shape) {
    empty = empty || d == 0;
    DEW_CHECK(!__builtin_mul_overflow(product, std::max<int64_t>(d, 1), &product), where, " field \"shape\" ",
              shape_text(e.shape), " overflows: its element count does not fit int64");
  }
  const uint64_t numel = empty ? 0 : static_cast<uint64_t>(product);
  const size_t esize = dtype_size(e.dtype);
  uint64_t bytes = 0;
  DEW_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(esize), &bytes), where, " field \"shape\" ",
            shape_text(e.shape), " x ", dtype_name(e.dtype), " overflows: its byte size does not fit uint64");
  DEW_CHECK(bytes == e.end - e.begin, where, ": size mismatch: shape ", shape_text(e.shape), " x ", dtype_name(e.dtype),
            " (", esize, " bytes) = ", bytes, " bytes, but data_offsets [", e.begin, ", ", e.end, "] span ",
            e.end - e.begin, " bytes; accepted: equal sizes");
  return e;
}

}  // namespace

size_t dtype_size(Dtype dtype) { return info(dtype).size; }

const char* dtype_name(Dtype dtype) { return info(dtype).name; }

Dtype dtype_from_string(const std::string& name, const std::string& where) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  fail(where, ": unknown dtype ", quote(name), "; accepted: ", accepted_dtypes());
}

Header parse_header(const uint8_t* data, size_t size, const std::string& path_for_errors) {
  const std::string file = "safetensors file '" + path_for_errors + "'";
  DEW_CHECK(size >= 8, file, ": truncated: the file is ", size,
            " bytes, shorter than the 8-byte header length field; accepted: 8 + header length + data bytes");
  DEW_CHECK(data != nullptr, file, ": no data pointer for ", size, " bytes");

  // Little-endian by construction, whatever the host's byte order.
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(data[i]) << (8 * i);
  DEW_CHECK(n <= kMaxHeaderBytes, file, ": absurd header length ", n, " bytes in the first 8 bytes; accepted: at most ",
            kMaxHeaderBytes, " (the file is corrupt or not safetensors)");
  DEW_CHECK(n <= size - 8, file, ": header length ", n, " runs past the end of the file (", size, " bytes, so at most ",
            size - 8, " header bytes); the file is truncated or corrupt");

  Header h;
  h.data_start = 8 + n;
  h.data_size = size - h.data_start;

  const char* text = reinterpret_cast<const char*>(data + 8);
  json root;
  try {
    root = json::parse(text, text + n);
  } catch (const json::exception& e) {
    // what() quotes the last token read raw: it can be megabytes long and hold invalid UTF-8, which
    // would garble a terminal or a log. Keep the start and show only printable ASCII.
    std::string why = e.what();
    if (why.size() > 300) why = why.substr(0, 297) + "...";
    for (char& c : why)
      if (c < 0x20 || c > 0x7e) c = '?';
    fail(file, ": header is not valid JSON (", why,
         "); accepted: a JSON object {name: {dtype, shape, data_offsets}, __metadata__: {...}}");
  }
  DEW_CHECK(root.is_object(), file, ": header must be a JSON object {name: {dtype, shape, data_offsets}}, got ",
            describe(root));

  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() != "__metadata__") {
      h.tensors.push_back(parse_entry(it.key(), it.value(), h.data_size, file));
      continue;
    }
    const json& meta = it.value();
    if (meta.is_null()) continue;  // the reference implementation reads null as "no metadata"
    DEW_CHECK(meta.is_object(), file, ": __metadata__ must be an object of string -> string, got ", describe(meta));
    for (auto m = meta.begin(); m != meta.end(); ++m) {
      DEW_CHECK(m.value().is_string(), file, ": __metadata__ entry ", quote(m.key()), " must be a string, got ",
                describe(m.value()), "; accepted: string values only");
      h.metadata[m.key()] = m.value().get<std::string>();
    }
  }

  // Tensors must tile the data section exactly, as in the reference implementation: overlaps would alias
  // two tensors, holes and trailing bytes would let a file carry data no tensor accounts for.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end != b.end ? a.end < b.end : a.name < b.name;
  });
  uint64_t expected = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorEntry& t = h.tensors[i];
    if (t.begin < expected) {
      const TensorEntry& p = h.tensors[i - 1];
      fail(file, ": tensor ", quote(t.name), " data_offsets [", t.begin, ", ", t.end, "] overlap tensor ",
           quote(p.name), " [", p.begin, ", ", p.end, "]; accepted: each tensor starts where the previous one ends");
    }
    DEW_CHECK(t.begin == expected, file, ": tensor ", quote(t.name), " data_offsets [", t.begin, ", ", t.end,
              "] leave a gap of bytes [", expected, ", ", t.begin,
              ") that no tensor covers; accepted: each tensor starts where the previous one ends");
    expected = t.end;
  }
  DEW_CHECK(expected == h.data_size, file, ": the data section holds ", h.data_size, " bytes but the tensors cover ",
            expected, "; accepted: tensors covering the data section exactly (no trailing bytes)");
  return h;
}

}  // namespace io
}  // namespace dew
