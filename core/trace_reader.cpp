#include <retrace/trace.h>

#include "largest_first.h"
#include "prefault.h"
#include "trace_fields.h"
#include "tensor_codec.h"
#include "trace_format.h"
#include "xxh3.h"

#include <retrace/records.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <vector>

#include <simdjson.h>
#include <xxhash.h>

namespace retrace {

using namespace format;

// --- reader ----------------------------------------------------------------------------------

namespace {

[[noreturn]] void bad(TraceError::Kind kind, const std::string& path, std::uint64_t offset, const std::string& what) {
  throw TraceError(kind, offset, path + ": " + what + " at byte offset " + std::to_string(offset));
}

// Reads exactly n bytes at `offset` through the file layer; its failure is a kIo TraceError naming
// the byte offset.
void read_exactly(const io::ReadableFile& file, void* out, std::size_t n, std::uint64_t offset,
                  const std::string& path) {
  try {
    file.read_at(offset, out, n);
  } catch (const io::IoError& e) {
    bad(TraceError::Kind::kIo, path, offset, e.reason());
  }
}

// The deepest nesting of arrays and objects in `text`, brackets inside strings not counted (a
// scan of the bytes; malformed JSON is the parser's to report).
int nesting_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json parse_meta(const std::string& text, int max_depth, const std::string& path, std::uint64_t offset) {
  try {
    // Deep nesting is refused before anything is built, counted as the writer counts it (a
    // container is one deeper than its deepest element). The parse then runs without a per-value
    // callback.
    if (nesting_depth(text) > max_depth) throw std::runtime_error("nesting deeper than " + std::to_string(max_depth));
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    bad(TraceError::Kind::kMalformed, path, offset,
        std::string("record metadata is not valid JSON (") + e.what() + ")");
  }
}

// The file header: magic, then a format version this build reads. Returns the version.
std::uint32_t read_file_header(const io::ReadableFile& file, const std::string& path, std::uint64_t file_size) {
  if (file_size < kFileHeaderBytes) bad(TraceError::Kind::kBadMagic, path, 0, "too short to be a retrace trace");
  unsigned char head[kFileHeaderBytes];
  read_exactly(file, head, sizeof head, 0, path);
  if (std::memcmp(head, kTraceMagic, 8) != 0)
    bad(TraceError::Kind::kBadMagic, path, 0, "not a retrace trace (bad magic)");
  std::uint32_t version;
  std::memcpy(&version, head + 8, 4);
  if (version == 0 || version > kTraceFormatVersion) {
    bad(TraceError::Kind::kVersion, path, 8,
        "format version " + std::to_string(version) + " is not readable by this build (reads 1.." +
            std::to_string(kTraceFormatVersion) + "); upgrade retrace");
  }
  return version;
}

// The trailer at `pos`, after the index at `index_offset`: exactly kTrailerBytes naming it.
void check_trailer(const io::ReadableFile& file, const std::string& path, std::uint64_t pos, std::uint64_t left,
                   std::uint64_t index_offset) {
  if (left > kTrailerBytes) bad(TraceError::Kind::kMalformed, path, pos, "bytes after the index are not the trailer");
  unsigned char trailer[kTrailerBytes];
  read_exactly(file, trailer, sizeof trailer, pos, path);
  std::uint64_t declared;
  std::memcpy(&declared, trailer, 8);
  if (std::memcmp(trailer + 8, kTrailerMagic, 8) != 0 || declared != index_offset) {
    bad(TraceError::Kind::kMalformed, path, pos, "corrupt trailer");
  }
}

// A record header's own fields: magic, checksum, flags, and a length under the reader's cap.
void check_record_header(const RecordHeader& h, const unsigned char* raw, const std::string& path, std::uint64_t pos,
                         std::uint64_t max_record_bytes) {
  if (h.magic != kRecordMagic) bad(TraceError::Kind::kMalformed, path, pos, "no record starts here (bad record magic)");
  if (!header_checksum_matches(h, raw)) {
    bad(TraceError::Kind::kChecksum, path, pos, "record header checksum mismatch");
  }
  if (h.flags != 0)
    bad(TraceError::Kind::kMalformed, path, pos,
        "record flags " + std::to_string(h.flags) + " are not defined in format version 1");
  if (h.length > max_record_bytes) {
    bad(TraceError::Kind::kTooLarge, path, pos,
        "record of " + std::to_string(h.length) + " bytes exceeds the cap of " + std::to_string(max_record_bytes) +
            " (ReaderOptions::max_record_bytes)");
  }
}

// The index record lists exactly the records before it, by type and offset.
void check_index(const Record& r, const std::vector<RecordInfo>& records, const std::string& path, std::uint64_t pos) {
  const auto& list = r.meta.contains("records") ? r.meta["records"] : nlohmann::json();
  if (!list.is_array() || list.size() != records.size()) {
    bad(TraceError::Kind::kMalformed, path, pos, "the index does not list the records before it");
  }
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_array() || list[i].size() < 2 || list[i][0] != static_cast<int>(records[i].type) ||
        list[i][1] != records[i].offset) {
      bad(TraceError::Kind::kMalformed, path, pos, "index entry " + std::to_string(i) + " does not match the record");
    }
  }
}

