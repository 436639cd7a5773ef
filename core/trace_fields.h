#pragma once
// The one validating reader of a trace's JSON fields, shared by the record decoders (records.cpp)
// and the reader's tensor table (trace_reader.cpp). Internal to retrace::core.

#include <retrace/number.h>
#include <retrace/trace.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace retrace::format {

// Reads the fields of one JSON object of a trace -- a record's metadata (records.cpp), an entry of
// its tensor table (trace_reader.cpp) -- trusting none of them: a missing required field or one
// of another type (a float or boolean where an integer belongs: nlohmann would convert it) is a
// kMalformed TraceError "SOURCE: WHAT's 'KEY' ... at byte offset N". Holds references: the object
// and `source` must outlive it.
class Fields {
 public:
  // `what` names the object in errors: "the step_end record", "tensor entry 3".
  Fields(const nlohmann::json& meta, const std::string& source, std::uint64_t offset, std::string what)
      : meta_(meta), source_(source), offset_(offset), what_(std::move(what)) {
    if (!meta.is_object()) fail("", "is not an object");
  }

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    std::string msg = source_ + ": " + what_ + "'s ";
    msg += key.empty() ? std::string("metadata") : "'" + key + "'";
    msg += " " + what + " at byte offset " + std::to_string(offset_);
    throw TraceError(TraceError::Kind::kMalformed, offset_, msg);
  }

  const nlohmann::json* find(const char* key) const {
    const auto it = meta_.find(key);
    return it == meta_.end() ? nullptr : &*it;
  }

  std::int64_t integer(const char* key, std::optional<std::int64_t> fallback = std::nullopt) const {
    const nlohmann::json* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "is missing");
    }
    if (!v->is_number_integer() ||
        (v->is_number_unsigned() && v->get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max())) {
      fail(key, "is not an integer (" + v->dump().substr(0, 40) + ")");
    }
    return v->get<std::int64_t>();
  }

  std::int64_t step(const char* key = "step") const {
    const std::int64_t s = integer(key);
    if (s < 0) fail(key, "is negative (" + std::to_string(s) + ")");
    return s;
  }

  // A number as json_number writes it: a JSON number, or "nan", "inf", "-inf".
  double number(const char* key, std::optional<double> fallback = std::nullopt) const {
    const nlohmann::json* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "is missing");
    }
    const std::optional<double> d = number_from_json(*v);
    if (!d) fail(key, "is not a number or \"nan\", \"inf\", \"-inf\" (" + v->dump().substr(0, 40) + ")");
    return *d;
  }

  bool flag(const char* key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(key, "is not true or false (" + v->dump().substr(0, 40) + ")");
    return v->get<bool>();
  }

  std::string text(const char* key, std::optional<std::string> fallback = std::nullopt) const {
    const nlohmann::json* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      fail(key, "is missing");
    }
    if (!v->is_string()) fail(key, "is not a string (" + v->dump().substr(0, 40) + ")");
    return v->get<std::string>();
  }

  std::vector<std::string> texts(const char* key) const {
    std::vector<std::string> out;
    const nlohmann::json* v = find(key);
    if (!v) return out;
    if (!v->is_array()) fail(key, "is not a list");
    for (const nlohmann::json& x : *v) {
      if (!x.is_string()) fail(key, "holds a non-string (" + x.dump().substr(0, 40) + ")");
      out.push_back(x.get<std::string>());
    }
    return out;
  }

  // A size or an offset: an integer from 0 to 2^64 - 1.
  std::uint64_t count(const char* key) const {
    const nlohmann::json* v = find(key);
    if (!v) fail(key, "is missing");
    if (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<std::int64_t>() >= 0)) {
      fail(key, "is not a non-negative integer (" + v->dump().substr(0, 40) + ")");
    }
    return v->get<std::uint64_t>();
  }

  std::vector<std::int64_t> integers(const char* key) const {
    const nlohmann::json* v = find(key);
    if (!v) fail(key, "is missing");
    if (!v->is_array()) fail(key, "is not a list");
    std::vector<std::int64_t> out;
    out.reserve(v->size());
    for (const nlohmann::json& x : *v) {
      if (!x.is_number_integer() ||
          (x.is_number_unsigned() && x.get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max())) {
        fail(key, "holds a non-integer (" + x.dump().substr(0, 40) + ")");
      }
      out.push_back(x.get<std::int64_t>());
    }
    return out;
  }

 private:
  const nlohmann::json& meta_;
  const std::string& source_;
  std::uint64_t offset_;
  std::string what_;
};

}  // namespace retrace::format
