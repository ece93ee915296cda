// Options <-> JSON by reflection. An options struct lists and documents its fields once, in a `visit` method:
//
//   struct CosineOptions {
//     int64_t timesteps = 1000;
//     double beta_end = 0.999;
//     template <class V> void visit(V& v) {
//       v("timesteps", timesteps, "number of discrete steps T");
//       v("beta_end", beta_end, "upper clip of each beta_i");
//     }
//   };
//
// and gets to_json, from_json (rejecting unknown fields and wrong types with the valid ones named)
// and a field listing with defaults, for `dew list` and `--help`.
//
// A struct of chaining setters (the nn options) declares each field once, as a row of an X-macro list:
// F(type, name, default, doc), or C(name, default, (accepted strings), doc) for a string field that takes
// one of a list. DEW_OPTIONS expands the list into TORCH_ARG members (`o.patch_size()`, `o.patch_size(2)`
// returning the struct, member patch_size_) and into `visit`, in the order of the rows:
//
//   struct PatchOptions {
//   #define DEW_PATCH_FIELDS(F, C)    <- each line of the list but the last ends in a backslash
//     F(int64_t, patch_size, 16, "patch side in pixels")
//     F(std::vector<int64_t>, depths, (std::vector<int64_t>{2, 2}), "blocks per level")
//     C(scan_order, "raster", ({"raster", "hilbert"}), "token order of the patch grid")
//     DEW_OPTIONS(DEW_PATCH_FIELDS)
//   #undef DEW_PATCH_FIELDS
//   };
//
// A default holding a comma goes in parentheses, as the accepted strings always do. A visit that does more
// (a base struct's fields first, a second group of fields) is written with the two halves of DEW_OPTIONS:
// DEW_OPTION_MEMBERS(LIST) declares the members, DEW_VISIT_FIELDS(LIST) visits them with the visitor `v`.
#pragma once
#include <torch/arg.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/error.h"