// True when `text` is `digits` lowercase hex digits.
bool lower_hex(const std::string& text, std::size_t digits) {
  return text.size() == digits && text.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// The 16 hex digits of `hex` from `from` (lower_hex checked them).
std::uint64_t hex64(const std::string& hex, std::size_t from) {
  std::uint64_t v = 0;
  for (std::size_t i = from; i < from + 16; ++i)
    v = v << 4 | static_cast<std::uint64_t>(hex[i] <= '9' ? hex[i] - '0' : hex[i] - 'a' + 10);
  return v;
}

// What a tensor entry is checked against: the trace, the reader's caps, the record.
struct TableContext {
  const std::string& path;
  const ReaderOptions& options;
  std::uint32_t version;
  std::uint64_t offset;     // the record's
  std::uint64_t blob_size;  // its stored tensor bytes
};

// One entry of a record's tensor table, from `f`: Fields over nlohmann's parse, or SimdEntry over
// simdjson's (which leaves anything not plainly well-typed to the former).
template <class Source>
TensorEntry table_entry(const Source& f, const TableContext& c) {
  TensorEntry e;
  e.name = f.text("name");
  const auto dtype = dtype_from_name(f.text("dtype"));
  if (!dtype) bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has an unknown dtype");
  e.dtype = *dtype;
  e.shape = f.integers("shape");
  if (e.shape.size() > kMaxRank)
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has rank over 64");
  // numel * element size without overflow, against the cap. An empty tensor declares 0 bytes
  // whatever its other sizes, but LibTorch still computes its contiguous strides in int64 (the
  // stride of dimension 0 is the product of the later sizes, a 0 counted as 1): those must
  // fit too.
  unsigned __int128 bytes = c10::elementSize(e.dtype);
  unsigned __int128 stride = 1;
  for (std::size_t d = 0; d < e.shape.size(); ++d) {
    const std::int64_t s = e.shape[d];
    if (s < 0) bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has a negative size");
    bytes *= static_cast<unsigned __int128>(s);
    if (bytes > c.options.max_tensor_bytes) {
      bad(TraceError::Kind::kTooLarge, c.path, c.offset,
          "tensor '" + e.name + "' declares more than " + std::to_string(c.options.max_tensor_bytes) +
              " bytes (ReaderOptions::max_tensor_bytes)");
    }
    if (d > 0) stride *= static_cast<unsigned __int128>(std::max<std::int64_t>(s, 1));
    if (stride > static_cast<unsigned __int128>(std::numeric_limits<std::int64_t>::max())) {
      bad(TraceError::Kind::kMalformed, c.path, c.offset,
          "tensor '" + e.name + "' has sizes whose strides overflow 64 bits");
    }
  }
  e.raw_bytes = f.count("raw_bytes");
  if (e.raw_bytes != static_cast<std::uint64_t>(bytes)) {
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' raw_bytes does not match its shape");
  }
  const std::string hex = f.text("digest");
  if (!lower_hex(hex, 32)) {
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has a malformed digest");
  }
  e.digest.hi = hex64(hex, 0);
  e.digest.lo = hex64(hex, 16);
  const std::int64_t alg = f.integer("digest_algorithm");
  if (alg < 1 || alg > 2)
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has an unknown digest algorithm");
  e.digest.algorithm = static_cast<DigestAlgorithm>(alg);
  const std::int64_t codec = f.integer("codec", 0);
  if (codec < 0 || codec > 3)
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' has an unknown codec");
  if (codec == 3 && c.version < 2) {
    bad(TraceError::Kind::kMalformed, c.path, c.offset,
        "tensor '" + e.name + "' has codec 3, which format version " + std::to_string(c.version) + " does not define");
  }
  e.codec = static_cast<TensorCodec>(codec);
  if (e.has_data()) {
    e.offset = f.count("offset");
    e.stored_bytes = f.count("stored_bytes");
    if (c.version >= kTensorChecksumVersion) {
      const std::string sum = f.text("checksum");
      if (!lower_hex(sum, 16)) {
        bad(TraceError::Kind::kMalformed, c.path, c.offset,
            "tensor '" + e.name + "' has a malformed checksum (16 lowercase hex digits)");
      }
      e.checksum = hex64(sum, 0);
    }
  }
  if (e.has_data() && (e.offset > c.blob_size || e.stored_bytes > c.blob_size - e.offset)) {
    bad(TraceError::Kind::kMalformed, c.path, c.offset, "tensor '" + e.name + "' data lies outside its record");
  }
  return e;
}

// The fast parse met something it leaves to nlohmann's path, which reports it exactly.
struct Fallback {};

// A tensor entry parsed by simdjson, read as Fields reads one, for values of the types Fields
// takes as they are; anything else (a missing field, another type, a key given twice) throws
// Fallback.
class SimdEntry {
 public:
  explicit SimdEntry(simdjson::dom::element e) {
    simdjson::dom::object o;
    if (e.get_object().get(o) != simdjson::SUCCESS) throw Fallback{};
    for (const simdjson::dom::key_value_pair field : o) {
      const int k = slot(field.key);
      if (k < 0) continue;  // Fields ignores keys it does not read
      if (has_[k]) throw Fallback{};
      has_[k] = true;
      values_[k] = field.value;
    }
  }

  std::string text(const char* key, std::optional<std::string> fallback = std::nullopt) const {
    const simdjson::dom::element* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      throw Fallback{};
    }
    std::string_view sv;
    if (v->get_string().get(sv) != simdjson::SUCCESS) throw Fallback{};
    return std::string(sv);
  }

  std::vector<std::int64_t> integers(const char* key) const {
    const simdjson::dom::element* v = find(key);
    simdjson::dom::array a;
    if (!v || v->get_array().get(a) != simdjson::SUCCESS) throw Fallback{};
    std::vector<std::int64_t> out;
    out.reserve(a.size());
    for (const simdjson::dom::element x : a) out.push_back(int64(x));
    return out;
  }

  std::uint64_t count(const char* key) const {
    const simdjson::dom::element* v = find(key);
    if (!v) throw Fallback{};
    if (v->type() == simdjson::dom::element_type::UINT64) return v->get_uint64().value_unsafe();
    const std::int64_t n = int64(*v);
    if (n < 0) throw Fallback{};
    return static_cast<std::uint64_t>(n);
  }

  std::int64_t integer(const char* key, std::optional<std::int64_t> fallback = std::nullopt) const {
    const simdjson::dom::element* v = find(key);
    if (!v) {
      if (fallback) return *fallback;
      throw Fallback{};
    }
    return int64(*v);
  }

 private:
  static constexpr std::string_view kKeys[] = {"name",      "dtype", "shape",  "digest",       "digest_algorithm",
                                               "raw_bytes", "codec", "offset", "stored_bytes", "checksum"};
  static constexpr int kSlots = sizeof kKeys / sizeof kKeys[0];

  static int slot(std::string_view key) {
    for (int i = 0; i < kSlots; ++i) {
      if (key == kKeys[i]) return i;
    }
    return -1;
  }
  // An integer simdjson holds as int64 (UINT64 only above INT64_MAX, which Fields refuses).
  static std::int64_t int64(const simdjson::dom::element& v) {
    if (v.type() != simdjson::dom::element_type::INT64) throw Fallback{};
    return v.get_int64().value_unsafe();
  }
  const simdjson::dom::element* find(const char* key) const {
    const int k = slot(key);
    return k >= 0 && has_[k] ? &values_[k] : nullptr;
  }

  bool has_[kSlots] = {};
  simdjson::dom::element values_[kSlots];
};

