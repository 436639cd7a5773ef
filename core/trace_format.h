#pragma once
// The trace file's framing, shared by TraceWriter (trace_writer.cpp) and TraceReader
// (trace_reader.cpp), as leveldb's log_format.h is by its log writer and reader: the constants,
// the 24-byte record header and its checksums, and the dtype names. docs/trace-format.md is the
// spec. Internal to retrace::core.

#include <retrace/trace.h>

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace retrace::format {

constexpr std::uint32_t kRecordMagic = 0x43455252;  // "RREC"
constexpr std::size_t kFileHeaderBytes = 12;        // magic + version
constexpr std::size_t kRecordHeaderBytes = 24;
constexpr char kTrailerMagic[8] = {'R', 'T', 'R', 'C', 'I', 'D', 'X', '\0'};
constexpr std::size_t kTrailerBytes = 16;
constexpr int kMaxRank = 64;
// From this version on, a record's payload checksum covers u32 meta_len and the metadata only,
// and every stored tensor entry carries `checksum`, the XXH3-64 of its stored bytes (16 lowercase
// hex digits); the stored entries lie back to back in table order and fill the blob.
constexpr std::uint32_t kTensorChecksumVersion = 4;

struct RecordHeader {
  std::uint32_t magic;
  std::uint16_t type;
  std::uint16_t flags;
  std::uint32_t length;
  std::uint64_t payload_checksum;
  std::uint32_t header_checksum;
};

// The payload checksum is XXH3-64 of the payload seeded with this: type | flags << 16 |
// length << 32. Writer and reader hash the payload in pieces (XXH3's streaming state gives the
// same value as the one-shot call).
std::uint64_t payload_checksum_seed(std::uint16_t type, std::uint16_t flags, std::uint32_t length);
// Writes the 24 bytes of `h`, its header checksum computed over the first 20.
void encode_header(const RecordHeader& h, unsigned char* out);
// The fields of 24 header bytes as they are (nothing checked).
RecordHeader decode_header(const unsigned char* raw);
// True when the stored header checksum matches bytes 0..19.
bool header_checksum_matches(const RecordHeader& h, const unsigned char* raw);

// dtypes by name (stable across torch versions, unlike enum values). dtype_name throws
// retrace::Error for a dtype the format cannot store.
const char* dtype_name(at::ScalarType t);
std::optional<at::ScalarType> dtype_from_name(const std::string& name);

}  // namespace retrace::format