namespace dew {

using json = nlohmann::json;

/// The options of a registry entry that takes none (`{}` is its only valid JSON).
struct NoOptions {
  template <class V>
  void visit(V&) {}
};

/// A field that may be absent: written only when it holds a value (the key is left out, not null), read as empty
/// when absent or null. For recipe sections a run records only when used (a pixel run has no `autoencoder`).
template <class T>
struct Omittable : std::optional<T> {
  using std::optional<T>::optional;
  using std::optional<T>::operator=;
};

/// One field of an options struct as shown to users.
struct FieldInfo {
  std::string name;
  std::string type;    // "int", "float", "bool", "string", "list[int]", ...
  json default_value;  // the value a default-constructed struct holds
  std::string doc;
  std::vector<std::string> choices;  // accepted strings, when the field is an enumeration
};

namespace options_detail {

template <class T, class = void>
struct has_visit : std::false_type {};
struct NullVisitor {
  template <class F>
  void operator()(const char*, F&, const char*) {}
  template <class F>
  void choice(const char*, F&, std::vector<std::string>, const char*) {}
};
template <class T>
struct has_visit<T, std::void_t<decltype(std::declval<T&>().visit(std::declval<NullVisitor&>()))>> : std::true_type {};

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_omittable : std::false_type {};
template <class T>
struct is_omittable<Omittable<T>> : std::true_type {};
template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "int";
  else if constexpr (std::is_floating_point_v<T>) return "float";
  else if constexpr (std::is_same_v<T, std::string>) return "string";
  else if constexpr (std::is_same_v<T, json>) return "object";
  else if constexpr (is_optional<T>::value) return type_name<typename T::value_type>() + " | null";
  else if constexpr (is_omittable<T>::value) return type_name<typename T::value_type>() + " | absent";
  else if constexpr (is_vector<T>::value) return "list[" + type_name<typename T::value_type>() + "]";
  else if constexpr (is_pair<T>::value)
    return "[" + type_name<typename T::first_type>() + ", " + type_name<typename T::second_type>() + "]";
  else if constexpr (has_visit<T>::value) return "object";
  else static_assert(sizeof(T) == 0, "unsupported option field type");
}

template <class T>
json to_value(const T& v);
template <class T>
void from_value(const json& j, T& out, const std::string& where);

template <class T>
struct Writer {
  json out = json::object();
  template <class F>
  void operator()(const char* name, const F& f, const char*) {
    if constexpr (is_omittable<F>::value) {
      if (f) out[name] = to_value(*f);
    } else {
      out[name] = to_value(f);
    }
  }
  template <class F>
  void choice(const char* name, const F& f, const std::vector<std::string>&, const char*) {
    out[name] = to_value(f);
  }
};

template <class T>
json to_value(const T& v) {
  if constexpr (is_optional<T>::value || is_omittable<T>::value) return v ? to_value(*v) : json(nullptr);
  else if constexpr (is_vector<T>::value) {
    json a = json::array();
    for (const auto& e : v) a.push_back(to_value(e));
    return a;
  } else if constexpr (is_pair<T>::value) return json::array({to_value(v.first), to_value(v.second)});
  else if constexpr (has_visit<T>::value) {
    Writer<T> w;
    const_cast<T&>(v).visit(w);
    return w.out;
  } else return json(v);
}

std::string describe(const json& j);  // short rendering of a value for error messages

struct Reader {
  const json* in;
  std::string where;
  std::set<std::string> seen;
  template <class F>
  void operator()(const char* name, F& f, const char*) {
    seen.insert(name);
    auto it = in->find(name);
    if (it != in->end()) from_value(*it, f, where.empty() ? name : where + "." + name);
  }
  template <class F>
  void choice(const char* name, F& f, const std::vector<std::string>& ok, const char* doc) {
    (*this)(name, f, doc);
    bool valid = false;
    for (const auto& c : ok) valid |= (c == f);
    if (!valid) {
      std::string list;
      for (const auto& c : ok) list += (list.empty() ? "" : ", ") + c;
      fail(where.empty() ? name : where + "." + name, ": got \"", f, "\", accepted: ", list);
    }
  }
};

template <class T>
void from_value(const json& j, T& out, const std::string& where) {
  auto bad = [&](const std::string& want) { fail(where, ": expected ", want, ", got ", describe(j)); };
  if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) bad("bool");
    out = j.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    // Range-checked before converting: a number the field cannot hold is refused with the value written,
    // never wrapped (uint64 -> int64) or cast out of range (undefined for a double).
    using Limits = std::numeric_limits<T>;
    auto out_of_range = [&] {
      bad("an integer in [" + std::to_string(Limits::min()) + ", " + std::to_string(Limits::max()) + "]");
    };
    if (j.is_number_float()) {
      const double d = j.get<double>();
      if (!std::isfinite(d) || std::floor(d) != d) bad("an integer");
      // [min, max] as doubles: min is -2^digits (or 0), max + 1 is 2^digits, both exact.
      const double top = std::ldexp(1.0, Limits::digits);
      if (d < (Limits::is_signed ? -top : 0.0) || d >= top) out_of_range();
      out = static_cast<T>(d);
    } else if (j.is_number_unsigned()) {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(Limits::max())) out_of_range();
      out = static_cast<T>(u);
    } else if (j.is_number_integer()) {
      const int64_t v = j.get<int64_t>();
      if (Limits::is_signed ? (v < static_cast<int64_t>(Limits::min()) || v > static_cast<int64_t>(Limits::max()))
                            : (v < 0 || static_cast<uint64_t>(v) > static_cast<uint64_t>(Limits::max())))
        out_of_range();
      out = static_cast<T>(v);
    } else {
      bad("an integer");
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!j.is_number()) bad("a number");
    const double d = j.get<double>();
    // A float field refuses a finite double beyond its range (the conversion would be undefined).
    if (std::isfinite(d) && std::fabs(d) > static_cast<double>(std::numeric_limits<T>::max()))
      bad("a number of magnitude at most " + json(static_cast<double>(std::numeric_limits<T>::max())).dump());
    out = static_cast<T>(d);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!j.is_string()) bad("a string");
    out = j.get<std::string>();
  } else if constexpr (std::is_same_v<T, json>) {
    out = j;
  } else if constexpr (is_optional<T>::value || is_omittable<T>::value) {
    if (j.is_null()) {
      out.reset();
    } else {
      typename T::value_type v{};
      from_value(j, v, where);
      out = v;
    }
  } else if constexpr (is_vector<T>::value) {
    if (!j.is_array()) bad("a list of " + type_name<typename T::value_type>());
    out.clear();
    for (size_t i = 0; i < j.size(); ++i) {
      typename T::value_type v{};
      from_value(j[i], v, where + "[" + std::to_string(i) + "]");
      out.push_back(v);
    }
  } else if constexpr (is_pair<T>::value) {
    if (!j.is_array() || j.size() != 2) bad("a pair " + type_name<T>());
    from_value(j[0], out.first, where + "[0]");
    from_value(j[1], out.second, where + "[1]");
  } else if constexpr (has_visit<T>::value) {
    if (!j.is_object()) bad("an object");
    Reader r{&j, where, {}};
    out.visit(r);
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!r.seen.count(it.key())) {
        std::string valid;
        for (const auto& s : r.seen) valid += (valid.empty() ? "" : ", ") + s;
        fail(where.empty() ? "" : where + ": ", "unknown field \"", it.key(), "\"; valid fields: ", valid);
      }
    }
  }
}