// simdjson's value as nlohmann's parse would have given it (a non-negative integer unsigned, a
// negative one signed; objects keep the last of a key given twice).
nlohmann::json to_json(const simdjson::dom::element& v) {
  switch (v.type()) {
    case simdjson::dom::element_type::ARRAY: {
      simdjson::dom::array list;
      if (v.get_array().get(list) != simdjson::SUCCESS) throw Fallback{};
      nlohmann::json a = nlohmann::json::array();
      for (const simdjson::dom::element x : list) a.push_back(to_json(x));
      return a;
    }
    case simdjson::dom::element_type::OBJECT: {
      simdjson::dom::object fields;
      if (v.get_object().get(fields) != simdjson::SUCCESS) throw Fallback{};
      nlohmann::json o = nlohmann::json::object();
      for (const simdjson::dom::key_value_pair f : fields) o[std::string(f.key)] = to_json(f.value);
      return o;
    }
    case simdjson::dom::element_type::INT64: {
      const std::int64_t n = v.get_int64().value_unsafe();
      return n >= 0 ? nlohmann::json(static_cast<std::uint64_t>(n)) : nlohmann::json(n);
    }
    case simdjson::dom::element_type::UINT64: return v.get_uint64().value_unsafe();
    case simdjson::dom::element_type::DOUBLE: return v.get_double().value_unsafe();
    case simdjson::dom::element_type::STRING: return std::string(v.get_string().value_unsafe());
    case simdjson::dom::element_type::BOOL: return v.get_bool().value_unsafe();
    case simdjson::dom::element_type::NULL_VALUE: return nullptr;
  }
  throw Fallback{};
}

// The record's metadata and tensor table through simdjson; false: left to nlohmann's path (the
// record may still be valid). Errors of the entries' values themselves are thrown as they are.
// Deeper caps are left to nlohmann's path (to_json recurses once per level).
constexpr int kMaxFastDepth = 256;

