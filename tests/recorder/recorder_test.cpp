// The recorder: I/O faults at every file operation, backpressure, an exception leaving a step
// dumps the flight ring, and small records written by either thread make the same trace.
#include "../support/recording.h"

#include <retrace/environment.h>
#include <retrace/error.h>
#include <retrace/recorder.h>
#include <retrace/records.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace retrace {
namespace {

namespace fs = std::filesystem;

// The POSIX file system, each operation passed through; the file systems below change what they
// need (create, and the fault injector's rename and directory fsync).
class PosixPassThrough : public io::FileSystem {
 public:
  void rename(const std::string& a, const std::string& b) override { io::posix_file_system().rename(a, b); }
  void sync_directory(const std::string& d) override { io::posix_file_system().sync_directory(d); }
  void remove(const std::string& p) override { io::posix_file_system().remove(p); }
  std::unique_ptr<io::ReadableFile> open(const std::string& p) override { return io::posix_file_system().open(p); }
};

// A file passing every operation through to `f`; the files below change what they need.
struct PassThroughFile : io::WritableFile {
  std::unique_ptr<io::WritableFile> f;
  void append(const void* d, std::size_t n) override { f->append(d, n); }
  void append_all(const std::vector<io::ConstBytes>& pieces) override { f->append_all(pieces); }
  void sync() override { f->sync(); }
  void release_before(std::uint64_t offset) override { f->release_before(offset); }
  void close() override { f->close(); }
  std::uint64_t size() const override { return f->size(); }
};

// I/O faults (LevelDB's fault-injecting Env is the model): the Nth file operation -- create,
// append, sync, rename, directory sync -- fails with EIO or ENOSPC, an append failing halfway
// (a short write). For N = 1, 2, ... until a run completes: the failure surfaces as one clear
// retrace::Error, no partial file is ever presented as a finished trace, and whatever is left in
// PATH.incomplete reads as a (truncated) trace or fails with a typed error -- never a crash.
class FaultyFileSystem : public PosixPassThrough {
 public:
  // `write_backs`: the write-back after each record (release_before) is one of the operations too;
  // otherwise it passes through uncounted (it doubles the operations, and so the runs).
  explicit FaultyFileSystem(int fail_at, bool write_backs = false) : fail_at_(fail_at), write_backs_(write_backs) {}
  int operations() const { return count_; }
  bool fired() const { return fired_; }
  std::uint64_t synced_bytes() const { return synced_bytes_; }  // the file's size at its last good fsync
  int good_syncs() const { return good_syncs_; }

  std::unique_ptr<io::WritableFile> create(const std::string& path) override {
    hit("create " + path);
    struct File : PassThroughFile {
      FaultyFileSystem* fs;
      void append(const void* d, std::size_t n) override {
        if (fs->next()) {
          f->append(d, n / 2);  // a short write, then the error
          fs->fired_ = true;
          throw Error("injected ENOSPC: no space left on device (append of " + std::to_string(n) + " bytes)");
        }
        f->append(d, n);
      }
      // One operation, as a writev is: failing, it writes the first half of the pieces' bytes.
      void append_all(const std::vector<io::ConstBytes>& pieces) override {
        std::size_t n = 0;
        for (const io::ConstBytes& p : pieces) n += p.size;
        if (fs->next()) {
          std::size_t left = n / 2;
          for (const io::ConstBytes& p : pieces) {
            const std::size_t k = std::min(left, p.size);
            f->append(p.data, k);
            left -= k;
          }
          fs->fired_ = true;
          throw Error("injected ENOSPC: no space left on device (append of " + std::to_string(n) + " bytes)");
        }
        f->append_all(pieces);
      }
      void sync() override {
        fs->hit("fsync");
        f->sync();
        fs->synced_bytes_ = f->size();
        ++fs->good_syncs_;
      }
      void release_before(std::uint64_t offset) override {
        if (fs->write_backs_) fs->hit("write-back");
        f->release_before(offset);
      }
    };
    auto file = std::make_unique<File>();
    file->fs = this;
    file->f = io::posix_file_system().create(path);
    return file;
  }
  void rename(const std::string& a, const std::string& b) override {
    hit("rename");
    io::posix_file_system().rename(a, b);
  }
  void sync_directory(const std::string& d) override {
    hit("directory fsync");
    io::posix_file_system().sync_directory(d);
  }

