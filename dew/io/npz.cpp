#include "dew/io/npz.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cstring>
#include <limits>

#include "dew/core/error.h"
#include "dew/io/files.h"

namespace dew::io {

namespace npz_detail {

// Little-endian readers over a bounds-checked view: every read names what it wanted when the bytes end.
uint64_t le(std::string_view b, size_t at, int n, const std::string& what, const char* field) {
  DEW_CHECK(at <= b.size() && size_t(n) <= b.size() - at, what, ": truncated (", field, " at byte ", at, " needs ", n,
            " bytes, the data has ", b.size(), ")");
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | uint8_t(b[at + i]);
  return v;
}

void put_le(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

struct Descr {
  at::ScalarType type;
  bool swap = false;  // stored big-endian
};

Descr parse_descr(const std::string& d, const std::string& what) {
  DEW_CHECK(d.size() >= 3, what, ": unsupported .npy dtype '", d, "'");
  const char order = d[0];
  const std::string code = d.substr(1);
  DEW_CHECK(order == '<' || order == '>' || order == '|' || order == '=', what, ": unsupported .npy dtype '", d,
            "' (byte order must be <, > or |)");
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"f2", at::kHalf}, {"f4", at::kFloat}, {"f8", at::kDouble}, {"i1", at::kChar}, {"i2", at::kShort},
      {"i4", at::kInt},  {"i8", at::kLong},  {"u1", at::kByte},   {"b1", at::kBool}};
  for (const auto& [c, t] : kTypes)
    if (code == c) return {t, order == '>' && at::elementSize(t) > 1};
  fail(what, ": unsupported .npy dtype '", d, "' (accepted: float16/32/64, int8/16/32/64, uint8, bool)");
}

std::string descr_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "<f2";
    case at::kFloat: return "<f4";
    case at::kDouble: return "<f8";
    case at::kChar: return "|i1";
    case at::kShort: return "<i2";
    case at::kInt: return "<i4";
    case at::kLong: return "<i8";
    case at::kByte: return "|u1";
    case at::kBool: return "|b1";
    default: fail("npy: cannot write dtype ", t, " (accepted: float16/32/64, int8/16/32/64, uint8, bool)");
  }
}

// The header is a Python dict literal: {'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }.
struct NpyHeader {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
};

NpyHeader parse_npy_header(std::string_view h, const std::string& what) {
  NpyHeader out;
  bool has_descr = false, has_order = false, has_shape = false;
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < h.size() && (h[i] == ' ' || h[i] == '\n' || h[i] == '\t' || h[i] == ',')) ++i;
  };
  auto bad = [&](const char* why) -> void { fail(what, ": malformed .npy header (", why, "): ", std::string(h)); };
  auto quoted = [&]() -> std::string {
    if (i >= h.size() || (h[i] != '\'' && h[i] != '"')) bad("expected a quoted string");
    const char q = h[i++];
    const size_t end = h.find(q, i);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string s(h.substr(i, end - i));
    i = end + 1;
    return s;
  };
  skip_ws();
  if (i >= h.size() || h[i] != '{') bad("expected '{'");
  ++i;
  while (true) {
    skip_ws();
    if (i >= h.size()) bad("expected '}'");
    if (h[i] == '}') break;
    const std::string key = quoted();
    skip_ws();
    if (i >= h.size() || h[i] != ':') bad("expected ':'");
    ++i;
    skip_ws();
    if (key == "descr") {
      out.descr = quoted();
      has_descr = true;
    } else if (key == "fortran_order") {
      if (h.substr(i, 4) == "True") {
        out.fortran = true, i += 4;
      } else if (h.substr(i, 5) == "False") {
        out.fortran = false, i += 5;
      } else {
        bad("fortran_order must be True or False");
      }
      has_order = true;
    } else if (key == "shape") {
      if (i >= h.size() || h[i] != '(') bad("shape must be a tuple");
      ++i;
      while (true) {
        while (i < h.size() && (h[i] == ' ' || h[i] == ',')) ++i;
        if (i >= h.size()) bad("unterminated shape");
        if (h[i] == ')') break;
        if (h[i] < '0' || h[i] > '9') bad("shape entries must be non-negative integers");
        int64_t v = 0;
        while (i < h.size() && h[i] >= '0' && h[i] <= '9') {
          if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) bad("shape entry too large");
          v = v * 10 + (h[i++] - '0');
        }
        if (i < h.size() && h[i] == 'L') ++i;  // Python 2 longs
        out.shape.push_back(v);
        if (out.shape.size() > 32) bad("more than 32 dimensions");
      }
      ++i;
      has_shape = true;
    } else {
      bad("unknown key");
    }
  }
  if (!has_descr || !has_order || !has_shape) bad("needs descr, fortran_order and shape");
  return out;
}

