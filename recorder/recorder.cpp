#include <retrace/recorder.h>

#include "crash_point.h"

#include <retrace/records.h>

#include <retrace/digest.h>
#include <retrace/environment.h>
#include <retrace/number.h>
#include <retrace/parallel.h>
#include <retrace/rng.h>
#include <retrace/snapshot.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>

namespace retrace {

RecordMode parse_record_mode(const std::string& text) {
  if (text == "digest") return RecordMode::kDigest;
  if (text == "full") return RecordMode::kFull;
  throw Error("unknown record mode '" + text + "'; use digest or full");
}

RingCopy parse_ring_copy(const std::string& text) {
  if (text == "auto") return RingCopy::kAuto;
  if (text == "overlapped") return RingCopy::kOverlapped;
  if (text == "at-begin-step") return RingCopy::kAtBeginStep;
  throw Error("unknown ring copy '" + text + "'; use auto, overlapped or at-begin-step");
}

namespace {

// A stored copy later steps cannot change; for a CUDA tensor the copy to the host is still in
// flight and the writer thread waits for it (snapshot_to_host), and its digest is the device one
// (as in digest mode, so that replay compares like with like), queued before the snapshot.
TensorToWrite stored(const std::string& name, const at::Tensor& t, std::optional<Digest> d = std::nullopt) {
  std::function<Digest()> later;
  if (!d && t.is_cuda()) later = [p = digest_async(t)] { return p.get(); };
  HostSnapshot snap = snapshot_to_host(t);
  TensorToWrite w{name, std::move(snap.host), true, d};
  w.ready = std::move(snap.wait);
  w.digest_later = std::move(later);
  return w;
}

// Bytes that can be hashed or copied where they lie: a contiguous CPU tensor, not a lazy conjugate
// or negative view.
bool plain_host_bytes(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

// Digests of many tensors: plain host ones hashed on LibTorch's intra-op threads together (the
// state and the gradients are hundreds of tensors each step), the rest in device batches.
std::vector<PendingDigest> digest_all(const std::vector<NamedTensor>& tensors) {
  std::vector<PendingDigest> out(tensors.size());
  std::vector<char> done(tensors.size(), 0);
  parallel_for_by_size(
      tensors.size(),
      [&](std::size_t i) { return plain_host_bytes(tensors[i].tensor) ? tensors[i].tensor.nbytes() : 0; },
      [&](std::size_t i) {
        if (!plain_host_bytes(tensors[i].tensor)) return;
        out[i] = PendingDigest(digest(tensors[i].tensor));  // the no-dispatch path of digest()
        done[i] = 1;
      });
  // The rest (CUDA tensors, above all) batched: one launch per 128 tensors instead of one each.
  std::vector<std::size_t> rest;
  std::vector<at::Tensor> rest_tensors;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (done[i]) continue;
    rest.push_back(i);
    rest_tensors.push_back(tensors[i].tensor);
  }
  std::vector<PendingDigest> batched = digest_async_many(rest_tensors);
  for (std::size_t k = 0; k < rest.size(); ++k) out[rest[k]] = std::move(batched[k]);
  return out;
}

// Digest-only entries PREFIX + name for `tensors`.
std::vector<TensorToWrite> digest_entries(const std::string& prefix, const std::vector<NamedTensor>& tensors) {
  const std::vector<PendingDigest> digests = digest_all(tensors);
  std::vector<TensorToWrite> out;
  out.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    out.push_back(TensorToWrite::digest_only(prefix + tensors[i].name, tensors[i].tensor, digests[i]));
  }
  return out;
}

TensorToWrite entry(const std::string& name, const at::Tensor& t, bool full) {
  if (full) return stored(name, t);
  // CUDA: the digest kernel is queued and the writer thread collects the result; the training
  // thread does not synchronize with the device per tensor.
  return TensorToWrite::digest_only(name, t, digest_async(t));
}

// Host buffers for snapshots, reused once every tensor viewing them is gone: the flight ring
// copies the whole state every step, and fresh pages cost more than the copy. A buffer no request
// has taken for kIdleGets requests is freed: the state grows after the first step (the
// optimizer's moments), so the first snapshot's buffer fits no later one and would otherwise be
// held, idle, for the whole run (392 MB on GPT-2 small).
class BufferPool {
 public:
  static constexpr std::uint64_t kIdleGets = 16;

  std::shared_ptr<std::uint8_t[]> get(std::size_t bytes) {
    ++gets_;
    std::shared_ptr<std::uint8_t[]> found;
    for (Slot& s : slots_) {
      if (s.size >= bytes && s.buffer.use_count() == 1) {
        // The writer thread's last reads of this buffer happen before its release of the last
        // other reference; pair that with an acquire before we write into it.
        std::atomic_thread_fence(std::memory_order_acquire);
        s.last_get = gets_;
        found = s.buffer;
        break;
      }
    }
    slots_.erase(
        std::remove_if(slots_.begin(), slots_.end(),
                       [&](const Slot& s) { return s.buffer.use_count() == 1 && gets_ - s.last_get > kIdleGets; }),
        slots_.end());
    if (found) return found;
    slots_.push_back({std::shared_ptr<std::uint8_t[]>(new std::uint8_t[bytes > 0 ? bytes : 1]), bytes, gets_});
    if (slots_.size() > 16) slots_.erase(slots_.begin());  // bound what idle buffers hold
    return slots_.back().buffer;
  }

  // Host bytes the pool's buffers hold, in use or idle.
  std::uint64_t bytes() const {
    std::uint64_t total = 0;
    for (const Slot& s : slots_) total += s.size;
    return total;
  }