 private:
  bool next() { return ++count_ == fail_at_; }
  void hit(const std::string& what) {
    if (next()) {
      fired_ = true;
      throw Error("injected EIO: input/output error on " + what);
    }
  }
  int fail_at_;
  bool write_backs_;
  int count_ = 0;
  bool fired_ = false;
  std::uint64_t synced_bytes_ = 0;
  int good_syncs_ = 0;
};

TEST(IoFaults, EveryFailingOperationIsReportedAndNoPartialTraceLooksFinished) {
  register_builtin_programs();
  // Full mode with its small records by either thread (SmallRecords), and digest mode with nearly
  // every record written by the training thread itself: a failing write is reported alike.
  // Every record is followed by a write-back (io::WritableFile::release_before); in the first
  // case it is one of the operations that fail, and its window of 1 byte drops pages from the
  // first 8 MiB on.
  struct Case {
    RecordMode mode;
    SmallRecords small;
    std::uint64_t page_cache_window;
  };
  const std::vector<Case> cases = {
      {RecordMode::kFull, SmallRecords::kWriterThread, 1},
      {RecordMode::kFull, SmallRecords::kRecordingThread, WriterOptions{}.page_cache_window},
      {RecordMode::kDigest, SmallRecords::kRecordingThread, WriterOptions{}.page_cache_window}};
  for (const auto& [mode, small, page_cache_window] : cases) {
    SCOPED_TRACE(std::string(mode == RecordMode::kFull ? "full" : "digest") +
                 (small == SmallRecords::kWriterThread ? ", small records by the writer thread"
                                                       : ", small records by the training thread") +
                 ", page-cache window " + std::to_string(page_cache_window));
    int runs = 0;
    bool write_back_failed = false, completed = false;
    for (int n = 1; n < 500; ++n) {
      SCOPED_TRACE("failing operation " + std::to_string(n));
      FaultyFileSystem faulty(n, /*write_backs=*/page_cache_window == 1);
      RecorderOptions options;
      options.mode = mode;
      options.small_records = small;
      options.writer.page_cache_window = page_cache_window;
      options.writer.fs = &faulty;
      ScenarioProgram program(parse_scenario_text(kGpt, "io"));
      const std::string path = temp_path("io_" + std::to_string(n));
      std::string error;
      RecorderStats stats;
      try {
        Recorder recorder(path, program, options);
        record_run(program, recorder, 2);
        recorder.close();
        stats = recorder.stats();
      } catch (const Error& e) {
        error = e.what();
      }
      ++runs;
      if (!faulty.fired()) {  // every operation of a whole run succeeded: done
        EXPECT_TRUE(error.empty()) << error;
        EXPECT_TRUE(TraceReader(path).complete());
        // The policy under test was in effect: the training thread wrote records, or none.
        if (small == SmallRecords::kRecordingThread) {
          EXPECT_GT(stats.records_by_caller, 0);
        } else {
          EXPECT_EQ(stats.records_by_caller, 0);
        }
        fs::remove(path);
        completed = true;
        break;
      }
      EXPECT_NE(error.find("injected"), std::string::npos) << "the failure was not reported: '" << error << "'";
      write_back_failed |= error.find("write-back") != std::string::npos;
      EXPECT_EQ(error.find('\n'), std::string::npos) << error;
      if (fs::exists(path)) {
        // Only a failing directory fsync comes after the rename: the file is then whole.
        const TraceReader finished(path);
        EXPECT_TRUE(finished.complete()) << "a partial trace was presented as finished";
        EXPECT_FALSE(finished.truncated());
        fs::remove(path);
      }
      if (fs::exists(path + ".incomplete")) {
        try {
          // Whole content (the failure was the final fsync or the rename) or a truncated tail,
          // either way still named .incomplete; reading it must not crash.
          const TraceReader left(path + ".incomplete");
          if (left.complete()) {
            EXPECT_TRUE(error.find("fsync") != std::string::npos || error.find("rename") != std::string::npos) << error;
          }
        } catch (const Error&) {
          // A typed error (e.g. the header itself was cut) is an acceptable answer too.
        }
        fs::remove(path + ".incomplete");
      }
    }
    EXPECT_GT(runs, 10);  // a two-step run does dozens of file operations
    EXPECT_TRUE(completed) << "no run got through all of its file operations in " << runs << " tries";
    EXPECT_EQ(write_back_failed, page_cache_window == 1) << "a failing write-back was not among the failures";
  }
}

// The same faults under OnWriteError::kContinue: training runs every step whatever fails,
// stats().write_error says what did, no partial file is presented as finished, and a crash right
// after the failure -- everything not fsynced lost -- still leaves every write-ahead step readable.
TEST(IoFaults, UnderContinueTrainingGoesOnAndSyncedStepsSurviveLosingUnsyncedData) {
  register_builtin_programs();
  int runs = 0;
  bool completed = false;
  for (int n = 1; n < 500; ++n) {
    SCOPED_TRACE("failing operation " + std::to_string(n));
    FaultyFileSystem faulty(n);
    RecorderOptions options;
    options.mode = RecordMode::kFull;
    options.write_ahead = true;  // an fsync after every step_begin
    options.on_write_error = OnWriteError::kContinue;
    options.writer.fs = &faulty;
    ScenarioProgram program(parse_scenario_text(kGpt, "io"));
    const std::string path = temp_path("io_continue_" + std::to_string(n));
    std::vector<StepOutcome> outcomes;
    RecorderStats stats;
    std::unique_ptr<Recorder> recorder;
    try {
      recorder = std::make_unique<Recorder>(path, program, options);
    } catch (const Error& e) {
      // Creating the trace (file and header record) fails at once, whatever the policy: a
      // recorder that never started is a configuration error to see before training.
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      fs::remove(path + ".incomplete");
      ++runs;
      continue;
    }
    outcomes = record_run(program, *recorder, 3);  // never throws for a write failure
    recorder->close();
    stats = recorder->stats();
    recorder.reset();
    ++runs;
    ASSERT_EQ(outcomes.size(), 3u) << "training stopped";
    EXPECT_TRUE(program.defenses()->parameters_finite());
    if (!faulty.fired()) {
      EXPECT_TRUE(stats.write_error.empty()) << stats.write_error;
      EXPECT_TRUE(TraceReader(path).complete());
      fs::remove(path);
      completed = true;
      break;
    }
    EXPECT_NE(stats.write_error.find("injected"), std::string::npos) << "'" << stats.write_error << "'";
    if (fs::exists(path)) {  // only when the directory fsync after the rename failed
      EXPECT_NE(stats.write_error.find("directory fsync"), std::string::npos) << stats.write_error;
      EXPECT_TRUE(TraceReader(path).complete());
      fs::remove(path);
      continue;
    }
    const std::string left = path + ".incomplete";
    if (!fs::exists(left)) continue;  // the create itself failed
    // A crash now: whatever was not fsynced is gone.
    fs::resize_file(left, faulty.synced_bytes());
    if (faulty.good_syncs() == 0) {
      fs::remove(left);
      continue;
    }
    const TraceReader r(left);
    int step_begins = 0;
    for (std::size_t i = 0; i < r.records().size(); ++i) {
      const Record rec = r.read(i);
      for (const TensorEntry& e : rec.tensors) {
        if (e.has_data()) r.decode(rec, e);  // every surviving record decodes
      }
      step_begins += rec.type == RecordType::kStepBegin;
    }
    EXPECT_GE(step_begins, std::min(faulty.good_syncs(), 3)) << "a step that was fsynced was lost";
    fs::remove(left);
  }
  EXPECT_GT(runs, 10);
  EXPECT_TRUE(completed) << "no run got through all of its file operations in " << runs << " tries";
}

// The POSIX file system with the background writer held on its first record, so the training
// thread certainly pushes again while the writer is busy. (A fixed 40 ms per append had let a
// step slowed by a loaded machine fall behind the writer, and then the test saw no wait.) The
// header is written on the thread that made the file system and is not held; the hold is a
// bound far above the gap between two pushes of one step (one segment's forward), not a timing.
class SlowFileSystem : public PosixPassThrough {
 public:
  std::unique_ptr<io::WritableFile> create(const std::string& path) override {
    struct Slow : PassThroughFile {
      std::thread::id owner = std::this_thread::get_id();
      bool held = false;
      void hold() {
        if (!held && std::this_thread::get_id() != owner) {
          held = true;  // only the writer thread appends after the header
          std::this_thread::sleep_for(std::chrono::seconds(2));
        }
      }
      void append(const void* d, std::size_t n) override {
        hold();
        f->append(d, n);
      }
      void append_all(const std::vector<io::ConstBytes>& pieces) override {
        hold();
        f->append_all(pieces);
      }
    };
    auto slow = std::make_unique<Slow>();
    slow->f = io::posix_file_system().create(path);
    return slow;
  }
};

TEST(Recorder, FullQueueAppliesBackpressureAndDropsNothing) {
  SlowFileSystem slow;
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  options.queue_bytes = 1;  // every push waits for the writer
  options.writer.fs = &slow;
  const Recorded rec = record(kGpt, "backpressure", options, 2);
  EXPECT_GT(rec.stats.backpressure_waits, 0);
  const TraceReader trace(rec.path);
  EXPECT_EQ(static_cast<std::int64_t>(trace.records().size()), rec.stats.records);
  EXPECT_TRUE(replay(rec.path).reproduced);
  fs::remove(rec.path);

  // Control: the same held writer under the default bound never makes the training thread wait.
  SlowFileSystem slow_again;
  options.queue_bytes = RecorderOptions{}.queue_bytes;
  options.writer.fs = &slow_again;
  const Recorded unbounded = record(kGpt, "backpressure-control", options, 2);
  EXPECT_EQ(unbounded.stats.backpressure_waits, 0);
  EXPECT_EQ(static_cast<std::int64_t>(TraceReader(unbounded.path).records().size()), unbounded.stats.records);
  fs::remove(unbounded.path);
}

// A program whose step throws: the exception is noted in the trace and the ring dumped.
class Throwing : public ScenarioProgram {
 public:
  using ScenarioProgram::ScenarioProgram;
  StepOutcome step(std::int64_t s, const std::vector<NamedTensor>& b, StepMonitor* m) override {
    if (s == 3) throw std::runtime_error("data loader died");
    return ScenarioProgram::step(s, b, m);
  }
};

TEST(Recorder, ExceptionLeavingAStepDumpsTheRing) {
  Throwing program(parse_scenario_text(kGpt, "throwing"));
  const std::string path = temp_path("throwing");
  RecorderOptions options;
  options.ring = 2;
  Recorder recorder(path, program, options);
  EXPECT_THROW(record_run(program, recorder, 5), std::runtime_error);
  const TraceReader trace(path);  // closed by record_run
  bool noted = false;
  int ring = 0;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    noted = noted || (r.meta.value("event", "") == "exception" && r.meta.value("what", "") == "data loader died");
    ring += r.meta.value("ring", false);
  }
  EXPECT_TRUE(noted);
  EXPECT_EQ(ring, 2);  // steps 2 and 3
  fs::remove(path);
}

