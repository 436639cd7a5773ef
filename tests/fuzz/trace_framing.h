#pragma once
// The trace framing of docs/trace-format.md, written again from the spec for the trace fuzzer's
// mutator: split a trace into its records' metadata and blobs, change them, and seal it again —
// record lengths, metadata lengths, both checksums, the index's offsets and the trailer made
// right — so that a mutation reaches the metadata, tensor-table and codec checks behind the
// checksums instead of stopping at the first checksum mismatch.
//
// Independent of core/trace_reader.cpp and core/trace_format.cpp on purpose: it shares no code with the reader it feeds.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace retrace::fuzz {

struct FramedRecord {
  std::uint16_t type = 0;
  std::uint16_t flags = 0;
  // split(): true when the payload held a metadata length in bounds; then `meta` and `blob` are
  // the payload. False: `blob` is the whole payload, kept as it is (seal() writes it unchanged).
  bool split = true;
  std::string meta;  // JSON text
  std::string blob;
};

struct FramedTrace {
  std::string file_header;  // magic and version: the first 12 bytes (fewer in a short file)
  std::vector<FramedRecord> records;
  bool trailer = false;  // a 16-byte trailer followed the records
  std::string tail;      // bytes after the last record that are not a trailer, kept as they are
};

// Splits `data` along its record headers. Lenient: where framing stops making sense (bad record
// magic, a length past the end) the rest is kept as `tail`. Checksums are not verified.
FramedTrace split_trace(const unsigned char* data, std::size_t size);

// Writes `trace` back with every record length, metadata length and checksum recomputed (from
// format version 4, read from the file header, and with `fix_tensor_checksums`: each stored tensor
// entry's `checksum` too, for the bytes its offset and stored_bytes name; the metadata is
// rewritten only if one changed). When
// `fix_index` is set, an index record that parses as JSON gets its `records` list rebuilt from
// the records before it, and the trailer points at the last index record.
std::string seal_trace(const FramedTrace& trace, bool fix_index, bool fix_tensor_checksums = true);

}  // namespace retrace::fuzz