 private:
  struct Slot {
    std::shared_ptr<std::uint8_t[]> buffer;
    std::size_t size;
    std::uint64_t last_get;  // gets_ when it was last handed out
  };
  std::vector<Slot> slots_;
  std::uint64_t gets_ = 0;
};

// Host copies of many tensors in one buffer: a memcpy per contiguous CPU tensor instead of a
// dispatched clone() each. The copies keep the buffer alive. Planned first (offsets, the buffer,
// the tensors viewing it), then copied: at once (snapshot()), or later on another thread (the
// flight ring's overlapped copy), the views' bytes valid only once copy() has run.
struct PlannedSnapshot {
  std::vector<TensorToWrite> tensors;
  std::shared_ptr<std::uint8_t[]> buffer;
  // What copy() reads, one per plain host tensor: its bytes as planned, their storage held, so a
  // copy on another thread reads them even if the tensor is given other storage meanwhile.
  struct Source {
    const void* data;
    std::size_t bytes;
    std::size_t offset;  // in buffer
    c10::Storage storage;
  };
  std::vector<Source> sources;

  // `parallel`: on LibTorch's intra-op pool (memcpy only, no dispatch); else on this thread.
  void copy(bool parallel) const {
    const auto one = [&](std::size_t i) {
      const Source& src = sources[i];
      std::memcpy(buffer.get() + src.offset, src.data, src.bytes);
    };
    if (parallel) {
      parallel_for_by_size(
          sources.size(), [&](std::size_t i) { return sources[i].bytes; }, one);
    } else {
      for (std::size_t i = 0; i < sources.size(); ++i) one(i);
    }
  }
};

PlannedSnapshot plan_snapshot(const std::vector<NamedTensor>& tensors, const std::string& prefix, BufferPool& pool) {
  PlannedSnapshot s;
  std::vector<std::size_t> place(tensors.size(), SIZE_MAX);
  std::size_t total = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].tensor;
    if (!plain_host_bytes(t)) continue;
    place[i] = total;
    total += (t.nbytes() + 63) / 64 * 64;
  }
  s.buffer = pool.get(total);
  s.tensors.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].tensor;
    if (place[i] == SIZE_MAX) {  // a CUDA tensor (asynchronous copy), or a view
      s.tensors.push_back(stored(prefix + tensors[i].name, t));
      continue;
    }
    s.sources.push_back({t.const_data_ptr(), t.nbytes(), place[i], t.storage()});
    at::Tensor copy = at::from_blob(
        s.buffer.get() + place[i], t.sizes(), [keep = s.buffer](void*) {}, t.options().requires_grad(false));
    s.tensors.push_back({prefix + tensors[i].name, std::move(copy), true, std::nullopt});
  }
  return s;
}

std::vector<TensorToWrite> snapshot(const std::vector<NamedTensor>& tensors, const std::string& prefix,
                                    BufferPool& pool) {
  PlannedSnapshot s = plan_snapshot(tensors, prefix, pool);
  s.copy(/*parallel=*/true);
  return std::move(s.tensors);
}

// One thread that runs one job at a time (the flight ring's overlapped copy, RingCopy).
class Copier {
 public:
  Copier() : thread_([this] { loop(); }) {}
  ~Copier() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // After wait(): one job at a time.
  void start(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = std::move(job);
    busy_ = true;
    cv_.notify_all();
  }
  // Until the job started last has run and let go of what it held.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !busy_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (!busy_) return;  // stopping, nothing left
      std::function<void()> job = std::exchange(pending_, nullptr);
      lock.unlock();
      job();
      job = nullptr;  // its captures released before wait() returns
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> pending_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is built
};

std::size_t job_bytes(const std::vector<TensorToWrite>& tensors) {
  std::size_t n = 256;
  for (const TensorToWrite& t : tensors) {
    if (t.store_data) n += t.tensor.nbytes();
  }
  return n;
}

// --- background writer -----------------------------------------------------------------------

// The processes of this job on this host (torchrun's and `retrace record --ranks`'s LOCAL_WORLD_SIZE; 1
// when unset): data-parallel ranks started with cores / ranks intra-op threads each fill the
// cores together, though each one alone would leave some free.
int local_processes() {
  const char* text = std::getenv("LOCAL_WORLD_SIZE");
  if (text == nullptr || *text == '\0') return 1;
  int n = 0;
  const char* end = text + std::strlen(text);
  const auto [at, ec] = std::from_chars(text, end, n);
  if (ec != std::errc() || at != end || n < 1 || n > 65536) {
    throw Error(std::string("retrace::Recorder: LOCAL_WORLD_SIZE is '") + text +
                "', not a count of processes; set it to the number of this job's processes on this host (1 to "
                "65536), or unset it");
  }
  return n;
}

class BackgroundWriter {
 public:
  // `local_processes`: the processes of this job on this host (LOCAL_WORLD_SIZE). They share this
  // process's cores only when its affinity spans the machine: a rank pinned to cores of its own
  // (numactl, torchrun's binding) shares none.
  BackgroundWriter(std::unique_ptr<TraceWriter> writer, std::size_t cap, SmallRecords small, int local_processes)
      : writer_(std::move(writer)),
        cap_(cap),
        small_(small),
        cores_(usable_cores()),
        local_processes_(cores_ >= static_cast<int>(std::thread::hardware_concurrency()) ? local_processes : 1),
        thread_([this] { loop(); }) {}
  ~BackgroundWriter() { stop(); }

  void push(RecordType type, nlohmann::json meta, std::vector<TensorToWrite> tensors, RecorderStats& stats) {
    Job job{type, std::move(meta), std::move(tensors), 0, nullptr};
    job.bytes = job_bytes(job.tensors);
    std::unique_lock<std::mutex> lock(mutex_);
    if (stopping_) throw Error("retrace::Recorder: the trace is closed");
    rethrow_locked();
    // queued_ counts the job being written too: the bound is on bytes not yet written, and a
    // push waits whenever the writer is busy and the bound would be passed.
    if (queued_ + job.bytes > cap_ && queued_ > 0) {
      ++stats.backpressure_waits;
      const auto t0 = std::chrono::steady_clock::now();
      popped_.wait(lock, [&] { return queued_ == 0 || queued_ + job.bytes <= cap_ || error_; });
      stats.backpressure_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rethrow_locked();
    }
    ++stats.records;
    if (queue_.empty() && !in_hand_ && by_caller() && small(job)) {
      // The writer has nothing queued or in hand (so the order holds): write it here, now. A
      // failure is kept for later calls, as the writer thread keeps its own (error_ was clear).
      ++stats.records_by_caller;
      try {
        writer_->append(job.type, std::move(job.meta), std::move(job.tensors));
      } catch (...) {
        error_ = std::current_exception();
      }
      written_bytes_ = writer_->bytes_written();
      rethrow_locked();
      return;
    }
    queued_ += job.bytes;
    queue_.push_back(std::move(job));
    pushed_.notify_one();
  }

