#include <retrace/trace.h>

#include <retrace/version.h>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <blosc.h>
#include <xxhash.h>
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_getFrameHeader: checks the frame carries its checksum
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <limits>
#include <memory>
#include <sys/stat.h>
#include <unistd.h>

namespace retrace {

namespace {

constexpr std::uint32_t kRecordMagic = 0x43455252;  // "RREC"
constexpr std::size_t kFileHeaderBytes = 12;        // magic + version
constexpr std::size_t kRecordHeaderBytes = 24;
constexpr char kTrailerMagic[8] = {'R', 'T', 'R', 'C', 'I', 'D', 'X', '\0'};
constexpr std::size_t kTrailerBytes = 16;
constexpr int kMaxRank = 64;

struct RecordHeader {
  std::uint32_t magic;
  std::uint16_t type;
  std::uint16_t flags;
  std::uint32_t length;
  std::uint64_t payload_checksum;
  std::uint32_t header_checksum;
};

std::uint64_t payload_checksum(std::uint16_t type, std::uint16_t flags, std::uint32_t length,
                               const void* payload) {
  const std::uint64_t seed = std::uint64_t{type} | (std::uint64_t{flags} << 16) | (std::uint64_t{length} << 32);
  return XXH3_64bits_withSeed(payload, length, seed);
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

// --- dtypes by name (stable across torch versions, unlike enum values) ------------------------

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
    {at::kBFloat16, "bfloat16"}, {at::kByte, "uint8"}, {at::kChar, "int8"},
    {at::kShort, "int16"}, {at::kInt, "int32"}, {at::kLong, "int64"}, {at::kBool, "bool"},
    {at::kComplexFloat, "complex64"}, {at::kComplexDouble, "complex128"},
};

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

// --- byte shuffle ----------------------------------------------------------------------------

void shuffle(const unsigned char* in, unsigned char* out, std::size_t n, std::size_t width) {
  if (n == 0) return;  // an empty tensor may have no data pointer at all
  const std::size_t count = n / width;
  for (std::size_t b = 0; b < width; ++b) {
    unsigned char* dst = out + b * count;
    for (std::size_t i = 0; i < count; ++i) dst[i] = in[i * width + b];
  }
  std::memcpy(out + count * width, in + count * width, n - count * width);
}

void unshuffle(const unsigned char* in, unsigned char* out, std::size_t n, std::size_t width) {
  if (n == 0) return;
  const std::size_t count = n / width;
  for (std::size_t b = 0; b < width; ++b) {
    const unsigned char* src = in + b * count;
    for (std::size_t i = 0; i < count; ++i) out[i * width + b] = src[i];
  }
  std::memcpy(out + count * width, in + count * width, n - count * width);
}

bool want_shuffle(ShuffleMode mode, const at::Tensor& t) {
  switch (mode) {
    case ShuffleMode::kAlways: return t.element_size() > 1;
    case ShuffleMode::kNever: return false;
    case ShuffleMode::kAuto: return t.is_floating_point() && t.element_size() >= 2;
  }
  return false;
}

}  // namespace

const char* to_string(TensorCodec codec) {
  switch (codec) {
    case TensorCodec::kDigestOnly: return "digest-only";
    case TensorCodec::kZstd: return "zstd";
    case TensorCodec::kZstdShuffle: return "zstd+shuffle";
    case TensorCodec::kBloscBitshuffleLz4: return "blosc-bitshuffle-lz4";
  }
  return "unknown";
}

const char* to_string(Compression c) { return c == Compression::kFast ? "fast" : "small"; }

TensorCodec choose_codec(const at::Tensor& tensor, const WriterOptions& options) {
  if (options.compression == Compression::kFast && tensor.nbytes() <= static_cast<std::size_t>(BLOSC_MAX_BUFFERSIZE)) {
    return TensorCodec::kBloscBitshuffleLz4;
  }
  return want_shuffle(options.shuffle, tensor) ? TensorCodec::kZstdShuffle : TensorCodec::kZstd;
}

namespace {

// Blosc: the bit shuffle at the element size groups each bit position of all elements together,
// so the nearly constant exponent bits of floats (and the high bits of small integers) become
// long runs that LZ4 removes at memory speed, while the random mantissa bits are stored as they
// are. Level 5 is Blosc's default: the same size as level 9 here, and faster (bench/README.md).
constexpr int kBloscLevel = 5;

std::string encode_blosc(const at::Tensor& tensor) {
  const std::size_t n = tensor.nbytes();
  if (n > static_cast<std::size_t>(BLOSC_MAX_BUFFERSIZE)) {
    throw Error("a Blosc payload holds at most " + std::to_string(BLOSC_MAX_BUFFERSIZE) + " bytes, not " + std::to_string(n));
  }
  std::string out(n + BLOSC_MAX_OVERHEAD, '\0');
  const int size = blosc_compress_ctx(kBloscLevel, BLOSC_BITSHUFFLE, tensor.element_size(), n, tensor.const_data_ptr(),
                                      out.data(), out.size(), BLOSC_LZ4_COMPNAME, 0, 1);
  if (size <= 0) throw Error("Blosc compression failed (" + std::to_string(size) + ")");
  out.resize(static_cast<std::size_t>(size));
  return out;
}

std::string encode_zstd(const at::Tensor& tensor, TensorCodec codec, int zstd_level) {
  const std::size_t n = tensor.nbytes();
  const auto* raw = static_cast<const unsigned char*>(tensor.const_data_ptr());
  std::string staged;
  if (codec == TensorCodec::kZstdShuffle && tensor.element_size() > 1) {
    staged.resize(n);
    shuffle(raw, reinterpret_cast<unsigned char*>(staged.data()), n, tensor.element_size());
    raw = reinterpret_cast<const unsigned char*>(staged.data());
  }
  // One context per thread, reused: creating one per tensor costs more than compressing a small
  // tensor at a fast level.
  thread_local std::unique_ptr<ZSTD_CCtx, std::size_t (*)(ZSTD_CCtx*)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_reset(cctx.get(), ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, zstd_level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
  // zstd stores literals raw at negative levels unless told otherwise; float bytes are nearly all
  // literals, and Huffman-coding them (the shuffled exponent bytes above all) is where the size
  // goes down. Measured in bench/README.md: level -20 with this on is as small as level 1 and
  // 1.5-2x faster.
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  std::string frame(ZSTD_compressBound(n), '\0');
  const std::size_t size = ZSTD_compress2(cctx.get(), frame.data(), frame.size(), raw, n);
  if (ZSTD_isError(size)) throw Error(std::string("zstd compression failed: ") + ZSTD_getErrorName(size));
  frame.resize(size);
  return frame;
}

}  // namespace

std::string encode_tensor_payload(const at::Tensor& tensor, TensorCodec codec, int zstd_level) {
  TORCH_INTERNAL_ASSERT(tensor.is_cpu() && tensor.is_contiguous(), "encode_tensor_payload needs a contiguous CPU tensor");
  switch (codec) {
    case TensorCodec::kBloscBitshuffleLz4: return encode_blosc(tensor);
    case TensorCodec::kZstd:
    case TensorCodec::kZstdShuffle: return encode_zstd(tensor, codec, zstd_level);
    case TensorCodec::kDigestOnly: break;
  }
  throw Error("encode_tensor_payload: codec " + std::to_string(static_cast<int>(codec)) + " stores no data");
}

std::optional<std::uint64_t> declared_payload_size(const void* data, std::size_t size, TensorCodec codec) {
  switch (codec) {
    case TensorCodec::kBloscBitshuffleLz4: {
      // Validates the header against `size` (Blosc's decoder takes no source length), so that
      // decompressing afterwards cannot read past the payload.
      std::size_t n = 0;
      if (size < BLOSC_MIN_HEADER_LENGTH || blosc_cbuffer_validate(data, size, &n) != 0) return std::nullopt;
      std::size_t typesize = 0;
      int flags = 0;
      blosc_cbuffer_metainfo(data, &typesize, &flags);
      if (typesize == 0) return std::nullopt;
      return n;
    }
    case TensorCodec::kZstd:
    case TensorCodec::kZstdShuffle: {
      ZSTD_frameHeader frame{};
      if (ZSTD_getFrameHeader(&frame, data, size) != 0 || !frame.checksumFlag) return std::nullopt;
      const unsigned long long content = ZSTD_getFrameContentSize(data, size);
      if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN) return std::nullopt;
      return content;
    }
    case TensorCodec::kDigestOnly: break;
  }
  return std::nullopt;
}

void decode_tensor_payload(const void* data, std::size_t size, TensorCodec codec, at::Tensor& out) {
  const std::size_t n = out.nbytes();
  const std::optional<std::uint64_t> declared = declared_payload_size(data, size, codec);
  if (!declared) {
    throw Error(codec == TensorCodec::kBloscBitshuffleLz4 ? "Blosc buffer is malformed"
                                                          : "zstd frame is malformed or carries no checksum");
  }
  if (*declared != n) {
    throw Error("payload declares " + std::to_string(*declared) + " bytes, not the tensor's " + std::to_string(n));
  }
  if (codec == TensorCodec::kBloscBitshuffleLz4) {
    if (n == 0) return;
    const int got = blosc_decompress_ctx(data, out.data_ptr(), n, 1);
    if (got < 0 || static_cast<std::size_t>(got) != n) throw Error("Blosc buffer does not decompress (" + std::to_string(got) + ")");
    return;
  }
  const bool shuffled = codec == TensorCodec::kZstdShuffle && out.element_size() > 1;
  std::string staged;
  void* dst = out.data_ptr();
  if (shuffled) {
    staged.resize(n);
    dst = staged.data();
  }
  const std::size_t got = ZSTD_decompress(dst, n, data, size);
  if (ZSTD_isError(got) || got != n) {
    throw Error(std::string("does not decompress (") + (ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short") + ")");
  }
  if (shuffled) {
    unshuffle(reinterpret_cast<const unsigned char*>(staged.data()), static_cast<unsigned char*>(out.data_ptr()), n,
              out.element_size());
  }
}

const char* to_string(RecordType type) {
  switch (type) {
    case RecordType::kHeader: return "header";
    case RecordType::kStepBegin: return "step_begin";
    case RecordType::kSegment: return "segment";
    case RecordType::kStepEnd: return "step_end";
    case RecordType::kEvent: return "event";
    case RecordType::kIndex: return "index";
  }
  return "unknown";
}

nlohmann::json ExceptionEvent::to_meta() const {
  nlohmann::json meta = {{"event", "exception"}, {"what", what}, {"step", step}};
  if (raised_by_step) meta["raised_by_step"] = true;
  return meta;
}

std::optional<ExceptionEvent> ExceptionEvent::from_meta(const nlohmann::json& meta) {
  if (!meta.is_object() || meta.value("event", nlohmann::json()) != "exception") return std::nullopt;
  ExceptionEvent e;
  if (const auto it = meta.find("step"); it != meta.end() && it->is_number_integer()) e.step = it->get<std::int64_t>();
  if (const auto it = meta.find("what"); it != meta.end() && it->is_string()) e.what = it->get<std::string>();
  if (const auto it = meta.find("raised_by_step"); it != meta.end() && it->is_boolean()) e.raised_by_step = it->get<bool>();
  return e;
}

std::string exception_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

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

// Nesting of a JSON value as the reader's parse callback counts it: a scalar 0, a container one more
// than its deepest element.
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
                std::to_string(depth) + " levels deep, over the reader's cap of " + std::to_string(reader.max_meta_depth) +
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

void check_meta_size(RecordType type, std::size_t meta_bytes) {
  const ReaderOptions reader;
  if (meta_bytes > reader.max_meta_bytes) {
    throw Error("retrace::TraceWriter: a " + std::string(to_string(type)) + " record's metadata would be " +
                std::to_string(meta_bytes) + " bytes, over the reader's cap of " + std::to_string(reader.max_meta_bytes) +
                " (ReaderOptions::max_meta_bytes); shorten what goes there (a scenario's description, a program's "
                "config) or record fewer tensors per record");
  }
}

}  // namespace

TraceWriter::TraceWriter(std::string path, nlohmann::json header, WriterOptions options)
    : path_(std::move(path)), options_(options),
      fs_(options.fs ? options.fs : &io::posix_file_system()) {
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
  write_record(RecordType::kHeader, header, {}, {});
}

TraceWriter::~TraceWriter() = default;

std::uint64_t TraceWriter::bytes_written() const { return file_ ? file_->size() : 0; }

std::uint64_t TraceWriter::append(RecordType type, nlohmann::json meta,
                                  const std::vector<TensorToWrite>& tensors) {
  if (closed_) throw Error("retrace::TraceWriter: append after close of " + path_);
  std::string blob;
  std::vector<TensorEntry> entries;
  for (const TensorToWrite& w : tensors) {
    TensorEntry e;
    e.name = w.name;
    if (!w.tensor.defined()) {
      if (w.store_data || (!w.digest && !w.digest_later)) {
        throw Error("retrace::TraceWriter: entry '" + w.name + "' has neither a tensor nor a digest");
      }
      e.dtype = w.dtype;
      dtype_name(e.dtype);
      e.shape = w.shape;
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
    e.digest = w.digest ? *w.digest : w.digest_later ? w.digest_later() : digest(t);
    if (w.store_data) {
      const at::Tensor host = t.resolve_conj().resolve_neg().cpu().contiguous();
      e.codec = choose_codec(host, options_);
      const std::string frame = encode_tensor_payload(host, e.codec, options_.zstd_level);
      e.offset = blob.size();
      e.stored_bytes = frame.size();
      blob += frame;
    }
    entries.push_back(std::move(e));
  }
  const std::uint64_t offset = file_->size();
  write_record(type, meta, blob, entries);
  nlohmann::json item = {static_cast<int>(type), offset};
  if (meta.contains("step")) item.push_back(meta["step"]);
  index_.push_back(std::move(item));
  return offset;
}


void TraceWriter::write_record(RecordType type, const nlohmann::json& meta_in, const std::string& blob,
                               const std::vector<TensorEntry>& tensors) {
  check_readable(type, meta_in, tensors);
  // The tensor table is written as JSON text directly: building an nlohmann object per entry
  // cost the writer thread ~5 us per tensor, most of a digest-mode record's cost.
  std::string meta_text = meta_in.is_null() ? std::string("{}") : meta_in.dump();
  if (meta_text.empty() || meta_text.back() != '}') throw Error("retrace::TraceWriter: record metadata must be an object");
  if (!tensors.empty()) {
    if (meta_in.is_object() && meta_in.contains("tensors")) throw Error("retrace::TraceWriter: 'tensors' is reserved in record metadata");
    std::string table = meta_text.size() > 2 ? ",\"tensors\":[" : "\"tensors\":[";
    table.reserve(table.size() + tensors.size() * 160);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const TensorEntry& e = tensors[i];
      if (i) table += ',';
      table += "{\"name\":";
      table += nlohmann::json(e.name).dump();  // escapes what needs escaping
      table += ",\"dtype\":\"";
      table += dtype_name(e.dtype);
      table += "\",\"shape\":[";
      for (std::size_t d = 0; d < e.shape.size(); ++d) {
        if (d) table += ',';
        table += std::to_string(e.shape[d]);
      }
      table += "],\"digest\":\"" + e.digest.hex() + "\",\"digest_algorithm\":" +
               std::to_string(static_cast<int>(e.digest.algorithm)) + ",\"raw_bytes\":" + std::to_string(e.raw_bytes);
      if (e.has_data()) {  // digest-only entries leave codec, offset and stored_bytes at 0
        table += ",\"codec\":" + std::to_string(static_cast<int>(e.codec)) + ",\"offset\":" + std::to_string(e.offset) +
                 ",\"stored_bytes\":" + std::to_string(e.stored_bytes);
      }
      table += '}';
    }
    table += ']';
    meta_text.insert(meta_text.size() - 1, table);
  }
  check_meta_size(type, meta_text.size());
  const std::uint64_t payload_size = 4 + meta_text.size() + blob.size();
  if (payload_size > std::min<std::uint64_t>(ReaderOptions{}.max_record_bytes, 0xffffffffu)) {
    throw Error("a trace record would be " + std::to_string(payload_size) +
                " bytes, over the format's 4 GiB limit; record fewer tensors per step (--mode digest)");
  }
  std::string payload;
  payload.reserve(payload_size);
  const auto meta_len = static_cast<std::uint32_t>(meta_text.size());
  payload.append(reinterpret_cast<const char*>(&meta_len), 4);
  payload.append(meta_text);
  payload.append(blob);
  RecordHeader h{kRecordMagic, static_cast<std::uint16_t>(type), 0,
                 static_cast<std::uint32_t>(payload.size()), 0, 0};
  h.payload_checksum = payload_checksum(h.type, h.flags, h.length, payload.data());
  unsigned char head[kRecordHeaderBytes];
  encode_header(h, head);
  file_->append(head, sizeof head);
  file_->append(payload.data(), payload.size());
}

void TraceWriter::sync() { file_->sync(); }

void TraceWriter::close() {
  if (closed_) return;
  const std::uint64_t index_offset = file_->size();
  write_record(RecordType::kIndex, {{"records", index_}}, {}, {});
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

// --- reader ----------------------------------------------------------------------------------

namespace {

[[noreturn]] void bad(TraceError::Kind kind, const std::string& path, std::uint64_t offset,
                      const std::string& what) {
  throw TraceError(kind, offset, path + ": " + what + " at byte offset " + std::to_string(offset));
}

void pread_all(int fd, void* out, std::size_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) bad(TraceError::Kind::kIo, path, offset, r < 0 ? std::strerror(errno) : "unexpected end of file");
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
}

nlohmann::json parse_meta(const std::string& text, int max_depth, const std::string& path,
                          std::uint64_t offset) {
  try {
    // The callback sees each value's depth before it is built: deep nesting is refused early.
    return nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > max_depth) throw std::runtime_error("nesting deeper than " + std::to_string(max_depth));
      return true;
    });
  } catch (const std::exception& e) {
    bad(TraceError::Kind::kMalformed, path, offset, std::string("record metadata is not valid JSON (") + e.what() + ")");
  }
}

