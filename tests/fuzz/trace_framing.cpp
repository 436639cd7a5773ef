#include "trace_framing.h"

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <cstdio>
#include <cstring>

namespace retrace::fuzz {

namespace {

// docs/trace-format.md, version 1; from version 4 the payload checksum covers the metadata only
// and each stored tensor entry carries the checksum of its bytes.
constexpr std::size_t kFileHeaderBytes = 12;
constexpr std::size_t kRecordHeaderBytes = 24;
constexpr std::uint32_t kRecordMagic = 0x43455252;  // "RREC"
constexpr std::uint16_t kIndexType = 15;
constexpr char kTrailerMagic[8] = {'R', 'T', 'R', 'C', 'I', 'D', 'X', '\0'};
constexpr std::size_t kTrailerBytes = 16;
constexpr std::uint32_t kTensorChecksumVersion = 4;

// Version 4: `meta` with each stored tensor's `checksum` made right for the bytes its offset and
// stored_bytes name in `blob`; unchanged (the same text) when every checksum already was, or when
// the metadata is not an object with a tensor table.
std::string with_tensor_checksums(const std::string& meta, const std::string& blob) {
  nlohmann::json j = nlohmann::json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tensors") || !j["tensors"].is_array()) return meta;
  bool changed = false;
  for (nlohmann::json& e : j["tensors"]) {
    if (!e.is_object() || !e.contains("offset") || !e.contains("stored_bytes")) continue;
    const nlohmann::json& off = e["offset"];
    const nlohmann::json& len = e["stored_bytes"];
    if (!off.is_number_unsigned() || !len.is_number_unsigned()) continue;
    const auto at = off.get<std::uint64_t>(), n = len.get<std::uint64_t>();
    if (at > blob.size() || n > blob.size() - at) continue;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(XXH3_64bits(blob.data() + at, static_cast<std::size_t>(n))));
    if (!e.contains("checksum") || e["checksum"] != hex) {
      e["checksum"] = hex;
      changed = true;
    }
  }
  return changed ? j.dump() : meta;
}

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
void append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

}  // namespace

FramedTrace split_trace(const unsigned char* data, std::size_t size) {
  FramedTrace t;
  const std::size_t head = size < kFileHeaderBytes ? size : kFileHeaderBytes;
  t.file_header.assign(reinterpret_cast<const char*>(data), head);
  std::size_t pos = head;
  while (size - pos >= kRecordHeaderBytes) {
    const unsigned char* h = data + pos;
    const auto length = load<std::uint32_t>(h + 8);
    if (load<std::uint32_t>(h) != kRecordMagic || length > size - pos - kRecordHeaderBytes) break;
    FramedRecord r;
    r.type = load<std::uint16_t>(h + 4);
    r.flags = load<std::uint16_t>(h + 6);
    const char* payload = reinterpret_cast<const char*>(h + kRecordHeaderBytes);
    const std::uint32_t meta_len = length >= 4 ? load<std::uint32_t>(h + kRecordHeaderBytes) : 0;
    r.split = length >= 4 && meta_len <= length - 4;
    if (r.split) {
      r.meta.assign(payload + 4, meta_len);
      r.blob.assign(payload + 4 + meta_len, length - 4 - meta_len);
    } else {
      r.blob.assign(payload, length);
    }
    t.records.push_back(std::move(r));
    pos += kRecordHeaderBytes + length;
  }
  const std::size_t left = size - pos;
  if (!t.records.empty() && left == kTrailerBytes && std::memcmp(data + pos + 8, kTrailerMagic, 8) == 0) {
    t.trailer = true;
  } else {
    t.tail.assign(reinterpret_cast<const char*>(data + pos), left);
  }
  return t;
}

std::string seal_trace(const FramedTrace& trace, bool fix_index, bool fix_tensor_checksums) {
  std::string out = trace.file_header;
  std::uint32_t version = 0;
  if (out.size() >= kFileHeaderBytes)
    version = load<std::uint32_t>(reinterpret_cast<const unsigned char*>(out.data()) + 8);
  nlohmann::json listed = nlohmann::json::array();  // [type, offset, step?] of every record so far
  std::uint64_t index_offset = 0;
  for (const FramedRecord& r : trace.records) {
    const std::uint64_t offset = out.size();
    std::string meta = r.meta;
    if (r.type == kIndexType) {
      index_offset = offset;
      nlohmann::json j = fix_index && r.split ? nlohmann::json::parse(meta, nullptr, /*allow_exceptions=*/false)
                                              : nlohmann::json();
      if (j.is_object()) {
        j["records"] = listed;
        meta = j.dump();
      }
    }
    if (fix_tensor_checksums && r.split && version >= kTensorChecksumVersion)
      meta = with_tensor_checksums(meta, r.blob);
    std::string payload;
    if (r.split) {
      append(payload, static_cast<std::uint32_t>(meta.size()));
      payload += meta;
    }
    // Version 4 sums meta_len and the metadata; before it (or without a metadata length) all.
    const std::size_t summed = r.split && version >= kTensorChecksumVersion ? payload.size()
                                                                            : payload.size() + r.blob.size();
    payload += r.blob;
    const auto length = static_cast<std::uint32_t>(payload.size());
    const std::uint64_t seed = std::uint64_t{r.type} | (std::uint64_t{r.flags} << 16) | (std::uint64_t{length} << 32);
    append(out, kRecordMagic);
    append(out, r.type);
    append(out, r.flags);
    append(out, length);
    append(out, static_cast<std::uint64_t>(XXH3_64bits_withSeed(payload.data(), summed, seed)));
    append(out, static_cast<std::uint32_t>(XXH3_64bits(out.data() + offset, 20)));
    out += payload;

    if (r.type != kIndexType && r.type != 1) {  // the index lists every record but the header
      nlohmann::json item = {r.type, offset};
      if (r.split) {
        const nlohmann::json j = nlohmann::json::parse(r.meta, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("step")) item.push_back(j["step"]);
      }
      listed.push_back(std::move(item));
    }
  }
  if (trace.trailer) {
    append(out, index_offset);
    out.append(kTrailerMagic, sizeof kTrailerMagic);
  }
  out += trace.tail;
  return out;
}

}  // namespace retrace::fuzz
