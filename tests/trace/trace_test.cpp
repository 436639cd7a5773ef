// The trace format: round trips, golden files, truncation at every byte, bit flips, size caps.
#include <retrace/gtest.h>
#include <retrace/io.h>
#include <retrace/number.h>
#include <retrace/records.h>
#include <retrace/trace.h>

#include "core/prefault.h"
#include "core/tensor_codec.h"
#include "fuzz/trace_framing.h"
#include "support/watched_reads.h"

#include <torch/torch.h>
#include <xxhash.h>
#include <blosc.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <csignal>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/vfs.h>
#include <unistd.h>

namespace retrace {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("retrace_trace_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The trace `bytes` as the same records in format version `version` (its header's
// format_version too), sealed again: a version-3 trace's record checksum covers its tensor bytes.
// Its tensor entries keep their `checksum`, a key older versions ignore.
std::string as_version(const std::string& bytes, std::uint32_t version) {
  fuzz::FramedTrace t = fuzz::split_trace(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  std::memcpy(t.file_header.data() + 8, &version, 4);
  nlohmann::json header = nlohmann::json::parse(t.records.at(0).meta);
  header["format_version"] = version;
  t.records[0].meta = header.dump();
  return fuzz::seal_trace(t, /*fix_index=*/true);
}

// The POSIX file system, counting the bytes read through it (from the opening's threads too).
class CountingReads : public WatchedReads {
 public:
  CountingReads() : WatchedReads([this](std::uint64_t, std::size_t n) { bytes += n; }) {}
  std::atomic<std::uint64_t> bytes{0};
};

// The tensors of the small and golden traces: known answers.
at::Tensor tensor_a() { return torch::arange(12, torch::kFloat).view({3, 4}); }
at::Tensor tensor_b() { return (torch::arange(7, torch::kFloat) * 0.5 - 1).to(torch::kBFloat16); }
at::Tensor tensor_c() { return torch::tensor({-3, 0, 7, 1 << 30}, torch::kLong); }
at::Tensor tensor_d() { return torch::linspace(-2, 2, 5).to(torch::kHalf); }

// With `collective`: a collective record (format version 3) before the step_end.
void write_small(const std::string& path, WriterOptions options = {}, bool collective = false) {
  TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "small"}}}}, options);
  w.append(RecordType::kStepBegin, {{"step", 1}, {"full", true}},
           {{"a", tensor_a(), true, std::nullopt},
            {"b", tensor_b(), true, std::nullopt},
            {"c", tensor_c(), true, std::nullopt},
            {"d", tensor_d(), false, std::nullopt}});
  w.append(RecordType::kSegment, {{"step", 1}, {"segment", "block0"}, {"phase", "forward"}},
           {{"output.0", tensor_d(), true, std::nullopt}});
  if (collective) {
    CollectiveRecord c;
    c.step = 1;
    c.call = {CollectiveOp::kAllReduce, "sum", -1};
    c.rank = 1;
    c.input = {0, 11.0};
    c.output = {0, 22.0};
    c.values = true;
    w.append(RecordType::kCollective, c.to_meta(),
             {TensorToWrite::digest_only("input.0", tensor_a(), digest(tensor_a())),
              {"output.0", tensor_a() * 2, true, std::nullopt}});
  }
  w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.25}}, {});
  w.close();
}

void check_small(const TraceReader& r, int version = kTraceFormatVersion) {
  EXPECT_EQ(r.header()["program"]["config"], "small");
  EXPECT_EQ(r.header()["format_version"], version);
  ASSERT_EQ(r.records().size(), 3u);
  EXPECT_EQ(r.records()[1].segment, "block0");
  EXPECT_EQ(r.records()[1].phase, "forward");
  const Record begin = r.read(0);
  EXPECT_EQ(begin.type, RecordType::kStepBegin);
  EXPECT_BITWISE_EQ(tensor_a(), r.decode(begin, *begin.find("a")));
  EXPECT_BITWISE_EQ(tensor_b(), r.decode(begin, *begin.find("b")));
  EXPECT_BITWISE_EQ(tensor_c(), r.decode(begin, *begin.find("c")));
  const TensorEntry& d = *begin.find("d");
  EXPECT_FALSE(d.has_data());
  EXPECT_EQ(d.digest, digest(tensor_d()));
  EXPECT_EQ(d.shape, (std::vector<std::int64_t>{5}));
  EXPECT_THROW(r.decode(begin, d), Error);
  const Record seg = r.read(1);
  EXPECT_BITWISE_EQ(tensor_d(), r.decode(seg, seg.tensors[0]));
  EXPECT_EQ(r.read(2).meta["loss"], 0.25);
}

TEST(Trace, RoundTripFastAndSmallWithAndWithoutShuffle) {
  for (ShuffleMode mode : {ShuffleMode::kAuto, ShuffleMode::kAlways, ShuffleMode::kNever}) {
    const std::string path = temp_path("roundtrip");
    WriterOptions options;
    options.compression = Compression::kSmall;
    options.shuffle = mode;
    write_small(path, options);
    const TraceReader r(path);
    const Record begin = r.read(0);
    const TensorCodec expected_b = mode == ShuffleMode::kNever ? TensorCodec::kZstd : TensorCodec::kZstdShuffle;
    EXPECT_EQ(begin.find("b")->codec, expected_b);
    EXPECT_EQ(begin.find("c")->codec, mode == ShuffleMode::kAlways ? TensorCodec::kZstdShuffle : TensorCodec::kZstd);
    check_small(r);
    fs::remove(path);
  }
  {
    const std::string path = temp_path("roundtrip");
    write_small(path);  // kFast is the default
    EXPECT_FALSE(fs::exists(path + ".incomplete"));
    const TraceReader r(path);
    EXPECT_TRUE(r.complete());
    EXPECT_FALSE(r.truncated());
    check_small(r);
    fs::remove(path);
  }
}

// A record of many stored tensors of mixed sizes, dtypes and codecs, some digest-only, some given
// their digest, some non-contiguous; `flip` flips one bit of one of them.
void write_mixed(const std::string& path, WriterOptions options, bool flip = false) {
  torch::manual_seed(7);
  std::vector<TensorToWrite> tensors;
  for (int i = 0; i < 40; ++i) {
    const std::int64_t n = (i % 7 == 0) ? 300000 + i : 17 * i + 1;  // a few large ones, many small
    at::Tensor t = torch::randn({n}) * 0.02;
    if (i % 3 == 1) t = t.to(torch::kBFloat16);
    if (i % 5 == 2) t = torch::randint(0, 1000, {n}, torch::kLong);
    if (i % 11 == 4) t = torch::randn({n, 2}).t();  // non-contiguous
    if (flip && i == 21) {
      t = t.contiguous().clone();
      auto* bytes = static_cast<unsigned char*>(t.data_ptr());
      bytes[0] ^= 0x10;
    }
    const bool store = i % 4 != 3;
    std::optional<Digest> given;
    if (i % 6 == 5) given = digest(t);
    tensors.push_back({"t" + std::to_string(i), t, store, given});
  }
  TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "mixed"}}}}, options);
  w.append(RecordType::kStepBegin, {{"step", 1}, {"full", true}}, tensors);
  w.append(RecordType::kSegment, {{"step", 1}, {"segment", "block0"}, {"phase", "forward"}},
           {{"output.0", tensor_d(), true, std::nullopt}});
  w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.25}}, tensors);
  w.close();
}

TEST(Trace, EncodeThreadsWriteTheSameBytes) {
  for (Compression compression : {Compression::kFast, Compression::kSmall}) {
    WriterOptions one;
    one.compression = compression;
    one.encode_threads = 1;
    WriterOptions four = one;
    four.encode_threads = 4;
    const std::string a = temp_path("threads1"), b = temp_path("threads4"), c = temp_path("threads4flip");
    write_mixed(a, one);
    write_mixed(b, four);
    write_mixed(c, four, /*flip=*/true);
    const std::string bytes = slurp(a);
    EXPECT_GT(bytes.size(), 1000000u);
    EXPECT_TRUE(bytes == slurp(b)) << "encode_threads 4 wrote other bytes than 1 (" << to_string(compression) << ")";
    EXPECT_FALSE(bytes == slurp(c)) << "control: one flipped bit must show";
    // And what four threads wrote reads back: every stored tensor decodes to its digest.
    const TraceReader r(b);
    for (std::size_t i : {std::size_t{0}, std::size_t{2}}) {
      const Record rec = r.read(i);
      int decoded = 0;
      for (const TensorEntry& e : rec.tensors) {
        if (!e.has_data()) continue;
        EXPECT_EQ(digest(r.decode(rec, e)), e.digest) << e.name;
        ++decoded;
      }
      EXPECT_EQ(decoded, 30);
    }
    for (const std::string& p : {a, b, c}) fs::remove(p);
  }
  WriterOptions negative;
  negative.encode_threads = -1;
  try {
    TraceWriter w(temp_path("negative"), {}, negative);
    ADD_FAILURE() << "a negative encode_threads was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("encode_threads must not be negative"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(temp_path("negative") + ".incomplete"));
  EXPECT_THROW(resolve_encode_threads(65), Error);
  EXPECT_EQ(resolve_encode_threads(64), 64);
  EXPECT_EQ(resolve_encode_threads(3), 3);
  EXPECT_GE(resolve_encode_threads(0), 1);
  EXPECT_LE(resolve_encode_threads(0), 8);
}

// The fraction of the file's pages in [begin, end) that are in the page cache (mincore).
double resident_fraction(const std::string& path, std::uint64_t begin, std::uint64_t end) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error("cannot open " + path);
  const std::uint64_t size = fs::file_size(path);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) throw Error("cannot map " + path);
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((size + page - 1) / page);
  const int rc = ::mincore(map, size, in.data());
  ::munmap(map, size);
  if (rc != 0) throw Error("mincore failed on " + path);
  std::uint64_t resident = 0, pages = 0;
  for (std::uint64_t p = begin / page; p < (end + page - 1) / page && p < in.size(); ++p, ++pages) {
    resident += in[p] & 1;
  }
  return pages ? static_cast<double>(resident) / static_cast<double>(pages) : 0.0;
}