// CRC-32 and raw deflate streams through zlib.
uint32_t crc(std::string_view b) {
  uLong c = crc32(0L, Z_NULL, 0);
  size_t at = 0;
  while (at < b.size()) {  // zlib's length is a uInt: feed large members in pieces
    const size_t n = std::min<size_t>(b.size() - at, 1u << 30);
    c = crc32(c, reinterpret_cast<const Bytef*>(b.data() + at), uInt(n));
    at += n;
  }
  return uint32_t(c);
}

std::string inflate_raw(std::string_view in, uint64_t expected, const std::string& what) {
  // The central directory's size is only a claim: cap the allocation by deflate's best ratio (1032:1).
  DEW_CHECK(expected / 1032 <= in.size() + 1, what, ": claims ", expected, " bytes from ", in.size(),
            " compressed bytes (more than deflate can produce)");
  std::string out(expected, '\0');
  z_stream z{};
  DEW_CHECK(inflateInit2(&z, -15) == Z_OK, what, ": zlib inflateInit2 failed");
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = uInt(std::min<size_t>(in.size(), std::numeric_limits<uInt>::max()));
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = uInt(std::min<uint64_t>(expected, std::numeric_limits<uInt>::max()));
  const int rc = inflate(&z, Z_FINISH);
  const uint64_t produced = z.total_out;
  inflateEnd(&z);
  DEW_CHECK(rc == Z_STREAM_END && produced == expected, what, ": deflate stream is corrupt or its size differs (",
            produced, " bytes, the directory says ", expected, ")");
  return out;
}

std::string deflate_raw(std::string_view in) {
  z_stream z{};
  DEW_CHECK(deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) == Z_OK,
            "npz: zlib deflateInit2 failed");
  std::string out(deflateBound(&z, uLong(in.size())), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = uInt(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = uInt(out.size());
  const int rc = deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  DEW_CHECK(rc == Z_STREAM_END, "npz: deflate failed");
  return out;
}

}  // namespace npz_detail

at::Tensor parse_npy(std::string_view b, const std::string& what) {
  using namespace npz_detail;
  DEW_CHECK(b.size() >= 10 && b.substr(0, 6) == "\x93NUMPY", what, ": not an .npy array (no \\x93NUMPY magic)");
  const int major = uint8_t(b[6]);
  DEW_CHECK(major >= 1 && major <= 3, what, ": unsupported .npy format version ", major, " (accepted: 1, 2, 3)");
  const size_t len_bytes = major == 1 ? 2 : 4;
  const uint64_t hlen = le(b, 8, int(len_bytes), what, "header length");
  const size_t hstart = 8 + len_bytes;
  DEW_CHECK(hlen <= b.size() - hstart, what, ": .npy header of ", hlen, " bytes runs past the end (", b.size(),
            " bytes)");
  const NpyHeader h = parse_npy_header(b.substr(hstart, hlen), what);
  const Descr d = parse_descr(h.descr, what);
  const size_t item = at::elementSize(d.type);
  uint64_t count = 1;
  for (int64_t s : h.shape) {
    DEW_CHECK(s == 0 || count <= std::numeric_limits<uint64_t>::max() / item / uint64_t(s), what,
              ": .npy shape is too large");
    count *= uint64_t(s);
  }
  const std::string_view data = b.substr(hstart + hlen);
  DEW_CHECK(data.size() == count * item, what, ": .npy data has ", data.size(), " bytes, shape and dtype ", h.descr,
            " need ", count * item);
  std::vector<int64_t> shape = h.shape;
  if (h.fortran) std::reverse(shape.begin(), shape.end());  // column-major = the reversed shape, transposed
  auto t = at::empty(shape, at::TensorOptions().dtype(d.type));
  if (count) std::memcpy(t.data_ptr(), data.data(), data.size());
  if (d.swap) {
    auto* p = static_cast<uint8_t*>(t.data_ptr());
    for (uint64_t i = 0; i < count; ++i) std::reverse(p + i * item, p + (i + 1) * item);
  }
  if (d.type == at::kBool) t = t.view(at::kByte).ne(0);  // any non-zero byte is True, as numpy reads it
  if (h.fortran) {
    std::vector<int64_t> perm(shape.size());
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(perm.size() - 1 - i);
    t = t.permute(perm).contiguous();
  }
  return t;
}