  // Waits until everything queued is written (and fsynced when sync).
  void flush(bool sync) {
    std::promise<void> done;
    auto future = done.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw Error("retrace::Recorder: the trace is closed");
      rethrow_locked();
      Job barrier{RecordType::kEvent, nullptr, {}, 0, &done};
      barrier.sync = sync;
      queue_.push_back(std::move(barrier));
      pushed_.notify_one();
    }
    future.get();
  }

  // Flushes, closes the trace (rename to the final name) and stops the thread.
  void close() {
    flush(false);
    std::lock_guard<std::mutex> lock(mutex_);
    rethrow_locked();  // never index a trace with a failed record in it
    writer_->close();
  }

  std::uint64_t bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return written_bytes_;
  }

  // Whether a thread besides LibTorch's intra-op threads (this job's processes' together) would
  // have a core of its own: the writer thread (SmallRecords::kAuto), the ring's copier (RingCopy::kAuto).
  bool core_to_spare() const { return static_cast<std::int64_t>(at::get_num_threads()) * local_processes_ < cores_; }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      pushed_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Job {
    RecordType type;
    nlohmann::json meta;
    std::vector<TensorToWrite> tensors;
    std::size_t bytes;
    std::promise<void>* done;
    bool sync = false;
  };

  void rethrow_locked() {
    if (error_) std::rethrow_exception(error_);
  }

  bool by_caller() const {
    if (small_ != SmallRecords::kAuto) return small_ == SmallRecords::kRecordingThread;
    return !core_to_spare();
  }

  // A small record (SmallRecords): nothing to wait for (no device copy or digest in flight) and
  // at most kSmallBytes of host bytes to compress or hash.
  static bool small(const Job& job) {
    std::size_t bytes = 0;
    for (const TensorToWrite& t : job.tensors) {
      if (t.ready || t.digest_later) return false;
      if (t.store_data || !t.digest) {
        if (!t.tensor.defined() || !t.tensor.is_cpu()) return false;
        bytes += t.tensor.nbytes();
      }
    }
    return bytes <= kSmallBytes;
  }
  static constexpr std::size_t kSmallBytes = 64 * 1024;

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        pushed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        job = std::move(queue_.front());
        queue_.pop_front();
        in_hand_ = true;
      }
      // A flush is answered after the bookkeeping below: whoever flushed finds the writer idle, so
      // its next small record can be written by the recording thread (SmallRecords).
      std::exception_ptr failed;
      try {
        if (job.done) {
          {
            std::lock_guard<std::mutex> lock(mutex_);
            failed = error_;  // an earlier record failed: the flush did not happen
          }
          if (!failed && job.sync) writer_->sync();
        } else if (!error_) {
          writer_->append(job.type, std::move(job.meta), std::move(job.tensors));
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        failed = error_;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        queued_ -= job.bytes;
        in_hand_ = false;
        written_bytes_ = writer_->bytes_written();
        popped_.notify_all();
      }
      if (job.done) {
        if (failed) {
          job.done->set_exception(failed);
        } else {
          job.done->set_value();
        }
      }
    }
  }

  std::unique_ptr<TraceWriter> writer_;
  std::size_t cap_;
  SmallRecords small_;
  int cores_;            // usable_cores() when the recorder was made
  int local_processes_;  // sharing those cores
  std::mutex mutex_;
  std::condition_variable pushed_, popped_;
  std::deque<Job> queue_;
  std::size_t queued_ = 0;
  bool in_hand_ = false;  // the writer thread is writing a job (or serving a flush)
  std::uint64_t written_bytes_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// --- signals ---------------------------------------------------------------------------------

// The handler only writes the signal number to a pipe; a watcher thread does the dump. No
// LibTorch, allocation or locking in signal context.
int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_signal_write_end{-1};  // lock-free on every platform we build for
extern "C" void on_signal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  const int fd = g_signal_write_end.load();
  if (fd >= 0) [[maybe_unused]]
    ssize_t n = ::write(fd, &b, 1);
}

}  // namespace

struct Recorder::Impl {
  std::string path;
  RecorderOptions options;
  std::unique_ptr<BackgroundWriter> writer;
  std::recursive_mutex mutex;  // public API; re-entered by dump_ring from end_step
  RecorderStats stats;
  bool closed = false;
  bool disabled = false;  // a write failed under OnWriteError::kContinue: recording stopped

  // Runs a call into the writer. Under kContinue a failure stops recording instead of training.
  template <class F>
  void io(F&& f) {
    if (disabled) return;
    if (options.on_write_error == OnWriteError::kStop) {
      f();
      return;
    }
    try {
      f();
    } catch (const Error& e) {
      disabled = true;
      stats.write_error = e.what();
      // Nothing will be written any more: let go of the snapshots held for it.
      ring.clear();
      after_backward.clear();
    }
  }

  std::int64_t step = -1;  // -1: between steps
  bool first_step = true;
  std::int64_t next_ordinal = 0;
  std::unordered_map<std::uint64_t, std::int64_t> ordinals;  // invocation -> ordinal in step
  std::vector<TensorToWrite> after_backward;                 // loss and grads of this step