bool parse_fast(const std::string& text, const TableContext& c, Record& r) {
  // One parser per thread, reused: its buffers grow to the largest metadata parsed (a large one
  // gets a parser of its own, freed after).
  thread_local simdjson::dom::parser shared;
  std::optional<simdjson::dom::parser> own;
  constexpr std::size_t kSharedBytes = std::size_t{4} << 20;
  simdjson::dom::parser& parser = text.size() <= kSharedBytes ? shared : own.emplace();
  // Nesting past the reader's cap is refused by simdjson (DEPTH_ERROR, at the cap or one level
  // before it), and the nlohmann path then counts it exactly (parse_meta).
  if (c.options.max_meta_depth < 1 || c.options.max_meta_depth > kMaxFastDepth) return false;
  const auto depth = static_cast<std::size_t>(c.options.max_meta_depth);
  if (parser.max_depth() != depth &&
      parser.allocate(std::max<std::size_t>(text.size(), 64), depth) != simdjson::SUCCESS)
    return false;
  // simdjson reads up to SIMDJSON_PADDING bytes past the end: the text is parsed in place when its
  // buffer has them, copied otherwise.
  const bool padded = text.capacity() >= text.size() + simdjson::SIMDJSON_PADDING;
  simdjson::dom::element doc;
  const simdjson::error_code error = padded ? parser.parse(text.data(), text.size(), false).get(doc)
                                            : parser.parse(text).get(doc);
  simdjson::dom::object top;
  if (error != simdjson::SUCCESS || doc.get_object().get(top) != simdjson::SUCCESS) return false;
  try {
    nlohmann::json meta = nlohmann::json::object();
    std::optional<simdjson::dom::element> table;
    for (const simdjson::dom::key_value_pair field : top) {
      if (field.key == "tensors") {
        table = field.value;  // the last of a key given twice, as nlohmann keeps it
      } else {
        meta[std::string(field.key)] = to_json(field.value);
      }
    }
    std::vector<TensorEntry> tensors;
    if (table) {
      simdjson::dom::array list;
      if (table->get_array().get(list) != simdjson::SUCCESS) return false;
      // Each field's type is checked where Fields checks it, in the same order as the checks of
      // its value: an error thrown here is the one nlohmann's path would throw first.
      tensors.reserve(list.size());
      for (const simdjson::dom::element e : list) tensors.push_back(table_entry(SimdEntry(e), c));
    }
    r.meta = std::move(meta);
    r.tensors = std::move(tensors);
    return true;
  } catch (const Fallback&) {
    return false;
  }
}

}  // namespace

// A record's index entry, from its typed decoder (records.h): every step_begin, segment, step_end
// and event record is validated once, when the trace is opened.
RecordInfo TraceReader::index_entry(const Record& r, std::uint32_t length) const {
  RecordInfo info{r.type, r.offset, length};
  switch (r.type) {
    case RecordType::kStepBegin: info.step = StepBeginRecord::decode(r, path_).step; break;
    case RecordType::kStepEnd: info.step = StepEndRecord::decode(r, path_).step; break;
    case RecordType::kSegment: {
      const SegmentRecord s = SegmentRecord::decode(r, path_);
      info.step = s.step;
      info.segment = s.segment;
      info.phase = to_string(s.phase);
      break;
    }
    case RecordType::kEvent: {
      const EventRecord e = EventRecord::decode(r, path_);
      if (e.exception) info.step = e.exception->step;
      break;
    }
    case RecordType::kCollective: info.step = CollectiveRecord::decode(r, path_).step; break;
    case RecordType::kHeader:
    case RecordType::kIndex: break;
  }
  return info;
}

TraceReader::TraceReader(const std::string& path, ReaderOptions options) : path_(path), options_(options) {
  io::FileSystem& fs = options.fs ? *options.fs : io::posix_file_system();
  try {
    file_ = fs.open(path);
  } catch (const io::IoError& e) {
    if (e.os_error() == EISDIR)
      throw TraceError(TraceError::Kind::kIo, 0, "'" + path + "' is a directory, not a trace");
    throw TraceError(TraceError::Kind::kIo, 0, "cannot open trace '" + path + "': " + e.reason());
  }
  file_size_ = file_->size();
  try {
    version_ = read_file_header(*file_, path, file_size_);
    scan_records();
  } catch (...) {
    file_.reset();
    throw;
  }
}

namespace {
// Opening checks records on LibTorch's intra-op threads when their payloads add up to this much
// (below it, starting the threads costs more than they save).
constexpr std::uint64_t kParallelScanBytes = std::uint64_t{8} << 20;
// From format version 4 opening reads metadata only, whose cost goes with the number of records.
constexpr std::size_t kParallelScanRecords = 64;
}  // namespace