// Puts LibTorch's intra-op thread count and LOCAL_WORLD_SIZE back, however the test leaves.
class ThreadsAndLocalWorldSize {
 public:
  ThreadsAndLocalWorldSize() : threads_(at::get_num_threads()) {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    if (local) local_ = local;
  }
  ~ThreadsAndLocalWorldSize() {
    if (local_) {
      ::setenv("LOCAL_WORLD_SIZE", local_->c_str(), 1);
    } else {
      ::unsetenv("LOCAL_WORLD_SIZE");
    }
    at::set_num_threads(threads_);
  }

 private:
  int threads_;
  std::optional<std::string> local_;
};

// A program that changes one parameter in place, through ATen (its version counter moves), at
// the start of the steps `at` names -- after the recorder's begin_step, before after_backward:
// where a program's forward would (a BatchNorm's running statistics, an injector).
class ChangesStateMidStep : public ScenarioProgram {
 public:
  ChangesStateMidStep(ScenarioSpec spec, std::function<bool(std::int64_t)> at)
      : ScenarioProgram(std::move(spec)), at_(std::move(at)) {}
  StepOutcome step(std::int64_t s, const std::vector<NamedTensor>& b, StepMonitor* m) override {
    if (at_(s)) {
      at::NoGradGuard no_grad;
      for (NamedTensor& n : state()) {
        if (n.kind == TensorKind::kParameter) {
          n.tensor.add_(1e-3);
          break;
        }
      }
    }
    return ScenarioProgram::step(s, b, m);
  }