// WriterOptions::page_cache_window: a trace's older bytes are written back and leave the page
// cache as it grows, its newest stay, and everything reads back bit for bit (from the disk). The
// control, page_cache_window = 0, leaves the whole trace in the page cache.
TEST(Trace, OlderBytesLeaveThePageCacheAsTheTraceGrows) {
  struct statfs where {};
  const bool tmpfs = ::statfs(fs::temp_directory_path().c_str(), &where) == 0 && where.f_type == TMPFS_MAGIC;
  if (tmpfs) {
    GTEST_SKIP() << "the temporary directory is a tmpfs: its pages are the file, nothing can leave";
  }
  // 48 records of 1 MiB of random bytes each: Blosc stores them as they are.
  torch::manual_seed(7);
  std::vector<at::Tensor> chunks;
  for (int i = 0; i < 48; ++i) chunks.push_back(torch::randint(0, 256, {1 << 20}, torch::kUInt8));
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20, kWindow = 8 * kMiB;
  // Writes the 48 records, the first 24 flushed to disk through another descriptor before the
  // rest (so that the drops while the trace grows find them clean, whatever the disk's speed);
  // returns how much of the first 24 MiB is cached before close(), and of the file's last
  // 7 MiB after it.
  const auto write = [&](const std::string& path, std::uint64_t window) {
    WriterOptions options;
    options.page_cache_window = window;
    TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "page-cache"}}}}, options);
    for (int i = 0; i < 48; ++i) {
      if (i == 24) {
        const int fd = ::open((path + ".incomplete").c_str(), O_RDONLY);
        EXPECT_GE(fd, 0);
        EXPECT_EQ(::fdatasync(fd), 0);
        ::close(fd);
      }
      w.append(RecordType::kSegment, {{"step", 1}, {"segment", "b" + std::to_string(i)}, {"phase", "forward"}},
               {{"x", chunks[static_cast<std::size_t>(i)], true, std::nullopt}});
    }
    const double growing = resident_fraction(path + ".incomplete", 0, 24 * kMiB);
    w.close();
    const std::uint64_t size = fs::file_size(path);
    return std::make_pair(growing, resident_fraction(path, size - kWindow + kMiB, size));
  };
  const std::string kept = temp_path("page_cache_kept"), dropped = temp_path("page_cache_dropped");
  const auto [kept_growing, kept_end] = write(kept, 0);
  if (kept_growing < 0.9) {
    fs::remove(kept);
    GTEST_SKIP() << "control: only " << kept_growing << " of a fresh file is in the page cache here (a file "
                 << "system writing around it, or memory pressure): nothing to measure";
  }
  const auto [growing, end] = write(dropped, kWindow);
  EXPECT_LT(growing, 0.1) << "the bytes behind the window stayed in the page cache";
  EXPECT_GT(end, 0.9) << "the window itself left the page cache";
  EXPECT_GT(kept_end, 0.9);
  EXPECT_TRUE(slurp(dropped) == slurp(kept)) << "the window changed the trace's bytes";
  const TraceReader r(dropped);
  ASSERT_EQ(r.records().size(), 48u);
  for (std::size_t i = 0; i < r.records().size(); ++i) {
    const Record rec = r.read(i);
    EXPECT_TRUE(torch::equal(r.decode(rec, rec.tensors.at(0)), chunks[i])) << "record " << i;
  }
  fs::remove(dropped);
  fs::remove(kept);
}

// append_all() on a POSIX file: more pieces than one writev() takes (IOV_MAX), empty ones among
// them, land in order; the control appends the same bytes one piece at a time.
TEST(Trace, PosixAppendAllWritesEveryPieceInOrder) {
  std::string bytes;
  for (int i = 0; i < 3000; ++i) bytes += std::string(static_cast<std::size_t>(i % 5), static_cast<char>('a' + i % 26));
  std::vector<io::ConstBytes> pieces;
  std::size_t at = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::size_t n = static_cast<std::size_t>(i % 5);
    pieces.push_back({bytes.data() + at, n});
    at += n;
  }
  const std::string gathered = temp_path("gathered"), one_by_one = temp_path("one_by_one");
  {
    auto f = io::posix_file_system().create(gathered);
    f->append("head", 4);
    f->append_all(pieces);
    EXPECT_EQ(f->size(), 4 + bytes.size());
    f->close();
    auto g = io::posix_file_system().create(one_by_one);
    g->append("head", 4);
    for (const io::ConstBytes& p : pieces) g->append(p.data, p.size);
    g->close();
  }
  EXPECT_EQ(slurp(gathered), "head" + bytes);
  EXPECT_EQ(slurp(gathered), slurp(one_by_one));
  fs::remove(gathered);
  fs::remove(one_by_one);
}

// remove_tree: a folder with files and a subfolder goes, a symlink in it goes without what it
// points at (lstat, not stat); a missing path is no error. (std::filesystem::remove_all, which
// this replaces, crashes in a process that loads libtorch.so.)
TEST(Trace, RemoveTreeRemovesAFolderButNotWhatItsLinksPointAt) {
  const std::string dir = temp_path("tree"), outside = temp_path("outside");
  fs::create_directories(dir + "/sub/deeper");
  std::ofstream(dir + "/a") << "a";
  std::ofstream(dir + "/sub/deeper/b") << "b";
  std::ofstream(outside) << "kept";
  fs::create_directory(outside + "_dir");
  std::ofstream(outside + "_dir/c") << "c";
  fs::create_symlink(outside, dir + "/link");
  fs::create_directory_symlink(outside + "_dir", dir + "/sub/dirlink");
  io::remove_tree(dir);
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir)));
  EXPECT_EQ(slurp(outside), "kept");
  EXPECT_TRUE(fs::exists(outside + "_dir/c"));
  io::remove_tree(dir);      // gone already: nothing happens
  io::remove_tree(outside);  // a plain file
  EXPECT_FALSE(fs::exists(outside));
  io::remove_tree(outside + "_dir");
  EXPECT_FALSE(fs::exists(outside + "_dir"));
}

// A short writev (the file size limit reached mid-call, SIGXFSZ ignored): what was written is the
// pieces' first bytes in order, and the next call's failure is an IoError naming the file.
TEST(Trace, PosixAppendAllAfterAShortWriteFailsCleanly) {
  std::string bytes;
  std::vector<io::ConstBytes> pieces;
  for (int i = 0; i < 100; ++i) bytes += std::string(60, static_cast<char>('a' + i % 26));
  for (int i = 0; i < 100; ++i) pieces.push_back({bytes.data() + 60 * i, 60});
  const std::string path = temp_path("short_write");
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = old;
  limited.rlim_cur = 4 + 1000;  // the limit falls inside piece 16
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string error;
  {
    auto f = io::posix_file_system().create(path);
    f->append("head", 4);
    try {
      f->append_all(pieces);
    } catch (const io::IoError& e) {
      error = e.what();
    }
    EXPECT_EQ(f->size(), 1004u);  // the short write counted, nothing after it
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find(path), std::string::npos) << "no IoError naming the file: '" << error << "'";
  EXPECT_EQ(slurp(path), "head" + bytes.substr(0, 1000));
  fs::remove(path);
}