void TraceReader::scan_records() {
  const std::string& path = path_;
  // 1. Where each record lies, from its 24-byte header alone, up to what ends the walk: the
  //    trailer after the index, a truncated tail (a warning), or a bad header or trailer (an
  //    error, thrown at 3. after every record before it, so that the first bad record in file
  //    order is the one named, as a one-by-one scan names it).
  struct Place {
    std::uint64_t pos;
    std::uint32_t length;
  };
  std::vector<Place> places;
  std::uint64_t payload_bytes = 0;
  std::exception_ptr tail_error;
  // A truncated tail's warning, given the number of records readable before it.
  std::function<std::string(std::size_t)> tail_warning;
  bool seen_index = false, trailer_ok = false;
  std::uint64_t index_offset = 0;
  std::uint64_t pos = kFileHeaderBytes;
  try {
    while (pos < file_size_) {
      const std::uint64_t left = file_size_ - pos;
      if (seen_index) {
        if (left < kTrailerBytes) {
          tail_warning = [&path, pos](std::size_t records) {
            return path + ": ends inside the trailer at byte offset " + std::to_string(pos) + "; all " +
                   std::to_string(records) + " records are readable";
          };
          break;
        }
        check_trailer(*file_, path, pos, left, index_offset);
        trailer_ok = true;
        break;
      }
      if (left < kRecordHeaderBytes) {
        tail_warning = [&path, pos, left](std::size_t records) {
          return path + ": ends inside a record header at byte offset " + std::to_string(pos) + " (" +
                 std::to_string(left) + " trailing bytes ignored); all " + std::to_string(records) +
                 " complete records are readable";
        };
        break;
      }
      unsigned char raw[kRecordHeaderBytes];
      read_exactly(*file_, raw, sizeof raw, pos, path);
      const RecordHeader h = decode_header(raw);
      check_record_header(h, raw, path, pos, options_.max_record_bytes);
      if (h.length > left - kRecordHeaderBytes) {
        const std::uint64_t missing = h.length - (left - kRecordHeaderBytes);
        tail_warning = [&path, pos, missing](std::size_t records) {
          return path + ": ends inside the record at byte offset " + std::to_string(pos) + " (" +
                 std::to_string(missing) + " bytes missing); all " + std::to_string(records) +
                 " complete records are readable";
        };
        break;
      }
      places.push_back({pos, h.length});
      payload_bytes += h.length;
      if (h.type == static_cast<std::uint16_t>(RecordType::kIndex)) {
        seen_index = true;
        index_offset = pos;
      }
      pos += kRecordHeaderBytes + h.length;
    }
  } catch (...) {
    tail_error = std::current_exception();
  }

  // 2. Every record checked (checksum, metadata, tensor table; its tensor bytes hashed before
  //    version 4, never kept). A large trace is checked on the intra-op threads, each taking the
  //    largest record left (a trace's records differ in size by 1000x); one record after another,
  //    a small one.
  const std::size_t n = places.size();
  std::vector<Record> loaded(n);
  std::vector<std::uint64_t> hashes(n, 0);
  const auto check = [&](std::size_t i) { loaded[i] = load_record(places[i].pos, false, &hashes[i]); };
  // The first bad record's error, thrown at 3. after the records before it (one of them may be
  // malformed in a way only 3. sees).
  std::exception_ptr record_error;
  std::size_t bad_record = n;
  const bool large = version_ >= kTensorChecksumVersion ? n >= kParallelScanRecords
                                                        : payload_bytes >= kParallelScanBytes;
  if (n > 1 && large && at::get_num_threads() > 1) {
    const auto on_intra_op_threads = [](const auto& loop) {
      at::parallel_for(0, at::get_num_threads(), 1, [&](std::int64_t, std::int64_t) { loop(); });
    };
    try {
      detail::largest_first(
          n, [&](std::size_t i) { return places[i].length; }, check, on_intra_op_threads, &bad_record);
    } catch (...) {
      record_error = std::current_exception();
    }
  } else {
    for (std::size_t i = 0; i < n && !record_error; ++i) {
      try {
        check(i);
      } catch (...) {
        record_error = std::current_exception();
        bad_record = i;
      }
    }
  }

  // 3. In file order: the first error wins; the header first, the index last.
  for (std::size_t i = 0; i < n; ++i) {
    if (i == bad_record) std::rethrow_exception(record_error);
    const Record& r = loaded[i];
    const std::uint64_t at = places[i].pos;
    if (records_.empty() && !header_.is_object()) {
      if (r.type != RecordType::kHeader)
        bad(TraceError::Kind::kMalformed, path, at, "the first record is not the header");
      header_ = r.meta;
      TraceHeader::decode(header_, path);  // validates the header's fields once, here
    } else if (r.type == RecordType::kHeader) {
      bad(TraceError::Kind::kMalformed, path, at, "a second header record");
    } else if (r.type == RecordType::kIndex) {
      check_index(r, records_, path, at);
    } else {
      records_.push_back(index_entry(r, places[i].length));
      meta_hashes_.push_back(hashes[i]);
    }
  }
  if (tail_error) std::rethrow_exception(tail_error);
  if (tail_warning) warning_ = tail_warning(records_.size());
  complete_ = trailer_ok;
  if (!header_.is_object()) bad(TraceError::Kind::kMalformed, path, kFileHeaderBytes, "no header record");
  if (seen_index && !complete_ && warning_.empty()) {
    warning_ = path + ": ends after the index without its trailer; all " + std::to_string(records_.size()) +
               " records are readable";
  }
}

TraceReader::~TraceReader() = default;

TraceReader::TraceReader(TraceReader&& o) noexcept = default;

Record TraceReader::read(std::size_t i) const {
  if (i >= records_.size()) throw Error("record " + std::to_string(i) + " does not exist in " + path_);
  return load(records_[i].offset);
}

