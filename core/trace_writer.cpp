#include <retrace/trace.h>

#include "bytes.h"
#include "largest_first.h"
#include "tensor_codec.h"
#include "trace_format.h"
#include "xxh3.h"

#include <retrace/environment.h>
#include <retrace/records.h>

#include <retrace/version.h>

#include <c10/util/Exception.h>

#include <c10/core/thread_pool.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <new>

namespace retrace {

using namespace format;

TensorToWrite TensorToWrite::digest_only(std::string name, const at::Tensor& t, const Digest& d) {
  TensorToWrite w;
  w.name = std::move(name);
  w.digest = d;
  w.dtype = t.scalar_type();
  w.shape = t.sizes().vec();
  return w;
}

TensorToWrite TensorToWrite::digest_only(std::string name, const at::Tensor& t, const PendingDigest& d) {
  if (d.ready()) return digest_only(std::move(name), t, d.get());
  TensorToWrite w;
  w.name = std::move(name);
  w.digest_later = [d] { return d.get(); };
  w.dtype = t.scalar_type();
  w.shape = t.sizes().vec();
  return w;
}

const TensorEntry* Record::find(const std::string& name) const {
  for (const TensorEntry& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

// --- writer ----------------------------------------------------------------------------------

namespace {

// Nesting of a JSON value as the reader counts it (nesting_depth in trace_reader.cpp): a scalar 0,
// a container one more than its deepest element.
int json_depth(const nlohmann::json& j) {
  if (!j.is_structured()) return 0;
  int deepest = 0;
  for (const nlohmann::json& v : j) deepest = std::max(deepest, json_depth(v));
  return deepest + 1;
}

// What the default reader would refuse is never written (ReaderOptions' defaults are the
// contract): the metadata's nesting and each tensor's declared size, before anything is written.
void check_readable(RecordType type, const nlohmann::json& meta, const std::vector<TensorEntry>& tensors) {
  const ReaderOptions reader;
  const int depth = std::max(json_depth(meta), tensors.empty() ? 0 : 4);  // the tensor table nests 4 deep
  if (depth > reader.max_meta_depth) {
    throw Error("retrace::TraceWriter: a " + std::string(to_string(type)) + " record's metadata nests " +
                std::to_string(depth) + " levels deep, over the reader's cap of " +
                std::to_string(reader.max_meta_depth) +
                " (ReaderOptions::max_meta_depth); flatten what the program puts there (its config)");
  }
  for (const TensorEntry& e : tensors) {
    if (e.raw_bytes > reader.max_tensor_bytes) {
      throw Error("retrace::TraceWriter: tensor '" + e.name + "' is " + std::to_string(e.raw_bytes) +
                  " bytes, over the reader's cap of " + std::to_string(reader.max_tensor_bytes) +
                  " for one tensor (ReaderOptions::max_tensor_bytes), so the trace could not be read back");
    }
  }
}

// The tensor table's pieces, appended without a temporary string each: a digest-mode record's
// table is hundreds of entries, written on the training thread (recorder.cpp) since 2026-12-03.
template <typename T>
void append_number(std::string& out, T value) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, end);
}

// A JSON string literal, byte for byte what nlohmann::json::dump() writes: names that need no
// escaping (printable ASCII without '"' and '\\', every name the recorder makes) are copied; any
// other goes through nlohmann.
void append_json_string(std::string& out, const std::string& text) {
  const bool plain = std::all_of(text.begin(), text.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f && c != '"' && c != '\\';
  });
  if (!plain) {
    try {
      out += nlohmann::json(text).dump();
    } catch (const nlohmann::json::exception& e) {
      throw Error(std::string("retrace::TraceWriter: a tensor name is not valid UTF-8 (") + e.what() +
                  "); name tensors in UTF-8");
    }
    return;
  }
  out += '"';
  out += text;
  out += '"';
}

void check_meta_size(RecordType type, std::size_t meta_bytes) {
  const ReaderOptions reader;
  if (meta_bytes > reader.max_meta_bytes) {
    throw Error("retrace::TraceWriter: a " + std::string(to_string(type)) + " record's metadata would be " +
                std::to_string(meta_bytes) + " bytes, over the reader's cap of " +
                std::to_string(reader.max_meta_bytes) +
                " (ReaderOptions::max_meta_bytes); shorten what goes there (a scenario's description, a program's "
                "config) or record fewer tensors per record");
  }
}

}  // namespace