 private:
  std::function<bool(std::int64_t)> at_;
};

// The ring's state snapshots a trace's dump holds, by step: each state tensor's name and digest
// (the writer's, of the bytes it stored), and the dump's lost steps.
struct RingDump {
  std::map<std::int64_t, std::vector<std::pair<std::string, Digest>>> snapshots;
  std::vector<std::int64_t> lost;
};
RingDump ring_dump_of(const std::string& path) {
  RingDump out;
  const TraceReader trace(path);
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    if (r.type == RecordType::kEvent && r.meta.value("event", "") == "ring_dump") {
      const EventRecord e = EventRecord::decode(r, path);
      out.lost = e.ring_dump->lost;
    }
    if (r.type != RecordType::kStepBegin || !r.meta.value("ring", false)) continue;
    auto& snapshot = out.snapshots[r.meta.at("step").get<std::int64_t>()];
    for (const TensorEntry& t : r.tensors) {
      if (t.name.rfind(tensor_names::kStatePrefix, 0) == 0) snapshot.emplace_back(t.name, t.digest);
    }
  }
  return out;
}

// Records `steps` steps of `program` (1, 2, ...) with a ring of `k` copied `how`, a snapshot every
// `every` steps, then dumps it.
RecorderStats record_ring(ScenarioProgram& program, const std::string& path, RingCopy how, int k, std::int64_t steps,
                          int every = 1) {
  RecorderOptions options;
  options.ring = k;
  options.ring_every = every;
  options.ring_copy = how;
  options.state_check = false;
  Recorder recorder(path, program, options);
  record_run(program, recorder, steps);
  recorder.dump_ring("test");
  recorder.close();
  return recorder.stats();
}