Record TraceReader::read_table(std::size_t i) const {
  if (i >= records_.size()) throw Error("record " + std::to_string(i) + " does not exist in " + path_);
  // Opening checked the whole record (framing, checksum, metadata, tensor table): read its header
  // and metadata again, and check that they are the bytes checked then. Its tensor bytes are not
  // read: decode() reads and checks each one it needs.
  const RecordInfo& info = records_[i];
  unsigned char raw[kRecordHeaderBytes];
  read_exactly(*file_, raw, sizeof raw, info.offset, path_);
  const RecordHeader h = decode_header(raw);
  std::uint32_t meta_len = 0;
  std::string meta;
  const bool same_header = h.magic == kRecordMagic && header_checksum_matches(h, raw) && h.length == info.length &&
                           h.type == static_cast<std::uint16_t>(info.type) && h.length >= 4;
  if (same_header) {
    read_exactly(*file_, &meta_len, 4, info.offset + kRecordHeaderBytes, path_);
    if (meta_len <= h.length - 4) {
      meta.reserve(meta_len + simdjson::SIMDJSON_PADDING);  // parsed in place (parse_fast)
      meta.resize(meta_len);
      read_exactly(*file_, meta.data(), meta_len, info.offset + kRecordHeaderBytes + 4, path_);
    }
  }
  if (!same_header || meta.size() != meta_len ||
      detail::xxh3_64(meta.data(), meta.size(), h.payload_checksum) != meta_hashes_[i]) {
    bad(TraceError::Kind::kChecksum, path_, info.offset,
        "the record changed since the trace was opened (its header or metadata no longer match the checksummed "
        "ones); reopen the trace");
  }
  const std::uint64_t blob_at = info.offset + kRecordHeaderBytes + 4 + meta_len;
  return parse_record(info.offset, h.type, meta, blob_at, h.length - 4 - meta_len);
}

Record TraceReader::load(std::uint64_t offset) const { return load_record(offset, true); }

Record TraceReader::load_record(std::uint64_t offset, bool keep_blob, std::uint64_t* meta_hash) const {
  unsigned char raw[kRecordHeaderBytes];
  read_exactly(*file_, raw, sizeof raw, offset, path_);
  const RecordHeader h = decode_header(raw);
  // Callers checked framing, header checksum and size before calling. The payload is read in
  // pieces and hashed as it comes: the metadata into its own string, the tensor bytes straight
  // into the record's blob (kept) or through a small buffer (a scan: only the checksum counts),
  // so that no record is copied whole and no buffer of its size is allocated for nothing.
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash(XXH3_createState(), &XXH3_freeState);
  if (!hash) throw std::bad_alloc();
  XXH3_64bits_reset_withSeed(hash.get(), payload_checksum_seed(h.type, h.flags, h.length));
  std::uint64_t pos = offset + kRecordHeaderBytes;
  const auto take = [&](void* out, std::size_t n) {
    read_exactly(*file_, out, n, pos, path_);
    detail::xxh3_64_update(hash.get(), out, n);
    pos += n;
  };
  const auto hash_rest = [&](std::uint64_t n) {
    // 128 KiB pieces: each is still in the L2 cache when it is hashed.
    std::vector<char> chunk(static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 17)));
    while (n > 0) {
      const auto k = static_cast<std::size_t>(std::min<std::uint64_t>(n, chunk.size()));
      take(chunk.data(), k);
      n -= k;
    }
  };
  const auto check_sum = [&] {
    if (XXH3_64bits_digest(hash.get()) != h.payload_checksum) {
      bad(TraceError::Kind::kChecksum, path_, offset, "record payload checksum mismatch");
    }
  };
  std::uint32_t meta_len = 0;
  const bool has_meta_len = h.length >= 4;
  if (has_meta_len) take(&meta_len, 4);
  const bool meta_fits = has_meta_len && meta_len <= h.length - 4;
  const bool meta_in_bounds = meta_fits && meta_len <= options_.max_meta_bytes;
  // From version 4 the checksum covers meta_len and the metadata (the whole payload when meta_len
  // does not fit in it): each stored tensor's bytes are under its entry's checksum, which decode()
  // checks. Opening then reads no tensor bytes.
  const bool blob_unsummed = version_ >= kTensorChecksumVersion && meta_fits;
  std::string meta;
  std::uint64_t blob_size = 0, blob_at = 0;
  std::string blob;
  if (meta_in_bounds) {
    meta.reserve(meta_len + simdjson::SIMDJSON_PADDING);  // parsed in place (parse_fast)
    meta.resize(meta_len);
    take(meta.data(), meta_len);
    blob_size = h.length - 4 - meta_len;
    blob_at = pos;
    if (!blob_unsummed && keep_blob) {  // (unsummed: read after the checksum, below)
      blob.resize(static_cast<std::size_t>(blob_size));
      take(blob.data(), blob.size());
    } else if (!blob_unsummed) {
      hash_rest(blob_size);
    }
  } else if (blob_unsummed) {
    hash_rest(meta_len);  // over the reader's cap: checked, not kept
  } else {
    hash_rest(h.length - (has_meta_len ? 4 : 0));
  }
  check_sum();
  if (!has_meta_len)
    bad(TraceError::Kind::kMalformed, path_, offset, "record payload shorter than its metadata length");
  if (!meta_in_bounds) {
    bad(TraceError::Kind::kMalformed, path_, offset,
        "metadata length " + std::to_string(meta_len) + " is out of bounds");
  }
  if (blob_unsummed && keep_blob) {  // each stored tensor's checksum covers its bytes (decode_to)
    blob.resize(static_cast<std::size_t>(blob_size));
    read_exactly(*file_, blob.data(), blob.size(), blob_at, path_);
  }
  // Seeded with the payload checksum: the hash names this record's metadata, not just its text.
  if (meta_hash) *meta_hash = detail::xxh3_64(meta.data(), meta.size(), h.payload_checksum);
  Record r = parse_record(offset, h.type, meta, blob_at, blob_size);
  r.has_blob = keep_blob;
  r.blob = std::move(blob);
  return r;
}

