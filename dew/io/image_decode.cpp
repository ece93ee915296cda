#include "dew/io/image_decode.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dew/core/error.h"

// The stb_image implementation lives in this translation unit only (one definition per program; the
// writer and the resizer are in image.cpp). It is third-party C code: silence the warnings the project's
// -Wall -Wextra would raise in it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#pragma GCC diagnostic ignored "-Wdouble-promotion"
#define STB_IMAGE_IMPLEMENTATION
#define STBI_FAILURE_USERMSG  // "Corrupt PNG" rather than "bad zlib header" style codes
#include <stb_image.h>
#pragma GCC diagnostic pop

namespace dew {
namespace io {

namespace {

// stb_image 2.27 (Debian's libstb-dev) trusts the symbol counts of a JPEG Huffman table (DHT): counts
// summing past 256 index past its 257-entry size list and write past its 256-entry value list (found by
// fuzz/image_fuzz.cpp; upstream checks the sum since 2.28). We cannot patch the system header, so the
// file's markers are walked here, as stb walks them, and such a table is refused before stb reads it.
// Likewise a scan that decodes with a Huffman table no DHT defined before it: stb leaves its tables
// uninitialised (malloc'd), so the symbol index it computes from one is garbage and it reads far outside
// the table (fuzz/image_fuzz.cpp, finding 20). And a file too short for the blocks its frame declares: stb
// decodes past the end from zeros, so a 776-byte file declaring 23302 x 768 pixels took seconds (finding 21).
// Every 8 x 8 block of a sequential scan costs at least 2 bits (a DC and an end-of-block code of at least one
// bit each), of a progressive DC scan at least 1; the bytes after the first scan's header must hold that
// for the component with the fewest blocks.
void check_jpeg_huffman_tables(const unsigned char* b, size_t n, const std::string& path) {
  // SOI, after any number of 0xFF fill bytes (stb skips them there too); anything else is not a JPEG.
  size_t i = 0;
  while (i < n && b[i] == 0xFF) ++i;
  if (i == 0 || i >= n || b[i] != 0xD8) return;
  ++i;
  // Past the end stb reads zeros; so does this.
  auto at = [&](size_t k) -> unsigned { return k < n ? b[k] : 0u; };
  bool defined[2][4] = {};  // DHT tables seen so far: [DC 0 / AC 1][id]
  bool progressive = false;
  double fewest_blocks = 0;  // of the frame's components (SOF)
  size_t scan_bytes = 0;     // bytes after the first SOS header, segments excepted
  bool scanning = false;
  auto check_length = [&] {
    const double bits = fewest_blocks * (progressive ? 1 : 2);
    DEW_CHECK(!scanning || double(scan_bytes) * 8 >= bits, "cannot decode image \"", path,
              "\": truncated JPEG: its frame needs at least ", uint64_t(std::ceil(bits / 8)),
              " bytes of scan data, the file holds ", scan_bytes);
  };
  auto need = [&](unsigned cls, unsigned id) {
    if (id < 4)  // stb refuses larger ids itself
      DEW_CHECK(defined[cls][id], "cannot decode image \"", path, "\": corrupt JPEG: a scan decodes with ",
                cls == 0 ? "DC" : "AC", " Huffman table ", id, ", which no DHT segment before it defines");
  };
  while (i + 1 < n) {
    const unsigned m = b[i + 1];
    // Outside a segment: entropy-coded data, fill bytes, stuffed zeros and restart markers are stepped
    // over one byte at a time (stb also searches byte by byte for the next marker).
    if (b[i] != 0xFF || m == 0xFF || m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD7)) {
      ++i;
      if (scanning) ++scan_bytes;
      continue;
    }
    if (m == 0xD9) {  // EOI
      check_length();
      return;
    }
    const size_t length = (size_t(at(i + 2)) << 8) | at(i + 3);
    if (m == 0xC4) {
      // As stb's DHT loop: tables follow one another while the segment's length lasts.
      long left = long(length) - 2;
      size_t p = i + 4;
      while (left > 0) {
        size_t count = 0;
        for (size_t k = 1; k <= 16; ++k) count += at(p + k);
        if ((at(p) >> 4) <= 1 && (at(p) & 15) < 4) defined[at(p) >> 4][at(p) & 15] = true;
        DEW_CHECK(count <= 256, "cannot decode image \"", path, "\": corrupt JPEG: a Huffman table lists ", count,
                  " symbols, more than the 256 accepted");
        p += 17 + count;
        left -= long(17 + count);
      }
    } else if (m == 0xC0 || m == 0xC1 || m == 0xC2) {
      progressive = m == 0xC2;
      // height, width, components (id, H << 4 | V, table): each component's blocks at its sampling
      const double height = (at(i + 5) << 8) | at(i + 6), width = (at(i + 7) << 8) | at(i + 8);
      const size_t components = at(i + 9);
      unsigned hmax = 1, vmax = 1;
      for (size_t k = 0; k < components; ++k) {
        hmax = std::max(hmax, at(i + 11 + 3 * k) >> 4);
        vmax = std::max(vmax, at(i + 11 + 3 * k) & 15u);
      }
      fewest_blocks = 0;
      for (size_t k = 0; k < components; ++k) {
        const unsigned h = at(i + 11 + 3 * k) >> 4, v = at(i + 11 + 3 * k) & 15u;
        if (h == 0 || v == 0) continue;  // stb refuses these itself
        const double blocks = std::ceil(std::ceil(width * h / hmax) / 8) * std::ceil(std::ceil(height * v / vmax) / 8);
        fewest_blocks = k == 0 || fewest_blocks == 0 ? blocks : std::min(fewest_blocks, blocks);
      }
    } else if (m == 0xDA) {
      // SOS: components (selector, DC << 4 | AC), then Ss, Se, Ah << 4 | Al. A baseline scan decodes with both
      // tables; a progressive one with the DC table in a first DC pass, the AC table in an AC pass.
      scanning = true;
      const size_t components = at(i + 4), after = i + 5 + 2 * components;
      const unsigned ss = at(after), ah = at(after + 2) >> 4;
      for (size_t k = 0; k < components; ++k) {
        const unsigned tables = at(i + 6 + 2 * k);
        if (!progressive || (ss == 0 && ah == 0)) need(0, tables >> 4);
        if (!progressive || ss > 0) need(1, tables & 15);
      }
    }
    i += 2 + length;
  }
  check_length();  // no EOI: the data ends with the file
}

// stb 2.27 reads the width, height and maxval of a PNM header into an int without a bound: ten digits
// overflow it (undefined behaviour; found by fuzz/image_fuzz.cpp, bounded upstream since 2.28). The
// header is read here as stb reads it (whitespace, # comments, digits) and a number of more than 9
// digits is refused before stb parses it.
void check_pnm_header(const unsigned char* b, size_t n, const std::string& path) {
  if (n < 2 || b[0] != 'P' || (b[1] != '5' && b[1] != '6')) return;  // the PNM kinds stb reads
  size_t pos = 2;
  auto get = [&]() -> char { return pos < n ? char(b[pos++]) : '\0'; };
  auto at_eof = [&] { return pos >= n; };
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  char c = get();
  for (const char* field : {"width", "height", "maxval"}) {
    for (;;) {
      while (!at_eof() && space(c)) c = get();
      if (at_eof() || c != '#') break;
      while (!at_eof() && c != '\n' && c != '\r') c = get();
    }
    int digits = 0;
    for (; !at_eof() && c >= '0' && c <= '9'; c = get()) ++digits;
    DEW_CHECK(digits <= 9, "cannot decode image \"", path, "\": corrupt PNM header: its ", field, " has ", digits,
              " digits, more than the 9 accepted");
  }
}

// stb 2.27 sizes its buffer for a PNG's compressed data from each IDAT chunk's declared length before
// reading it: a 100-byte file declaring a 1 GiB chunk made it reallocate 2 GiB (found by
// fuzz/image_fuzz.cpp). The chunks are walked here and one longer than the rest of the file is refused.
void check_png_chunks(const unsigned char* b, size_t n, const std::string& path) {
  static const unsigned char kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (n < 8 || std::memcmp(b, kSignature, 8) != 0) return;
  for (size_t pos = 8; pos + 8 <= n;) {
    const uint64_t length =
        (uint64_t(b[pos]) << 24) | (uint64_t(b[pos + 1]) << 16) | (uint64_t(b[pos + 2]) << 8) | uint64_t(b[pos + 3]);
    DEW_CHECK(length <= n - (pos + 8), "cannot decode image \"", path, "\": corrupt PNG: a chunk at byte ", pos,
              " declares ", length, " bytes, but the file holds only ", n - (pos + 8), " more");
    if (std::memcmp(b + pos + 4, "IEND", 4) == 0) return;
    pos += 12 + length;  // length, type, data, CRC
  }
}

// stb 2.27 decodes an uncompressed TGA (image types 1-3) without checking that the file holds its pixels:
// past the end it reads zeros. A 75-byte header declaring 2054 x 28672 pixels made it allocate 176 MB and
// take over 10 s under ASan (found by the fuzz test in CI). TGA has no magic number; stb's own test is a
// colour-map type of 0 or 1 and an image type in {1, 2, 3, 9, 10, 11} (no other accepted format's second
// byte is 0 or 1). An uncompressed TGA whose file is shorter than width x height x bytes per pixel is
// refused as truncated (run-length types need about one byte per 128 pixels, so their work stays bounded).
// An RLE TGA (types 9-11) likewise: a packet of at most 128 pixels takes at least 1 + bytes per pixel (image
// fuzz finding 23: a 41-byte file declaring 3855 x 3855 pixels took 21 s under ASan).
void check_tga_size(const unsigned char* b, size_t n, const std::string& path) {
  if (n < 3 || b[1] > 1 || b[2] < 1 || (b[2] > 3 && b[2] < 9) || b[2] > 11) return;
  // stb reads a header cut short as zeros past the end too (image fuzz finding 24: 17 bytes declaring 2586 x 21254
  // run-length coded pixels, over 10 s under ASan)
  DEW_CHECK(n >= 18, "cannot decode image \"", path, "\": truncated TGA: ", n,
            " bytes, shorter than its 18-byte header");
  const uint64_t width = uint64_t(b[12]) | (uint64_t(b[13]) << 8), height = uint64_t(b[14]) | (uint64_t(b[15]) << 8);
  const uint64_t bytes_per_pixel = b[16] >= 16 ? b[16] / 8 : 1;
  if (b[2] >= 9) {
    const uint64_t least = (width * height + 127) / 128 * (1 + bytes_per_pixel);
    DEW_CHECK(least <= n - 18, "cannot decode image \"", path, "\": truncated TGA: its header declares ", width, "x",
              height, " run-length coded pixels (at least ", least, " bytes), but the file holds only ", n - 18,
              " bytes after it");
    return;
  }
  const uint64_t need = width * height * bytes_per_pixel;  // < 2^32 x 32: no overflow
  DEW_CHECK(need <= n - 18, "cannot decode image \"", path, "\": truncated TGA: its header declares ", width, "x",
            height, " pixels (", need, " bytes), but the file holds only ", n - 18, " bytes after it");
}

// The same for an uncompressed BMP (stb decodes every compression but RLE as uncompressed): stb reads its
// rows past the end as zeros, so a 50-byte file declaring 18639 x 150 pixels cost a whole decode (image
// fuzz finding 22). Its rows are padded to 4 bytes; the file must hold them from the pixel offset on. The
// OS/2 header (12 bytes) has 16-bit sizes; an RLE-compressed BMP stb refuses itself.
void check_bmp_size(const unsigned char* b, size_t n, const std::string& path) {
  if (n < 30 || b[0] != 'B' || b[1] != 'M') return;
  auto u16 = [&](size_t k) { return uint64_t(b[k]) | (uint64_t(b[k + 1]) << 8); };
  auto u32 = [&](size_t k) { return u16(k) | (u16(k + 2) << 16); };
  const uint64_t offset = u32(10), header = u32(14);
  uint64_t width = 0, height = 0, bits = 0, compression = 0;
  if (header == 12) {
    width = u16(18), height = u16(20), bits = u16(24);
  } else {
    if (n < 34) return;
    width = uint64_t(std::abs(int64_t(int32_t(uint32_t(u32(18))))));
    height = uint64_t(std::abs(int64_t(int32_t(uint32_t(u32(22))))));  // negative: rows top-down
    bits = u16(28), compression = u32(30);
  }
  if (compression == 1 || compression == 2 || bits == 0 || bits > 32) return;
  const uint64_t row = (bits * width + 31) / 32 * 4, last = (bits * width + 7) / 8;  // bits * width < 2^37
  // Every row, the last one's padding excepted (some writers leave it out). offset + row x height may pass
  // 2^64: compared by division first.
  const bool fits = offset <= n && (height == 0 || row == 0 ||
                                    (height - 1 <= (n - offset) / row && offset + row * (height - 1) + last <= n));
  DEW_CHECK(fits, "cannot decode image \"", path, "\": truncated BMP: its header declares ", width, "x", height,
            " pixels of ", bits, " bits (rows of ", row, " bytes from byte ", offset, "), but the file holds only ", n,
            " bytes");
}

}  // namespace

DecodedImage decode_image(const unsigned char* bytes, size_t size, int64_t channels, const std::string& path) {
  DEW_CHECK(channels == 1 || channels == 3 || channels == 4, "load_image(\"", path,
            "\"): channels must be 1 (grey), 3 (RGB) or 4 (RGBA), got ", channels);
  DEW_CHECK(size > 0, "cannot decode image \"", path, "\": the file is empty");
  DEW_CHECK(size <= size_t(INT_MAX), "cannot decode image \"", path, "\": file of ", size,
            " bytes is larger than the 2 GiB stb accepts");
  check_jpeg_huffman_tables(bytes, size, path);
  check_pnm_header(bytes, size, path);
  check_png_chunks(bytes, size, path);
  check_tga_size(bytes, size, path);
  check_bmp_size(bytes, size, path);
  DecodedImage out;
  int file_channels = 0;
  if (!stbi_info_from_memory(bytes, int(size), &out.width, &out.height, &file_channels))
    fail("cannot decode image \"", path, "\": ", stbi_failure_reason(),
         " (accepted formats: png, jpg, bmp, gif, tga, psd, pnm)");
  // stb 2.27 converts the channels of a 16-bit PNM (maxval > 255) as if it held bytes, then reads past
  // the converted buffer (found by fuzz/image_fuzz.cpp; upstream fixed it in 2.28): refused before loading.
  DEW_CHECK(!(size >= 2 && bytes[0] == 'P' && (bytes[1] == '5' || bytes[1] == '6') &&
              stbi_is_16_bit_from_memory(bytes, int(size))),
            "cannot decode image \"", path, "\": 16-bit PNM (maxval above 255) is not supported; accepted: 8-bit PNM");
  // stb 2.27 accepts a PNM header of width or height 0 (found by fuzz/image_fuzz.cpp) and returns an
  // empty buffer; an image without pixels is refused here rather than passed on as an empty tensor.
  DEW_CHECK(out.width > 0 && out.height > 0, "cannot decode image \"", path, "\": its header declares ", out.width, "x",
            out.height, " pixels; an image needs at least one");
  DEW_CHECK(out.width <= kMaxImageSide && out.height <= kMaxImageSide, "image \"", path, "\" is ", out.width, "x",
            out.height, ", larger than the accepted ", kMaxImageSide, " pixels per side");
  // Sides within bounds can still multiply to 4 GiB of pixels, which stb would allocate on the word of a
  // 100-byte header. At 2^28 pixels a 10-byte GIF header still made stb's GIF decoder hold 2.3 GB (found
  // by fuzz/image_fuzz.cpp); 2^26 keeps any decoder under about 600 MB.
  DEW_CHECK(int64_t(out.width) * out.height <= kMaxImagePixels, "image \"", path, "\" is ", out.width, "x", out.height,
            ", more than the accepted ", kMaxImagePixels, " pixels");
  out.pixels.reset(stbi_load_from_memory(bytes, int(size), &out.width, &out.height, &file_channels, int(channels)),
                   [](unsigned char* p) { stbi_image_free(p); });
  if (!out.pixels) fail("cannot decode image \"", path, "\": ", stbi_failure_reason());
  DEW_CHECK(out.width > 0 && out.height > 0 && out.width <= kMaxImageSide && out.height <= kMaxImageSide,
            "cannot decode image \"", path, "\": the decoder returned ", out.width, "x", out.height,
            " pixels, not the size its header declared");
  out.channels = int(channels);
  return out;
}

}  // namespace io
}  // namespace dew
