#include "dew/io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dew/core/error.h"
#include "dew/core/options.h"
#include "dew/io/stops.h"

// The format stores little-endian bytes and this code copies them as they are.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace dew {
namespace io {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  // Closes now and reports the error: close() can be the first to report a failed write (e.g. NFS).
  int close() {
    const int rc = ::close(fd);
    fd = -1;
    return rc;
  }
};

void write_all(int fd, const void* data, size_t n, const std::string& where) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; larger tensors go in pieces.
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(where, ": write failed: ", errno_text(w < 0 ? errno : EIO));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Makes a rename durable: the new directory entry is only on disk once the directory is synced.
void sync_directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  // Some file systems cannot open or sync directories; the file itself is already synced.
  if (d.fd >= 0) ::fsync(d.fd);
}

// A few names for "unknown tensor" messages: enough to spot a prefix mismatch, bounded for huge files.
std::string some_names(const std::map<std::string, size_t>& index) {
  constexpr size_t kShown = 8;
  std::string s;
  size_t i = 0;
  for (const auto& kv : index) {
    if (i == kShown) {
      s += ", ... (" + std::to_string(index.size() - kShown) + " more)";
      break;
    }
    s += (i++ ? ", " : "") + json(kv.first).dump();
  }
  return s.empty() ? "(none: the file holds no tensors)" : s;
}

}  // namespace

at::ScalarType scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::F64: return at::kDouble;
    case Dtype::F32: return at::kFloat;
    case Dtype::F16: return at::kHalf;
    case Dtype::BF16: return at::kBFloat16;
    case Dtype::I64: return at::kLong;
    case Dtype::I32: return at::kInt;
    case Dtype::I16: return at::kShort;
    case Dtype::I8: return at::kChar;
    case Dtype::U8: return at::kByte;
    case Dtype::BOOL: return at::kBool;
  }
  fail("safetensors: invalid Dtype value ", static_cast<int>(dtype));
}

Dtype dtype_of(at::ScalarType type, const std::string& where) {
  switch (type) {
    case at::kDouble: return Dtype::F64;
    case at::kFloat: return Dtype::F32;
    case at::kHalf: return Dtype::F16;
    case at::kBFloat16: return Dtype::BF16;
    case at::kLong: return Dtype::I64;
    case at::kInt: return Dtype::I32;
    case at::kShort: return Dtype::I16;
    case at::kChar: return Dtype::I8;
    case at::kByte: return Dtype::U8;
    case at::kBool: return Dtype::BOOL;
    default:
      fail(where, ": dtype ", c10::toString(type), " cannot be stored in safetensors; accepted: Double, Float, ",
           "Half, BFloat16, Long, Int, Short, Char, Byte, Bool");
  }
}

// The mapped bytes of one file; unmapped when the last SafetensorsFile or zero-copy tensor lets go.
struct SafetensorsFile::Mapping {
  uint8_t* data = nullptr;  // null for an empty file (mmap cannot map 0 bytes)
  size_t size = 0;
  bool writable = false;  // copy-on-write pages: zero-copy tensors may be written in place
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
};

SafetensorsFile::SafetensorsFile(std::string path, std::shared_ptr<Mapping> mapping, Header header)
    : path_(std::move(path)), mapping_(std::move(mapping)), header_(std::move(header)) {
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const std::string file = "safetensors file '" + path + "'";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) fail(file, ": cannot open: ", errno_text(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail(file, ": cannot stat: ", errno_text(errno));
  DEW_CHECK(S_ISREG(st.st_mode), file, ": not a regular file; accepted: a .safetensors file");

  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    // Private read-write pages, so that an in-place op on a zero-copy tensor changes this process's
    // copy instead of crashing on a read-only page; the file is opened read-only and never changes.
    void* p = ::mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.fd, 0);
    mapping->writable = p != MAP_FAILED;
    // Strict overcommit can refuse writable private maps of big files: read-only, tensors then copy.
    if (p == MAP_FAILED) p = ::mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
    if (p == MAP_FAILED) fail(file, ": cannot map ", mapping->size, " bytes: ", errno_text(errno));
    mapping->data = static_cast<uint8_t*>(p);
  }
  Header header = parse_header(mapping->data, mapping->size, path);
  return SafetensorsFile(path, std::move(mapping), std::move(header));
}

const std::string& SafetensorsFile::path() const { return path_; }

const Header& SafetensorsFile::header() const { return header_; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& kv : index_) out.push_back(kv.first);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) > 0; }

