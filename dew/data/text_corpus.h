// Text documents from files and folders, for `dew tokenize` and LM datasets: a plain file is one
// document; a fortune file (Debian's `fortunes` package, /usr/share/games/fortunes) holds one document
// per fortune.
//
// Fortune rule: a fortune file is split at lines that are exactly "%" (a trailing "\r" is ignored); each
// fortune is its lines joined with "\n" plus a final "\n" (as `fortune` prints it); fortunes that are
// empty or only whitespace are dropped.
//
//   auto docs = dew::data::read_documents("/usr/share/games/fortunes");   // every fortune, in file order
#pragma once
#include <string>
#include <vector>

namespace dew {
namespace data {

/// The fortunes of one fortune file's text (the rule above).
std::vector<std::string> split_fortunes(const std::string& text);

/// Whether `path` is a fortune file: it has a strfile index beside it (PATH.dat) or its name ends in
/// ".fortune" / ".fortunes".
bool is_fortune_file(const std::string& path);

/// The files a folder contributes, sorted by path: regular files found recursively, skipping hidden
/// entries, symbolic links (the fortunes package's NAME.u8 links repeat NAME) and the strfile index
/// NAME.dat of a file NAME. A plain file gives itself.
std::vector<std::string> document_files(const std::string& input);

/// The documents of a file or folder: `split` "auto" (fortune files per fortune, other files whole),
/// "fortune" (every file per fortune) or "file" (every file whole). Empty documents are dropped. A
/// missing input or an unknown split is a dew::Error.
std::vector<std::string> read_documents(const std::string& input, const std::string& split = "auto");

}  // namespace data
}  // namespace dew