  // One per step since the oldest snapshot kept: the steps between snapshots (ring_every > 1, a
  // lost snapshot) keep only their collectives, which replay from an earlier snapshot serves.
  struct RingEntry {
    std::int64_t step;
    bool snapshot;  // meta and tensors: the step_begin snapshot
    nlohmann::json meta;
    std::vector<TensorToWrite> tensors;
    // The step's collective records with stored results, written after its step_begin.
    std::vector<std::pair<nlohmann::json, std::vector<TensorToWrite>>> collectives;
  };
  std::deque<RingEntry> ring;
  std::optional<std::int64_t> ring_next;  // the first step that takes a snapshot (none: the next one)

  // Keeps K snapshots (K + 1 while the newest copy is unchecked: were it dropped, K remain) and
  // the steps after the oldest of them.
  void trim_ring() {
    const int keep = options.ring + (ring_in_flight ? 1 : 0);
    int snapshots = 0;
    for (const RingEntry& r : ring) snapshots += r.snapshot;
    for (; snapshots > keep; ring.pop_front()) snapshots -= ring.front().snapshot;
    while (!ring.empty() && !ring.front().snapshot) ring.pop_front();  // nothing before them to replay from
  }

  // The ring's overlapped copy (RingCopy::kOverlapped). A step's state tensors and the version
  // counters they had when begin_step took them: a tensor at the same version has not been
  // changed in place through ATen since.
  struct Versions {
    std::int64_t step = -1;
    std::vector<at::Tensor> tensors;
    std::vector<std::int64_t> versions;
    Versions(std::int64_t s, const std::vector<NamedTensor>& state) : step(s) {
      tensors.reserve(state.size());
      versions.reserve(state.size());
      for (const NamedTensor& n : state) {
        tensors.push_back(n.tensor);
        versions.push_back(n.tensor._version());
      }
    }
    bool unchanged() const {
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        if (tensors[i]._version() != versions[i]) return false;
      }
      return true;
    }
  };
  // kUnknown until a step copied in begin_step (ring_trial) reaches after_backward: kOn when its
  // forward and backward left the state alone, else kOff; kOff also after a lost snapshot.
  enum class Overlap { kUnknown, kOn, kOff } overlap = Overlap::kUnknown;
  std::optional<Versions> ring_trial;      // a step copied in begin_step, watched until after_backward
  std::optional<Versions> ring_in_flight;  // a step whose copy the copier runs or ran, not yet checked
  std::vector<std::int64_t> ring_lost;     // steps whose snapshot was dropped, for the next dump
  std::unique_ptr<Copier> copier;          // made on the first overlapped copy

  // Waits for an overlapped copy and checks it: a state tensor changed in place since begin_step
  // may have been copied half old, half new, so that step's snapshot is dropped, and copies happen
  // in begin_step from then on. Called from the training thread's recorder calls only (no op of
  // it in flight), before anything reads the ring or the optimizer could step.
  void settle_ring_copy() {
    if (!ring_in_flight) return;
    copier->wait();
    const std::int64_t step_copied = ring_in_flight->step;
    const bool unchanged = ring_in_flight->unchanged();
    ring_in_flight.reset();
    ++stats.ring_copies_overlapped;
    if (!unchanged) {
      // Its entry is the newest: nothing is pushed before this check (unless a write failure
      // cleared the ring). It keeps the step's collectives; the next step takes a snapshot.
      if (!ring.empty() && ring.back().step == step_copied) {
        RingEntry& r = ring.back();
        r.snapshot = false;
        r.meta = nullptr;
        r.tensors.clear();
      }
      ring_lost.push_back(step_copied);
      ++stats.ring_snapshots_lost;
      overlap = Overlap::kOff;
      ring_next.reset();
    }
    trim_ring();  // the one kept meanwhile, or the lost one's
  }

  BufferPool pool;
  // The state as end_step digested it (tensor, version counter): when begin_step of the next
  // step sees the same tensors unmodified, their digests are already in the trace.
  struct Seen {
    std::string name;
    at::Tensor tensor;     // held, so that its address cannot be reused by another tensor
    std::int64_t version;  // TensorBase::_version()
    PendingDigest digest;
  };
  std::vector<Seen> end_state;
  std::int64_t end_state_step = -1;
  std::thread signal_watcher;
  struct sigaction old_term {
  }, old_int{};

  bool full_now(std::int64_t s) const {
    return options.mode == RecordMode::kFull || first_step || options.write_ahead ||
           (options.every > 0 && s % options.every == 0);
  }
  bool store_values() const { return options.mode == RecordMode::kFull; }
  // A collective's result is what replay of one rank serves in place of its peers: stored
  // whenever replay may re-execute the step from the trace alone (full mode, write-ahead).
  bool store_collective_values() const { return options.mode == RecordMode::kFull || options.write_ahead; }

  RankInfo ranks;
  std::int64_t next_collective = 0;                 // the step's next collective's seq
  std::optional<CollectiveRecord> open_collective;  // before_collective ran, after_collective not yet
  std::vector<TensorToWrite> collective_inputs;

  // True when `state` holds the bits end_step digested: the same tensors at the same version
  // counters, or (for tensors a program makes afresh, like Adam's step count) equal digests.
  bool unchanged_since_end(const std::vector<NamedTensor>& state) const {
    if (end_state_step < 0 || end_state.size() != state.size()) return false;
    for (std::size_t i = 0; i < state.size(); ++i) {
      const at::Tensor& t = state[i].tensor;
      const Seen& seen = end_state[i];
      if (seen.name != state[i].name) return false;
      if (seen.tensor.is_same(t) && seen.version == t._version()) continue;
      if (digest(t) != seen.digest.get()) return false;
    }
    return true;
  }

  void segment(const SegmentEvent& e) {
    if (step < 0 || closed || disabled)
      return;  // outside a recorded step, after a signal closed the trace, or a write failed
    std::int64_t ordinal;
    if (e.phase == SegmentPhase::kForward) {
      ordinal = next_ordinal++;
      ordinals[e.invocation] = ordinal;
    } else {
      auto it = ordinals.find(e.invocation);
      ordinal = it == ordinals.end() ? -1 : it->second;
    }
    nlohmann::json meta = SegmentRecord{step, e.segment, e.phase, ordinal}.to_meta();
    std::vector<NamedTensor> named;
    for (std::size_t i = 0; i < e.inputs.size(); ++i) {
      const std::optional<std::string> name = tensor_names::segment_input(e.phase, i);
      if (name && e.inputs[i].defined()) named.push_back({*name, e.inputs[i]});
    }
    for (std::size_t i = 0; i < e.outputs.size(); ++i) {
      if (e.outputs[i].defined()) named.push_back({tensor_names::segment_output(e.phase, i), e.outputs[i]});
    }
    // Digest mode: the event's tensors digested together (on a GPU, one launch, copy and event
    // for the event instead of one each).
    std::vector<TensorToWrite> tensors;
    if (store_values()) {
      for (const NamedTensor& n : named) tensors.push_back(stored(n.name, n.tensor));
    } else {
      tensors = digest_entries("", named);
    }
    io([&] { writer->push(RecordType::kSegment, std::move(meta), std::move(tensors), stats); });
  }

  void dump_ring(const std::string& reason) {
    settle_ring_copy();
    if ((ring.empty() && ring_lost.empty()) || disabled) return;
    io([&] {
      RingDumpEvent dump{reason, {}, ring_lost};
      for (RingEntry& r : ring) {
        if (r.snapshot) {
          dump.steps.push_back(r.step);
          writer->push(RecordType::kStepBegin, r.meta, r.tensors, stats);
        }
        for (auto& [meta, tensors] : r.collectives) writer->push(RecordType::kCollective, meta, tensors, stats);
      }
      writer->push(RecordType::kEvent, dump.to_meta(), {}, stats);
      writer->flush(/*sync=*/true);
      ring.clear();
      ring_lost.clear();
      ring_next.reset();  // the ring starts again at the next step
      ++stats.ring_dumps;
    });
  }
};