Record TraceReader::parse_record(std::uint64_t offset, std::uint16_t type, const std::string& meta,
                                 std::uint64_t blob_at, std::uint64_t blob_size) const {
  Record r;
  r.offset = offset;
  r.blob_at = blob_at;
  r.has_blob = false;
  switch (type) {
    case 1:
    case 2:
    case 3:
    case 4:
    case 5:
    case 15: r.type = static_cast<RecordType>(type); break;
    case 6:
      if (version_ < 3) {
        bad(TraceError::Kind::kMalformed, path_, offset,
            "record type 6 (collective) in a format version " + std::to_string(version_) +
                " trace; it came with version 3");
      }
      r.type = RecordType::kCollective;
      break;
    default: bad(TraceError::Kind::kMalformed, path_, offset, "unknown record type " + std::to_string(type));
  }
  // The metadata parsed by simdjson (about 30x nlohmann's speed on a tensor table: opening a
  // trace parses every record's); anything it refuses or that is not plainly well-typed (a field
  // of another type, a duplicate key, an integer past 64 bits) is parsed again by nlohmann, whose
  // parse and Fields give the exact errors. Either way the entries pass the same checks.
  const TableContext c{path_, options_, version_, offset, blob_size};
  if (!parse_fast(meta, c, r)) {
    r.meta = parse_meta(meta, options_.max_meta_depth, path_, offset);
    if (!r.meta.is_object()) bad(TraceError::Kind::kMalformed, path_, offset, "record metadata is not an object");
    if (r.meta.contains("tensors")) {
      const nlohmann::json& list = r.meta["tensors"];
      if (!list.is_array()) bad(TraceError::Kind::kMalformed, path_, offset, "'tensors' is not a list");
      for (const nlohmann::json& t : list) {
        const Fields f(t, path_, offset, "tensor entry " + std::to_string(r.tensors.size()));
        r.tensors.push_back(table_entry(f, c));
      }
      r.meta.erase("tensors");  // Record::tensors holds them
    }
  }
  // Version 4: the stored tensors lie back to back in table order and fill the blob, so that
  // every byte of it is under one tensor's checksum.
  if (version_ >= kTensorChecksumVersion) {
    std::uint64_t next = 0;
    for (const TensorEntry& e : r.tensors) {
      if (!e.has_data()) continue;
      if (e.offset != next) {
        bad(TraceError::Kind::kMalformed, path_, offset,
            "tensor '" + e.name + "' is stored at blob offset " + std::to_string(e.offset) + ", not at " +
                std::to_string(next) + " where the stored tensor before it ends (format version " +
                std::to_string(version_) + " stores them back to back)");
      }
      next += e.stored_bytes;
    }
    if (next != blob_size) {
      bad(TraceError::Kind::kMalformed, path_, offset,
          "the record's stored tensors cover " + std::to_string(next) + " of its " + std::to_string(blob_size) +
              " blob bytes");
    }
  }
  return r;
}

namespace {
// A tensor's stored bytes read from the file by decode(): into a buffer the thread keeps for its
// next tensor, up to kKeptStagingBytes (larger ones into `once`, freed with it). A fresh buffer
// for every tensor had the kernel mapping and zeroing new pages for each: in a replay's anchor
// decode (GPT-2 small, 1.2 GB of state) they cost more than Blosc's decoding (bench/README.md).
// Each thread that decodes keeps at most kKeptStagingBytes.
constexpr std::size_t kKeptStagingBytes = std::size_t{64} << 20;

// Tensors of at least this many bytes have their pages faulted in before they are decoded into.
constexpr std::size_t kPrefaultBytes = std::size_t{1} << 20;

char* staging_room(std::size_t bytes, std::unique_ptr<char[]>& once) {
  thread_local std::unique_ptr<char[]> kept;
  thread_local std::size_t capacity = 0;
  bytes = std::max<std::size_t>(bytes, 1);
  if (bytes > kKeptStagingBytes) {
    once.reset(new char[bytes]);
    return once.get();
  }
  if (bytes > capacity) {
    const std::size_t grown = std::min(kKeptStagingBytes, std::max(bytes, 2 * capacity));
    kept.reset();  // before the new one: never both at once
    kept.reset(new char[grown]);
    capacity = grown;
  }
  return kept.get();
}
}  // namespace

at::Tensor TraceReader::decode(const Record& record, const TensorEntry& e) const {
  at::Tensor out;
  decode_to(record, e, out);
  return out;
}

void TraceReader::decode_into(const Record& record, const TensorEntry& e, const at::Tensor& out) const {
  if (!out.defined() || !out.is_cpu() || !out.is_contiguous() || out.scalar_type() != e.dtype ||
      out.sizes() != at::IntArrayRef(e.shape) || out.is_neg() || out.is_conj()) {
    std::ostringstream m;
    m << path_ << ": tensor '" << e.name << "' in the record at byte offset " << record.offset
      << " cannot be decoded into ";
    if (out.defined()) {
      m << c10::toString(out.scalar_type()) << " " << out.sizes() << " on " << out.device()
        << (out.is_contiguous() ? "" : ", not contiguous") << (out.is_neg() ? ", a negative view" : "")
        << (out.is_conj() ? ", a conjugate view" : "");
    } else {
      m << "an undefined tensor";
    }
    m << ": decode_into needs a contiguous CPU tensor of its dtype " << c10::toString(e.dtype) << " and shape "
      << at::IntArrayRef(e.shape) << " (decode() makes one)";
    throw Error(m.str());
  }
  at::Tensor target = out;
  decode_to(record, e, target);
  target.unsafeGetTensorImpl()->bump_version();
}