TEST(Trace, OddSizesAndEveryDtypeRoundTrip) {
  for (Compression compression : {Compression::kFast, Compression::kSmall}) {
    SCOPED_TRACE(to_string(compression));
    const std::string path = temp_path("dtypes");
    WriterOptions options;
    options.compression = compression;
    std::vector<at::Tensor> tensors{torch::randn({3, 5, 7}),
                                    torch::randn({13}).to(torch::kHalf),
                                    torch::randn({1}).to(torch::kBFloat16),
                                    torch::randn({9}).to(torch::kDouble),
                                    torch::randint(0, 255, {11}).to(torch::kByte),
                                    torch::tensor({true, false, true}),
                                    torch::randn({4}, torch::kComplexFloat),
                                    torch::empty({0, 3})};
    {
      TraceWriter w(path, nlohmann::json::object(), options);
      std::vector<TensorToWrite> list;
      for (std::size_t i = 0; i < tensors.size(); ++i)
        list.push_back({"t" + std::to_string(i), tensors[i], true, std::nullopt});
      list.push_back({"view", tensors[0].transpose(0, 2), true, std::nullopt});
      w.append(RecordType::kEvent, {{"event", "dtypes"}}, list);
      w.close();
    }
    const TraceReader r(path);
    const Record rec = r.read(0);
    for (std::size_t i = 0; i < tensors.size(); ++i) EXPECT_BITWISE_EQ(tensors[i], r.decode(rec, rec.tensors[i]));
    EXPECT_BITWISE_EQ(tensors[0].transpose(0, 2).contiguous(), r.decode(rec, *rec.find("view")));
    fs::remove(path);
  }
}

// The writer writes the tensor table's JSON itself (names copied as they are where nothing needs
// escaping). Names with quotes, backslashes, control characters, DEL and UTF-8, digest-only and
// stored, read back as written, and every digest and size with them. A name that is not UTF-8 is
// refused with a retrace::Error saying so, and nothing of that record is written.
TEST(Trace, TensorNamesOfAnyTextRoundTripThroughTheTable) {
  const std::string path = temp_path("names");
  const std::vector<std::string> names = {
      "plain.name_0/x:y",         "quote\"in", "back\\slash", "tab\tnew\nline", std::string("nul\0byte", 8), "del\x7f",
      "caf\xc3\xa9 \xe2\x9c\x93", ""};
  const at::Tensor t = torch::arange(12, torch::kFloat).reshape({3, 4});
  {
    TraceWriter w(path, nlohmann::json::object());
    std::vector<TensorToWrite> list;
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (i % 2) list.push_back({names[i], t + static_cast<double>(i), true, std::nullopt});
      else
        list.push_back(
            TensorToWrite::digest_only(names[i], t + static_cast<double>(i), digest(t + static_cast<double>(i))));
    }
    w.append(RecordType::kEvent, {{"event", "names"}}, list);
    EXPECT_THROW(
        w.append(RecordType::kEvent, {{"event", "bad"}}, {TensorToWrite::digest_only("not \xff utf-8", t, digest(t))}),
        std::exception);
    w.close();
  }
  const TraceReader r(path);
  ASSERT_EQ(r.records().size(), 1u);  // the refused record left nothing
  const Record rec = r.read(0);
  ASSERT_EQ(rec.tensors.size(), names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(i);
    const at::Tensor expected = t + static_cast<double>(i);
    EXPECT_EQ(rec.tensors[i].name, names[i]);
    EXPECT_EQ(rec.tensors[i].digest, digest(expected));
    EXPECT_EQ(rec.tensors[i].shape, (std::vector<std::int64_t>{3, 4}));
    EXPECT_EQ(rec.tensors[i].raw_bytes, 48u);
    if (i % 2) {
      EXPECT_BITWISE_EQ(expected, r.decode(rec, rec.tensors[i]));
    }
  }
  fs::remove(path);
}

// A large tensor, so that Blosc splits it into several blocks, round trips bitwise
// in both compressions; the fast one is no more than a little larger than the small one.
TEST(Trace, LargeBf16WeightsRoundTripInBothCompressions) {
  torch::manual_seed(0);
  const at::Tensor w = (torch::randn({512, 1024}) * 0.02).to(torch::kBFloat16);
  std::size_t fast_bytes = 0, small_bytes = 0;
  for (TensorCodec codec : {TensorCodec::kBloscBitshuffleLz4, TensorCodec::kZstdShuffle}) {
    const std::string payload = encode_tensor_payload(w, codec);
    (codec == TensorCodec::kZstdShuffle ? small_bytes : fast_bytes) = payload.size();
    at::Tensor out = at::empty_like(w);
    decode_tensor_payload(payload.data(), payload.size(), codec, out);
    EXPECT_BITWISE_EQ(w, out);
  }
  EXPECT_LT(small_bytes, fast_bytes);
  EXPECT_LT(fast_bytes * 13, w.nbytes() * 10) << "bf16 weights stored at least 1.3x smaller than raw";
}

// prefault_for_write makes the whole pages inside its range present, and only those (mincore
// shows which are); memory it cannot populate is refused, not an error.
TEST(Trace, PrefaultForWriteMakesTheWholePagesInsideItsRangePresent) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  constexpr std::size_t kPages = 16;
  void* m = ::mmap(nullptr, kPages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  const auto present = [&] {
    std::vector<unsigned char> v(kPages);
    EXPECT_EQ(::mincore(m, kPages * page, v.data()), 0);
    std::string s;
    for (unsigned char c : v) s += (c & 1) ? 'x' : '.';
    return s;
  };
  EXPECT_EQ(present(), "................");
  // From the middle of page 1 to the middle of page 10: pages 2..9 are the whole ones.
  char* c = static_cast<char*>(m);
  if (!detail::prefault_for_write(c + page + page / 2, 9 * page)) {
    ::munmap(m, kPages * page);
    GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  }
  EXPECT_EQ(present(), "..xxxxxxxx......");
  EXPECT_FALSE(detail::prefault_for_write(c, page / 2)) << "no whole page in the range";
  EXPECT_EQ(present(), "..xxxxxxxx......");
  ::munmap(m, kPages * page);
  void* ro = ::mmap(nullptr, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(ro, MAP_FAILED);
  EXPECT_FALSE(detail::prefault_for_write(ro, page)) << "read-only memory";
  ::munmap(ro, page);
}

// A tensor large enough to be prefaulted decodes bitwise into fresh memory (decode) and into a
// view that starts and ends inside pages of a larger tensor (decode_into), whose neighbours keep
// their values.
TEST(Trace, ALargeTensorDecodesIntoFreshMemoryAndIntoAViewInsideOthers) {
  const std::string path = temp_path("prefault");
  torch::manual_seed(3);
  const at::Tensor t = torch::randn({(3 << 20) / 4 + 5});  // over 3 MiB, not whole pages
  {
    TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "large"}}}});
    w.append(RecordType::kStepBegin, {{"step", 1}, {"full", true}}, {{"state.w", t, true, std::nullopt}});
    w.close();
  }
  const TraceReader r(path);
  const Record table = r.read_table(0);
  const TensorEntry& e = *table.find("state.w");
  EXPECT_BITWISE_EQ(t, r.decode(table, e));
  at::Tensor around = torch::full({t.numel() + 2 * 333}, 7.0f);
  at::Tensor view = around.narrow(0, 333, t.numel());
  r.decode_into(table, e, view);
  EXPECT_BITWISE_EQ(t, view);
  EXPECT_BITWISE_EQ(torch::full({333}, 7.0f), around.narrow(0, 0, 333));
  EXPECT_BITWISE_EQ(torch::full({333}, 7.0f), around.narrow(0, 333 + t.numel(), 333));
  fs::remove(path);
}

// A damaged payload is an error from the codec, never a crash or a read past the payload: every
// truncation of a Blosc buffer, and a flip of every bit of its header.
// The codec takes contiguous CPU tensors; anything else is the caller's mistake, said as one
// retrace::Error with the fix.
TEST(Trace, EncodingANonContiguousTensorIsAnErrorSayingTheFix) {
  const at::Tensor w = torch::randn({4, 6});
  try {
    encode_tensor_payload(w.t(), TensorCodec::kZstd);
    ADD_FAILURE() << "encoded a non-contiguous tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not contiguous; pass tensor.cpu().contiguous()"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(encode_tensor_payload(w.t().contiguous(), TensorCodec::kZstd));  // control
}

TEST(Trace, DamagedBloscPayloadsAreErrors) {
  torch::manual_seed(0);
  const at::Tensor w = torch::randn({64, 33});
  const std::string good = encode_tensor_payload(w, TensorCodec::kBloscBitshuffleLz4);
  at::Tensor out = at::empty_like(w);
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_THROW(decode_tensor_payload(good.data(), cut, TensorCodec::kBloscBitshuffleLz4, out), Error) << cut;
  }
  int undetected = 0;
  for (std::size_t bit = 0; bit < 16 * 8; ++bit) {
    std::string bad = good;
    bad[bit / 8] = static_cast<char>(bad[bit / 8] ^ (1 << (bit % 8)));
    try {
      decode_tensor_payload(bad.data(), bad.size(), TensorCodec::kBloscBitshuffleLz4, out);
      if (!at::equal(out, w)) ++undetected;  // the record checksum and digest catch these in a trace
    } catch (const Error&) {
    }
  }
  // Blosc has no checksum of its own: a flip in its header may decode to other bytes. In a trace
  // the record's XXH3 checksum (and the tensor digest) catch it: Trace.EveryBitFlipIsDetected.
  RecordProperty("header_flips_decoding_to_other_bytes", undetected);
  at::Tensor wrong_size = at::empty({64, 34});
  EXPECT_THROW(decode_tensor_payload(good.data(), good.size(), TensorCodec::kBloscBitshuffleLz4, wrong_size), Error);
}