namespace {
Recorder* g_signal_recorder = nullptr;
}

Recorder::Recorder(const std::string& path, const Program& program, RecorderOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->options = options;
  if (options.every < 0 || options.ring < 0)
    throw Error(
        "RecorderOptions::every and RecorderOptions::ring must not be negative (retrace record --every, --ring)");
  if (options.ring_every < 1) {
    throw Error("RecorderOptions::ring_every must be at least 1 (retrace record --ring-every), got " +
                std::to_string(options.ring_every));
  }
  TraceHeader header;
  header.environment = Environment::current();
  header.program = ProgramRef{program.name(), program.config()};
  header.recorder = RecorderSettings{options.mode == RecordMode::kFull ? "full" : "digest", options.every, options.ring,
                                     options.write_ahead, options.ring_every};
  impl_->ranks = program.ranks();
  if (impl_->ranks.distributed()) header.ranks = impl_->ranks;
  // Before the trace's file exists: a bad LOCAL_WORLD_SIZE leaves nothing behind.
  const int sharing = options.small_records == SmallRecords::kAuto ? local_processes() : 1;
  impl_->writer =
      std::make_unique<BackgroundWriter>(std::make_unique<TraceWriter>(path, header.to_meta(), options.writer),
                                         options.queue_bytes, options.small_records, sharing);
  if (options.ring > 0 && options.dump_on_signal && g_signal_recorder == nullptr && ::pipe(g_signal_pipe) == 0) {
    g_signal_recorder = this;
    g_signal_write_end.store(g_signal_pipe[1]);
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, &impl_->old_term);
    ::sigaction(SIGINT, &sa, &impl_->old_int);
    impl_->signal_watcher = std::thread([this] {
      unsigned char sig = 0;
      if (::read(g_signal_pipe[0], &sig, 1) != 1 || sig == 0) return;  // 0: shut down
      try {
        note_exception(std::string("signal ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT"));
      } catch (...) {
      }
      try {
        close();  // even when the dump failed: what was written stays readable
      } catch (...) {
      }
      ::signal(sig, SIG_DFL);
      ::raise(sig);
    });
  }
}

Recorder::~Recorder() {
  try {
    close();
  } catch (...) {
  }
}

const std::string& Recorder::path() const { return impl_->path; }

const RecorderOptions& Recorder::options() const { return impl_->options; }

void Recorder::note_state_check(StateCheckResult result) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->stats.state_check = std::move(result);
}

void Recorder::note_batch_drew_rng(std::int64_t step, const std::string& generators) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  if (impl_->stats.batch_drew_rng_step > 0) return;
  impl_->stats.batch_drew_rng_step = step;
  impl_->stats.batch_drew_rng = generators;
}