// A metadata field of exactly type T: integers must be JSON integers in T's range (nlohmann
// would otherwise cast floats and booleans), strings strings, lists lists of such.
template <typename T>
bool valid_as(const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return v.is_string();
  } else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
    if (!v.is_array()) return false;
    for (const nlohmann::json& x : v) {
      if (!valid_as<std::int64_t>(x)) return false;
    }
    return true;
  } else {
    static_assert(std::is_integral_v<T>);
    if (v.is_number_unsigned()) return v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max());
    if (v.is_number_integer()) {
      const auto x = v.get<std::int64_t>();
      return std::is_signed_v<T> ? x >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
                                       x <= static_cast<std::int64_t>(std::numeric_limits<T>::max())
                                 : x >= 0;
    }
    return false;
  }
}

template <typename T>
T field(const nlohmann::json& j, const char* key, const std::string& path, std::uint64_t offset) {
  auto it = j.find(key);
  if (it == j.end() || !valid_as<T>(*it)) {
    bad(TraceError::Kind::kMalformed, path, offset, std::string("record metadata lacks a valid '") + key + "'");
  }
  return it->get<T>();
}

// An optional field: absent gives `fallback`, a wrong type is malformed.
template <typename T>
T optional_field(const nlohmann::json& j, const char* key, T fallback, const std::string& path, std::uint64_t offset) {
  return j.contains(key) ? field<T>(j, key, path, offset) : fallback;
}

}  // namespace

