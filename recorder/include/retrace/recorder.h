#pragma once
// The recorder: writes a trace of a training run. It is a SegmentObserver (segment records come
// from checkpointed segments) and a StepMonitor (grads after backward), driven per step by
// begin_step()/end_step().
//
// Modes: digest (hashes only; the always-on default), full (tensors), or digest with a full
// snapshot every k steps. The first step's state is always written in full, so any trace replays
// from its start. The flight ring keeps the last K step-begin snapshots in memory and writes them
// when a non-finite loss or gradient is seen, when an exception leaves a step, or on
// SIGTERM/SIGINT. Write-ahead puts each step-begin snapshot on disk (fsync) before the step runs,
// for crashes that leave no chance to dump (SIGSEGV, SIGKILL).
//
// Records are compressed and written by a background thread behind a bounded queue; a full
// queue blocks the training thread (backpressure), never drops a record. Small records (a
// digest-mode segment, step_begin or step_end) may instead be written by the recording thread
// itself, in the same order (SmallRecords).

#include <retrace/collectives.h>
#include <retrace/observer.h>
#include <retrace/program.h>
#include <retrace/state_check.h>
#include <retrace/trace.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace retrace {

enum class RecordMode { kDigest, kFull };
// "digest" | "full"; throws retrace::Error otherwise.
RecordMode parse_record_mode(const std::string& text);

// What a failing trace write (EIO, ENOSPC, ...) does to training.
//   kStop:     the error is thrown from the recorder call that finds it: training stops there.
//   kContinue: recording stops and training goes on; stats().write_error says what failed. The
//              trace stays PATH.incomplete, readable up to its last complete record.
// Either way, failing to create the trace (its file and header) throws from the constructor.
enum class OnWriteError { kStop, kContinue };

// Where a small record is written: one with nothing on a device to wait for and at most 64 KiB
// of host bytes to hash or compress (on the CPU, every record of digest mode after the first step
// but its full snapshots: `every`, write-ahead, ring dumps). Larger records always go to the writer thread, and the trace's order is the calls' order
// either way: a small record is written by the recording thread only when the writer has
// nothing queued and nothing in hand.
//   kAuto:            by the recording thread when the writer thread would have no core of its
//                     own: LibTorch's intra-op threads (at::get_num_threads()) times this job's
//                     processes on the host (LOCAL_WORLD_SIZE, set by torchrun and by `retrace
//                     record --ranks`; 1 when unset, or when this process's affinity does not
//                     span the machine) reach the cores this process may run on (usable_cores()).
//                     Else by the writer thread. With no core to spare, waking
//                     the writer for a few KiB cost the step more than writing them: it preempts
//                     an intra-op thread mid-op (bench/README.md). A LOCAL_WORLD_SIZE that is not
//                     a count makes the Recorder constructor throw.
//   kWriterThread:    always by the writer thread.
//   kRecordingThread: by the recording thread whenever the writer is idle.
enum class SmallRecords { kAuto, kWriterThread, kRecordingThread };

// Where the flight ring copies the state a step begins with (digest mode; full mode stores it anyway).
//   kOverlapped: on a thread of the recorder's own while forward and backward run, once a step has
//                shown that they leave the state alone: begin_step notes each state tensor's
//                version counter, and after_backward finds them unchanged. From then on, every
//                overlapped copy is checked the same way when after_backward (or end_step, or a
//                dump) waits for it; a copy of a tensor changed meanwhile may be torn, so that
//                step's snapshot is dropped (RecorderStats::ring_snapshots_lost, the dump's
//                `lost`) and the ring copies in begin_step from then on. A program that writes
//                its state's memory outside ATen (no version bump) during a step must use
//                kAtBeginStep.
//   kAtBeginStep: in begin_step, on the training thread (LibTorch's intra-op threads).
//   kAuto:        kOverlapped when the copier would have a core of its own (the rule of
//                 SmallRecords::kAuto: intra-op threads times this job's processes on the host
//                 below the usable cores), else kAtBeginStep. With no core to spare the copier
//                 preempts an intra-op thread and the step gets slower, not faster (bench/README.md).
enum class RingCopy { kAuto, kOverlapped, kAtBeginStep };
// "auto" | "overlapped" | "at-begin-step" (retrace record --ring-copy); throws retrace::Error otherwise.
RingCopy parse_ring_copy(const std::string& text);

struct RecorderOptions {
  RecordMode mode = RecordMode::kDigest;
  int every = 0;  // digest mode: also a full step-begin snapshot every k steps (0: never)
  int ring = 0;   // flight ring size K (0: off)
  // The ring's snapshots are taken every `ring_every` steps (the first step recorded, then each
  // step at least this many after the last one taken; 1: every step), so K of them span K x
  // ring_every steps and a step costs 1/ring_every of a copy. A dump holds the K snapshots and,
  // in a data-parallel run, the stored collective results of every step since the oldest: replay
  // re-executes from the newest snapshot at or before the step asked for, up to ring_every - 1
  // steps more (their batches and RNG are in every step_begin record). After a lost snapshot
  // (RingCopy::kOverlapped) the next step takes one.
  int ring_every = 1;
  bool write_ahead = false;
  std::size_t queue_bytes = std::size_t{256} << 20;  // bound on bytes queued for, or being written by, the writer
  bool dump_on_signal = true;                        // with ring > 0: dump on SIGTERM/SIGINT, then die by the signal
  OnWriteError on_write_error = OnWriteError::kStop;
  SmallRecords small_records = SmallRecords::kAuto;
  RingCopy ring_copy = RingCopy::kAuto;
  // record_run's state round-trip self-check (state_check.h): once, at step kStateCheckStep, a
  // copy of the program rebuilt by name and config from the step's start state() must end the
  // step bitwise as the live program does; else record_run throws StateCheckError after that
  // step's records. Costs one program construction and one extra step, once; the recorded run
  // (its RNG stream, the trace) is bitwise the same with the check on or off.
  bool state_check = true;
  WriterOptions writer;
};

