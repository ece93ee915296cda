// Registries: build things by name from JSON, list their entries and fields.
//
//   Registry<Schedule>& schedules();                      // one accessor per kind of thing
//   schedules().add<CosineOptions>("cosine", "doc", [](const CosineOptions& o) { return ...; });
//   auto s = schedules().build("cosine", {{"beta_end", 1.0}});
//   auto s = schedules().build(json{{"name", "cosine"}, {"beta_end", 1.0}});
//
// Built-in entries are added inside the accessor on first use (no static-initialisation order issues,
// nothing dropped by the static linker).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew {

/// Description of one registry entry: its name, one line of documentation and its option fields.
struct EntryInfo {
  std::string name;
  std::string doc;
  std::vector<FieldInfo> fields;
};

/// Type-erased view of a registry, for listings (`dew list`).
class RegistryBase {
 public:
  virtual ~RegistryBase() = default;
  virtual const std::string& kind() const = 0;
  virtual std::vector<EntryInfo> entries() const = 0;
};

template <class Base, class... Args>
class Registry : public RegistryBase {
 public:
  using Ptr = std::shared_ptr<Base>;
  using Factory = std::function<Ptr(const json& fields, const std::string& where, Args...)>;

  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  /// Adds an entry whose options struct `Opt` is parsed from JSON before `make` is called.
  template <class Opt, class Make>
  void add(const std::string& name, const std::string& doc, Make make) {
    Entry e;
    e.info = {name, doc, fields_of<Opt>()};
    e.factory = [make](const json& fields, const std::string& where, Args... args) -> Ptr {
      return make(from_json<Opt>(fields, where), args...);
    };
    entries_[name] = std::move(e);
  }

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }

  /// Builds entry `name` from its fields; unknown names and fields throw dew::Error listing valid ones.
  Ptr build(const std::string& name, const json& fields, Args... args) const {
    return find(name).factory(fields, kind_ + " \"" + name + "\"", args...);
  }

  /// Builds from a spec object {"name": NAME, field: value, ...} (or a bare string NAME).
  Ptr build(const json& spec, Args... args) const {
    if (spec.is_string()) return build(spec.get<std::string>(), json::object(), args...);
    DEW_CHECK(spec.is_object() && spec.contains("name") && spec["name"].is_string(), kind_,
              ": expected {\"name\": ..., fields...} or a name, got ", spec.dump());
    json fields = spec;
    fields.erase("name");
    return build(spec["name"].get<std::string>(), fields, args...);
  }

  const EntryInfo& info(const std::string& name) const { return find(name).info; }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& kv : entries_) out.push_back(kv.first);
    return out;
  }

  const std::string& kind() const override { return kind_; }
  std::vector<EntryInfo> entries() const override {
    std::vector<EntryInfo> out;
    for (const auto& kv : entries_) out.push_back(kv.second.info);
    return out;
  }

 private:
  struct Entry {
    EntryInfo info;
    Factory factory;
  };
  const Entry& find(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      std::string valid;
      for (const auto& kv : entries_) valid += (valid.empty() ? "" : ", ") + kv.first;
      fail("unknown ", kind_, " \"", name, "\"; registered: ", valid);
    }
    return it->second;
  }
  std::string kind_;
  std::map<std::string, Entry> entries_;
};

/// Renders a registry's entries with their fields and defaults.
std::string format_registry(const RegistryBase& r);

}  // namespace dew