TEST(Trace, UnclosedTraceStaysIncompleteAndReadable) {
  const std::string path = temp_path("unclosed");
  {
    TraceWriter w(path, nlohmann::json::object());
    w.append(RecordType::kStepBegin, {{"step", 1}}, {{"a", tensor_a(), true, std::nullopt}});
    w.sync();
  }  // no close(): as after a crash
  EXPECT_FALSE(fs::exists(path));
  const TraceReader r(path + ".incomplete");
  EXPECT_FALSE(r.complete());
  ASSERT_EQ(r.records().size(), 1u);
  const Record rec = r.read(0);
  EXPECT_BITWISE_EQ(tensor_a(), r.decode(rec, rec.tensors[0]));
  fs::remove(path + ".incomplete");
}

// Golden files freeze the format: every later version must still read them. Version 1 (zstd,
// written with byte shuffle) is frozen; RETRACE_WRITE_GOLDEN=1 rewrites only the current version's.
TEST(Trace, GoldenVersion1TraceReads) {
  const char* dir = std::getenv("RETRACE_TEST_DATA");
  ASSERT_NE(dir, nullptr) << "RETRACE_TEST_DATA is set by ctest";
  const std::string golden = std::string(dir) + "/golden-v1.trace";
  ASSERT_TRUE(fs::exists(golden)) << golden;
  const TraceReader r(golden);
  check_small(r, 1);
  EXPECT_EQ(r.read(0).find("b")->codec, TensorCodec::kZstdShuffle);
}

TEST(Trace, GoldenVersion2TraceReads) {
  const char* dir = std::getenv("RETRACE_TEST_DATA");
  ASSERT_NE(dir, nullptr) << "RETRACE_TEST_DATA is set by ctest";
  const std::string golden = std::string(dir) + "/golden-v2.trace";  // frozen
  ASSERT_TRUE(fs::exists(golden)) << golden;
  const TraceReader r(golden);
  check_small(r, 2);
  EXPECT_EQ(r.read(0).find("b")->codec, TensorCodec::kBloscBitshuffleLz4);
}

// Version 3 on: the small trace plus a collective record (a data-parallel rank's).
void write_small_v3(const std::string& path) { write_small(path, {}, /*collective=*/true); }

// The golden collective trace of `version` (3 or 4) reads as written.
void check_small_v3(const TraceReader& r, int version) {
  EXPECT_EQ(r.header()["format_version"], version);
  ASSERT_EQ(r.records().size(), 4u);
  EXPECT_EQ(r.records()[2].type, RecordType::kCollective);
  EXPECT_EQ(r.records()[2].step, 1);
  const Record rec = r.read(2);
  const CollectiveRecord c = CollectiveRecord::decode(rec, r.path());
  EXPECT_EQ(c.call.describe(), "allreduce(sum)");
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.input.abs_max, 11.0);
  EXPECT_TRUE(c.values);
  EXPECT_FALSE(rec.find("input.0")->has_data());
  EXPECT_BITWISE_EQ(tensor_a() * 2, r.decode(rec, *rec.find("output.0")));
  const Record table = r.read_table(0);  // its tensors decoded from the file, one by one
  EXPECT_BITWISE_EQ(tensor_a(), r.decode(table, *table.find("a")));
  EXPECT_BITWISE_EQ(tensor_b(), r.decode(table, *table.find("b")));
}

TEST(Trace, GoldenVersion3TraceReads) {
  const char* dir = std::getenv("RETRACE_TEST_DATA");
  ASSERT_NE(dir, nullptr) << "RETRACE_TEST_DATA is set by ctest";
  const std::string golden = std::string(dir) + "/golden-v3.trace";  // frozen
  ASSERT_TRUE(fs::exists(golden)) << golden;
  check_small_v3(TraceReader(golden), 3);
}

// Version 4: the same records, each stored tensor with the checksum of its bytes, the record
// checksum over the metadata.
TEST(Trace, GoldenVersion4TraceReads) {
  static_assert(kTraceFormatVersion == 4, "a new format version needs its own golden file and test");
  const char* dir = std::getenv("RETRACE_TEST_DATA");
  ASSERT_NE(dir, nullptr) << "RETRACE_TEST_DATA is set by ctest";
  const std::string golden = std::string(dir) + "/golden-v4.trace";
  if (std::getenv("RETRACE_WRITE_GOLDEN")) write_small_v3(golden);
  ASSERT_TRUE(fs::exists(golden)) << golden;
  const TraceReader r(golden);
  check_small_v3(r, 4);
  const Record begin = r.read(0);
  const TensorEntry& a = *begin.find("a");
  EXPECT_EQ(a.checksum, XXH3_64bits(slurp(golden).data() + begin.blob_at + a.offset, a.stored_bytes));
}

// The writer's bytes are frozen: writing golden-v4's records again (the build of 2026-12-03 wrote
// the file) gives the file byte for byte -- frame headers, metadata and tensor tables, checksums,
// the stored pieces, the index and trailer. A change to how records are written (the kept head
// buffer, the hashing) that moved a byte fails here. The stored pieces are Blosc + LZ4 output:
// with other versions of those libraries than the ones that wrote the file the comparison is
// skipped (and says so). Control: the same records with the other compression differ.
TEST(Trace, WriterReproducesGoldenVersion4ByteForByte) {
  const char* dir = std::getenv("RETRACE_TEST_DATA");
  ASSERT_NE(dir, nullptr) << "RETRACE_TEST_DATA is set by ctest";
  const std::string golden = std::string(dir) + "/golden-v4.trace";
  const std::string blosc = blosc_get_version_string();
  char* complib = nullptr;
  char* version = nullptr;
  std::string lz4 = "none";
  if (blosc_get_complib_info("lz4", &complib, &version) >= 0 && version != nullptr) lz4 = version;
  std::free(complib);
  std::free(version);
  if (blosc != "1.21.3" || lz4 != "1.9.4") {
    GTEST_SKIP() << "golden-v4.trace was written with Blosc 1.21.3 and LZ4 1.9.4; this build has Blosc " << blosc
                 << " and LZ4 " << lz4 << ", whose output may differ";
  }
  const std::string path = temp_path("golden_again");
  write_small_v3(path);
  const std::string again = slurp(path), frozen = slurp(golden);
  ASSERT_EQ(again.size(), frozen.size());
  const auto [at, unused] = std::mismatch(again.begin(), again.end(), frozen.begin());
  EXPECT_TRUE(at == again.end()) << "first differing byte at offset " << (at - again.begin());
  // Control: the comparison sees a change in the stored pieces.
  WriterOptions small;
  small.compression = Compression::kSmall;
  write_small(path, small, /*collective=*/true);
  EXPECT_NE(slurp(path), frozen);
  fs::remove(path);
}

// The collective record arrived with format version 3: a version-2 file that holds one is malformed.
TEST(Trace, CollectiveRecordInAVersion2FileIsMalformed) {
  const std::string path = temp_path("v2collective");
  write_small_v3(path);
  const std::string written = slurp(path);
  spit(path, as_version(written, 2));  // its records sealed as version 2 seals them
  try {
    const TraceReader r(path);
    ADD_FAILURE() << "a collective record accepted in a version-2 file";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kMalformed);
    EXPECT_NE(std::string(e.what()).find("record type 6 (collective) in a format version 2 trace"), std::string::npos)
        << e.what();
  }
  // Controls: the same file as version 3, and with its own version, reads.
  spit(path, as_version(written, 3));
  EXPECT_NO_THROW(TraceReader{path});
  write_small_v3(path);
  EXPECT_NO_THROW(TraceReader{path});
  fs::remove(path);
}

// Codec 3 arrived with format version 2: a version-1 file that claims it is malformed.
TEST(Trace, BloscCodecInAVersion1FileIsMalformed) {
  const std::string path = temp_path("v1blosc");
  write_small(path);
  const std::string written = slurp(path);
  spit(path, as_version(written, 1));  // its records sealed as version 1 seals them
  try {
    const TraceReader r(path);
    r.read(0);
    ADD_FAILURE() << "codec 3 accepted in a version-1 file";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kMalformed);
    EXPECT_NE(std::string(e.what()).find("format version 1 does not define"), std::string::npos) << e.what();
  }
  spit(path, as_version(written, 2));  // control
  EXPECT_NO_THROW(TraceReader(path).read(0));
  fs::remove(path);
}