// The ring copied while forward and backward run (RingCopy::kOverlapped) holds, bit for bit, what
// the copy in begin_step holds; a step that changed the state in place meanwhile loses its
// snapshot, says so, and the ring copies in begin_step from then on.
TEST(Recorder, RingCopiedWhileTheStepRunsHoldsTheStateItBeganWith) {
  register_builtin_programs();
  const auto run = [](RingCopy how, std::function<bool(std::int64_t)> at, const std::string& name, int k = 4,
                      std::int64_t steps = 8) {
    ChangesStateMidStep program(parse_scenario_text(kGpt, name), std::move(at));
    const std::string path = temp_path(name);
    const RecorderStats stats = record_ring(program, path, how, k, steps);
    RingDump dump = ring_dump_of(path);
    fs::remove(path);
    return std::pair{stats, dump};
  };
  const auto never = [](std::int64_t) { return false; };
  const auto at_step_5 = [](std::int64_t s) { return s == 5; };
  const auto always = [](std::int64_t) { return true; };

  // Nothing changes the state mid-step: steps 2..8 after the trial step 1, all overlapped.
  const auto [plain_stats, plain] = run(RingCopy::kAtBeginStep, never, "ring_at_begin");
  const auto [over_stats, over] = run(RingCopy::kOverlapped, never, "ring_overlapped");
  EXPECT_EQ(plain_stats.ring_copies_overlapped, 0);
  EXPECT_EQ(over_stats.ring_copies_overlapped, 7);
  EXPECT_EQ(over_stats.ring_snapshots_lost, 0);
  ASSERT_EQ(plain.snapshots.size(), 4u);  // steps 5..8
  EXPECT_EQ(over.snapshots, plain.snapshots);
  EXPECT_TRUE(over.lost.empty());

  // Step 5 changes a parameter mid-step: its overlapped snapshot is dropped and named, so the ring
  // keeps step 4 instead; 6..8 are copied in begin_step. Every snapshot kept is what the copy in
  // begin_step holds for that step (`ref`, a ring of 5: steps 4..8).
  const auto [ref_stats, ref] = run(RingCopy::kAtBeginStep, at_step_5, "ring_at_begin_5", 5);
  const auto [lost_stats, lost] = run(RingCopy::kOverlapped, at_step_5, "ring_overlapped_5");
  EXPECT_EQ(lost_stats.ring_copies_overlapped, 4);  // steps 2..5
  EXPECT_EQ(lost_stats.ring_snapshots_lost, 1);
  EXPECT_EQ(lost.lost, (std::vector<std::int64_t>{5}));
  std::vector<std::int64_t> kept;
  for (const auto& [step, snapshot] : lost.snapshots) {
    kept.push_back(step);
    ASSERT_TRUE(ref.snapshots.count(step)) << step;
    EXPECT_EQ(snapshot, ref.snapshots.at(step)) << "step " << step;
  }
  EXPECT_EQ(kept, (std::vector<std::int64_t>{4, 6, 7, 8}));
  // Control: the change is real -- step 5 began as the unchanged run's did, step 6 did not.
  EXPECT_EQ(ref.snapshots.at(5), plain.snapshots.at(5));
  EXPECT_NE(ref.snapshots.at(6), plain.snapshots.at(6));
  // A ring of one dumped right after the lost step still holds a snapshot (step 4's): while a copy
  // is unchecked the ring keeps one more.
  const auto [one_stats, one] = run(RingCopy::kOverlapped, at_step_5, "ring_overlapped_one", 1, 5);
  EXPECT_EQ(one.lost, (std::vector<std::int64_t>{5}));
  ASSERT_EQ(one.snapshots.size(), 1u);
  EXPECT_EQ(one.snapshots.begin()->first, 4);
  EXPECT_EQ(one.snapshots.begin()->second, ref.snapshots.at(4));

  // kAuto (the default) overlaps only when the copier has a core of its own.
  {
    const ThreadsAndLocalWorldSize restore;
    ::unsetenv("LOCAL_WORLD_SIZE");
    const int cores = usable_cores();
    at::set_num_threads(cores);
    EXPECT_EQ(run(RingCopy::kAuto, never, "ring_auto_busy").first.ring_copies_overlapped, 0);
    if (cores > 1) {
      at::set_num_threads(cores - 1);
      EXPECT_EQ(run(RingCopy::kAuto, never, "ring_auto_spare").first.ring_copies_overlapped, 7);
    }
  }

  // A program that changes its state every step (a BatchNorm's statistics) never overlaps: the
  // trial step shows it, and nothing is lost.
  const auto [bn_stats, bn] = run(RingCopy::kOverlapped, always, "ring_overlapped_always");
  EXPECT_EQ(bn_stats.ring_copies_overlapped, 0);
  EXPECT_EQ(bn_stats.ring_snapshots_lost, 0);
  EXPECT_EQ(bn.snapshots.size(), 4u);
}

// A program that all-reduces a tensor holding its step number once a step, through the recorder
// as a data-parallel program's collectives reach it (one rank: the result is the contribution).
class OneCollectivePerStep : public ChangesStateMidStep {
 public:
  using ChangesStateMidStep::ChangesStateMidStep;
  CollectiveObserver* observer = nullptr;
  StepOutcome step(std::int64_t s, const std::vector<NamedTensor>& b, StepMonitor* m) override {
    const at::Tensor t = at::full({4}, static_cast<double>(s));
    observer->before_collective(CollectiveCall{CollectiveOp::kAllReduce, "sum", -1}, {t});
    observer->after_collective(CollectiveCall{CollectiveOp::kAllReduce, "sum", -1}, {t});
    return ChangesStateMidStep::step(s, b, m);
  }
};