std::string npy_bytes(const at::Tensor& tensor) {
  using namespace npz_detail;
  auto t = tensor.detach().cpu().contiguous();
  std::string header = "{'descr': '" + descr_of(t.scalar_type()) + "', 'fortran_order': False, 'shape': (";
  for (int64_t i = 0; i < t.dim(); ++i)
    header += std::to_string(t.size(i)) + (t.dim() == 1 ? "," : i + 1 < t.dim() ? ", " : "");
  header += "), }";
  // numpy pads with spaces and ends with '\n' so that the data starts on a 64-byte boundary.
  const size_t total = 10 + header.size() + 1;
  header += std::string((64 - total % 64) % 64, ' ') + "\n";
  std::string out = "\x93NUMPY";
  out.push_back(char(1));
  out.push_back(char(0));
  put_le(out, header.size(), 2);
  out += header;
  out.append(static_cast<const char*>(t.data_ptr()), size_t(t.numel()) * t.element_size());
  return out;
}

std::map<std::string, at::Tensor> parse_npz(std::string_view b, const std::string& what) {
  using namespace npz_detail;
  // End of central directory: 22 bytes plus a comment of at most 65535, found scanning back from the end.
  DEW_CHECK(b.size() >= 22, what, ": not an .npz (", b.size(), " bytes, too short for a zip)");
  size_t eocd = std::string_view::npos;
  const size_t lowest = b.size() >= 22 + 65535 ? b.size() - 22 - 65535 : 0;
  for (size_t p = b.size() - 22 + 1; p-- > lowest;)
    if (le(b, p, 4, what, "signature") == 0x06054b50) {
      eocd = p;
      break;
    }
  DEW_CHECK(eocd != std::string_view::npos, what, ": not an .npz (no zip end-of-central-directory record)");
  uint64_t entries = le(b, eocd + 10, 2, what, "entry count");
  uint64_t cd_offset = le(b, eocd + 16, 4, what, "central directory offset");
  if ((entries == 0xffff || cd_offset == 0xffffffff) && eocd >= 20 &&
      le(b, eocd - 20, 4, what, "zip64 locator") == 0x07064b50) {
    const uint64_t z64 = le(b, eocd - 20 + 8, 8, what, "zip64 record offset");
    DEW_CHECK(le(b, z64, 4, what, "zip64 record") == 0x06064b50, what, ": bad zip64 end-of-central-directory record");
    entries = le(b, z64 + 32, 8, what, "zip64 entry count");
    cd_offset = le(b, z64 + 48, 8, what, "zip64 central directory offset");
  }
  DEW_CHECK(cd_offset <= b.size() && entries <= (b.size() - cd_offset) / 46, what, ": central directory (", entries,
            " entries at byte ", cd_offset, ") runs past the end");
  std::map<std::string, at::Tensor> out;
  size_t p = cd_offset;
  for (uint64_t e = 0; e < entries; ++e) {
    DEW_CHECK(le(b, p, 4, what, "central directory entry") == 0x02014b50, what, ": bad central directory entry ", e);
    const uint64_t method = le(b, p + 10, 2, what, "method");
    const uint32_t crc_expected = uint32_t(le(b, p + 16, 4, what, "crc"));
    uint64_t csize = le(b, p + 20, 4, what, "compressed size");
    uint64_t usize = le(b, p + 24, 4, what, "size");
    const uint64_t nlen = le(b, p + 28, 2, what, "name length"), xlen = le(b, p + 30, 2, what, "extra length"),
                   clen = le(b, p + 32, 2, what, "comment length");
    uint64_t local = le(b, p + 42, 4, what, "local header offset");
    DEW_CHECK(p + 46 + nlen + xlen + clen <= b.size(), what, ": central directory entry ", e, " runs past the end");
    const std::string name(b.substr(p + 46, nlen));
    // Zip64 extra field (id 1): the 64-bit values of whichever fields hold 0xffffffff, in this order.
    for (size_t x = p + 46 + nlen; x + 4 <= p + 46 + nlen + xlen;) {
      const uint64_t id = le(b, x, 2, what, "extra id"), sz = le(b, x + 2, 2, what, "extra size");
      if (id == 1) {
        size_t f = x + 4;
        if (usize == 0xffffffff) usize = le(b, f, 8, what, "zip64 size"), f += 8;
        if (csize == 0xffffffff) csize = le(b, f, 8, what, "zip64 compressed size"), f += 8;
        if (local == 0xffffffff) local = le(b, f, 8, what, "zip64 offset"), f += 8;
      }
      x += 4 + sz;
    }
    p += 46 + nlen + xlen + clen;
    DEW_CHECK(le(b, local, 4, what, "local header") == 0x04034b50, what, ": member '", name,
              "' has no local header at byte ", local);
    const uint64_t data =
        local + 30 + le(b, local + 26, 2, what, "local name length") + le(b, local + 28, 2, what, "local extra length");
    DEW_CHECK(data <= b.size() && csize <= b.size() - data, what, ": member '", name, "' (", csize,
              " bytes) runs past the end");
    const std::string_view raw = b.substr(data, csize);
    const std::string member = what + ":" + name;
    std::string inflated;
    std::string_view bytes;
    if (method == 0) {
      DEW_CHECK(csize == usize, member, ": stored member sizes differ (", csize, " vs ", usize, ")");
      bytes = raw;
    } else if (method == 8) {
      inflated = inflate_raw(raw, usize, member);
      bytes = inflated;
    } else {
      fail(member, ": unsupported zip compression method ", method, " (accepted: 0 stored, 8 deflate)");
    }
    DEW_CHECK(crc(bytes) == crc_expected, member, ": CRC-32 mismatch (the file is corrupt)");
    DEW_CHECK(name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0, member,
              ": an .npz member must be NAME.npy");
    const std::string key = name.substr(0, name.size() - 4);
    DEW_CHECK(!out.count(key), what, ": member '", name, "' appears twice");
    out[key] = parse_npy(bytes, member);
  }
  return out;
}

