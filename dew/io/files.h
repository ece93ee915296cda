// Small-file helpers every layer that writes a run directory or reads a text file uses: whole-file reads,
// atomic writes (a crash leaves the old file or the new one, never a torn one), fsync, and cutting a
// step-stamped JSON-lines file back to a step.
#pragma once
#include <cstdint>
#include <string>

namespace dew::io {

/// The bytes of the file at `path`; a missing, unreadable or directory path is a dew::Error naming `what`
/// and the path.
std::string read_file(const std::string& path, const std::string& what);

/// Writes `content` to `path` through `path + ".tmp"`, fsync and rename; failures are a dew::Error naming
/// the path.
void write_file_atomic(const std::string& path, const std::string& content);

/// fsync of a file or a directory (so a rename inside it is durable); a path that cannot be opened is
/// skipped.
void fsync_path(const std::string& path);

/// Keeps the leading lines of a JSON-lines file of step-stamped objects whose step is at most `step`; the
/// first torn or later line ends what is kept (a resumed run rewrites what came after its checkpoint;
/// step 0 empties the file). A missing file is left missing. Rewritten atomically.
void truncate_jsonl(const std::string& path, int64_t step);

}  // namespace dew::io