// RecorderOptions::ring_every: the ring's K snapshots are that many steps apart, each bitwise the
// snapshot an every-step ring takes of that step; after a lost snapshot the next step takes one;
// the steps since the oldest snapshot keep their collectives' stored results (what a rank's replay
// from that snapshot is served).
TEST(Recorder, RingEveryKeepsSnapshotsThatFarApartAndTheStepsBetween) {
  register_builtin_programs();
  const auto run = [](RingCopy how, std::function<bool(std::int64_t)> at, const std::string& name, int k, int every,
                      std::int64_t steps = 8) {
    ChangesStateMidStep program(parse_scenario_text(kGpt, name), std::move(at));
    const std::string path = temp_path(name);
    const RecorderStats stats = record_ring(program, path, how, k, steps, every);
    RingDump dump = ring_dump_of(path);
    fs::remove(path);
    return std::pair{stats, dump};
  };
  const auto steps_of = [](const RingDump& d) {
    std::vector<std::int64_t> steps;
    for (const auto& [step, snapshot] : d.snapshots) steps.push_back(step);
    return steps;
  };
  const auto never = [](std::int64_t) { return false; };
  const auto at_step_5 = [](std::int64_t s) { return s == 5; };

  // Every step's snapshot, for reference (a ring of 8 over 8 steps).
  const auto [all_stats, all] = run(RingCopy::kAtBeginStep, never, "ring_every_ref", 8, 1);
  ASSERT_EQ(all.snapshots.size(), 8u);
  // Snapshots at steps 1, 4, 7; the ring of 2 keeps 4 and 7.
  const auto [every_stats, every] = run(RingCopy::kAtBeginStep, never, "ring_every_3", 2, 3);
  EXPECT_EQ(steps_of(every), (std::vector<std::int64_t>{4, 7}));
  for (const auto& [step, snapshot] : every.snapshots) EXPECT_EQ(snapshot, all.snapshots.at(step)) << step;
  // Control: the same ring with every = 1 keeps the last two steps.
  EXPECT_EQ(steps_of(run(RingCopy::kAtBeginStep, never, "ring_every_1", 2, 1).second),
            (std::vector<std::int64_t>{7, 8}));

  // Overlapped, every 2: step 1 (the trial) and 3 kept, 5 lost to its mid-step change, then step
  // 6 takes one at once (not 7), and 8. The kept ones are what the copy in begin_step holds.
  const auto [ref_stats, ref] = run(RingCopy::kAtBeginStep, at_step_5, "ring_every_ref_5", 8, 1);
  const auto [lost_stats, lost] = run(RingCopy::kOverlapped, at_step_5, "ring_every_lost", 2, 2);
  EXPECT_EQ(lost_stats.ring_copies_overlapped, 2);  // steps 3 and 5
  EXPECT_EQ(lost.lost, (std::vector<std::int64_t>{5}));
  EXPECT_EQ(steps_of(lost), (std::vector<std::int64_t>{6, 8}));
  for (const auto& [step, snapshot] : lost.snapshots) EXPECT_EQ(snapshot, ref.snapshots.at(step)) << step;

  // Collectives: a ring of 1, every 3 over 6 steps holds step 4's snapshot and the stored results
  // of steps 4, 5 and 6; every 1 only step 6's. Overlapped, every 2, over 5 steps: step 5's
  // snapshot is lost, so replay would start at 3 and needs the results of 3, 4 and 5.
  const auto collectives = [](
                               int every, RingCopy how = RingCopy::kAtBeginStep,
                               std::function<bool(std::int64_t)> at = [](std::int64_t) { return false; },
                               std::int64_t run_steps = 6) {
    OneCollectivePerStep program(parse_scenario_text(kGpt, "ring_every_collectives"), std::move(at));
    const std::string path = temp_path("ring_every_collectives");
    RecorderOptions options;
    options.ring = 1;
    options.ring_every = every;
    options.ring_copy = how;
    options.state_check = false;
    {
      Recorder recorder(path, program, options);
      program.observer = &recorder;
      record_run(program, recorder, run_steps);
      recorder.dump_ring("test");
      recorder.close();
    }
    std::vector<std::int64_t> steps;
    const TraceReader trace(path);
    for (std::size_t i = 0; i < trace.records().size(); ++i) {
      const Record r = trace.read(i);
      if (r.type != RecordType::kCollective || !r.meta.value("ring", false)) continue;
      const CollectiveRecord c = CollectiveRecord::decode(r, path);
      const TensorEntry* out = r.find(tensor_names::collective_output(0));
      EXPECT_TRUE(out && out->has_data());
      if (out && out->has_data()) {
        EXPECT_TRUE(trace.decode(r, *out).eq(static_cast<double>(c.step)).all().item<bool>());
      }
      steps.push_back(c.step);
    }
    fs::remove(path);
    return steps;
  };
  EXPECT_EQ(collectives(3), (std::vector<std::int64_t>{4, 5, 6}));
  EXPECT_EQ(collectives(1), (std::vector<std::int64_t>{6}));
  EXPECT_EQ(collectives(2, RingCopy::kOverlapped, at_step_5, 5), (std::vector<std::int64_t>{3, 4, 5}));

  // Refused: fewer than one step apart.
  RecorderOptions bad;
  bad.ring = 2;
  bad.ring_every = 0;
  ScenarioProgram program(parse_scenario_text(kGpt, "ring_every_0"));
  EXPECT_THROW(Recorder(temp_path("ring_every_0"), program, bad), Error);
}