void Recorder::begin_step(std::int64_t step, const std::vector<NamedTensor>& state,
                          const std::vector<NamedTensor>& batch, double lr, double loss_scale) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (m.closed) throw Error("retrace::Recorder: begin_step after close");
  if (m.disabled) return;
  m.settle_ring_copy();  // a step that never reached end_step
  m.ring_trial.reset();
  m.step = step;
  m.next_ordinal = 0;
  m.next_collective = 0;
  m.open_collective.reset();
  m.ordinals.clear();
  m.after_backward.clear();
  // Full mode: a state bit for bit what the previous step_end stored (the same tensors at the same
  // version counters, or equal digests) is not stored again; the record points at that step_end,
  // and replay restores the state from there (docs/replay.md). Half of full mode's bytes a step.
  const bool full_now = m.full_now(step);
  const bool stored_at_end = full_now && m.store_values() && !m.first_step && m.end_state_step >= 0 &&
                             m.unchanged_since_end(state);
  const bool full = full_now && !stored_at_end;
  // The ring takes a snapshot this step (RecorderOptions::ring_every), else keeps the step's collectives.
  const bool ring = m.options.ring > 0 && (!m.ring_next || step >= *m.ring_next);
  StepBeginRecord record;
  record.step = step;
  record.lr = lr;
  record.loss_scale = loss_scale;
  record.full = full;
  const std::vector<std::uint8_t> rng = RngState::capture_all().serialize();
  at::Tensor rng_tensor = at::empty({static_cast<std::int64_t>(rng.size())}, at::kByte);
  std::memcpy(rng_tensor.data_ptr(), rng.data(), rng.size());

  std::vector<TensorToWrite> common{{std::string(tensor_names::kRng), rng_tensor, true, std::nullopt}};
  record.batch_kinds.emplace();  // what replay hands the program back
  for (const NamedTensor& b : batch) {
    common.push_back(entry(tensor_names::batch(b.name), b.tensor, true));
    if (b.kind != TensorKind::kOther) (*record.batch_kinds)[b.name] = b.kind;
  }
  std::vector<TensorToWrite> full_state;
  const bool may_overlap = ring && (m.options.ring_copy == RingCopy::kOverlapped ||
                                    (m.options.ring_copy == RingCopy::kAuto && m.writer->core_to_spare()));
  if (may_overlap && !full && m.overlap == Impl::Overlap::kOn) {
    // The ring's copy runs on the copier while forward and backward run; settle_ring_copy() checks it.
    PlannedSnapshot plan = plan_snapshot(state, std::string(tensor_names::kStatePrefix), m.pool);
    full_state = std::move(plan.tensors);  // the copy needs only the sources and the buffer
    m.ring_in_flight.emplace(step, state);
    if (!m.copier) m.copier = std::make_unique<Copier>();
    m.copier->start([plan = std::move(plan)] { plan.copy(/*parallel=*/false); });
  } else if (full || ring) {
    full_state = snapshot(state, std::string(tensor_names::kStatePrefix), m.pool);
    if (may_overlap && m.overlap == Impl::Overlap::kUnknown) m.ring_trial.emplace(step, state);
  }
  if (ring) {
    std::vector<TensorToWrite> snapshot = common;
    snapshot.insert(snapshot.end(), full_state.begin(), full_state.end());
    StepBeginRecord ring_record = record;
    ring_record.full = true;
    ring_record.ring = true;
    m.ring.push_back({step, true, ring_record.to_meta(), std::move(snapshot), {}});
    m.ring_next = step + m.options.ring_every;
    m.trim_ring();
  } else if (m.options.ring > 0 && !m.ring.empty()) {
    m.ring.push_back({step, false, nullptr, {}, {}});
  }
  std::vector<TensorToWrite> tensors = std::move(common);
  if (full) {
    tensors.insert(tensors.end(), full_state.begin(), full_state.end());
  } else if (stored_at_end) {
    record.state_as_step_end = m.end_state_step;  // that step_end stored these bits
  } else if (m.unchanged_since_end(state)) {
    record.state_as_step_end = m.end_state_step;  // same bits as that step_end's state digests
  } else {
    for (TensorToWrite& w : digest_entries(std::string(tensor_names::kStatePrefix), state))
      tensors.push_back(std::move(w));
  }
  m.io([&] {
    m.writer->push(RecordType::kStepBegin, record.to_meta(), std::move(tensors), m.stats);
    if (m.options.write_ahead) m.writer->flush(/*sync=*/true);
  });
  m.first_step = false;
}

void Recorder::on_forward(SegmentEvent& e) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->segment(e);
}

void Recorder::on_recompute(SegmentEvent& e) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->segment(e);
}

void Recorder::on_backward(SegmentEvent& e) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->segment(e);
}

void Recorder::after_backward(const at::Tensor& loss, const std::vector<NamedTensor>& grads) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  m.settle_ring_copy();
  if (m.ring_trial) {
    m.overlap = m.ring_trial->unchanged() ? Impl::Overlap::kOn : Impl::Overlap::kOff;
    m.ring_trial.reset();
  }
  if (m.step < 0 || m.closed || m.disabled) return;
  m.after_backward.push_back(entry(std::string(tensor_names::kLoss), loss, true));
  if (m.store_values()) {
    // One buffer and a memcpy per gradient on the intra-op threads, not a dispatched clone each.
    for (TensorToWrite& w : snapshot(grads, "", m.pool)) m.after_backward.push_back(std::move(w));
  } else {
    for (TensorToWrite& w : digest_entries("", grads)) m.after_backward.push_back(std::move(w));
  }
}

namespace {

// Non-finite elements and max |x| over the finite ones, across the floating tensors of `ts`. One
// pass over a contiguous CPU float or double tensor (a gradient bucket is the whole model's
// gradients, every step); other tensors through ATen.
//
// The pass reads each element's bits: with the sign cleared, a float's bits order as its magnitude
// does, and NaN and Inf are the magnitudes from the exponent's all-ones pattern up. Blocks of 4096
// elements, each a branch-free loop of a constant trip count, which GCC's -O2 vectorizes (16
// bytes at a time); the float loop that compared magnitudes with a branch had run one element at a
// time, twice a step over the bucket (bench/README.md).
template <class T, class Bits, Bits kInfBits>
void scan(const T* p, std::int64_t n, CollectiveRecord::Stats& s) {
  static_assert(sizeof(T) == sizeof(Bits));
  using AliasBits [[gnu::may_alias]] = Bits;  // T's bits read as Bits (GCC's and Clang's alias rule)
  const auto* bits = reinterpret_cast<const AliasBits*>(p);
  constexpr Bits kMagnitude = std::numeric_limits<Bits>::max() >> 1;
  constexpr std::int64_t kBlock = 4096;
  Bits top = 0;
  std::int64_t bad = 0;
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const AliasBits* block = bits + i;
    Bits block_top = 0, block_bad = 0;
    for (std::int64_t k = 0; k < kBlock; ++k) {
      const Bits m = block[k] & kMagnitude;
      const Bits nonfinite = m >= kInfBits;                        // 1 for NaN and Inf
      block_top = std::max<Bits>(block_top, m & (nonfinite - 1));  // 0 in their place
      block_bad += nonfinite;
    }
    top = std::max(top, block_top);
    bad += static_cast<std::int64_t>(block_bad);
  }
  for (; i < n; ++i) {
    const Bits m = bits[i] & kMagnitude;
    if (m < kInfBits) {
      top = std::max(top, m);
    } else {
      ++bad;
    }
  }
  T largest;
  std::memcpy(&largest, &top, sizeof largest);
  s.nonfinite += bad;
  s.abs_max = std::max(s.abs_max, static_cast<double>(largest));
}

