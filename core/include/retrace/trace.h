#pragma once
// The trace format: a versioned header, then append-only records (type, length, checksum), tensor
// payloads compressed either fast (Blosc: bit-shuffle + LZ4) or small (byte shuffle + zstd with
// its frame checksum), and an index at the end. The spec, with every field's invariants, is docs/trace-format.md.
//
// A trace being written is NAME.incomplete; close() writes the index, fsyncs and renames it to
// NAME. A truncated tail is a clean end: every complete record stays readable, with a warning.
// The reader checks every length and offset before it allocates, caps sizes, and fails with a
// TraceError naming the byte offset. Nothing in a trace is ever unpickled.

#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/io.h>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10 {
class ThreadPool;
}  // namespace c10

namespace retrace {

// File magic, then kTraceFormatVersion as u32.
inline constexpr char kTraceMagic[8] = {'R', 'E', 'T', 'R', 'A', 'C', 'E', '\0'};
// Bumped on any change an older reader could misread. Readers accept versions <= their own.
// Version 2 added codec 3 (Blosc); version 3 the collective record (data-parallel runs); version 4
// a checksum of each stored tensor's bytes, the record checksum then covering the metadata only
// (opening a trace reads no tensor bytes). Older traces read unchanged.
inline constexpr std::uint32_t kTraceFormatVersion = 4;

enum class RecordType : std::uint16_t {
  kHeader = 1,      // exactly one, first: writer, environment, program
  kStepBegin = 2,   // state before a step: full tensors or digests; batch and RNG always full
  kSegment = 3,     // one checkpointed segment's event: forward, recompute or backward
  kStepEnd = 4,     // loss, grad norm, scale, skipped, grad and post-step state digests
  kEvent = 5,       // a note: flight-ring dump, exception, signal, injected fault tag
  kCollective = 6,  // one collective of a data-parallel step: key, contribution, result (version 3+)
  kIndex = 15,      // last: offsets of every record, for random access
};
const char* to_string(RecordType type);

// How a tensor's bytes are stored.
enum class TensorCodec : std::uint8_t {
  kDigestOnly = 0,          // no data, only the digest
  kZstd = 1,                // zstd frame of the raw little-endian bytes
  kZstdShuffle = 2,         // zstd frame of the bytes regrouped by byte position (all byte 0s, ...)
  kBloscBitshuffleLz4 = 3,  // Blosc buffer: bits regrouped by bit position, then LZ4 (version 2+)
};
// "digest-only", "zstd", "zstd+shuffle", "blosc-bitshuffle-lz4".
const char* to_string(TensorCodec codec);

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
  Digest digest;
  TensorCodec codec = TensorCodec::kDigestOnly;
  std::uint64_t raw_bytes = 0;     // numel * element size
  std::uint64_t offset = 0;        // into the record's blob
  std::uint64_t stored_bytes = 0;  // compressed size
  // XXH3-64 of the stored bytes (format version 4+; 0 in older traces, whose record checksum
  // covers them): decode() checks it before decoding.
  std::uint64_t checksum = 0;
  bool has_data() const { return codec != TensorCodec::kDigestOnly; }
};

struct Record {
  RecordType type = RecordType::kEvent;
  std::uint64_t offset = 0;  // byte offset of the record header in the file
  nlohmann::json meta;       // record-specific fields (docs/trace-format.md); the tensor table is `tensors`
  std::vector<TensorEntry> tensors;
  std::string blob;           // the stored tensor bytes; empty after TraceReader::read_table()
  bool has_blob = true;       // false after read_table(): decode() reads each tensor's bytes itself
  std::uint64_t blob_at = 0;  // file offset of the stored tensor bytes (where entry offsets count from)
  const TensorEntry* find(const std::string& name) const;
};

// A tensor to append: data stored (compressed) or only its digest.
struct TensorToWrite {
  std::string name;
  at::Tensor tensor;  // any device; copied to host when stored
  bool store_data = false;
  std::optional<Digest> digest;  // precomputed (e.g. on device); else computed on the host
  // For a digest-only entry without `tensor` (cheaper than a tensor to carry): its dtype and
  // shape. Ignored when `tensor` is defined.
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
  // When set, the writer calls it before reading `tensor`: an asynchronous device-to-host copy
  // (snapshot_to_host) is still in flight.
  std::function<void()> ready;
  // When set and `digest` is not: the digest, finished by the writer (digest_async).
  std::function<Digest()> digest_later;