// RecorderStats::snapshot_buffer_bytes: the ring's buffers hold K (+ the one being written)
// snapshots of the state as it is now. The first step's snapshot is smaller (AdamW has no moments
// before its first step) and fits no later one; its buffer is freed once idle long enough, not
// held for the run.
TEST(Recorder, RingLetsGoOfABufferNoSnapshotFits) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(kGpt, "ring_pool"));
  const std::string path = temp_path("ring_pool");
  RecorderOptions options;
  options.ring = 2;
  options.ring_copy = RingCopy::kAtBeginStep;
  options.state_check = false;
  std::vector<std::uint64_t> held;  // after each step
  {
    Recorder recorder(path, program, options);
    record_run(program, recorder, 30, true,
               [&](std::int64_t, const StepOutcome&) { held.push_back(recorder.stats().snapshot_buffer_bytes); });
    recorder.close();
  }
  fs::remove(path);
  ASSERT_EQ(held.size(), 30u);
  const std::uint64_t first = held[0];            // step 1's snapshot: parameters only
  const std::uint64_t later = held[1] - held[0];  // step 2's: parameters and moments
  // Control: the state did grow, so the first buffer fits no later snapshot.
  ASSERT_GT(first, 0u);
  ASSERT_GT(later, first);
  // At the end: only buffers of the later size, no more than the ring's 2 and one being reused.
  EXPECT_EQ(held.back() % later, 0u) << held.back() << " bytes held; snapshots of " << later;
  EXPECT_LE(held.back(), 3 * later);
  EXPECT_GE(held.back(), 2 * later);
}


// Every record of trace `a` equals trace `b`'s, in the same order: type, metadata and tensor table
// (names, digests, codecs, offsets, stored sizes, checksums). The headers (host, time) may differ.
void expect_same_records(const std::string& a, const std::string& b) {
  const TraceReader ta(a), tb(b);
  ASSERT_EQ(ta.records().size(), tb.records().size());
  for (std::size_t i = 0; i < ta.records().size(); ++i) {
    SCOPED_TRACE("record " + std::to_string(i));
    const Record ra = ta.read(i), rb = tb.read(i);
    ASSERT_EQ(ra.type, rb.type);
    ASSERT_EQ(ra.meta, rb.meta);
    ASSERT_EQ(ra.tensors.size(), rb.tensors.size());
    for (std::size_t k = 0; k < ra.tensors.size(); ++k) {
      const TensorEntry &ea = ra.tensors[k], &eb = rb.tensors[k];
      EXPECT_EQ(ea.name, eb.name);
      EXPECT_EQ(ea.digest, eb.digest) << ea.name;
      EXPECT_EQ(ea.codec, eb.codec) << ea.name;
      EXPECT_EQ(ea.offset, eb.offset) << ea.name;
      EXPECT_EQ(ea.stored_bytes, eb.stored_bytes) << ea.name;
      EXPECT_EQ(ea.checksum, eb.checksum) << ea.name;
    }
    EXPECT_EQ(ra.blob, rb.blob);
  }
}