// A trace of `records` step_begin records of noise (Blosc keeps nearly all of it), record i of i x
// 4 KiB: the later the larger, so that opening on several threads, largest first, checks the
// later records first; over the record count (version 4) and the size (version 3) from which it
// does.
void write_large(const std::string& path, int records) {
  TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "large"}}}});
  at::manual_seed(7);
  for (int i = 1; i <= records; ++i) {
    w.append(RecordType::kStepBegin, {{"step", i}, {"full", true}},
             {{"state.w", at::randn({i << 10}), true, std::nullopt}});
  }
  w.close();
}

// The TraceError of opening `path` (its kind and byte offset), or nothing.
std::optional<std::pair<TraceError::Kind, std::uint64_t>> open_error(const std::string& path) {
  try {
    const TraceReader r(path);
  } catch (const TraceError& e) {
    return std::make_pair(e.kind(), e.offset());
  }
  return std::nullopt;
}

// Opening a large trace checks its records on the intra-op threads, largest first; what it finds
// is what a check of one record after another finds: the same records, and of several bad ones
// the first in file order, before a truncated tail or a bad trailer after them. In both record
// checksum layouts: version 4 (metadata) and 3 (the whole payload).
TEST(Trace, OpeningOnSeveralThreadsFindsWhatOneThreadFinds) {
  constexpr int kRecords = 80;
  const std::string path = temp_path("large"), bad = temp_path("large_bad");
  write_large(path, kRecords);
  const std::string written = slurp(path);
  const int threads = at::get_num_threads();
  for (const std::uint32_t version : {4u, 3u}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    const std::string bytes = version == kTraceFormatVersion ? written : as_version(written, version);
    spit(path, bytes);
    std::vector<RecordInfo> by_one, by_two;
    at::set_num_threads(1);
    by_one = TraceReader(path).records();
    at::set_num_threads(2);
    {
      const TraceReader r(path);
      EXPECT_TRUE(r.complete());
      EXPECT_FALSE(r.truncated());
      by_two = r.records();
      const Record last = r.read_table(kRecords - 1);
      EXPECT_EQ(r.decode(last, last.tensors.at(0)).numel(), kRecords << 10);
    }
    ASSERT_EQ(by_one.size(), static_cast<std::size_t>(kRecords));
    ASSERT_EQ(by_two.size(), by_one.size());
    for (std::size_t i = 0; i < by_one.size(); ++i) {
      EXPECT_EQ(by_two[i].offset, by_one[i].offset);
      EXPECT_EQ(by_two[i].step, static_cast<std::int64_t>(i) + 1);
      EXPECT_EQ(by_two[i].length, by_one[i].length);
    }
    const auto flipped = [&](std::initializer_list<std::size_t> records) {
      std::string copy = bytes;
      for (std::size_t i : records) copy[by_one[i].offset + 24 + 4 + 3] ^= 0x10;  // a metadata byte
      return copy;
    };
    for (int n : {1, 2}) {
      SCOPED_TRACE(std::to_string(n) + " threads");
      at::set_num_threads(n);
      // The later of two bad records is the larger, checked first on two threads: the earlier one
      // is named all the same.
      spit(bad, flipped({60, 20}));
      auto e = open_error(bad);
      ASSERT_TRUE(e);
      EXPECT_EQ(e->first, TraceError::Kind::kChecksum);
      EXPECT_EQ(e->second, by_one[20].offset);
      spit(bad, flipped({60}));
      e = open_error(bad);
      ASSERT_TRUE(e);
      EXPECT_EQ(e->second, by_one[60].offset);
      // A bad record before a truncated tail is an error, not a clean end.
      spit(bad, flipped({50}).substr(0, by_one[kRecords - 1].offset + 100));
      e = open_error(bad);
      ASSERT_TRUE(e);
      EXPECT_EQ(e->second, by_one[50].offset);
      // Control: the same tail without the bad record is a clean end before the last record.
      spit(bad, bytes.substr(0, by_one[kRecords - 1].offset + 100));
      EXPECT_FALSE(open_error(bad));
      const TraceReader cut(bad);
      EXPECT_TRUE(cut.truncated());
      EXPECT_EQ(cut.records().size(), static_cast<std::size_t>(kRecords - 1));
      EXPECT_NE(cut.warning().find("all 79 complete records are readable"), std::string::npos) << cut.warning();
      // A bad record before a damaged trailer is the one named; the trailer alone is named after.
      std::string trailer = flipped({70});
      trailer[trailer.size() - 1] ^= 1;
      spit(bad, trailer);
      e = open_error(bad);
      ASSERT_TRUE(e);
      EXPECT_EQ(e->second, by_one[70].offset);
      trailer = bytes;
      trailer[trailer.size() - 1] ^= 1;
      spit(bad, trailer);
      e = open_error(bad);
      ASSERT_TRUE(e);
      EXPECT_EQ(e->first, TraceError::Kind::kMalformed);
      EXPECT_EQ(e->second, bytes.size() - 16);
    }
  }
  at::set_num_threads(threads);
  fs::remove(path);
  fs::remove(bad);
}