  // A digest-only entry: name, digest, dtype and shape of `t`, no data and no tensor kept.
  static TensorToWrite digest_only(std::string name, const at::Tensor& t, const Digest& d);
  // A digest-only entry whose digest may still be computing on a device.
  static TensorToWrite digest_only(std::string name, const at::Tensor& t, const PendingDigest& d);
};

enum class ShuffleMode { kAuto, kAlways, kNever };

// What the writer optimizes stored tensors for (bench/README.md has the ratios and speeds):
//   kFast:  Blosc bit-shuffle + LZ4 (codec 3): the default, so that full mode and ring dumps cost
//           the writer thread little.
//   kSmall: byte shuffle (ShuffleMode) + zstd (codecs 1/2): smaller and several times slower to
//           encode; for traces kept long or shipped over a slow link.
enum class Compression { kFast, kSmall };
const char* to_string(Compression c);

inline constexpr int kDefaultZstdLevel = -20;

struct WriterOptions {
  Compression compression = Compression::kFast;
  // kSmall's zstd level. The default is zstd's fastest level with Huffman coding of literals
  // forced on, chosen over levels 1 and 3 by bench/README.md's recorder figures.
  int zstd_level = kDefaultZstdLevel;
  // kAuto: shuffle floating-point tensors of 2+ byte elements (bench/README.md).
  ShuffleMode shuffle = ShuffleMode::kAuto;
  // Threads that encode a record's stored tensors: the appending thread and encode_threads - 1
  // more, started with the writer and kept for its life (c10::ThreadPool), each taking whole
  // tensors, largest first. 0: automatic, a quarter of the machine's cores, at least 1 and at most
  // 8 (on 2 cores 1: a second one competes with the training's intra-op threads and measured no
  // faster there). The trace's bytes are the same whatever the count; bench/README.md has the
  // speeds.
  int encode_threads = 0;
  // The trace's newest bytes left in the page cache. After each record the trace's bytes are
  // written back as it grows and those further behind its end dropped from the page cache
  // (io::WritableFile::release_before): a long full-mode run neither fills the page cache with
  // its trace, evicting the training data, nor asks the kernel for never-used pages at every
  // write (the cost of a full-mode step on a VM, bench/README.md). A failure to start that
  // write-back throws from append() after the record is written and indexed. 0: off; the kernel
  // decides, as for any file.
  std::uint64_t page_cache_window = std::uint64_t{64} << 20;
  io::FileSystem* fs = nullptr;  // nullptr: the POSIX file system
};
// WriterOptions::encode_threads resolved: `requested` when positive, else automatic.
int resolve_encode_threads(int requested);

// Writes one trace. Not thread-safe: one thread appends (the recorder's writer thread).
class TraceWriter {
 public:
  // Creates PATH.incomplete and writes the header record. `header` is stored as the header's
  // meta, with format_version added.
  TraceWriter(std::string path, nlohmann::json header, WriterOptions options = {});
  ~TraceWriter();  // without close(): the .incomplete file stays, readable up to its last record
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  // Encodes and appends one record; returns its byte offset. Cost: host copy and compression of
  // stored tensors, XXH3 of digest-only ones.
  std::uint64_t append(RecordType type, nlohmann::json meta, const std::vector<TensorToWrite>& tensors);
  // The same, taking the entries' names and shapes over instead of copying them.
  std::uint64_t append(RecordType type, nlohmann::json meta, std::vector<TensorToWrite>&& tensors);
  // fsync: everything appended so far survives a crash.
  void sync();
  // Index, trailer, fsync, rename to the final name, fsync of the directory. Idempotent.
  void close();
  bool closed() const { return closed_; }
  const std::string& path() const { return path_; }
  std::string incomplete_path() const { return path_ + ".incomplete"; }
  std::uint64_t bytes_written() const;

