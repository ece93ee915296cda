// Small-file helpers every layer that writes a run directory or reads a text file uses: whole-file reads,
// atomic writes (a crash leaves the old file or the new one, never a torn one), fsync, and cutting a
// step-stamped JSON-lines file back to a step.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace dew::io {

/// The bytes of the file at `path`; a missing, unreadable or directory path is a dew::Error naming `what`
/// and the path.
std::string read_file(const std::string& path, const std::string& what);

/// Deepest nesting of arrays and objects a JSON document handed to Dew may have. Recipes, run records and
/// checkpoints' state nest a few levels; copying, comparing and printing a value recurse once per level, so
/// a document nested tens of thousands of levels deep would overflow the stack long after it was parsed.
inline constexpr int kMaxJsonDepth = 64;

/// Refuses (dew::Error naming `what`) a JSON text whose arrays and objects nest deeper than kMaxJsonDepth,
/// before it is parsed. Brackets inside strings do not count; the text need not be valid JSON.
void check_json_depth(const std::string& text, const std::string& what);

/// Refuses (dew::Error naming `what`) a JSON value holding a string (or an object key) that is not valid UTF-8:
/// JSON text is UTF-8, and such a value could not be written to run.json or printed. Command-line values and
/// paths may hold any bytes (a Latin-1 file name); they are checked before they enter a recipe.
void check_json_utf8(const nlohmann::json& value, const std::string& what);

/// The JSON document in `text`: its depth checked first (check_json_depth), then parsed; invalid JSON is a
/// dew::Error naming `what` and the parser's position.
nlohmann::json parse_json(const std::string& text, const std::string& what);

/// Writes `content` to `path` through `path + ".tmp"`, fsync and rename; failures are a dew::Error naming
/// the path.
void write_file_atomic(const std::string& path, const std::string& content);

/// Refuses (dew::Error naming `what`, the link and its target) a model, pipeline, adapter or tokenizer folder
/// that holds a symbolic link resolving outside the folder, so that nothing Dew reads through it leaves the
/// tree the user named. The folder itself may be a link. A folder inside a Hugging Face cache snapshot
/// (`.../models--ORG--NAME/snapshots/REV/...`) may link anywhere inside its repository's cache folder (its files
/// are links into `blobs/`). Links to folders are followed (inside the tree, 32 levels at most); a folder of
/// more than 100000 entries is refused. A missing folder or a file is left to the caller.
void check_folder_links(const std::string& dir, const std::string& what);

/// fsync of a file or a directory (so a rename inside it is durable); a path that cannot be opened is
/// skipped.
void fsync_path(const std::string& path);

/// Keeps the leading lines of a JSON-lines file of step-stamped objects whose step is at most `step`; the
/// first torn or later line ends what is kept (a resumed run rewrites what came after its checkpoint;
/// step 0 empties the file). A missing file is left missing. Rewritten atomically.
void truncate_jsonl(const std::string& path, int64_t step);

/// An exclusive lock on the file `path` (created if missing), held until destruction: flock(2), which the
/// kernel releases when the holder exits however it ends, so the lock of a killed process is free at once
/// and is taken over without any clean-up. The holder writes its PID into the file for the message others
/// get. Not inherited by child processes (close-on-exec).
class FileLock {
 public:
  /// Takes the lock; when another process holds it, a dew::Error: "`what` is being written by process PID
  /// (`path`); `advice`".
  FileLock(const std::string& path, const std::string& what, const std::string& advice);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  /// The same dew::Error as the constructor's when another process holds the lock on `path`; creates and
  /// takes nothing (a check before expensive work; the constructor still decides).
  static void check_free(const std::string& path, const std::string& what, const std::string& advice);

 private:
  int fd_ = -1;
};

}  // namespace dew::io