// Version 4: opening reads each record's header and metadata and none of its tensor bytes; a
// stored tensor's bytes are checked by their own checksum when decoded, from read() or read_table(),
// and a changed byte fails that tensor alone. Control: the same trace as version 3 (the record
// checksum over the tensor bytes) reads them all when opened and refuses the changed byte there.
TEST(Trace, Version4OpensWithoutReadingTensorBytesAndChecksEachWhenDecoded) {
  const std::string path = temp_path("lazy");
  write_large(path, 40);
  const std::string v4 = slurp(path);
  const auto bytes_read_opening = [&](const std::string& bytes) {
    spit(path, bytes);
    CountingReads counting;
    ReaderOptions options;
    options.fs = &counting;
    const TraceReader r(path, options);
    EXPECT_EQ(r.records().size(), 40u);
    return counting.bytes.load();
  };
  const std::uint64_t v4_read = bytes_read_opening(v4);
  EXPECT_LT(v4_read * 100, v4.size()) << v4_read << " of " << v4.size() << " bytes read";
  const std::string v3 = as_version(v4, 3);
  EXPECT_GE(bytes_read_opening(v3), v3.size() - 16) << "version 3 reads every record whole";

  spit(path, v4);
  std::uint64_t at = 0;
  {
    const TraceReader r(path);
    const Record table = r.read_table(19);
    const TensorEntry& e = table.tensors.at(0);
    at = table.blob_at + e.offset + e.stored_bytes / 2;
  }
  std::string changed = v4;
  changed[at] ^= 0x08;
  spit(path, changed);
  const TraceReader r(path);  // opens: the metadata is intact
  ASSERT_EQ(r.records().size(), 40u);
  for (const Record& rec : {r.read(19), r.read_table(19)}) {
    SCOPED_TRACE(rec.has_blob ? "read()" : "read_table()");
    for (const bool decode : {true, false}) {  // decode(), and check_stored() without decoding
      try {
        if (decode) {
          r.decode(rec, rec.tensors.at(0));
        } else {
          r.check_stored(rec, rec.tensors.at(0));
        }
        ADD_FAILURE() << "a changed tensor byte passed " << (decode ? "decode()" : "check_stored()");
      } catch (const TraceError& e) {
        EXPECT_EQ(e.kind(), TraceError::Kind::kChecksum);
        EXPECT_EQ(e.offset(), rec.offset);
        EXPECT_NE(std::string(e.what()).find("tensor 'state.w' stored bytes do not match their checksum"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  for (const Record& next : {r.read(20), r.read_table(20)}) {  // control: the other records' tensors pass
    EXPECT_NO_THROW(r.check_stored(next, next.tensors.at(0)));
    EXPECT_EQ(r.decode(next, next.tensors.at(0)).numel(), 21 << 10);
  }
  std::string changed_v3 = v3;
  changed_v3[at] ^= 0x08;  // the same byte: the records lie where they lay
  spit(path, changed_v3);
  const auto e = open_error(path);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->first, TraceError::Kind::kChecksum);
  EXPECT_EQ(e->second, r.records()[19].offset);
  fs::remove(path);
}

// Version 4: the stored tensors lie back to back in table order and fill the blob, so that no
// byte of it escapes every checksum; an entry must carry its checksum, in 16 lowercase hex digits.
// Each case is sealed again with right checksums (fuzz/trace_framing.h); control: the trace sealed
// again unchanged reads.
TEST(Trace, Version4StoredTensorsFillTheBlobAndEachHasAChecksum) {
  const std::string path = temp_path("tiling");
  write_small(path);
  const std::string bytes = slurp(path);
  const fuzz::FramedTrace framed =
      fuzz::split_trace(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  ASSERT_EQ(framed.records.size(), 5u);  // header, step_begin, segment, step_end, index
  const auto refusal = [&](const std::function<void(fuzz::FramedRecord&)>& change,
                           bool fix_checksums = true) -> std::string {
    fuzz::FramedTrace t = framed;
    change(t.records[1]);
    spit(path, fuzz::seal_trace(t, /*fix_index=*/true, fix_checksums));
    try {
      const TraceReader r(path);
      return "";
    } catch (const TraceError& e) {
      EXPECT_EQ(e.kind(), TraceError::Kind::kMalformed) << e.what();
      return e.what();
    }
  };
  const auto with_table = [](fuzz::FramedRecord& r, const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json meta = nlohmann::json::parse(r.meta);
    change(meta["tensors"]);
    r.meta = meta.dump();
  };
  EXPECT_EQ(refusal([](fuzz::FramedRecord&) {}), "");  // control
  std::string msg = refusal([](fuzz::FramedRecord& r) { r.blob += 'x'; });
  EXPECT_NE(msg.find("the record's stored tensors cover"), std::string::npos) << msg;
  msg = refusal([&](fuzz::FramedRecord& r) {
    with_table(r, [](nlohmann::json& table) {  // b read again from a's first bytes, a's rest unread
      table[1]["offset"] = 0;
      table[1]["stored_bytes"] = table[0]["stored_bytes"];
    });
  });
  EXPECT_NE(msg.find("tensor 'b' is stored at blob offset 0"), std::string::npos) << msg;
  msg = refusal([&](fuzz::FramedRecord& r) {
    with_table(r, [](nlohmann::json& table) {
      std::swap(table[0], table[1]);  // each where it lies, out of table order
    });
  });
  EXPECT_NE(msg.find("tensor 'b' is stored at blob offset"), std::string::npos) << msg;
  for (const char* checksum : {"", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0"}) {
    SCOPED_TRACE(checksum);
    msg = refusal(
        [&](fuzz::FramedRecord& r) { with_table(r, [&](nlohmann::json& table) { table[0]["checksum"] = checksum; }); },
        /*fix_checksums=*/false);
    EXPECT_NE(msg.find("tensor 'a' has a malformed checksum"), std::string::npos) << msg;
  }
  msg =
      refusal([&](fuzz::FramedRecord& r) { with_table(r, [](nlohmann::json& table) { table[0].erase("checksum"); }); },
              /*fix_checksums=*/false);
  EXPECT_NE(msg.find("'checksum' is missing"), std::string::npos) << msg;
  // Versions 1 to 3 have neither rule: the same swapped table, without checksums, reads there.
  fuzz::FramedTrace v3 = framed;
  std::memcpy(v3.file_header.data() + 8, "\3\0\0\0", 4);
  with_table(v3.records[1], [](nlohmann::json& table) {
    std::swap(table[0], table[1]);
    for (nlohmann::json& e : table) e.erase("checksum");
  });
  spit(path, fuzz::seal_trace(v3, /*fix_index=*/true));
  const TraceReader old(path);
  const Record begin = old.read(0);
  EXPECT_BITWISE_EQ(tensor_a(), old.decode(begin, *begin.find("a")));
  EXPECT_BITWISE_EQ(tensor_b(), old.decode(begin, *begin.find("b")));
  fs::remove(path);
}

// Every prefix of a trace either fails with a TraceError (inside the file header or header
// record) or yields a prefix of the records, each fully readable; in both record checksum
// layouts (version 4, and 3 as versions 1 to 3 have it).
TEST(Trace, TruncationAtEveryByteIsACleanEndOrATypedError) {
  const std::string path = temp_path("truncate_src");
  write_small(path);
  const std::string written = slurp(path);
  const std::string cut_path = temp_path("truncate_cut");
  for (const std::uint32_t version : {4u, 3u}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    const std::string bytes = version == kTraceFormatVersion ? written : as_version(written, version);
    std::size_t clean = 0, errors = 0;
    for (std::size_t cut = 0; cut <= bytes.size(); ++cut) {
      spit(cut_path, bytes.substr(0, cut));
      try {
        const TraceReader r(cut_path);
        ++clean;
        EXPECT_LE(r.records().size(), 3u);
        EXPECT_EQ(r.complete(), cut == bytes.size()) << "cut at " << cut;
        if (r.truncated()) {
          EXPECT_NE(r.warning().find("readable"), std::string::npos) << r.warning();
        }
        for (std::size_t i = 0; i < r.records().size(); ++i) {
          const Record rec = r.read(i);
          for (const TensorEntry& e : rec.tensors) {
            if (e.has_data()) r.decode(rec, e);
          }
        }
        if (r.records().size() == 3) check_small(r, static_cast<int>(version));
      } catch (const TraceError& e) {
        ++errors;
        EXPECT_NE(std::string(e.what()).find("byte offset"), std::string::npos) << e.what();
      }
    }
    EXPECT_GT(clean, bytes.size() / 2);  // most cuts keep records
    EXPECT_GT(errors, 0u);               // cuts inside the header record cannot
  }
  fs::remove(path);
  fs::remove(cut_path);
}

// Every single-bit flip anywhere in a trace is detected (in version 4, a flip in a tensor's bytes
// when it is decoded); none crashes. In both record checksum layouts.
TEST(Trace, EveryBitFlipIsDetected) {
  const std::string path = temp_path("flip_src");
  write_small(path);
  const std::string written = slurp(path);
  const std::string flip_path = temp_path("flip");
  for (const std::uint32_t file_version : {4u, 3u}) {
    SCOPED_TRACE("format version " + std::to_string(file_version));
    const std::string bytes = file_version == kTraceFormatVersion ? written : as_version(written, file_version);
    std::size_t undetected = 0;
    for (std::size_t byte = 0; byte < bytes.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string copy = bytes;
        copy[byte] = static_cast<char>(copy[byte] ^ (1 << bit));
        // The file header's version is under no checksum: a flip to an older version whose format
        // this file's records fit (3 -> 2: no collective record here) reads the same records, which
        // is right. A file holding what the older version lacks is refused
        // (CollectiveRecordInAVersion2FileIsMalformed). (No flip of 4 gives 1, 2 or 3.)
        const auto version = static_cast<unsigned char>(copy[8]);
        if (byte == 8 && version >= 1 && version < file_version) continue;
        spit(flip_path, copy);
        try {
          const TraceReader r(flip_path);
          for (std::size_t i = 0; i < r.records().size(); ++i) {
            const Record rec = r.read(i);
            for (const TensorEntry& e : rec.tensors) {
              if (e.has_data()) r.decode(rec, e);
            }
          }
          if (!r.truncated() && r.records().size() == 3) {
            ++undetected;
            ADD_FAILURE() << "flip of bit " << bit << " at byte " << byte << " went unnoticed";
          }
        } catch (const TraceError&) {
        }
      }
    }
    EXPECT_EQ(undetected, 0u);
  }
  fs::remove(path);
  fs::remove(flip_path);
}

// read_table() reads a record's metadata and table, none of its tensor bytes; decode() then
// reads a tensor's bytes from the file. Control: tensor bytes changed in the file after the trace
// was opened are refused by decode() from the table (the record read whole still holds the old
// ones) and from the record read whole again (the tensor's checksum); read_table() does not read them, so it still
// serves the table, and decode() from that table refuses them again. A metadata byte changed
// since the trace was opened fails read_table() with a checksum error.
TEST(Trace, ReadTableDecodesEachTensorFromTheFileAndSeesBytesChangedSince) {
  const std::string path = temp_path("table");
  write_small(path);
  const TraceReader r(path);
  const Record whole = r.read(0);
  const Record table = r.read_table(0);
  EXPECT_TRUE(whole.has_blob);
  EXPECT_FALSE(table.has_blob);
  EXPECT_TRUE(table.blob.empty());
  ASSERT_EQ(table.tensors.size(), whole.tensors.size());
  for (const TensorEntry& e : whole.tensors) {
    if (!e.has_data()) continue;
    EXPECT_BITWISE_EQ(r.decode(whole, e), r.decode(table, *table.find(e.name))) << e.name;
  }
  const TensorEntry& a = *table.find("a");
  std::string bytes = slurp(path);
  const std::size_t last = static_cast<std::size_t>(table.blob_at + a.offset + a.stored_bytes - 1);
  bytes[last] = static_cast<char>(bytes[last] ^ 0x40);
  spit(path, bytes);  // the same file, rewritten in place: the reader's descriptor sees it
  EXPECT_THROW(r.decode(table, a), TraceError);
  EXPECT_BITWISE_EQ(tensor_a(), r.decode(whole, *whole.find("a")));
  const Record reread = r.read(0);  // its metadata is intact; the tensor's own checksum refuses its bytes
  EXPECT_THROW(r.decode(reread, *reread.find("a")), TraceError);
  const Record again = r.read_table(0);
  EXPECT_THROW(r.decode(again, *again.find("a")), TraceError);
  // The metadata: the tensor's name in the table ("a" -> "b"), same length.
  const std::size_t name_at = bytes.find("\"name\":\"a\"", static_cast<std::size_t>(table.offset));
  ASSERT_NE(name_at, std::string::npos);
  ASSERT_LT(name_at, table.blob_at);
  bytes[name_at + 8] = 'b';
  spit(path, bytes);
  try {
    r.read_table(0);
    ADD_FAILURE() << "read_table() served metadata changed since the trace was opened";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kChecksum) << e.what();
    EXPECT_EQ(e.offset(), table.offset) << e.what();
    EXPECT_NE(std::string(e.what()).find("changed since the trace was opened"), std::string::npos) << e.what();
  }
  fs::remove(path);
}

// A stored tensor whose codec and digest check nothing -- a device digest (a CUDA trace's) in a
// Blosc buffer (no checksum) -- is checked by its own checksum when decoded from a table-only
// record (version 4); in a version-3 trace it is decoded through its whole record, whose checksum
// then sees bytes changed since. Control: the same change under a host digest is caught by the
// digest (ReadTableDecodesEachTensorFromTheFileAndSeesBytesChangedSince).
TEST(Trace, ReadTableDecodesAnUncheckedTensorThroughItsWholeRecord) {
  const std::string path = temp_path("table_device");
  {
    TraceWriter w(path, {{"program", {{"name", "test"}, {"config", "small"}}}});
    const at::Tensor t = torch::arange(4096, torch::kFloat);
    w.append(RecordType::kStepBegin, {{"step", 1}, {"full", true}},
             {{"dev", t, true, Digest{1, 2, DigestAlgorithm::kDeviceLanes}}});
    w.close();
  }
  const std::string written = slurp(path);
  for (const std::uint32_t version : {4u, 3u}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    spit(path, version == kTraceFormatVersion ? written : as_version(written, version));
    const TraceReader r(path);
    const Record table = r.read_table(0);
    const TensorEntry& e = *table.find("dev");
    ASSERT_EQ(e.codec, TensorCodec::kBloscBitshuffleLz4);
    EXPECT_BITWISE_EQ(torch::arange(4096, torch::kFloat), r.decode(table, e));
    std::string bytes = slurp(path);
    const std::size_t last = static_cast<std::size_t>(table.blob_at + e.offset + e.stored_bytes - 1);
    bytes[last] = static_cast<char>(bytes[last] ^ 0x40);
    spit(path, bytes);
    EXPECT_THROW(r.decode(table, e), TraceError);
  }
  fs::remove(path);
}

// decode_into() writes a stored tensor into the caller's own (a program's parameter, requiring
// grad): the same bits as decode(), in the same memory, its version bumped. A tensor it cannot
// fill is refused with one line naming the tensor, what it got and what it needs; a changed byte
// is the same TraceError decode() gives. Controls: decode() of the changed byte throws too, and
// the refused targets are left as they were.
TEST(Trace, DecodeIntoFillsTheCallersTensorOrSaysWhyNot) {
  const std::string path = temp_path("decode_into");
  write_small(path);
  const TraceReader r(path);
  for (const Record& rec : {r.read(0), r.read_table(0)}) {
    SCOPED_TRACE(rec.has_blob ? "read()" : "read_table()");
    const TensorEntry& a = *rec.find("a");
    at::Tensor param = torch::full({3, 4}, -1.0f).requires_grad_();
    const void* memory = param.const_data_ptr();
    const auto version = param._version();
    r.decode_into(rec, a, param);
    EXPECT_EQ(param.const_data_ptr(), memory);
    EXPECT_GT(param._version(), version);
    EXPECT_TRUE(param.requires_grad());
    EXPECT_BITWISE_EQ(r.decode(rec, a), param.detach());
    EXPECT_BITWISE_EQ(tensor_b(), [&] {
      at::Tensor b = torch::zeros({7}, torch::kBFloat16);
      r.decode_into(rec, *rec.find("b"), b);
      return b;
    }());

    const auto refused = [&](const at::Tensor& target, const std::string& says) {
      const at::Tensor before = target.defined() ? target.clone() : at::Tensor();
      try {
        r.decode_into(rec, a, target);
        ADD_FAILURE() << "decode_into filled " << says;
      } catch (const TraceError& e) {
        ADD_FAILURE() << "a TraceError, not a usage error: " << e.what();
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("tensor 'a'"), std::string::npos) << m;
        EXPECT_NE(m.find(says), std::string::npos) << m;
        EXPECT_NE(m.find("Float and shape [3, 4]"), std::string::npos) << m;
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      }
      if (target.defined()) {
        EXPECT_BITWISE_EQ(before, target);
      }
    };
    refused(torch::zeros({3, 4}, torch::kDouble), "Double [3, 4]");
    refused(torch::zeros({4, 3}), "Float [4, 3]");
    refused(torch::zeros({4, 3}).t(), "not contiguous");
    refused(at::Tensor(), "an undefined tensor");
  }

  const Record table = r.read_table(0);
  const TensorEntry& a = *table.find("a");
  std::string bytes = slurp(path);
  const std::size_t last = static_cast<std::size_t>(table.blob_at + a.offset + a.stored_bytes - 1);
  bytes[last] = static_cast<char>(bytes[last] ^ 0x40);
  spit(path, bytes);
  at::Tensor target = torch::zeros({3, 4});
  EXPECT_THROW(r.decode_into(table, a, target), TraceError);
  EXPECT_THROW(r.decode(table, a), TraceError);
  fs::remove(path);
}

// The reader counts nesting in the metadata's structure, not in its text: brackets inside a string
// are text. Control: Trace.TheWriterRefusesWhatTheReaderWouldRefuse refuses 33 levels.
TEST(Trace, BracketsInsideAStringAreNotNesting) {
  const std::string path = temp_path("brackets");
  const std::string text = std::string(100, '[') + "\\\"{" + std::string(100, '{');
  {
    TraceWriter w(path, {{"description", text}});
    w.close();
  }
  EXPECT_EQ(TraceReader(path).header()["description"], text);
  fs::remove(path);
}

// A reader with a cap below what a trace declares refuses it before allocating (the writer never
// writes past the default caps: Trace.TheWriterRefusesWhatTheReaderWouldRefuse).
TEST(Trace, DeclaredSizesNeverDriveAnAllocationBeyondTheCap) {
  const std::string path = temp_path("huge");
  {
    TraceWriter w(path, nlohmann::json::object());
    const at::Tensor huge =
        torch::empty({std::int64_t{2} << 30}, torch::TensorOptions().device(torch::kMeta).dtype(torch::kByte));
    w.append(RecordType::kEvent, {{"event", "huge"}}, {{"h", huge, false, Digest{1, 2, DigestAlgorithm::kXxh3_128}}});
    w.close();
  }
  ReaderOptions one_gib;
  one_gib.max_tensor_bytes = std::uint64_t{1} << 30;
  try {
    const TraceReader r(path, one_gib);  // opening parses every record's tensor table
    r.read(0);
    ADD_FAILURE() << "a 2 GiB tensor was accepted under a 1 GiB cap";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kTooLarge);
    EXPECT_NE(std::string(e.what()).find("max_tensor_bytes"), std::string::npos) << e.what();
  }
  ReaderOptions tiny;
  tiny.max_record_bytes = 64;
  try {
    TraceReader small(path, tiny);
    ADD_FAILURE() << "a record over the cap was accepted";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kTooLarge);
  }
  fs::remove(path);
}

TEST(Trace, WrongMagicFutureVersionAndMissingFileAreTypedErrors) {
  const std::string path = temp_path("magic");
  spit(path, "this is not a trace at all");
  try {
    TraceReader r(path);
    ADD_FAILURE();
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kBadMagic);
  }
  write_small(path);
  std::string bytes = slurp(path);
  bytes[8] = static_cast<char>(kTraceFormatVersion + 1);  // a future format version
  spit(path, bytes);
  try {
    TraceReader r(path);
    ADD_FAILURE();
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), TraceError::Kind::kVersion);
    EXPECT_NE(std::string(e.what()).find("upgrade retrace"), std::string::npos);
  }
  EXPECT_THROW(TraceReader(temp_path("does_not_exist")), TraceError);
  fs::remove(path);
}