CollectiveRecord::Stats collective_stats(const std::vector<at::Tensor>& ts) {
  CollectiveRecord::Stats s;
  for (const at::Tensor& t : ts) {
    if (!t.defined() || !t.is_floating_point() || t.numel() == 0) continue;
    if (plain_host_bytes(t) && t.scalar_type() == at::kFloat) {
      scan<float, std::uint32_t, 0x7f800000u>(t.const_data_ptr<float>(), t.numel(), s);
      continue;
    }
    if (plain_host_bytes(t) && t.scalar_type() == at::kDouble) {
      scan<double, std::uint64_t, 0x7ff0000000000000ull>(t.const_data_ptr<double>(), t.numel(), s);
      continue;
    }
    const at::Tensor finite = at::isfinite(t);
    const std::int64_t bad = t.numel() - finite.sum().item<std::int64_t>();
    s.nonfinite += bad;
    const at::Tensor a = bad == 0 ? t.abs() : at::where(finite, t.abs(), at::zeros({}, t.options()));
    s.abs_max = std::max(s.abs_max, a.max().item<double>());
  }
  return s;
}

}  // namespace

void Recorder::before_collective(const CollectiveCall& call, const std::vector<at::Tensor>& contribution) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (m.step < 0 || m.closed || m.disabled) return;  // outside a recorded step
  CollectiveRecord rec;
  rec.step = m.step;
  rec.seq = m.next_collective++;
  rec.call = call;
  rec.rank = m.ranks.rank;
  rec.input = collective_stats(contribution);
  m.collective_inputs.clear();
  for (std::size_t i = 0; i < contribution.size(); ++i)
    m.collective_inputs.push_back(entry(tensor_names::collective_input(i), contribution[i], false));
  m.open_collective = std::move(rec);
}

void Recorder::after_collective(const CollectiveCall& call, const std::vector<at::Tensor>& result) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (!m.open_collective || m.step < 0 || m.closed || m.disabled) return;
  CollectiveRecord rec = std::move(*m.open_collective);
  m.open_collective.reset();
  rec.output = collective_stats(result);
  const bool values = m.store_collective_values();
  rec.values = values;
  std::vector<TensorToWrite> tensors = std::move(m.collective_inputs);
  m.collective_inputs.clear();
  const std::size_t inputs = tensors.size();
  for (std::size_t i = 0; i < result.size(); ++i)
    tensors.push_back(entry(tensor_names::collective_output(i), result[i], values));
  if (m.options.ring > 0 && !m.ring.empty() && m.ring.back().step == m.step) {
    CollectiveRecord ring_rec = rec;
    ring_rec.values = true;
    ring_rec.ring = true;
    std::vector<TensorToWrite> ring_tensors(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(inputs));
    for (std::size_t i = 0; i < result.size(); ++i) {
      if (values) ring_tensors.push_back(tensors[inputs + i]);  // the same stored copy
      else ring_tensors.push_back(stored(tensor_names::collective_output(i), result[i]));
    }
    m.ring.back().collectives.emplace_back(ring_rec.to_meta(), std::move(ring_tensors));
  }
  m.io([&] { m.writer->push(RecordType::kCollective, rec.to_meta(), std::move(tensors), m.stats); });
}

void Recorder::end_step(std::int64_t step, const StepOutcome& outcome, const std::vector<NamedTensor>& state_after) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (m.closed) throw Error("retrace::Recorder: end_step after close");
  m.settle_ring_copy();  // no after_backward this step: checked here (the optimizer's writes drop it)
  m.ring_trial.reset();  // learnt only at after_backward, before the optimizer
  if (m.disabled) {
    ++m.stats.steps;
    return;
  }
  StepEndRecord record;
  record.step = step;
  record.loss = outcome.loss;
  record.grad_norm = outcome.grad_norm;
  record.loss_scale = outcome.loss_scale;
  record.lr = outcome.lr;
  record.skipped = outcome.skipped;
  record.finite = outcome.finite();
  record.skip_reason = outcome.skip_reason;
  record.rolled_back = outcome.rolled_back;
  record.rolled_back_to = outcome.rolled_back_to;
  record.injected = outcome.injected;  // tagged: not a real fault
  std::vector<TensorToWrite> tensors = std::move(m.after_backward);
  m.after_backward.clear();
  // Reused entry by entry: the names are the same every step, and assigning an equal name
  // allocates nothing. Not valid until every entry is this step's (a throw leaves it invalid).
  m.end_state_step = -1;
  m.end_state.resize(state_after.size());
  const std::vector<PendingDigest> digests = digest_all(state_after);
  tensors.reserve(tensors.size() + state_after.size());
  // Full mode stores the state: copied as begin_step copies it (one buffer, a memcpy per tensor).
  std::vector<TensorToWrite> copies;
  if (m.store_values()) copies = snapshot(state_after, std::string(tensor_names::kStatePrefix), m.pool);
  for (std::size_t i = 0; i < state_after.size(); ++i) {
    const NamedTensor& s = state_after[i];
    const PendingDigest& d = digests[i];
    if (m.store_values()) {
      TensorToWrite w = std::move(copies[i]);
      w.digest_later = [d] { return d.get(); };
      tensors.push_back(std::move(w));
    } else {
      tensors.push_back(TensorToWrite::digest_only(tensor_names::state(s.name), s.tensor, d));
    }
    Impl::Seen& seen = m.end_state[i];
    if (seen.name != s.name) seen.name = s.name;
    seen.tensor = s.tensor;
    seen.version = s.tensor._version();
    seen.digest = d;
  }
  m.end_state_step = step;
  m.io([&] { m.writer->push(RecordType::kStepEnd, record.to_meta(), std::move(tensors), m.stats); });
  ++m.stats.steps;
  m.step = -1;
  if (!outcome.finite()) {
    m.dump_ring(std::string("non-finite ") + (std::isfinite(outcome.loss) ? "gradient norm" : "loss") + " at step " +
                std::to_string(step));
  }
}

