// libFuzzer target: bytes -> retrace::TraceReader. Opens the bytes as a trace, reads every record
// and decodes every stored tensor. Every failure must be a retrace::Error (TraceError for the
// reader's checks); anything else — another exception, a crash, a sanitizer report, a leak, a
// broken invariant below — fails the run.
//
// Records are checksummed, so plain byte mutation mostly stops at the first checksum. The custom
// mutator below therefore mutates a trace's parts (metadata text, tensor-table fields, blobs,
// record types, the record list) and seals it again (trace_framing.h); one mutation in eight is a
// plain byte mutation with stale checksums, for the framing and checksum checks themselves. A
// crash file is an ordinary trace file: `retrace inspect crash-...` reads the same bytes.
//
//   build-fuzz/bin/fuzz_trace_reader CORPUS_DIR tests/fuzz/corpus/trace -dict=tests/fuzz/trace.dict
//   build-fuzz/bin/fuzz_trace_reader crash-file        # reproduce one input

#include "fuzz_support.h"
#include "trace_framing.h"

#include <retrace/trace.h>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <sys/mman.h>
#include <unistd.h>

extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max_size);

namespace {

using retrace::fuzz::check;
using retrace::fuzz::FramedRecord;
using retrace::fuzz::FramedTrace;

// The caps the reader checks before it allocates, lowered from their defaults (1 GiB records,
// 4 GiB tensors) so that an input declaring the most the caps allow stays under libFuzzer's
// 2 GiB malloc limit. The fuzzer checks that the caps hold, not what they are.
retrace::ReaderOptions fuzz_caps() {
  retrace::ReaderOptions o;
  o.max_record_bytes = 64u << 20;
  o.max_tensor_bytes = 64u << 20;
  o.max_meta_bytes = 1u << 20;
  return o;
}

// The input lives in an anonymous memory file; the reader opens it by path like any trace.
int g_fd = -1;
std::string g_path;

// Whether check_stored() accepts the entry's bytes; it must wherever decode() decodes them.
bool passes_check(const retrace::TraceReader& reader, const retrace::Record& record,
                  const retrace::TensorEntry& entry) {
  try {
    reader.check_stored(record, entry);
    return true;
  } catch (const retrace::Error&) {
    return false;
  }
}

void read_everything(const std::string& path) {
  const retrace::ReaderOptions caps = fuzz_caps();
  retrace::TraceReader reader(path, caps);  // a retrace::Error here ends the input
  check(reader.header().is_object(), "an opened trace has a header object");
  check(!(reader.complete() && reader.truncated()), "a complete trace is not also truncated");
  for (std::size_t i = 0; i < reader.records().size(); ++i) {
    retrace::Record record;
    try {
      record = reader.read(i);
    } catch (const retrace::Error& e) {
      // open() verified every record's metadata checksum and metadata already; the file has not changed
      // (a version-4 tensor's own checksum is checked when it is decoded, below).
      retrace::fuzz::fail(std::string("record ") + std::to_string(i) + " passed open() but read() throws: " + e.what());
    }
    check(record.offset == reader.records()[i].offset && record.type == reader.records()[i].type,
          "read(i) returns the record records()[i] describes");
    for (const retrace::TensorEntry& entry : record.tensors) {
      if (!entry.has_data()) continue;
      check(entry.offset <= record.blob.size() && entry.stored_bytes <= record.blob.size() - entry.offset,
            "a stored tensor's bytes lie inside its record's blob");
      const bool checked = passes_check(reader, record, entry);
      try {
        const at::Tensor t = reader.decode(record, entry);
        check(checked, "check_stored() refused a tensor that decode() decodes");
        check(t.defined() && t.is_cpu() && t.is_contiguous(), "decode() returns a contiguous CPU tensor");
        check(t.scalar_type() == entry.dtype && t.sizes().vec() == entry.shape,
              "decode() returns the declared dtype and shape");
        check(static_cast<std::uint64_t>(t.nbytes()) == entry.raw_bytes, "decode() returns raw_bytes bytes");
        check(entry.raw_bytes <= caps.max_tensor_bytes, "decode() honours max_tensor_bytes");
      } catch (const retrace::Error&) {
        // a typed refusal of this tensor; the next one is tried
      }
    }
    // The same record read for its table only: the same entries, and decode() (which then reads
    // each tensor's bytes from the file) gives the same bits or the same refusal.
    retrace::Record table;
    try {
      table = reader.read_table(i);
    } catch (const retrace::Error& e) {
      retrace::fuzz::fail(std::string("record ") + std::to_string(i) +
                          " passed read() but read_table() throws: " + e.what());
    }
    check(!table.has_blob && table.blob.empty() && table.tensors.size() == record.tensors.size(),
          "read_table(i) holds read(i)'s entries and no tensor bytes");
    for (std::size_t k = 0; k < record.tensors.size(); ++k) {
      const retrace::TensorEntry& entry = record.tensors[k];
      if (!entry.has_data()) continue;
      at::Tensor whole, from_file;
      try {
        whole = reader.decode(record, entry);
      } catch (const retrace::Error&) {
      }
      const bool checked = passes_check(reader, table, table.tensors[k]);
      try {
        from_file = reader.decode(table, table.tensors[k]);
      } catch (const retrace::Error&) {
      }
      check(!from_file.defined() || checked, "check_stored() from read_table() refused a tensor decode() decodes");
      check(whole.defined() == from_file.defined(), "decode() of read() and of read_table() refuse alike");
      if (whole.defined()) {
        check(whole.nbytes() == from_file.nbytes() &&
                  (whole.nbytes() == 0 ||  // an empty tensor may have no data pointer
                   std::memcmp(whole.const_data_ptr(), from_file.const_data_ptr(), whole.nbytes()) == 0),
              "the same bits either way");
      }
    }
  }
}

// --- the mutator ---------------------------------------------------------------------------------

// libFuzzer's byte mutations (and its -dict entries) on a string, growing it by at most `grow`.
void mutate_bytes(std::string& s, std::size_t grow) {
  if (s.empty()) s.push_back('{');
  const std::size_t size = s.size();
  s.resize(size + grow);
  s.resize(LLVMFuzzerMutate(reinterpret_cast<std::uint8_t*>(s.data()), size, s.size()));
}

// The format's dtype names, and two it does not have.
const char* const kDtypeNames[] = {"float32", "float64", "float16", "bfloat16",  "uint8",      "int8",   "int16",
                                   "int32",   "int64",   "bool",    "complex64", "complex128", "float8", ""};

std::size_t element_size(const std::string& dtype) {
  if (dtype == "float64" || dtype == "int64" || dtype == "complex64") return 8;
  if (dtype == "complex128") return 16;
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16") return 2;
  return 1;
}

// A value at or near an edge: sizes, offsets and counts are where readers go wrong.
nlohmann::json interesting_number(std::minstd_rand& rng, std::uint64_t near) {
  static const std::int64_t kSigned[] = {0,
                                         1,
                                         2,
                                         3,
                                         4,
                                         7,
                                         8,
                                         16,
                                         255,
                                         256,
                                         4095,
                                         4096,
                                         65535,
                                         65536,
                                         (std::int64_t{1} << 31) - 1,
                                         std::int64_t{1} << 31,
                                         (std::int64_t{1} << 32) - 1,
                                         std::int64_t{1} << 32,
                                         std::int64_t{1} << 53,
                                         std::int64_t{1} << 62,
                                         std::numeric_limits<std::int64_t>::max(),
                                         -1,
                                         -2,
                                         std::numeric_limits<std::int64_t>::min()};
  switch (rng() % 4) {
    case 0: return near + rng() % 3 - 1;
    case 1: return std::numeric_limits<std::uint64_t>::max() - rng() % 2;
    default: return kSigned[rng() % (sizeof kSigned / sizeof kSigned[0])];
  }
}

nlohmann::json wrong_type(std::minstd_rand& rng) {
  switch (rng() % 6) {
    case 0: return "7";
    case 1: return 1.5;
    case 2: return true;
    case 3: return nullptr;
    case 4: return nlohmann::json::array({1, 2});
    default: return nlohmann::json::object();
  }
}

// Changes one field of one tensor entry, keeping raw_bytes consistent half the time so that the
// change reaches the checks after it.
bool mutate_tensor_entry(FramedRecord& r, std::minstd_rand& rng) {
  nlohmann::json meta = nlohmann::json::parse(r.meta, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || !meta.contains("tensors") || !meta["tensors"].is_array() || meta["tensors"].empty())
    return false;
  nlohmann::json& e = meta["tensors"][rng() % meta["tensors"].size()];
  if (!e.is_object()) return false;
  static const char* const kKeys[] = {"shape",  "shape",        "dtype",   "raw_bytes",
                                      "offset", "stored_bytes", "codec",   "digest_algorithm",
                                      "digest", "name",         "checksum"};
  const std::string key = kKeys[rng() % (sizeof kKeys / sizeof kKeys[0])];
  const auto unsigned_field = [&e](const char* k) -> std::uint64_t {
    const auto it = e.find(k);
    return it != e.end() && it->is_number_unsigned() ? it->get<std::uint64_t>() : 0;
  };
  const std::uint64_t stored = unsigned_field("stored_bytes");
  switch (rng() % 8) {
    case 0: e.erase(key); break;
    case 1: e[key] = wrong_type(rng); break;
    default:
      if (key == "shape") {
        nlohmann::json& shape = e[key];
        if (!shape.is_array()) shape = nlohmann::json::array();
        const auto op = rng() % 5;
        if (op == 0) {
          shape.push_back(interesting_number(rng, 1));
        } else if (op == 1 && !shape.empty()) {
          shape.erase(shape.size() - 1);
        } else if (op == 2 && !shape.empty()) {
          shape[rng() % shape.size()] = interesting_number(rng, 1);
        } else if (op == 3) {
          std::reverse(shape.begin(), shape.end());
        } else {
          shape = nlohmann::json::array();  // a new shape of edge sizes, zeros among them
          for (auto rank = rng() % 5; rank > 0; --rank) shape.push_back(interesting_number(rng, 1));
        }
      } else if (key == "dtype") {
        e[key] = kDtypeNames[rng() % (sizeof kDtypeNames / sizeof kDtypeNames[0])];
      } else if (key == "codec" || key == "digest_algorithm") {
        e[key] = static_cast<int>(rng() % 5) - 1;
      } else if (key == "digest" || key == "checksum") {
        const auto it = e.find(key);
        std::string hex = it != e.end() && it->is_string() ? it->get<std::string>()
                                                           : std::string(key == "digest" ? 32 : 16, '0');
        if (!hex.empty()) hex[rng() % hex.size()] = "0123456789abcdefG"[rng() % 17];
        e[key] = hex;
      } else if (key == "name") {
        e[key] = std::string(rng() % 3, 'x');
      } else {
        e[key] = interesting_number(rng, key == "offset" ? r.blob.size() : stored);
      }
  }
  // raw_bytes = numel x element size, as the reader requires, unless raw_bytes itself was the target.
  if (key != "raw_bytes" && rng() % 2 && e.contains("shape") && e["shape"].is_array()) {
    const auto dtype = e.find("dtype");
    unsigned __int128 bytes = element_size(dtype != e.end() && dtype->is_string() ? dtype->get<std::string>() : "");
    for (const nlohmann::json& s : e["shape"]) bytes *= s.is_number_unsigned() ? s.get<std::uint64_t>() : 0;
    if (bytes <= std::numeric_limits<std::uint64_t>::max()) e["raw_bytes"] = static_cast<std::uint64_t>(bytes);
  }
  r.meta = meta.dump();
  return true;
}

// Mutates the records of `t`: returns false when it changed the index record's own text (then
// seal_trace must not rebuild the index over the mutation).
bool mutate_records(FramedTrace& t, std::minstd_rand& rng) {
  bool keep_index = true;
  for (unsigned n = 1 + rng() % 3; n > 0 && !t.records.empty(); --n) {
    const std::size_t i = rng() % t.records.size();
    FramedRecord& r = t.records[i];
    switch (rng() % 10) {
      case 0:
      case 1:
      case 2:
        if (mutate_tensor_entry(r, rng)) break;
        [[fallthrough]];
      case 3:
      case 4:
        mutate_bytes(r.meta, 64);
        if (r.type == 15) keep_index = false;
        break;
      case 5:
      case 6: mutate_bytes(r.blob, 64); break;
      case 7: {
        static const std::uint16_t kTypes[] = {1, 2, 3, 4, 5, 15, 0, 6, 14, 16, 0xffff};
        if (rng() % 4) {
          r.type = kTypes[rng() % (sizeof kTypes / sizeof kTypes[0])];
        } else {
          r.flags = static_cast<std::uint16_t>(1u << (rng() % 16));
        }
        break;
      }
      case 8: {
        const auto op = rng() % 4;
        if (op == 0 && t.records.size() > 1) {
          t.records.erase(t.records.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (op == 1) {
          t.records.insert(t.records.begin() + static_cast<std::ptrdiff_t>(i), t.records[i]);
        } else if (op == 2 && i + 1 < t.records.size()) {
          std::swap(t.records[i], t.records[i + 1]);
        } else {
          t.trailer = !t.trailer;
        }
        break;
      }
      default:
        r.split = !r.split;  // the metadata length is written, or left to the blob's first bytes
        break;
    }
  }
  return keep_index;
}

std::size_t emit(const std::string& out, std::uint8_t* data, std::size_t max_size) {
  const std::size_t n = std::min(out.size(), max_size);  // a cut trace is a case of its own
  std::memcpy(data, out.data(), n);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);  // the fuzz lane runs two fuzzers on two cores
  g_fd = ::memfd_create("fuzz.trace", MFD_CLOEXEC);
  check(g_fd >= 0, "memfd_create");
  g_path = "/proc/self/fd/" + std::to_string(g_fd);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  check(::ftruncate(g_fd, 0) == 0 && ::pwrite(g_fd, data, size, 0) == static_cast<ssize_t>(size), "write the input");
  retrace::fuzz::only_retrace_errors([] { read_everything(g_path); });
  return 0;
}

extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size, std::size_t max_size,
                                               unsigned int seed) {
  std::minstd_rand rng(seed);
  if (rng() % 8 == 0) return LLVMFuzzerMutate(data, size, max_size);  // stale checksums on purpose
  FramedTrace t = retrace::fuzz::split_trace(data, size);
  if (t.records.empty()) return LLVMFuzzerMutate(data, size, max_size);
  const bool fix_index = mutate_records(t, rng);
  // A quarter of the time the tensors' own checksums (format 4) are left as the mutation left them:
  // a stale or malformed one must be refused; otherwise they are made right, so that a changed
  // blob reaches the codecs behind them.
  std::string out = retrace::fuzz::seal_trace(t, fix_index, /*fix_tensor_checksums=*/rng() % 4 != 0);
  if (rng() % 16 == 0) out.resize(rng() % (out.size() + 1));  // a crash while writing
  return emit(out, data, max_size);
}

// Crossover along record boundaries: the first records of one trace, the rest of another.
extern "C" std::size_t LLVMFuzzerCustomCrossOver(const std::uint8_t* data1, std::size_t size1,
                                                 const std::uint8_t* data2, std::size_t size2, std::uint8_t* out,
                                                 std::size_t max_out_size, unsigned int seed) {
  std::minstd_rand rng(seed);
  FramedTrace a = retrace::fuzz::split_trace(data1, size1);
  const FramedTrace b = retrace::fuzz::split_trace(data2, size2);
  a.records.resize(rng() % (a.records.size() + 1));
  const std::size_t from = rng() % (b.records.size() + 1);
  a.records.insert(a.records.end(), b.records.begin() + static_cast<std::ptrdiff_t>(from), b.records.end());
  a.trailer = b.trailer;
  a.tail = b.tail;
  return emit(retrace::fuzz::seal_trace(a, /*fix_index=*/true), out, max_out_size);
}