std::map<std::string, at::Tensor> read_npz(const std::string& path) {
  const std::string bytes = read_file(path, ".npz statistics");
  return parse_npz(bytes, path);
}

std::string npz_bytes(const std::map<std::string, at::Tensor>& arrays, bool compressed) {
  using namespace npz_detail;
  std::string out, dir;
  for (const auto& [key, t] : arrays) {
    const std::string name = key + ".npy";
    const std::string raw = npy_bytes(t);
    const std::string data = compressed ? deflate_raw(raw) : raw;
    DEW_CHECK(out.size() < 0xffffffffu && data.size() < 0xffffffffu && raw.size() < 0xffffffffu, "npz: member '", name,
              "' is too large for a zip without zip64 (", raw.size(), " bytes)");
    const uint32_t c = crc(raw);
    const uint64_t offset = out.size();
    auto fields = [&](std::string& s) {  // version, flags, method, time, date, crc, sizes, name length
      put_le(s, 20, 2);
      put_le(s, 0, 2);
      put_le(s, compressed ? 8 : 0, 2);
      put_le(s, 0, 2);
      put_le(s, (1980 - 1980) << 9 | 1 << 5 | 1, 2);  // 1980-01-01: reproducible bytes
      put_le(s, c, 4);
      put_le(s, data.size(), 4);
      put_le(s, raw.size(), 4);
      put_le(s, name.size(), 2);
      put_le(s, 0, 2);  // extra length
    };
    put_le(out, 0x04034b50, 4);
    fields(out);
    out += name;
    out += data;
    put_le(dir, 0x02014b50, 4);
    put_le(dir, 20, 2);  // made by
    fields(dir);
    put_le(dir, 0, 2);  // comment length
    put_le(dir, 0, 2);  // disk
    put_le(dir, 0, 2);  // internal attributes
    put_le(dir, 0, 4);  // external attributes
    put_le(dir, offset, 4);
    dir += name;
  }
  const uint64_t cd_offset = out.size();
  out += dir;
  put_le(out, 0x06054b50, 4);
  put_le(out, 0, 2);
  put_le(out, 0, 2);
  put_le(out, arrays.size(), 2);
  put_le(out, arrays.size(), 2);
  put_le(out, dir.size(), 4);
  put_le(out, cd_offset, 4);
  put_le(out, 0, 2);
  return out;
}

void write_npz(const std::string& path, const std::map<std::string, at::Tensor>& arrays, bool compressed) {
  write_file_atomic(path, npz_bytes(arrays, compressed));
}

}  // namespace dew::io
