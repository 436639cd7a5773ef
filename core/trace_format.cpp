#include "trace_format.h"

#include <retrace/error.h>

#include <c10/util/Exception.h>
#include <xxhash.h>

#include <cstring>

namespace retrace {

namespace format {

std::uint64_t payload_checksum_seed(std::uint16_t type, std::uint16_t flags, std::uint32_t length) {
  return std::uint64_t{type} | (std::uint64_t{flags} << 16) | (std::uint64_t{length} << 32);
}

void encode_header(const RecordHeader& h, unsigned char* out) {
  std::memcpy(out, &h.magic, 4);
  std::memcpy(out + 4, &h.type, 2);
  std::memcpy(out + 6, &h.flags, 2);
  std::memcpy(out + 8, &h.length, 4);
  std::memcpy(out + 12, &h.payload_checksum, 8);
  const auto check = static_cast<std::uint32_t>(XXH3_64bits(out, 20));
  std::memcpy(out + 20, &check, 4);
}

RecordHeader decode_header(const unsigned char* raw) {
  RecordHeader h;
  std::memcpy(&h.magic, raw, 4);
  std::memcpy(&h.type, raw + 4, 2);
  std::memcpy(&h.flags, raw + 6, 2);
  std::memcpy(&h.length, raw + 8, 4);
  std::memcpy(&h.payload_checksum, raw + 12, 8);
  std::memcpy(&h.header_checksum, raw + 20, 4);
  return h;
}

bool header_checksum_matches(const RecordHeader& h, const unsigned char* raw) {
  return h.header_checksum == static_cast<std::uint32_t>(XXH3_64bits(raw, 20));
}

namespace {
struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "float32"},
    {at::kDouble, "float64"},
    {at::kHalf, "float16"},
    {at::kBFloat16, "bfloat16"},
    {at::kByte, "uint8"},
    {at::kChar, "int8"},
    {at::kShort, "int16"},
    {at::kInt, "int32"},
    {at::kLong, "int64"},
    {at::kBool, "bool"},
    {at::kComplexFloat, "complex64"},
    {at::kComplexDouble, "complex128"},
};
}  // namespace

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  throw Error(std::string("the trace format cannot store dtype ") + c10::toString(t));
}

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  return std::nullopt;
}

}  // namespace format

const char* to_string(RecordType type) {
  switch (type) {
    case RecordType::kHeader: return "header";
    case RecordType::kStepBegin: return "step_begin";
    case RecordType::kSegment: return "segment";
    case RecordType::kStepEnd: return "step_end";
    case RecordType::kEvent: return "event";
    case RecordType::kCollective: return "collective";
    case RecordType::kIndex: return "index";
  }
  return "unknown";
}

}  // namespace retrace
