// `dew tokenize`: text files or Debian's fortunes -> token files (docs/lm.md).
#include <chrono>
#include <cmath>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/data/text_corpus.h"
#include "dew/data/token_files.h"
#include "dew/data/tokenizer.h"

namespace dew::cli {

namespace {

const char* kTokenizeUsage =
    "usage: dew tokenize --input FILE|DIR --out DIR [--tokenizer byte|PATH] [--val-fraction F] [--pack]\n"
    "                    [--split auto|fortune|file]\n"
    "\n"
    "  --input         a text file or a folder (read recursively, sorted; hidden files, symlinks and\n"
    "                  fortune .dat indexes skipped)\n"
    "  --out           output folder: train.bin, val.bin, meta.json\n"
    "  --tokenizer     byte (default), a tokenizer.model / tokenizer.json, or a folder holding one\n"
    "  --val-fraction  share of tokens, taken as whole documents from the head of the stream, that go to\n"
    "                  val.bin (default 0.05)\n"
    "  --pack          append the tokenizer's EOS after every document\n"
    "  --split         auto (default): fortune files (NAME.dat beside them) give one document per\n"
    "                  %-separated fortune, other files one document each; fortune | file force one rule\n";

}  // namespace

int cmd_tokenize(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kTokenizeUsage;
      return 0;
    }
  auto f = parse_flags(args, {"input", "out", "tokenizer", "val-fraction", "split"}, {"pack"});
  DEW_CHECK(f.positional.empty(), "tokenize: unexpected argument \"", f.positional.empty() ? "" : f.positional[0],
            "\" (dew tokenize --help)");
  DEW_CHECK(f.has("input"), "tokenize: --input FILE|DIR is required");
  DEW_CHECK(f.has("out"), "tokenize: --out DIR is required");
  double val_fraction = f.get_double("val-fraction", 0.05);
  DEW_CHECK(val_fraction >= 0 && val_fraction < 1, "--val-fraction: must be in [0, 1), got ", val_fraction);
  bool pack = f.has("pack");
  auto tok = data::load_tokenizer(f.get("tokenizer", "byte"));
  DEW_CHECK(!pack || tok->eos_id() >= 0, "--pack: the tokenizer ", tok->spec().dump(),
            " has no EOS id to end documents with");

  auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto files = data::document_files(f.get("input", ""));
  std::string split = f.get("split", "auto");
  std::vector<std::vector<int64_t>> docs;
  int64_t total = 0, bytes = 0;
  double last_report = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    for (auto& text : data::read_documents(files[i], split)) {
      bytes += static_cast<int64_t>(text.size());
      auto ids = tok->encode(text);
      if (pack) ids.push_back(tok->eos_id());
      total += static_cast<int64_t>(ids.size());
      docs.push_back(std::move(ids));
    }
    if (seconds() - last_report > 1.0 || i + 1 == files.size()) {
      last_report = seconds();
      std::cerr << "\rtokenize: " << i + 1 << "/" << files.size() << " files, " << docs.size() << " documents, "
                << total << " tokens, " << static_cast<int64_t>(bytes / std::max(1e-9, seconds()) / 1e3) << " kB/s"
                << std::flush;
    }
  }
  std::cerr << "\n";
  DEW_CHECK(!docs.empty(), "tokenize: \"", f.get("input", ""), "\" holds no non-empty document");

  // Validation = whole documents from the head of the stream until it holds val_fraction of the tokens
  // (at least one document when the fraction is > 0 and there are two or more).
  size_t n_val = 0;
  int64_t val_tokens = 0;
  while (n_val + 1 < docs.size() && val_fraction > 0 && static_cast<double>(val_tokens) < val_fraction * total)
    val_tokens += static_cast<int64_t>(docs[n_val++].size());
  std::vector<int64_t> val, train;
  val.reserve(val_tokens);
  train.reserve(total - val_tokens);
  for (size_t d = 0; d < docs.size(); ++d) {
    auto& dst = d < n_val ? val : train;
    dst.insert(dst.end(), docs[d].begin(), docs[d].end());
    std::vector<int64_t>().swap(docs[d]);
  }
  data::TokenMeta meta;
  meta.tokenizer = tok->spec();
  meta.vocab_size = tok->vocab_size();
  meta.eos_id = tok->eos_id();
  meta.packed = pack;
  std::string out = f.get("out", "");
  data::write_token_files(out, train, val, meta);
  std::cout << "tokenized " << files.size() << " files, " << docs.size() << " documents (" << bytes << " bytes) with "
            << tok->name() << " (vocab " << tok->vocab_size() << ") into " << out << ": train " << train.size()
            << " tokens, val " << val.size() << " tokens (" << n_val << " documents), "
            << (bytes > 0 ? static_cast<double>(total) / bytes : 0.0) << " tokens/byte, "
            << std::round(seconds() * 10) / 10 << " s\n";
  return 0;
}

}  // namespace dew::cli