TraceWriter::TraceWriter(std::string path, nlohmann::json header, WriterOptions options)
    : path_(std::move(path)),
      options_(options),
      fs_(options.fs ? options.fs : &io::posix_file_system()),
      encode_threads_(resolve_encode_threads(options.encode_threads)) {
  if (encode_threads_ > 1) pool_ = std::make_unique<c10::ThreadPool>(encode_threads_ - 1);
  header["format_version"] = kTraceFormatVersion;
  header["writer"] = std::string("retrace ") + kVersion;
  // A header the reader would refuse (a huge or deeply nested program config or description) fails
  // here, before the file exists and before any training.
  check_readable(RecordType::kHeader, header, {});
  check_meta_size(RecordType::kHeader, header.dump().size());
  file_ = fs_->create(incomplete_path());
  unsigned char head[kFileHeaderBytes];
  std::memcpy(head, kTraceMagic, 8);
  const std::uint32_t version = kTraceFormatVersion;
  std::memcpy(head + 8, &version, 4);
  file_->append(head, sizeof head);
  write_record(RecordType::kHeader, header, {}, 0, {});
}

TraceWriter::~TraceWriter() = default;

std::uint64_t TraceWriter::bytes_written() const { return file_ ? file_->size() : 0; }

namespace {
constexpr int kMaxEncodeThreads = 64;
}  // namespace

int resolve_encode_threads(int requested) {
  if (requested < 0) {
    throw Error("WriterOptions::encode_threads must not be negative, got " + std::to_string(requested) +
                " (0: automatic; retrace record --encode-threads)");
  }
  if (requested > kMaxEncodeThreads) {
    throw Error("WriterOptions::encode_threads is at most " + std::to_string(kMaxEncodeThreads) + ", got " +
                std::to_string(requested) + " (retrace record --encode-threads)");
  }
  if (requested > 0) return requested;
  return std::clamp(usable_cores() / 4, 1, 8);
}

char* TraceWriter::blob_room(std::size_t bytes) {
  if (bytes > blob_capacity_) {
    blob_.reset();  // before allocating the larger one: never both at once
    blob_capacity_ = 0;
    blob_.reset(new char[bytes]);  // not zeroed: every byte written is encoded first
    blob_capacity_ = bytes;
  }
  return blob_.get();
}

namespace {

// One stored tensor of a record being appended.
struct Encoding {
  std::size_t entry = 0;  // index into the record's entries
  at::Tensor host;        // contiguous CPU
  const TensorToWrite* source = nullptr;
  std::size_t slot = 0;   // where in the blob it is encoded
  std::size_t bound = 0;  // room there
  std::size_t size = 0;   // encoded bytes
};

// Runs loop() on the calling thread and on up to `helpers` threads of `pool`; returns when every
// one has returned. `loop` must not throw.
void run_shared(c10::ThreadPool* pool, int helpers, const std::function<void()>& loop) {
  std::mutex mutex;
  std::condition_variable all_done;
  int done = 0;
  int started = 0;
  for (; pool && started < helpers; ++started) {
    try {
      pool->run([&] {
        loop();
        std::lock_guard<std::mutex> lock(mutex);  // notified under the lock: the waiter may return at once
        ++done;
        all_done.notify_one();
      });
    } catch (...) {
      break;  // the calling thread does the rest
    }
  }
  loop();
  std::unique_lock<std::mutex> lock(mutex);
  all_done.wait(lock, [&] { return done == started; });
}

}  // namespace