// Records with metadata of the wrong types are never written (the writer runs the reader's typed
// decoders, records.h); a well-framed one made by hand is refused by the reader at open
// (Records.TheReaderRefusesAWellFramedRecordOfTheWrongTypeAtOpen).
TEST(Trace, MetadataOfTheWrongTypeIsNeverWritten) {
  const std::vector<nlohmann::json> metas = {
      {{"step", "1"}}, {{"step", nullptr}}, {{"step", 1.5}}, {{"segment", 0}}, {{"phase", true}}};
  const std::string path = temp_path("types");
  TraceWriter w(path, nlohmann::json::object());
  for (const nlohmann::json& meta : metas) {
    SCOPED_TRACE(meta.dump());
    EXPECT_THROW(w.append(RecordType::kSegment, meta, {}), Error);
  }
  w.append(RecordType::kSegment, {{"step", 1}, {"segment", "b"}, {"phase", "forward"}}, {});  // control
  w.close();
  EXPECT_EQ(TraceReader(path).records().size(), 1u);
  fs::remove(path);
}

// fuzz_trace_reader). A shape LibTorch can hold still reads.
TEST(Trace, EmptyTensorsWhoseStridesOverflowAreMalformed) {
  const std::int64_t big = std::int64_t{1} << 62;
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{0, big, big}, {0, big, 1}}) {
    const bool torch_holds_it = shape[2] == 1;
    SCOPED_TRACE(torch_holds_it ? "[0, 2^62, 1]" : "[0, 2^62, 2^62]");
    const std::string path = temp_path("strides");
    {
      TraceWriter w(path, nlohmann::json::object());
      TensorToWrite empty;
      empty.name = "empty";
      empty.digest = Digest{1, 2, DigestAlgorithm::kXxh3_128};
      empty.shape = shape;
      w.append(RecordType::kEvent, {{"event", "empty"}}, {empty});
      w.close();
    }
    try {
      const TraceReader r(path);
      EXPECT_TRUE(torch_holds_it) << "accepted";
      EXPECT_EQ(r.read(0).tensors.at(0).shape, shape);
    } catch (const TraceError& e) {
      EXPECT_FALSE(torch_holds_it) << e.what();
      EXPECT_EQ(e.kind(), TraceError::Kind::kMalformed);
      EXPECT_NE(std::string(e.what()).find("strides overflow"), std::string::npos) << e.what();
    }
    fs::remove(path);
  }
}