// The POSIX file system with the writer thread's first append held until open() (or 60 s).
class GatedFileSystem : public PosixPassThrough {
 public:
  void open_gate() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    opened_.notify_all();
  }
  std::unique_ptr<io::WritableFile> create(const std::string& path) override {
    struct Gated : PassThroughFile {
      GatedFileSystem* fs;
      std::thread::id owner = std::this_thread::get_id();
      void wait() {
        if (std::this_thread::get_id() == owner) return;  // the header, and the recording thread's
        std::unique_lock<std::mutex> lock(fs->mutex_);
        fs->opened_.wait_for(lock, std::chrono::seconds(60), [&] { return fs->open_; });
      }
      void append(const void* d, std::size_t n) override {
        wait();
        f->append(d, n);
      }
      void append_all(const std::vector<io::ConstBytes>& pieces) override {
        wait();
        f->append_all(pieces);
      }
    };
    auto gated = std::make_unique<Gated>();
    gated->fs = this;
    gated->f = io::posix_file_system().create(path);
    return gated;
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

struct GatedRecording {
  std::string path;
  RecorderStats after_step_1;  // the writer thread still held
  RecorderStats end;
};

// Four steps of kGpt; the writer thread's first append (step 1's state, stored in full: not a small
// record) is held until step 1 has ended, so every record of step 1 is pushed while the writer has
// one in hand. Then the gate opens and the writer catches up before step 2.
GatedRecording record_gated(const std::string& name, RecorderOptions options) {
  register_builtin_programs();
  GatedFileSystem gate;
  options.writer.fs = &gate;
  ScenarioProgram program(parse_scenario_text(kGpt, name));
  GatedRecording r;
  r.path = temp_path(name);
  Recorder recorder(r.path, program, options);
  for (std::int64_t n = 1; n <= 4; ++n) {
    const std::vector<NamedTensor> batch = program.batch(n);
    ObserverScope scope(recorder);
    recorder.begin_step(n, program.state(), batch, program.lr(), 1.0);
    const StepOutcome outcome = program.step(n, batch, &recorder);
    recorder.end_step(n, outcome, program.state());
    if (n == 1) {
      r.after_step_1 = recorder.stats();
      gate.open_gate();
      recorder.flush();
    }
  }
  recorder.close();
  r.end = recorder.stats();
  return r;
}

// SmallRecords: the recording thread writes a small record only when the writer thread has nothing
// queued or in hand. Step 1's small records come while the writer holds the step's state: they
// must queue behind it (none written by the recording thread yet), and the whole trace must be
// record for record what the writer thread alone writes. Control: the writer thread alone writes
// every record itself.
TEST(Recorder, SmallRecordsWrittenByTheRecordingThreadKeepTheTraceAsTheWriterThreadWritesIt) {
  RecorderOptions options;
  options.ring = 2;  // the ring's copies must not change what is written either
  options.small_records = SmallRecords::kWriterThread;
  const GatedRecording by_writer = record_gated("small-by-writer", options);
  EXPECT_EQ(by_writer.end.records_by_caller, 0);

  options.small_records = SmallRecords::kRecordingThread;
  const GatedRecording by_caller = record_gated("small-by-caller", options);
  EXPECT_EQ(by_caller.end.records, by_writer.end.records);
  EXPECT_GT(by_caller.after_step_1.records, 1);
  EXPECT_EQ(by_caller.after_step_1.records_by_caller, 0) << "a small record jumped the writer's queue";
  // After step 1 the writer is idle between records: steps 2 to 4 are all small (digest mode).
  EXPECT_EQ(by_caller.end.records_by_caller, by_caller.end.records - by_caller.after_step_1.records);
  expect_same_records(by_writer.path, by_caller.path);
  EXPECT_TRUE(replay(by_caller.path).reproduced);
  fs::remove(by_writer.path);
  fs::remove(by_caller.path);
}

// kAuto writes small records on the recording thread when LibTorch's intra-op threads, times this
// job's processes on the host (LOCAL_WORLD_SIZE), take every core this process may run on, and on
// the writer thread when one is left over. A LOCAL_WORLD_SIZE that is not a count is an error.

TEST(Recorder, SmallRecordsAutoWritesOnTheRecordingThreadOnlyWithNoCoreToSpare) {
  const ThreadsAndLocalWorldSize restore;
  const int cores = usable_cores();
  ::unsetenv("LOCAL_WORLD_SIZE");
  RecorderOptions options;  // kAuto
  at::set_num_threads(cores);
  const Recorded busy = record(kGpt, "small-auto-busy", options, 2);
  EXPECT_GT(busy.stats.records_by_caller, 0);
  fs::remove(busy.path);
  const bool whole_machine = cores >= static_cast<int>(std::thread::hardware_concurrency());
  if (cores > 1) {
    at::set_num_threads(cores - 1);
    const Recorded spare = record(kGpt, "small-auto-spare", options, 2);
    EXPECT_EQ(spare.stats.records_by_caller, 0);
    fs::remove(spare.path);
    // Ranks of one job filling the cores together (cores - 1 threads each, two on this host),
    // when this process may run on every core (else the ranks are pinned apart).
    ::setenv("LOCAL_WORLD_SIZE", "2", 1);
    const Recorded ranks = record(kGpt, "small-auto-ranks", options, 2);
    if (whole_machine) {
      EXPECT_GT(ranks.stats.records_by_caller, 0);
    } else {
      EXPECT_EQ(ranks.stats.records_by_caller, 0);
    }
    fs::remove(ranks.path);
  }
  for (const char* bad : {"two", "0", "-1", "2x", "99999999999"}) {
    SCOPED_TRACE(bad);
    ::setenv("LOCAL_WORLD_SIZE", bad, 1);
    const std::string path = temp_path("small-auto-bad");
    try {
      register_builtin_programs();
      ScenarioProgram program(parse_scenario_text(kGpt, "small-auto-bad"));
      Recorder recorder(path, program, options);
      ADD_FAILURE() << "LOCAL_WORLD_SIZE=" << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LOCAL_WORLD_SIZE is '" + std::string(bad) + "'"), std::string::npos)
          << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path + ".incomplete")) << "the refused recorder left a trace file";
    fs::remove(path + ".incomplete");
  }
  // Control: a policy that does not look at the cores does not read it.
  options.small_records = SmallRecords::kWriterThread;
  const Recorded fixed = record(kGpt, "small-fixed-bad-env", options, 1);
  EXPECT_EQ(fixed.stats.records_by_caller, 0);
  fs::remove(fixed.path);
  if (cores == 1) GTEST_SKIP() << "one usable core: the writer thread never has one of its own";
}

}  // namespace
}  // namespace retrace
