#include "dew/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "dew/core/error.h"

namespace dew {
namespace data {

namespace {

struct GzClose {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzClose>;

std::string gz_reason(gzFile f) {
  int code = 0;
  const char* msg = gzerror(f, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  return msg && *msg ? msg : "unexpected end of data";
}

// Reads exactly n bytes or throws naming the file and how far it got; the n bytes are the part of the
// `what` that starts at byte `offset` of its `whole` bytes (the data is read in steps).
void read_exact(gzFile f, const std::string& path, void* dst, int64_t n, const char* what, int64_t offset = 0,
                int64_t whole = -1) {
  auto* p = static_cast<unsigned char*>(dst);
  int64_t done = 0;
  while (done < n) {
    const unsigned chunk = unsigned(std::min<int64_t>(n - done, int64_t(1) << 30));  // gzread takes an unsigned
    const int r = gzread(f, p + done, chunk);
    if (r < 0) fail(path, ": corrupt gzip data while reading the ", what, ": ", gz_reason(f));
    if (r == 0) {
      fail(path, ": truncated: the ", what, " needs ", whole < 0 ? n : whole, " bytes, the file holds only ",
           offset + done, (gzeof(f) ? "" : std::string(" (") + gz_reason(f) + ")"));
    }
    done += r;
  }
}

constexpr int64_t kMaxBytes = int64_t(1) << 34;

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
}

}  // namespace

IdxBytes read_idx_bytes(const std::string& path, int32_t magic) {
  // IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
  const int32_t expected_type = (magic >> 8) & 0xff, ndim = magic & 0xff;
  DEW_CHECK((magic >> 16) == 0 && expected_type == 0x08 && ndim >= 1 && ndim <= 4, "read_idx(\"", path,
            "\"): expected magic must describe unsigned bytes with 1-4 dimensions "
            "(0x0801-0x0804), got ",
            magic);
  errno = 0;
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) fail(path, ": cannot open: ", errno ? std::strerror(errno) : "out of memory");
  gzbuffer(f.get(), 1 << 18);  // fewer, larger reads of the compressed file

  unsigned char head[4];
  read_exact(f.get(), path, head, 4, "magic number");
  const uint32_t got = big_endian(head);
  if (got != uint32_t(magic)) {
    fail(path, ": bad magic number ", got, ", expected ", magic, " (IDX unsigned bytes, ", ndim,
         ndim == 1 ? " dimension" : " dimensions", "); not an IDX file of this kind, or corrupt");
  }
  IdxBytes out;
  out.dims.assign(size_t(ndim), 0);
  int64_t total = 1;
  for (int32_t d = 0; d < ndim; ++d) {
    unsigned char b[4];
    read_exact(f.get(), path, b, 4, "header");
    out.dims[d] = int64_t(big_endian(b));
    DEW_CHECK(out.dims[d] > 0, path, ": dimension ", d, " is 0; an IDX file must hold at least one item");
    // 16 GiB is far above any real IDX file; larger sizes mean a corrupt header, not data to allocate.
    // Checked before multiplying: two dimensions near 2^32 overflow int64.
    DEW_CHECK(out.dims[d] <= kMaxBytes / total, path, ": header declares ", total, " x ", out.dims[d],
              "+ bytes of data, more than the 16 GiB accepted; the header is corrupt");
    total *= out.dims[d];
  }
  // Grow with the data read, doubling from 64 KiB: a truncated file whose header declares gigabytes fails
  // after reading what it holds, having allocated at most twice that (plus 64 KiB).
  for (int64_t done = 0; done < total;) {
    const int64_t n = std::min(std::max(int64_t(1) << 16, done), total - done);
    out.data.resize(size_t(done + n));
    read_exact(f.get(), path, out.data.data() + done, n, "data", done, total);
    done += n;
  }
  unsigned char extra;
  const int r = gzread(f.get(), &extra, 1);
  if (r < 0) fail(path, ": corrupt gzip data after the items: ", gz_reason(f.get()));
  DEW_CHECK(r == 0, path, ": trailing bytes after the ", out.dims[0],
            " items the header declares; the file is corrupt");
  return out;
}

}  // namespace data
}  // namespace dew