std::uint64_t TraceWriter::append(RecordType type, nlohmann::json meta, const std::vector<TensorToWrite>& tensors) {
  return append_entries(type, std::move(meta), tensors, false);
}

std::uint64_t TraceWriter::append(RecordType type, nlohmann::json meta, std::vector<TensorToWrite>&& tensors) {
  return append_entries(type, std::move(meta), tensors, true);
}

std::uint64_t TraceWriter::append_entries(RecordType type, nlohmann::json meta,
                                          const std::vector<TensorToWrite>& tensors, bool take) {
  if (closed_) throw Error("retrace::TraceWriter: append after close of " + path_);
  std::vector<TensorEntry> entries;
  entries.reserve(tensors.size());
  std::vector<Encoding> stored;
  std::size_t room = 0;
  for (const TensorToWrite& w : tensors) {
    TensorEntry e;
    // (`take`: the caller's vector, given up, is not const.)
    e.name = take ? std::move(const_cast<std::string&>(w.name)) : w.name;
    if (!w.tensor.defined()) {
      if (w.store_data || (!w.digest && !w.digest_later)) {
        throw Error("retrace::TraceWriter: entry '" + e.name + "' has neither a tensor nor a digest");
      }
      e.dtype = w.dtype;
      dtype_name(e.dtype);
      e.shape = take ? std::move(const_cast<std::vector<std::int64_t>&>(w.shape)) : w.shape;
      unsigned __int128 bytes = c10::elementSize(e.dtype);
      for (std::int64_t size : e.shape) bytes *= static_cast<unsigned __int128>(size);
      e.raw_bytes = static_cast<std::uint64_t>(bytes);
      e.digest = w.digest ? *w.digest : w.digest_later();
      entries.push_back(std::move(e));
      continue;
    }
    if (w.ready) w.ready();  // an asynchronous device-to-host copy must land before we read it
    const at::Tensor t = w.tensor.detach();
    e.dtype = t.scalar_type();
    dtype_name(e.dtype);  // throws for dtypes the format cannot store
    e.shape = t.sizes().vec();
    e.raw_bytes = static_cast<std::uint64_t>(t.numel()) * t.element_size();
    if (w.digest) {
      e.digest = *w.digest;
    } else if (w.digest_later) {
      e.digest = w.digest_later();
    } else if (!w.store_data || !t.is_cpu()) {
      e.digest = digest(t);  // a device tensor's on its device, as digest() does
    }                        // else: hashed where it is encoded, from the same bytes
    if (w.store_data) {
      Encoding enc;
      enc.entry = entries.size();
      enc.host = t.resolve_conj().resolve_neg().cpu().contiguous();
      enc.source = &w;
      e.codec = choose_codec(enc.host, options_);
      enc.slot = room;
      enc.bound = tensor_payload_bound(enc.host, e.codec);
      room += enc.bound;
      stored.push_back(std::move(enc));
    }
    entries.push_back(std::move(e));
  }
  // Each stored tensor is hashed (unless its digest came with it) and encoded into its own slot of
  // the blob, on the encode threads, largest first; the record holds the pieces in entry order, so
  // its bytes do not depend on the thread count.
  char* blob = stored.empty() ? nullptr : blob_room(room);
  // (Every stored tensor's host copy is held until the record is written: device or strided
  // tensors passed in directly cost their host size at once. The recorder passes host snapshots.)
  // Waking a helper costs more than encoding a small record (a segment's few KiB) on this thread.
  constexpr std::size_t kSharedEncodeBytes = std::size_t{1} << 20;
  const int helpers = pool_ && room >= kSharedEncodeBytes ? encode_threads_ - 1 : 0;
  const auto encode = [&](Encoding& enc) {
    TensorEntry& e = entries[enc.entry];
    if (!enc.source->digest && !enc.source->digest_later && enc.source->tensor.is_cpu()) e.digest = digest(enc.host);
    enc.size = encode_tensor_payload_into(enc.host, e.codec, options_.zstd_level, blob + enc.slot, enc.bound);
    e.checksum = detail::xxh3_64(blob + enc.slot, enc.size);  // while the piece is still in the cache
  };
  if (helpers == 0) {
    // One thread, in entry order, each piece right after the last: the blob is one piece. (A slot
    // moves only down, so its room stays at least its bound.)
    std::size_t at = 0;
    for (Encoding& enc : stored) {
      enc.slot = at;
      encode(enc);
      at += enc.size;
    }
  } else {
    // No more helpers than tensors beyond the calling thread's first.
    const int wanted = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(helpers), stored.size() - 1));
    detail::largest_first(
        stored.size(), [&](std::size_t k) { return stored[k].bound; }, [&](std::size_t k) { encode(stored[k]); },
        [&](const auto& loop) { run_shared(pool_.get(), wanted, loop); });
  }
  // The blob is the pieces in entry order, written where they lie (one writev).
  std::vector<io::ConstBytes> pieces;
  std::uint64_t blob_size = 0;
  for (const Encoding& enc : stored) {
    TensorEntry& e = entries[enc.entry];
    e.offset = blob_size;
    e.stored_bytes = enc.size;
    blob_size += enc.size;
    const char* at = blob + enc.slot;
    if (!pieces.empty() && static_cast<const char*>(pieces.back().data) + pieces.back().size == at) {
      pieces.back().size += enc.size;
    } else {
      pieces.push_back({at, enc.size});
    }
  }
  stored.clear();  // the host copies go before the write
  const std::uint64_t offset = file_->size();
  write_record(type, meta, pieces, blob_size, entries);
  if (room > kKeptBlobBytes) {
    appends_since_large_ = 0;
  } else if (blob_capacity_ > kKeptBlobBytes && ++appends_since_large_ >= kLargeBlobIdleAppends) {
    blob_.reset();
    blob_capacity_ = 0;
  }
  nlohmann::json item = {static_cast<int>(type), offset};
  if (meta.contains("step")) item.push_back(meta["step"]);
  index_.push_back(std::move(item));
  // Last, so that a failing write-back (IoError) finds the record written and indexed.
  // (Called from the first record on, so that the write-back starts as the trace grows.)
  if (options_.page_cache_window > 0) {
    const std::uint64_t size = file_->size();
    file_->release_before(size > options_.page_cache_window ? size - options_.page_cache_window : 0);
  }
  return offset;
}