TraceReader::TraceReader(const std::string& path, ReaderOptions options)
    : path_(path), options_(options) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    throw TraceError(TraceError::Kind::kIo, 0, "cannot open trace '" + path + "': " + std::strerror(errno));
  }
  struct stat st {};
  ::fstat(fd_, &st);
  if (S_ISDIR(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw TraceError(TraceError::Kind::kIo, 0, "'" + path + "' is a directory, not a trace");
  }
  file_size_ = static_cast<std::uint64_t>(st.st_size);
  try {
    if (file_size_ < kFileHeaderBytes) bad(TraceError::Kind::kBadMagic, path, 0, "too short to be a retrace trace");
    unsigned char head[kFileHeaderBytes];
    pread_all(fd_, head, sizeof head, 0, path);
    if (std::memcmp(head, kTraceMagic, 8) != 0) bad(TraceError::Kind::kBadMagic, path, 0, "not a retrace trace (bad magic)");
    std::uint32_t version;
    std::memcpy(&version, head + 8, 4);
    if (version == 0 || version > kTraceFormatVersion) {
      bad(TraceError::Kind::kVersion, path, 8,
          "format version " + std::to_string(version) + " is not readable by this build (reads 1.." +
              std::to_string(kTraceFormatVersion) + "); upgrade retrace");
    }
    version_ = version;
    std::uint64_t pos = kFileHeaderBytes;
    bool seen_index = false;
    std::uint64_t index_offset = 0;
    while (pos < file_size_) {
      const std::uint64_t left = file_size_ - pos;
      if (seen_index) {
        if (left < kTrailerBytes) {
          warning_ = path + ": ends inside the trailer at byte offset " + std::to_string(pos) + "; all " +
                     std::to_string(records_.size()) + " records are readable";
          break;
        }
        if (left > kTrailerBytes) bad(TraceError::Kind::kMalformed, path, pos, "bytes after the index are not the trailer");
        unsigned char trailer[kTrailerBytes];
        pread_all(fd_, trailer, sizeof trailer, pos, path);
        std::uint64_t declared;
        std::memcpy(&declared, trailer, 8);
        if (std::memcmp(trailer + 8, kTrailerMagic, 8) != 0 || declared != index_offset) {
          bad(TraceError::Kind::kMalformed, path, pos, "corrupt trailer");
        }
        complete_ = true;
        break;
      }
      if (left < kRecordHeaderBytes) {
        warning_ = path + ": ends inside a record header at byte offset " + std::to_string(pos) + " (" +
                   std::to_string(left) + " trailing bytes ignored); all " + std::to_string(records_.size()) +
                   " complete records are readable";
        break;
      }
      unsigned char raw[kRecordHeaderBytes];
      pread_all(fd_, raw, sizeof raw, pos, path);
      RecordHeader h;
      std::memcpy(&h.magic, raw, 4);
      std::memcpy(&h.type, raw + 4, 2);
      std::memcpy(&h.flags, raw + 6, 2);
      std::memcpy(&h.length, raw + 8, 4);
      std::memcpy(&h.payload_checksum, raw + 12, 8);
      std::memcpy(&h.header_checksum, raw + 20, 4);
      if (h.magic != kRecordMagic) bad(TraceError::Kind::kMalformed, path, pos, "no record starts here (bad record magic)");
      if (h.header_checksum != static_cast<std::uint32_t>(XXH3_64bits(raw, 20))) {
        bad(TraceError::Kind::kChecksum, path, pos, "record header checksum mismatch");
      }
      if (h.flags != 0) bad(TraceError::Kind::kMalformed, path, pos, "record flags " + std::to_string(h.flags) + " are not defined in format version 1");
      if (h.length > options_.max_record_bytes) {
        bad(TraceError::Kind::kTooLarge, path, pos,
            "record of " + std::to_string(h.length) + " bytes exceeds the cap of " +
                std::to_string(options_.max_record_bytes) + " (ReaderOptions::max_record_bytes)");
      }
      if (h.length > left - kRecordHeaderBytes) {
        warning_ = path + ": ends inside the record at byte offset " + std::to_string(pos) + " (" +
                   std::to_string(h.length - (left - kRecordHeaderBytes)) + " bytes missing); all " +
                   std::to_string(records_.size()) + " complete records are readable";
        break;
      }
      const Record r = load(pos);
      if (records_.empty() && !header_.is_object()) {
        if (r.type != RecordType::kHeader) bad(TraceError::Kind::kMalformed, path, pos, "the first record is not the header");
        header_ = r.meta;
      } else if (r.type == RecordType::kHeader) {
        bad(TraceError::Kind::kMalformed, path, pos, "a second header record");
      } else if (r.type == RecordType::kIndex) {
        const auto& list = r.meta.contains("records") ? r.meta["records"] : nlohmann::json();
        if (!list.is_array() || list.size() != records_.size()) {
          bad(TraceError::Kind::kMalformed, path, pos, "the index does not list the records before it");
        }
        for (std::size_t i = 0; i < list.size(); ++i) {
          if (!list[i].is_array() || list[i].size() < 2 || list[i][0] != static_cast<int>(records_[i].type) ||
              list[i][1] != records_[i].offset) {
            bad(TraceError::Kind::kMalformed, path, pos, "index entry " + std::to_string(i) + " does not match the record");
          }
        }
        seen_index = true;
        index_offset = pos;
      } else {
        RecordInfo info{r.type, pos, h.length};
        info.step = optional_field<std::int64_t>(r.meta, "step", -1, path, pos);
        info.segment = optional_field<std::string>(r.meta, "segment", "", path, pos);
        info.phase = optional_field<std::string>(r.meta, "phase", "", path, pos);
        records_.push_back(std::move(info));
      }
      pos += kRecordHeaderBytes + h.length;
    }
    if (!header_.is_object()) bad(TraceError::Kind::kMalformed, path, kFileHeaderBytes, "no header record");
    if (seen_index && !complete_ && warning_.empty()) {
      warning_ = path + ": ends after the index without its trailer; all " + std::to_string(records_.size()) +
                 " records are readable";
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

TraceReader::~TraceReader() {
  if (fd_ >= 0) ::close(fd_);
}

TraceReader::TraceReader(TraceReader&& o) noexcept
    : path_(std::move(o.path_)), options_(o.options_), fd_(o.fd_), file_size_(o.file_size_),
      header_(std::move(o.header_)), records_(std::move(o.records_)), warning_(std::move(o.warning_)),
      complete_(o.complete_), version_(o.version_) {
  o.fd_ = -1;
}

Record TraceReader::read(std::size_t i) const {
  if (i >= records_.size()) throw Error("record " + std::to_string(i) + " does not exist in " + path_);
  return load(records_[i].offset);
}

Record TraceReader::load(std::uint64_t offset) const {
  unsigned char raw[kRecordHeaderBytes];
  pread_all(fd_, raw, sizeof raw, offset, path_);
  RecordHeader h;
  std::memcpy(&h.type, raw + 4, 2);
  std::memcpy(&h.flags, raw + 6, 2);
  std::memcpy(&h.length, raw + 8, 4);
  std::memcpy(&h.payload_checksum, raw + 12, 8);
  // Callers checked framing, header checksum and size before calling.
  std::string payload(h.length, '\0');
  pread_all(fd_, payload.data(), h.length, offset + kRecordHeaderBytes, path_);
  if (payload_checksum(h.type, h.flags, h.length, payload.data()) != h.payload_checksum) {
    bad(TraceError::Kind::kChecksum, path_, offset, "record payload checksum mismatch");
  }
  Record r;
  r.offset = offset;
  switch (h.type) {
    case 1: case 2: case 3: case 4: case 5: case 15: r.type = static_cast<RecordType>(h.type); break;
    default: bad(TraceError::Kind::kMalformed, path_, offset, "unknown record type " + std::to_string(h.type));
  }
  if (h.length < 4) bad(TraceError::Kind::kMalformed, path_, offset, "record payload shorter than its metadata length");
  std::uint32_t meta_len;
  std::memcpy(&meta_len, payload.data(), 4);
  if (meta_len > options_.max_meta_bytes || meta_len > h.length - 4) {
    bad(TraceError::Kind::kMalformed, path_, offset, "metadata length " + std::to_string(meta_len) + " is out of bounds");
  }
  r.meta = parse_meta(payload.substr(4, meta_len), options_.max_meta_depth, path_, offset);
  if (!r.meta.is_object()) bad(TraceError::Kind::kMalformed, path_, offset, "record metadata is not an object");
  r.blob = payload.substr(4 + meta_len);
  if (r.meta.contains("tensors")) {
    const nlohmann::json& list = r.meta["tensors"];
    if (!list.is_array()) bad(TraceError::Kind::kMalformed, path_, offset, "'tensors' is not a list");
    for (const nlohmann::json& t : list) {
      if (!t.is_object()) bad(TraceError::Kind::kMalformed, path_, offset, "a tensor entry is not an object");
      TensorEntry e;
      e.name = field<std::string>(t, "name", path_, offset);
      const auto dtype = dtype_from_name(field<std::string>(t, "dtype", path_, offset));
      if (!dtype) bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has an unknown dtype");
      e.dtype = *dtype;
      e.shape = field<std::vector<std::int64_t>>(t, "shape", path_, offset);
      if (e.shape.size() > kMaxRank) bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has rank over 64");
      // numel * element size without overflow, against the cap. An empty tensor declares 0 bytes
      // whatever its other sizes, but LibTorch still computes its contiguous strides in int64 (the
      // stride of dimension 0 is the product of the later sizes, a 0 counted as 1): those must
      // fit too.
      unsigned __int128 bytes = c10::elementSize(e.dtype);
      unsigned __int128 stride = 1;
      for (std::size_t d = 0; d < e.shape.size(); ++d) {
        const std::int64_t s = e.shape[d];
        if (s < 0) bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has a negative size");
        bytes *= static_cast<unsigned __int128>(s);
        if (bytes > options_.max_tensor_bytes) {
          bad(TraceError::Kind::kTooLarge, path_, offset,
              "tensor '" + e.name + "' declares more than " + std::to_string(options_.max_tensor_bytes) +
                  " bytes (ReaderOptions::max_tensor_bytes)");
        }
        if (d > 0) stride *= static_cast<unsigned __int128>(std::max<std::int64_t>(s, 1));
        if (stride > static_cast<unsigned __int128>(std::numeric_limits<std::int64_t>::max())) {
          bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has sizes whose strides overflow 64 bits");
        }
      }
      e.raw_bytes = field<std::uint64_t>(t, "raw_bytes", path_, offset);
      if (e.raw_bytes != static_cast<std::uint64_t>(bytes)) {
        bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' raw_bytes does not match its shape");
      }
      const std::string hex = field<std::string>(t, "digest", path_, offset);
      if (hex.size() != 32 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
        bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has a malformed digest");
      }
      e.digest.hi = std::stoull(hex.substr(0, 16), nullptr, 16);
      e.digest.lo = std::stoull(hex.substr(16), nullptr, 16);
      const int alg = field<int>(t, "digest_algorithm", path_, offset);
      if (alg < 1 || alg > 2) bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has an unknown digest algorithm");
      e.digest.algorithm = static_cast<DigestAlgorithm>(alg);
      const int codec = optional_field<int>(t, "codec", 0, path_, offset);
      if (codec < 0 || codec > 3) bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' has an unknown codec");
      if (codec == 3 && version_ < 2) {
        bad(TraceError::Kind::kMalformed, path_, offset,
            "tensor '" + e.name + "' has codec 3, which format version " + std::to_string(version_) + " does not define");
      }
      e.codec = static_cast<TensorCodec>(codec);
      if (e.has_data()) {
        e.offset = field<std::uint64_t>(t, "offset", path_, offset);
        e.stored_bytes = field<std::uint64_t>(t, "stored_bytes", path_, offset);
      }
      if (e.has_data() && (e.offset > r.blob.size() || e.stored_bytes > r.blob.size() - e.offset)) {
        bad(TraceError::Kind::kMalformed, path_, offset, "tensor '" + e.name + "' data lies outside its record");
      }
      r.tensors.push_back(std::move(e));
    }
  }
  return r;
}

at::Tensor TraceReader::decode(const Record& record, const TensorEntry& e) const {
  if (!e.has_data()) {
    throw Error(path_ + ": tensor '" + e.name + "' in the record at byte offset " + std::to_string(record.offset) +
                " holds only a digest (recorded in digest mode)");
  }
  const char* src = record.blob.data() + e.offset;
  const std::optional<std::uint64_t> declared = declared_payload_size(src, e.stored_bytes, e.codec);
  if (!declared || *declared != e.raw_bytes) {
    bad(TraceError::Kind::kMalformed, path_, record.offset,
        "tensor '" + e.name + "' payload does not declare its size of " + std::to_string(e.raw_bytes) + " bytes");
  }
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  try {
    decode_tensor_payload(src, e.stored_bytes, e.codec, out);
  } catch (const Error& err) {
    bad(TraceError::Kind::kChecksum, path_, record.offset, "tensor '" + e.name + "' " + err.what());
  }
  if (e.digest.algorithm == DigestAlgorithm::kXxh3_128 && digest(out) != e.digest) {
    bad(TraceError::Kind::kChecksum, path_, record.offset, "tensor '" + e.name + "' does not match its digest");
  }
  return out;
}

}  // namespace retrace