 private:
  // `blob`: the record's stored tensor bytes, `blob_size` in all, in pieces where they lie.
  void write_record(RecordType type, const nlohmann::json& meta, const std::vector<io::ConstBytes>& blob,
                    std::uint64_t blob_size, const std::vector<TensorEntry>& tensors);
  // append(); `take`: the caller gave `tensors` up (the && overload), names and shapes are moved.
  std::uint64_t append_entries(RecordType type, nlohmann::json meta, const std::vector<TensorToWrite>& tensors,
                               bool take);
  // Room for `bytes` in blob_ (not zeroed).
  char* blob_room(std::size_t bytes);
  std::string path_;
  WriterOptions options_;
  io::FileSystem* fs_;
  std::unique_ptr<io::WritableFile> file_;
  nlohmann::json index_ = nlohmann::json::array();
  bool closed_ = false;
  // A record's stored tensors, encoded into it; kept for the next record. Over kKeptBlobBytes, only
  // while such records keep coming (a full-mode step has one, a digest run's snapshot every K
  // steps does not): freed after kLargeBlobIdleAppends appends that needed less. Fresh pages for
  // every large record had cost the writer more than encoding them (bench/README.md).
  std::unique_ptr<char[]> blob_;
  std::size_t blob_capacity_ = 0;
  // The record head being written (write_record), kept for the next record up to kKeptHeadBytes.
  std::string head_;
  static constexpr std::size_t kKeptHeadBytes = std::size_t{1} << 20;
  int appends_since_large_ = 0;
  static constexpr std::size_t kKeptBlobBytes = std::size_t{64} << 20;
  static constexpr int kLargeBlobIdleAppends = 64;
  // The encode_threads - 1 helpers; null with one encode thread.
  std::unique_ptr<c10::ThreadPool> pool_;
  int encode_threads_ = 1;
};

// A trace that cannot be read past some point.
class TraceError : public Error {
 public:
  enum class Kind { kIo, kBadMagic, kVersion, kChecksum, kMalformed, kTooLarge };
  TraceError(Kind kind, std::uint64_t offset, const std::string& what) : Error(what), kind_(kind), offset_(offset) {}
  Kind kind() const noexcept { return kind_; }
  std::uint64_t offset() const noexcept { return offset_; }

 private:
  Kind kind_;
  std::uint64_t offset_;
};

// The reader's caps. TraceWriter refuses to write what the default ReaderOptions would refuse to
// read (a clear retrace::Error when the record is appended; the header's, when the writer is
// created, before any training), so every trace retrace writes reads back with the defaults.
struct ReaderOptions {
  // Every record's length is a u32: by default the format's own limit (a full-mode snapshot of a
  // 100 M-parameter model with AdamW is over 1 GiB). A reader of untrusted files may set less.
  std::uint64_t max_record_bytes = 0xffffffffu;
  std::uint64_t max_tensor_bytes = std::uint64_t{4} << 30;  // decoded size of one tensor
  std::uint32_t max_meta_bytes = 16u << 20;
  int max_meta_depth = 32;       // JSON nesting
  io::FileSystem* fs = nullptr;  // nullptr: the POSIX file system (tests substitute failing ones)
};

struct RecordInfo {
  RecordType type;
  std::uint64_t offset;
  std::uint32_t length;  // payload bytes
  std::int64_t step = -1;
  std::string segment;
  std::string phase;
};

// Reads a trace (final or .incomplete). Opening scans every record once, verifying framing,
// checksums, metadata and tensor tables (on the intra-op threads when the records are large; the
// first bad record in file order is the one named). In a version-4 trace the record checksum
// covers the metadata and each stored tensor has a checksum of its own, so opening reads no tensor
// bytes: decode() checks a tensor's bytes when it reads them. In older traces the record checksum
// covers the tensor bytes too, and opening reads them all. Thread-compatible: const methods may
// run concurrently.
class TraceReader {
 public:
  explicit TraceReader(const std::string& path, ReaderOptions options = {});
  ~TraceReader();
  TraceReader(TraceReader&&) noexcept;
  TraceReader& operator=(TraceReader&&) = delete;