at::Tensor SafetensorsFile::tensor(const std::string& name, bool copy) const {
  const auto it = index_.find(name);
  if (it == index_.end())
    fail("safetensors file '", path_, "': no tensor ", json(name).dump(), "; available (", index_.size(),
         "): ", some_names(index_));
  const TensorEntry& e = header_.tensors[it->second];
  const auto options = at::TensorOptions().dtype(scalar_type(e.dtype));
  const size_t bytes = static_cast<size_t>(e.end - e.begin);
  if (bytes == 0) return at::empty(e.shape, options);
  uint8_t* src = mapping_->data + header_.data_start + e.begin;

  // A bool byte other than 0/1 is undefined behaviour in LibTorch's kernels, so it is refused here.
  if (e.dtype == Dtype::BOOL) {
    const uint8_t* bad = std::find_if(src, src + bytes, [](uint8_t b) { return b > 1; });
    DEW_CHECK(bad == src + bytes, "safetensors file '", path_, "': tensor ", json(name).dump(), " (BOOL) holds byte ",
              int(*bad), " at element ", bad - src, "; accepted: 0 or 1");
  }

  const bool aligned = reinterpret_cast<uintptr_t>(src) % dtype_size(e.dtype) == 0;
  if (!copy && aligned && mapping_->writable) {
    std::shared_ptr<Mapping> keep = mapping_;  // the tensor's storage holds the mapping alive
    return at::from_blob(
        src, e.shape, [keep](void*) {}, options);
  }
  at::Tensor out = at::empty(e.shape, options);
  std::memcpy(out.data_ptr(), src, bytes);
  return out;
}

void SafetensorsFile::release(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end() || !mapping_->data) return;
  const TensorEntry& e = header_.tensors[it->second];
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(mapping_->data + header_.data_start + e.begin) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(mapping_->data + header_.data_start + e.end);
  // Advice only: a failure leaves the pages resident, which is what happened before.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

std::map<std::string, std::string> SafetensorsFile::metadata() const { return header_.metadata; }

std::map<std::string, at::Tensor> load_safetensors(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : f.header().tensors) out.emplace(e.name, f.tensor(e.name, /*copy=*/true));
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string file = "safetensors file '" + path + "'";
  struct Item {
    const std::string* name;
    const at::Tensor* tensor;
    Dtype dtype;
    uint64_t bytes;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    const std::string where = file + ": tensor " + json(name).dump();
    DEW_CHECK(name != "__metadata__", where, ": the name is reserved for the metadata; choose another");
    DEW_CHECK(t.defined(), where, " is undefined; accepted: defined dense tensors");
    // Layouts are rendered first: passing a c10 type to fail() makes its str() call ambiguous with c10::str.
    DEW_CHECK(t.layout() == at::kStrided, where, " has layout ", dew::str(t.layout()),
              "; accepted: strided (dense) tensors");
    const Dtype d = dtype_of(t.scalar_type(), where);
    items.push_back({&name, &t, d, static_cast<uint64_t>(t.numel()) * dtype_size(d)});
  }
  // Largest elements first, then by name (as the reference writer does): with the header padded to 8
  // bytes every tensor then starts at a multiple of its element size, so readers can map it zero-copy.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return dtype_size(a.dtype) > dtype_size(b.dtype); });

  json header = json::object();
  uint64_t offset = 0;
  for (const Item& it : items) {
    json entry = json::object();
    entry["dtype"] = dtype_name(it.dtype);
    entry["shape"] = it.tensor->sizes().vec();
    entry["data_offsets"] = json::array({offset, offset + it.bytes});
    header[*it.name] = std::move(entry);
    offset += it.bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail(file, ": tensor names and metadata must be valid UTF-8 (", e.what(), ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data then starts 8-byte aligned
  DEW_CHECK(text.size() <= kMaxHeaderBytes, file, ": header of ", text.size(), " bytes exceeds the ", kMaxHeaderBytes,
            " bytes readers accept; store less metadata");

  const TempFile guard(path + ".tmp");  // removed on any failure, and by a signal that ends the process
  const std::string& tmp = guard.path();
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.fd < 0) fail(file, ": cannot create '", tmp, "': ", errno_text(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  write_all(fd.fd, len, 8, file);
  write_all(fd.fd, text.data(), text.size(), file);
  for (const Item& it : items) {
    if (it.bytes == 0) continue;
    at::Tensor cpu;
    try {
      // One tensor at a time, so a GPU model never needs a second full copy in host memory.
      cpu = it.tensor->detach().to(at::kCPU).contiguous();
    } catch (const c10::Error& e) {
      fail(file, ": tensor ", json(*it.name).dump(), " cannot be copied to the CPU: ", e.what_without_backtrace());
    }
    write_all(fd.fd, cpu.data_ptr(), it.bytes, file);
  }
  if (::fsync(fd.fd) != 0) fail(file, ": fsync of '", tmp, "' failed: ", errno_text(errno));
  if (fd.close() != 0) fail(file, ": close of '", tmp, "' failed: ", errno_text(errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail(file, ": cannot rename '", tmp, "' into place: ", errno_text(errno));
  sync_directory_of(path);
}

}  // namespace io
}  // namespace dew