void Recorder::flush(bool sync) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (!m.closed) m.io([&] { m.writer->flush(sync); });
}

void Recorder::dump_ring(const std::string& reason) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  if (!impl_->closed) impl_->dump_ring(reason);
}

void Recorder::note_exception(const std::string& what, bool raised_by_step) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  Impl& m = *impl_;
  if (m.closed || m.disabled) return;
  ExceptionEvent event{m.step, what, raised_by_step && m.step >= 0};
  if (m.open_collective) event.collective = m.open_collective->seq;  // it left a collective (a peer gone)
  m.io([&] { m.writer->push(RecordType::kEvent, event.to_meta(), {}, m.stats); });
  m.dump_ring("exception: " + what);
  m.io([&] { m.writer->flush(/*sync=*/true); });
}

void Recorder::close() {
  std::thread watcher;
  int read_end = -1;
  {
    std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
    Impl& m = *impl_;
    if (m.closed) return;
    m.settle_ring_copy();
    m.closed = true;
    if (g_signal_recorder == this) {
      ::sigaction(SIGTERM, &m.old_term, nullptr);
      ::sigaction(SIGINT, &m.old_int, nullptr);
      const int write_end = g_signal_write_end.exchange(-1);  // a late handler writes nowhere
      const unsigned char zero = 0;
      [[maybe_unused]] ssize_t n = ::write(write_end, &zero, 1);  // wakes the watcher to leave
      ::close(write_end);
      read_end = g_signal_pipe[0];
      watcher = std::move(m.signal_watcher);
      g_signal_recorder = nullptr;
    }
    try {
      m.io([&] { m.writer->close(); });  // after a failed write under kContinue: stays .incomplete
    } catch (...) {
      m.stats.bytes = m.writer->bytes();
      m.writer->stop();
      throw;
    }
    m.stats.bytes = m.writer->bytes();
    m.writer->stop();
  }
  // Join outside the lock: a watcher that caught a signal may be waiting for it (it then finds
  // the trace closed, and re-raises the signal).
  if (watcher.joinable()) {
    if (watcher.get_id() == std::this_thread::get_id()) {
      watcher.detach();
    } else {
      watcher.join();
    }
  }
  if (read_end >= 0) ::close(read_end);
}

RecorderStats Recorder::stats() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  RecorderStats s = impl_->stats;
  if (!impl_->closed) s.bytes = impl_->writer->bytes();
  s.snapshot_buffer_bytes = impl_->pool.bytes();
  return s;
}

namespace {
std::atomic<std::int64_t> g_crash_after_step_begin{0};
}  // namespace

void internal::set_crash_after_step_begin(std::int64_t step) { g_crash_after_step_begin.store(step > 0 ? step : 0); }

std::vector<StepOutcome> record_run(Program& program, Recorder& recorder, std::int64_t steps, bool stop_on_nonfinite,
                                    const std::function<void(std::int64_t, const StepOutcome&)>& after_step) {
  std::vector<StepOutcome> outcomes;
  ObserverScope scope(recorder);
  CollectiveObserverScope collectives(recorder);
  const std::int64_t kill_at = g_crash_after_step_begin.load();  // crash_point.h; 0: off
  const bool distributed = program.ranks().distributed();
  const bool check_state = recorder.options().state_check && !distributed;
  for (std::int64_t s = 1; s <= steps; ++s) {
    bool in_step = false;  // the exception, if any, left Program::step (not the loader or the recorder)
    try {
      const RngState before_batch = RngState::capture_all();
      const std::vector<NamedTensor> batch = program.batch(s);
      if (const std::string drew = generators_differing(RngState::capture_all(), before_batch, "before it");
          !drew.empty())
        recorder.note_batch_drew_rng(s, drew);
      // Before begin_step: the copy's step runs between the recorder's steps (it ignores its
      // segment events), and the RNG state begin_step captures is the one the check restored.
      std::optional<StateCheck> state_check;
      if (check_state && s == kStateCheckStep) state_check.emplace(program, s, batch);
      recorder.begin_step(s, program.state(), batch, program.lr(), program.loss_scale());
      if (kill_at > 0 && s == kill_at) ::raise(SIGKILL);
      in_step = true;
      const StepOutcome outcome = program.step(s, batch, &recorder);
      in_step = false;
      recorder.end_step(s, outcome, program.state());
      outcomes.push_back(outcome);
      if (state_check) {
        StateCheckResult result = state_check->finish(outcome, program.state());
        recorder.note_state_check(result);
        if (result.status == StateCheckResult::Status::kFailed) throw StateCheckError(std::move(result));
      }
      if (after_step) after_step(s, outcome);
      if (!outcome.finite() && !outcome.skipped && stop_on_nonfinite) break;  // a skipped one was handled
    } catch (const std::exception& e) {
      try {
        recorder.note_exception(exception_message(e), in_step);
        recorder.close();
      } catch (...) {
        // The step's exception is the one to report; a failing trace write must not replace it.
      }
      throw;
    }
  }
  if (recorder.options().state_check && recorder.stats().state_check.status == StateCheckResult::Status::kNotRun) {
    StateCheckResult skipped;
    skipped.status = StateCheckResult::Status::kSkipped;
    skipped.step = kStateCheckStep;
    skipped.message = distributed
                          ? "state round-trip self-check skipped: a data-parallel rank cannot run a copy's step (its "
                            "collectives would have no peers); replay each rank's trace instead (retrace replay)"
                          : "state round-trip self-check skipped: the run ended before step " +
                                std::to_string(kStateCheckStep) +
                                ", the first step whose start state is not the one the program's constructor made";
    recorder.note_state_check(std::move(skipped));
  }
  return outcomes;
}

}  // namespace retrace