  const std::string& path() const { return path_; }
  // The header record's metadata as stored; TraceHeader::decode(trace) (records.h) reads it typed.
  const nlohmann::json& header() const { return header_; }
  // Every record after the header, in file order (the index record excluded).
  const std::vector<RecordInfo>& records() const { return records_; }
  // True when the file ends inside a record (a crash while writing); warning() says where.
  bool truncated() const { return !warning_.empty(); }
  const std::string& warning() const { return warning_; }
  // True when the trace was closed (index and trailer present).
  bool complete() const { return complete_; }
  std::uint64_t file_size() const { return file_size_; }

  // Loads record i of records() with its stored tensor bytes: verifies its checksum, parses meta
  // and tensor entries. (In a version-4 trace the tensor bytes are checked when decoded.)
  Record read(std::size_t i) const;
  // Loads record i's metadata and tensor table without its stored tensor bytes: for callers that
  // compare digests and decode few of its tensors, if any. Opening checked the record; this
  // reads only the metadata again and checks it against the hash taken then (a record changed
  // since is a kChecksum TraceError), so its cost is the metadata's, not the record's. decode()
  // then reads a tensor's bytes from the file and checks them against the tensor's checksum
  // (version 4), else its codec and digest (or the whole record's checksum, for a tensor of an
  // older trace that checks nothing itself).
  Record read_table(std::size_t i) const;
  // Checks a stored tensor's bytes against their checksum without decoding them (version 4; in an
  // older trace opening checked them under the record's checksum): a kChecksum TraceError names
  // the tensor and the record. `retrace inspect` checks every stored tensor this way.
  void check_stored(const Record& record, const TensorEntry& entry) const;
  // Decodes a stored tensor (CPU), checking its stored bytes' checksum (version 4), sizes against
  // the caps, and its digest. Safe to call from several threads at once.
  at::Tensor decode(const Record& record, const TensorEntry& entry) const;
  // Decodes a stored tensor into `out`, which must be a contiguous CPU tensor of the entry's dtype
  // and shape (retrace::Error otherwise): e.g. a program's own parameter, restored without new
  // memory or a copy. The same checks as decode(); a bad tensor (a TraceError) may leave `out`
  // partly written. Bumps `out`'s version counter, as an in-place write does.
  void decode_into(const Record& record, const TensorEntry& entry, const at::Tensor& out) const;

 private:
  // Walks the records after the file header: fills records_ and header_, checks the index and
  // trailer, and says in warning_ where a truncated trace ends.
  void scan_records();
  Record load(std::uint64_t offset) const;
  // decode() and decode_into(): into `out`, or (undefined) a new tensor once the stored bytes
  // declare the entry's size.
  void decode_to(const Record& record, const TensorEntry& entry, at::Tensor& out) const;
  // The bytes of a stored tensor of `record` are inside it (else a retrace::Error); returns where
  // they are: in record.blob, or, for a record read without them, read from the file into
  // `staging` (a thread's kept buffer, or `once`).
  const char* stored_bytes(const Record& record, const TensorEntry& entry, std::unique_ptr<char[]>& once) const;
  // Version 4: `bytes` (the entry's stored bytes) match its checksum, else a kChecksum TraceError.
  void check_checksum(const Record& record, const TensorEntry& entry, const char* bytes) const;
  // keep_blob false: the payload is checked (checksum, metadata, tensor entries) but its tensor
  // bytes are not kept (the scan when the trace is opened). `meta_hash`, when given, receives the
  // XXH3-64 of the metadata bytes (read_table() checks them against it later).
  Record load_record(std::uint64_t offset, bool keep_blob, std::uint64_t* meta_hash = nullptr) const;
  // The record's type, metadata and tensor table from its metadata bytes (`meta`), its tensor bytes
  // being `blob_size` bytes at `blob_at`.
  Record parse_record(std::uint64_t offset, std::uint16_t type, const std::string& meta, std::uint64_t blob_at,
                      std::uint64_t blob_size) const;
  RecordInfo index_entry(const Record& record, std::uint32_t length) const;
  std::string path_;
  ReaderOptions options_;
  std::unique_ptr<io::ReadableFile> file_;
  std::uint64_t file_size_ = 0;
  nlohmann::json header_;
  std::vector<RecordInfo> records_;
  std::vector<std::uint64_t> meta_hashes_;  // per record of records_: XXH3-64 of its metadata bytes
  std::string warning_;
  bool complete_ = false;
  std::uint32_t version_ = 0;
};

}  // namespace retrace