struct Lister {
  std::vector<FieldInfo> fields;
  template <class F>
  void operator()(const char* name, const F& f, const char* doc) {
    fields.push_back({name, type_name<F>(), to_value(f), doc, {}});
  }
  template <class F>
  void choice(const char* name, const F& f, const std::vector<std::string>& ok, const char* doc) {
    fields.push_back({name, type_name<F>(), to_value(f), doc, ok});
  }
};

}  // namespace options_detail

/// Serialises an options struct (every field, defaults included).
template <class T>
json to_json(const T& options) {
  return options_detail::to_value(options);
}

/// Parses an options struct from a JSON object. Missing fields keep their defaults; an unknown field or a
/// value of the wrong type throws dew::Error naming the field (prefixed by `where`) and what is valid.
template <class T>
T from_json(const json& j, const std::string& where = "") {
  T out{};
  if (j.is_null()) return out;
  options_detail::from_value(j, out, where);
  return out;
}

/// The fields of an options struct with their types, defaults and docs.
template <class T>
std::vector<FieldInfo> fields_of() {
  T v{};
  options_detail::Lister l;
  v.visit(l);
  return l.fields;
}

/// Renders field listings as aligned text lines ("  name  type  = default  doc").
std::string format_fields(const std::vector<FieldInfo>& fields, const std::string& indent = "  ");

}  // namespace dew

// The rows of a field list as members and as visits (see the top of this file).
#define DEW_OPTION_MEMBER_(T, name, init, doc) TORCH_ARG(T, name) = init;
#define DEW_CHOICE_MEMBER_(name, init, choices, doc) TORCH_ARG(std::string, name) = init;
#define DEW_VISIT_OPTION_(T, name, init, doc) v(#name, name##_, doc);
#define DEW_VISIT_CHOICE_(name, init, choices, doc) v.choice(#name, name##_, std::vector<std::string> choices, doc);

/// The members of a field list (access is private after it).
#define DEW_OPTION_MEMBERS(FIELDS) FIELDS(DEW_OPTION_MEMBER_, DEW_CHOICE_MEMBER_)
/// Statements visiting a field list's members with the visitor `v`, in the order of the rows.
#define DEW_VISIT_FIELDS(FIELDS) FIELDS(DEW_VISIT_OPTION_, DEW_VISIT_CHOICE_)
/// The members of a field list and `visit` over them.
#define DEW_OPTIONS(FIELDS)  \
  DEW_OPTION_MEMBERS(FIELDS) \
                             \
 public:                     \
  template <class V>         \
  void visit(V& v) {         \
    DEW_VISIT_FIELDS(FIELDS) \
  }