void TraceWriter::write_record(RecordType type, const nlohmann::json& meta_in, const std::vector<io::ConstBytes>& blob,
                               std::uint64_t blob_size, const std::vector<TensorEntry>& tensors) {
  check_readable(type, meta_in, tensors);
  // The schema (records.h): a record the reader's typed decoder would refuse is not written.
  try {
    static const nlohmann::json kNoMeta = nlohmann::json::object();  // (a reference, not a copy, of meta_in)
    validate_record_meta(type, meta_in.is_null() ? kNoMeta : meta_in, path_, file_->size());
  } catch (const TraceError& e) {
    throw Error(std::string("retrace::TraceWriter: refuses to write what the reader would refuse: ") + e.what());
  }
  // The record's head -- frame header, u32 meta_len, the metadata with the tensor table -- is
  // built in one buffer kept across records (a digest-mode step's table is ~100 KiB: a fresh
  // string or two per record cost the allocator more than the text). The tensor table is written
  // as JSON text directly: an nlohmann object per entry cost ~5 us per tensor.
  std::string& head = head_;
  // A large head (full mode's tables, the index, a refused oversized record) is not kept, on
  // every way out: most records are small.
  struct Release {
    std::string& head;
    ~Release() {
      if (head.capacity() > kKeptHeadBytes) std::string().swap(head);
    }
  } release{head};
  head.assign(kRecordHeaderBytes + 4, '\0');
  head += meta_in.is_null() ? std::string("{}") : meta_in.dump();
  if (head.size() < kRecordHeaderBytes + 4 + 2 || head.back() != '}')
    throw Error("retrace::TraceWriter: record metadata must be an object");
  if (!tensors.empty()) {
    if (meta_in.is_object() && meta_in.contains("tensors"))
      throw Error("retrace::TraceWriter: 'tensors' is reserved in record metadata");
    head.pop_back();  // the closing brace, put back after the table
    head += head.size() > kRecordHeaderBytes + 4 + 1 ? ",\"tensors\":[" : "\"tensors\":[";
    head.reserve(head.size() + tensors.size() * 192);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const TensorEntry& e = tensors[i];
      if (i) head += ',';
      head += "{\"name\":";
      append_json_string(head, e.name);
      head += ",\"dtype\":\"";
      head += dtype_name(e.dtype);
      head += "\",\"shape\":[";
      for (std::size_t d = 0; d < e.shape.size(); ++d) {
        if (d) head += ',';
        append_number(head, e.shape[d]);
      }
      head += "],\"digest\":\"";
      detail::append_hex(head, e.digest.hi);
      detail::append_hex(head, e.digest.lo);
      head += "\",\"digest_algorithm\":";
      append_number(head, static_cast<int>(e.digest.algorithm));
      head += ",\"raw_bytes\":";
      append_number(head, e.raw_bytes);
      if (e.has_data()) {  // digest-only entries leave codec, offset and stored_bytes at 0
        head += ",\"codec\":";
        append_number(head, static_cast<int>(e.codec));
        head += ",\"offset\":";
        append_number(head, e.offset);
        head += ",\"stored_bytes\":";
        append_number(head, e.stored_bytes);
        head += ",\"checksum\":\"";
        detail::append_hex(head, e.checksum);
        head += '"';
      }
      head += '}';
    }
    head += "]}";
  }
  const std::size_t meta_size = head.size() - kRecordHeaderBytes - 4;
  check_meta_size(type, meta_size);
  const std::uint64_t payload_size = 4 + meta_size + blob_size;
  if (payload_size > std::min<std::uint64_t>(ReaderOptions{}.max_record_bytes, 0xffffffffu)) {
    throw Error("a trace record would be " + std::to_string(payload_size) +
                " bytes, over the format's 4 GiB limit; record fewer tensors per step (RecorderOptions::mode digest; "
                "retrace record --mode digest)");
  }
  // The payload is u32 meta_len, the metadata, the blob. Its checksum covers the first two (the
  // blob's pieces are each under their entry's checksum, in the metadata), and the record goes
  // out as two writes -- the header with the metadata, then the blob -- without copying the blob.
  const auto meta_len = static_cast<std::uint32_t>(meta_size);
  RecordHeader h{kRecordMagic, static_cast<std::uint16_t>(type), 0, static_cast<std::uint32_t>(payload_size), 0, 0};
  std::memcpy(head.data() + kRecordHeaderBytes, &meta_len, 4);
  h.payload_checksum = detail::xxh3_64(head.data() + kRecordHeaderBytes, 4 + meta_size,
                                       payload_checksum_seed(h.type, h.flags, h.length));
  encode_header(h, reinterpret_cast<unsigned char*>(head.data()));
  file_->append(head.data(), head.size());
  if (!blob.empty()) file_->append_all(blob);
}

void TraceWriter::sync() { file_->sync(); }

void TraceWriter::close() {
  if (closed_) return;
  const std::uint64_t index_offset = file_->size();
  write_record(RecordType::kIndex, {{"records", index_}}, {}, 0, {});
  unsigned char trailer[kTrailerBytes];
  std::memcpy(trailer, &index_offset, 8);
  std::memcpy(trailer + 8, kTrailerMagic, 8);
  file_->append(trailer, sizeof trailer);
  file_->sync();
  file_->close();
  fs_->rename(incomplete_path(), path_);
  fs_->sync_directory(std::filesystem::path(path_).parent_path().string());
  closed_ = true;
}

}  // namespace retrace