const char* TraceReader::stored_bytes(const Record& record, const TensorEntry& e, std::unique_ptr<char[]>& once) const {
  // A record read without its tensor bytes (read_table): this tensor's bytes, from the file,
  // within the record's blob as its header declares it.
  std::uint64_t blob_bytes = record.blob.size();
  if (!record.has_blob) {
    // The record's length as opening checked it (records() is in file order), else its header's.
    std::uint64_t length = 0;
    const auto it = std::lower_bound(records_.begin(), records_.end(), record.offset,
                                     [](const RecordInfo& r, std::uint64_t offset) { return r.offset < offset; });
    if (it != records_.end() && it->offset == record.offset) {
      length = it->length;
    } else {
      unsigned char raw[kRecordHeaderBytes];
      read_exactly(*file_, raw, sizeof raw, record.offset, path_);
      length = decode_header(raw).length;
    }
    const std::uint64_t payload_end = record.offset + kRecordHeaderBytes + length;
    blob_bytes = record.blob_at < record.offset + kRecordHeaderBytes || record.blob_at > payload_end
                     ? 0
                     : payload_end - record.blob_at;
  }
  if (e.offset > blob_bytes || e.stored_bytes > blob_bytes - e.offset) {
    throw Error(path_ + ": tensor '" + e.name + "' lies outside the bytes of the record at byte offset " +
                std::to_string(record.offset));
  }
  if (record.has_blob) return record.blob.data() + e.offset;
  char* staged = staging_room(static_cast<std::size_t>(e.stored_bytes), once);  // not zeroed: the read fills it
  read_exactly(*file_, staged, static_cast<std::size_t>(e.stored_bytes), record.blob_at + e.offset, path_);
  return staged;
}

void TraceReader::check_checksum(const Record& record, const TensorEntry& e, const char* bytes) const {
  if (version_ >= kTensorChecksumVersion &&
      detail::xxh3_64(bytes, static_cast<std::size_t>(e.stored_bytes)) != e.checksum) {
    bad(TraceError::Kind::kChecksum, path_, record.offset,
        "tensor '" + e.name + "' stored bytes do not match their checksum");
  }
}

namespace {
[[noreturn]] void digest_only(const std::string& path, const Record& record, const TensorEntry& e) {
  throw Error(path + ": tensor '" + e.name + "' in the record at byte offset " + std::to_string(record.offset) +
              " holds only a digest (recorded in digest mode)");
}
}  // namespace

void TraceReader::check_stored(const Record& record, const TensorEntry& e) const {
  if (!e.has_data()) digest_only(path_, record, e);
  if (version_ < kTensorChecksumVersion) return;  // opening checked them under the record's checksum
  std::unique_ptr<char[]> once;
  check_checksum(record, e, stored_bytes(record, e, once));
}

void TraceReader::decode_to(const Record& record, const TensorEntry& e, at::Tensor& out) const {
  if (!e.has_data()) digest_only(path_, record, e);
  // From the file (a record read without its tensor bytes), its own checksum (version 4) checks
  // a tensor's bytes; in an older trace a host digest (XXH3-128) or a zstd frame's own checksum
  // does, and anything else (a device digest, Blosc) has no check of its own: the tensor is then
  // decoded from the whole record read again, its record checksum verified.
  if (!record.has_blob && version_ < kTensorChecksumVersion && e.digest.algorithm != DigestAlgorithm::kXxh3_128 &&
      e.codec != TensorCodec::kZstd && e.codec != TensorCodec::kZstdShuffle) {
    return decode_to(load(record.offset), e, out);
  }
  std::unique_ptr<char[]> once;  // a tensor too large for the thread's kept buffer
  const char* src = stored_bytes(record, e, once);
  check_checksum(record, e, src);
  const std::optional<std::uint64_t> declared = declared_payload_size(src, e.stored_bytes, e.codec);
  if (!declared || *declared != e.raw_bytes) {
    bad(TraceError::Kind::kMalformed, path_, record.offset,
        "tensor '" + e.name + "' payload does not declare its size of " + std::to_string(e.raw_bytes) + " bytes");
  }
  if (!out.defined()) out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  // A large tensor's memory is often fresh (a replay's optimizer moments, a program's parameters
  // not yet written): its pages faulted in at once, not one fault per page during the decode.
  if (out.nbytes() >= kPrefaultBytes) detail::prefault_for_write(out.data_ptr(), out.nbytes());
  try {
    decode_tensor_payload(src, e.stored_bytes, e.codec, out);
  } catch (const Error& err) {
    bad(TraceError::Kind::kChecksum, path_, record.offset, "tensor '" + e.name + "' " + err.what());
  }
  if (e.digest.algorithm == DigestAlgorithm::kXxh3_128 && digest(out) != e.digest) {
    bad(TraceError::Kind::kChecksum, path_, record.offset, "tensor '" + e.name + "' does not match its digest");
  }
}

}  // namespace retrace