struct RecorderStats {
  std::int64_t steps = 0;
  std::int64_t records = 0;
  std::int64_t records_by_caller = 0;   // of those, written by the recording thread (SmallRecords)
  std::int64_t backpressure_waits = 0;  // times the training thread waited for the writer
  double backpressure_seconds = 0;
  std::int64_t ring_dumps = 0;
  std::int64_t ring_copies_overlapped = 0;  // ring snapshots copied while forward and backward ran (RingCopy)
  std::int64_t ring_snapshots_lost = 0;     // of those, dropped: the state changed in place meanwhile
  std::uint64_t bytes = 0;                  // written to the trace so far
  // Host memory the recorder's snapshot buffers hold (the flight ring's copies, full mode's
  // gradients and state on their way to the writer), in use or kept for reuse.
  std::uint64_t snapshot_buffer_bytes = 0;
  std::string write_error;       // OnWriteError::kContinue: why recording stopped
  StateCheckResult state_check;  // what record_run's state self-check found (kNotRun: off)
  // The first step whose Program::batch() moved a global generator (0: none), and which, in words:
  // against Program's contract (a batch deterministic in (config, step)); record_run notes it.
  std::int64_t batch_drew_rng_step = 0;
  std::string batch_drew_rng;
};

// Data-parallel runs (retrace/dist.h): the recorder is also a CollectiveObserver. Each rank's trace
// holds every collective of its steps as a collective record: the key (step, sequence number, op,
// dtypes and shapes), its contribution's digest, non-finite count and max |x|, and the result --
// stored in full mode and with write-ahead (what replay of the rank alone serves back), a digest
// otherwise; the flight ring keeps stored copies of its steps' results and dumps them with the
// ring. The header names the rank, the world size and the run id.
class Recorder : public SegmentObserver, public StepMonitor, public CollectiveObserver {
 public:
  // Creates PATH.incomplete and writes the header (environment, program name and config).
  Recorder(const std::string& path, const Program& program, RecorderOptions options = {});
  // Closes the trace (flush, index, rename) unless close() ran; never throws.
  ~Recorder() override;

  // Before step `step` runs: its state, batch, LR and loss scale; RNG is captured here.
  void begin_step(std::int64_t step, const std::vector<NamedTensor>& state, const std::vector<NamedTensor>& batch,
                  double lr, double loss_scale);
  // After the step: outcome and the state after the optimizer. Dumps the ring on a non-finite
  // loss or gradient norm.
  void end_step(std::int64_t step, const StepOutcome& outcome, const std::vector<NamedTensor>& state_after);

  void on_forward(SegmentEvent& event) override;
  void on_recompute(SegmentEvent& event) override;
  void on_backward(SegmentEvent& event) override;
  void after_backward(const at::Tensor& loss, const std::vector<NamedTensor>& grads) override;
  void before_collective(const CollectiveCall& call, const std::vector<at::Tensor>& contribution) override;
  void after_collective(const CollectiveCall& call, const std::vector<at::Tensor>& result) override;

  // Waits until every record so far is written (and fsynced when sync).
  void flush(bool sync = false);
  // Writes the ring's snapshots now (reason goes in an event record) and syncs the file.
  void dump_ring(const std::string& reason);
  // An exception left the step: note it (an `exception` event, ExceptionEvent) and dump the
  // ring. raised_by_step: it left Program::step itself, and replay expects the step to raise it
  // again (record_run says so; a signal or a failing trace write does not).
  void note_exception(const std::string& what, bool raised_by_step = false);
  // Flushes everything, writes the index and renames PATH.incomplete to PATH. Idempotent.
  void close();

  // Keeps the state self-check's result for stats() (record_run calls it).
  void note_state_check(StateCheckResult result);
  // Keeps the first step whose Program::batch() drew from a global generator (record_run calls it).
  void note_batch_drew_rng(std::int64_t step, const std::string& generators);

  RecorderStats stats() const;
  const RecorderOptions& options() const;
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs `steps` steps of `program` (1..steps), recording them; the building block of
// `retrace record`. Stops early, after dumping the ring, at the first non-finite step when
// stop_on_nonfinite -- unless a defense skipped that step (it was handled; the run goes on). Returns the outcomes. An exception from a step is noted in the trace, the
// ring dumped, the trace closed and the exception rethrown.
// With options().state_check, step kStateCheckStep is also run on a restored copy (StateCheck);
// a failing check throws StateCheckError after the step's end record (noted in the trace like
// any exception; the trace is closed), and a check that could not run (an unregistered program,
// a run shorter than kStateCheckStep) is a kSkipped result in stats().state_check.
// A data-parallel program (Program::ranks()) has its collectives recorded too (the recorder is
// attached as the CollectiveObserver for the run), and skips the state check: the copy's step
// would run collectives its peers never join.
// `after_step`, when set, is called after each step's end record (and the check).
std::vector<StepOutcome> record_run(Program& program, Recorder& recorder, std::int64_t steps,
                                    bool stop_on_nonfinite = true,
                                    const std::function<void(std::int64_t, const StepOutcome&)>& after_step = {});

}  // namespace retrace