TEST(Trace, AppendAfterCloseIsAnError) {
  const std::string path = temp_path("closed");
  TraceWriter w(path, nlohmann::json::object());
  w.close();
  w.close();  // idempotent
  EXPECT_THROW(w.append(RecordType::kEvent, {}, {}), Error);
  fs::remove(path);
}

// The writer never writes what the default reader refuses: a header whose metadata is over the
// 16 MiB cap (a long scenario description) or nests past 32 levels fails before the file exists,
// a record declaring a tensor over the 4 GiB cap fails at append. Controls: just under each cap,
// the trace is written and reads back with the default ReaderOptions.
TEST(Trace, TheWriterRefusesWhatTheReaderWouldRefuse) {
  const ReaderOptions caps;
  const std::string path = temp_path("caps");
  const auto message = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(written)");
  };
  // Metadata size: the description alone is the cap.
  const std::string huge(caps.max_meta_bytes, 'x');
  EXPECT_NE(message([&] {
              TraceWriter w(path, {{"description", huge}});
            }).find("ReaderOptions::max_meta_bytes"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(path + ".incomplete")) << "a refused header left a file behind";
  // Nesting: 33 levels.
  nlohmann::json deep = 1;
  for (int i = 0; i < caps.max_meta_depth; ++i) deep = nlohmann::json::array({deep});
  EXPECT_NE(message([&] {
              TraceWriter w(path, {{"config", deep}});
            }).find("ReaderOptions::max_meta_depth"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(path + ".incomplete"));
  // A digest-only entry declaring 5 GiB.
  {
    TraceWriter w(path, nlohmann::json::object());
    TensorToWrite big;
    big.name = "big";
    big.dtype = at::kByte;
    big.shape = {std::int64_t{5} << 30};
    big.digest = Digest{1, 2, DigestAlgorithm::kXxh3_128};
    EXPECT_NE(message([&] {
                w.append(RecordType::kEvent, {{"event", "big"}}, {big});
              }).find("ReaderOptions::max_tensor_bytes"),
              std::string::npos);
    big.shape = {std::int64_t{1} << 30};  // control: 1 GiB declared is fine
    EXPECT_EQ(message([&] { w.append(RecordType::kEvent, {{"event", "big"}}, {big}); }), "(written)");
    w.close();
  }
  EXPECT_EQ(TraceReader(path).records().size(), 1u);  // the event (the header and the index are not listed)
  // Controls: just under the size and depth caps, written and read back.
  nlohmann::json deep_ok = 1;
  for (int i = 0; i < caps.max_meta_depth - 2; ++i) deep_ok = nlohmann::json::array({deep_ok});
  const std::string long_text(caps.max_meta_bytes - 1024, 'x');
  {
    TraceWriter w(path, {{"description", long_text}, {"config", deep_ok}});
    w.close();
  }
  const TraceReader back(path);
  EXPECT_EQ(back.header()["description"].get<std::string>().size(), long_text.size());
  fs::remove(path);
}

// The one codec for non-finite numbers: a NaN is "nan" whatever its sign, in JSON and in text.
// Control: the -nan really has its sign bit set (printed with << it reads "-nan").
TEST(Numbers, NonFiniteNumbersHaveOneSpellingAndANaNNoSign) {
  const double negative_nan = -std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(std::signbit(negative_nan));
  std::ostringstream raw;
  raw << negative_nan;
  ASSERT_EQ(raw.str(), "-nan");
  EXPECT_EQ(json_number(negative_nan), "nan");
  EXPECT_EQ(number_text(negative_nan), "nan");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "-inf");
  EXPECT_EQ(number_text(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(json_number(1.5), 1.5);
  EXPECT_EQ(number_text(-0.000123456789, 3), "-0.000123");
  for (const double v : {1.5, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(number_from_json(json_number(v)), v);
  }
  EXPECT_TRUE(std::isnan(*number_from_json(json_number(negative_nan))));
  EXPECT_FALSE(number_from_json("NaN").has_value());  // only the codec's own spelling
  EXPECT_FALSE(number_from_json(nlohmann::json()).has_value());
}

// Two numbers a message compares are printed with digits enough to tell them apart (a replay's
// "loss differs too (recorded 31.5276, replayed 31.5276)", outsider finding): up to 17, which tell
// any two doubles apart. Control: equal numbers keep the 6 digits.
TEST(Numbers, DigitsApartTellTwoNumbersApart) {
  const double a = 31.527612, b = 31.527638;
  ASSERT_EQ(number_text(a), number_text(b));
  const int d = digits_apart(a, b);
  EXPECT_EQ(d, 7);
  EXPECT_NE(number_text(a, d), number_text(b, d));
  const double c = std::nextafter(a, 100.0);
  EXPECT_NE(number_text(a, digits_apart(a, c)), number_text(c, digits_apart(a, c)));
  EXPECT_EQ(digits_apart(a, a), 6);
}

// The exception event: what the recorder writes reads back; a trace from before raised_by_step
// reads as not raised by the step; an event of another kind is no exception; fields of the wrong
// type are malformed (records.h decodes every event the same way).
TEST(Trace, ExceptionEventReadsBackAndOldOnesReadAsNotRaisedByTheStep) {
  const ExceptionEvent e{3, "step 3: clipping refuses it", true};
  const EventRecord back = EventRecord::decode(e.to_meta(), 0, "t");
  ASSERT_TRUE(back.exception.has_value());
  EXPECT_EQ(back.exception->step, 3);
  EXPECT_EQ(back.exception->what, e.what);
  EXPECT_TRUE(back.exception->raised_by_step);
  const nlohmann::json old = {{"event", "exception"}, {"what", "signal SIGTERM"}, {"step", 7}};
  ASSERT_TRUE(EventRecord::decode(old, 0, "t").exception.has_value());
  EXPECT_FALSE(EventRecord::decode(old, 0, "t").exception->raised_by_step);
  const ExceptionEvent signal{7, "signal SIGTERM", false};
  EXPECT_FALSE(signal.to_meta().contains("raised_by_step"));  // written as before the field existed
  const nlohmann::json dump = {{"event", "ring_dump"}, {"reason", "x"}};
  EXPECT_FALSE(EventRecord::decode(dump, 0, "t").exception.has_value());
  EXPECT_THROW(EventRecord::decode(nlohmann::json::array(), 0, "t"), TraceError);
  const nlohmann::json wrong_types = {{"event", "exception"}, {"what", 5}, {"step", "3"}, {"raised_by_step", 1}};
  EXPECT_THROW(EventRecord::decode(wrong_types, 0, "t"), TraceError);
}

// A c10::Error's message is recorded without its backtrace (frame addresses differ between runs).
TEST(Trace, ExceptionMessageOfAC10ErrorHasNoBacktrace) {
  try {
    TORCH_CHECK(false, "the shapes differ");
  } catch (const c10::Error& e) {
    EXPECT_EQ(exception_message(e), "the shapes differ");
    EXPECT_NE(std::string(e.what()), exception_message(e));  // control: what() carries more
  }
  EXPECT_EQ(exception_message(std::runtime_error("data loader died")), "data loader died");
}

}  // namespace
}  // namespace retrace
