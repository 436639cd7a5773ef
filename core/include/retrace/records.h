#pragma once
// The trace schema: what each record's metadata holds and what its tensors are named, as types
// with one encoder (to_meta) and one validating decoder (decode) each. The recorder writes through
// these types and every reader (replay, reports, diagnose, inspect) reads through them, so a key
// or a tensor name lives here once instead of as matching string literals on both sides
// (leveldb's log_format.h is the model). docs/trace-format.md is the human-readable spec.
//
// Decoders trust nothing: a field of the wrong type, a negative step, an unknown phase or kind is
// a TraceError (kMalformed) naming the trace and the record's byte offset. A field that older
// traces lack (golden v1 and v2) reads as the default the field documents.

#include <retrace/collectives.h>
#include <retrace/environment.h>
#include <retrace/observer.h>
#include <retrace/program.h>
#include <retrace/trace.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace retrace {

// --- tensor names ------------------------------------------------------------------------------
// The names the recorder gives a record's tensors and the replayer looks up.
namespace tensor_names {

inline constexpr std::string_view kRng = "rng";    // step_begin: the serialized RngState
inline constexpr std::string_view kLoss = "loss";  // step_end: the loss as backward saw it
inline constexpr std::string_view kStatePrefix = "state.";
inline constexpr std::string_view kBatchPrefix = "batch.";

// step_begin and step_end: a state() tensor; step_begin: a batch tensor.
std::string state(std::string_view name);  // "state." + name
std::string batch(std::string_view name);  // "batch." + name
// The program's name of a "state."/"batch." entry; nullopt for another entry.
std::optional<std::string_view> state_name(std::string_view entry);
std::optional<std::string_view> batch_name(std::string_view entry);

// A segment record's tensors, by phase: forward input.I / output.I; recompute output.I (its
// inputs are the forward's); backward grad_output.I (in) / grad_input.I (out).
std::optional<std::string> segment_input(SegmentPhase phase, std::size_t i);  // nullopt: recompute
std::string segment_output(SegmentPhase phase, std::size_t i);

}  // namespace tensor_names

// --- records -----------------------------------------------------------------------------------

// The phase's name in a segment record ("forward", "recompute", "backward"); nullopt for another.
std::optional<SegmentPhase> segment_phase_from_string(std::string_view name);

// How the recorder was set up (the header's `recorder`).
struct RecorderSettings {
  std::string mode = "digest";  // "digest" or "full"
  std::int64_t every = 0;       // a full snapshot every N steps (0: only the first)
  std::int64_t ring = 0;        // flight-ring depth
  bool write_ahead = false;
  std::int64_t ring_every = 1;  // the ring's snapshots are this many steps apart (absent: 1)
};

// The program that made the trace (the header's `program`): replay rebuilds it by name.
struct ProgramRef {
  std::string name;
  std::string config;  // the program's own config text, handed back to its factory
};

// The header record. format_version and writer are set by TraceWriter (to_meta leaves them out).
struct TraceHeader {
  std::uint32_t format_version = 0;
  std::string writer;  // "retrace X.Y.Z"
  Environment environment;
  std::optional<ProgramRef> program;  // absent in traces not made by a Recorder
  std::optional<RecorderSettings> recorder;
  // The rank of a data-parallel run that wrote this trace (every rank writes its own); absent in
  // a single-process trace.
  std::optional<RankInfo> ranks;

  nlohmann::json to_meta() const;
  // `source` names the trace in errors.
  static TraceHeader decode(const nlohmann::json& meta, const std::string& source);
  static TraceHeader decode(const TraceReader& trace) { return decode(trace.header(), trace.path()); }
  // The program, or a retrace::Error saying that the trace names none.
  const ProgramRef& require_program(const std::string& source) const;
};

struct StepBeginRecord {
  std::int64_t step = 0;
  double lr = 0;
  double loss_scale = 1;
  bool full = false;  // the state is stored, not only digested: replay can start here
  bool ring = false;  // written by a flight-ring dump (later in the file than the step)
  // The kind the program gave each batch tensor it marked; nullopt in traces written before kinds
  // existed (replay then takes `input` and `target` as the built-in program's).
  std::optional<std::map<std::string, TensorKind>> batch_kinds;
  // The step whose step_end state digests this state equals; the record then holds no state.*.
  std::optional<std::int64_t> state_as_step_end;

  nlohmann::json to_meta() const;
  static StepBeginRecord decode(const Record& record, const std::string& source);  // also checks the type
  static StepBeginRecord decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source);
};

struct SegmentRecord {
  std::int64_t step = 0;
  std::string segment;
  SegmentPhase phase = SegmentPhase::kForward;
  std::int64_t ordinal = -1;  // the forward's position in the step; -1: its forward was not seen

  nlohmann::json to_meta() const;
  static SegmentRecord decode(const Record& record, const std::string& source);  // also checks the type
  static SegmentRecord decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source);
};

struct StepEndRecord {
  std::int64_t step = 0;
  double loss = 0, grad_norm = 0, loss_scale = 1, lr = 0;  // any of them may be non-finite
  // grad_norm is NaN where the record holds none (the golden v1/v2 traces' synthetic records).
  bool skipped = false;
  bool finite = true;       // loss and gradient norm finite (as recorded; derived where absent)
  std::string skip_reason;  // empty: not skipped, or no reason given
  bool rolled_back = false;
  std::int64_t rolled_back_to = -1;   // the step whose start a rollback restored (rolled_back)
  std::vector<std::string> injected;  // one line per injected fault that fired: never a real one

  nlohmann::json to_meta() const;
  static StepEndRecord decode(const Record& record, const std::string& source);  // also checks the type
  static StepEndRecord decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source);
};

// The most ranks a trace may name (a bound for the decoders, not for training).
inline constexpr std::int64_t kMaxWorldSize = 1 << 16;

// One collective of a data-parallel step as this rank saw it (format version 3+). Its tensors:
// input.I -- this rank's contribution, digest only -- and output.I -- the result, stored when
// `values` (full mode, write-ahead, a flight-ring dump), else a digest. The key of a collective
// is (step, seq, op, reduce, root, and each tensor's dtype and shape); replay of one rank alone
// serves output.I back to the program in place of its peers.
struct CollectiveRecord {
  struct Stats {
    std::int64_t nonfinite = 0;  // NaN and Inf elements over the floating tensors
    double abs_max = 0;          // max |x| over their finite elements (0 when none)
  };
  std::int64_t step = 0;
  std::int64_t seq = 0;  // its position among the step's collectives, from 0
  CollectiveCall call;
  int rank = 0;  // the rank that recorded it
  Stats input, output;
  bool values = false;  // output.I hold the values (replay can serve them)
  bool ring = false;    // written by a flight-ring dump (a copy with values of an earlier record)

  // "step 3 collective #1 allreduce(avg)"
  std::string key() const;
  nlohmann::json to_meta() const;
  static CollectiveRecord decode(const Record& record, const std::string& source);  // also checks the type
  static CollectiveRecord decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source);
};

namespace tensor_names {
// A collective record's tensors: input.I (this rank's contribution), output.I (the result).
std::string collective_input(std::size_t i);
std::string collective_output(std::size_t i);
}  // namespace tensor_names

// An `exception` event record (docs/trace-format.md): an exception left a recorded step, or a
// signal ended the run. Written by the recorder; read by the replayer and `retrace inspect`.
struct ExceptionEvent {
  std::int64_t step = -1;  // the step that was running; -1 between steps
  std::string what;        // exception_message() of the exception, or "signal SIGTERM"
  // True when the exception left Program::step itself: replay then expects the step to raise the
  // same message. False for anything else (the data loader, a trace write, a signal) and in
  // traces written before the field existed; replay does not hold a step to those.
  bool raised_by_step = false;
  // A data-parallel rank: the collective (its seq in the step) the exception left, when one was
  // running (a peer that died: the collective timed out); -1 otherwise, and in older traces.
  std::int64_t collective = -1;
  nlohmann::json to_meta() const;
};

// An exception's message as the trace records it and replay compares it: what(), or for a
// c10::Error what_without_backtrace() (its backtrace holds addresses that differ between runs).
std::string exception_message(const std::exception& e);

// A flight-ring dump: the ring's step_begin snapshots were written just before this event.
struct RingDumpEvent {
  std::string reason;
  std::vector<std::int64_t> steps;
  // Steps whose snapshot the ring dropped: the state changed in place while it was being copied
  // (RingCopy::kOverlapped). Written only when there are some.
  std::vector<std::int64_t> lost;
  nlohmann::json to_meta() const;
};

// An event record. `kind` says which of the typed events it is; an event of a kind this build
// does not know (a newer writer's) is kOther and keeps its name.
struct EventRecord {
  enum class Kind { kException, kRingDump, kOther };
  Kind kind = Kind::kOther;
  std::string name;                         // the `event` field
  std::optional<ExceptionEvent> exception;  // kException
  std::optional<RingDumpEvent> ring_dump;   // kRingDump

  static EventRecord decode(const Record& record, const std::string& source);  // also checks the type
  static EventRecord decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source);
};

// Decodes `meta` with the typed decoder of `type` (header, step_begin, segment, step_end, event, collective;
// the index is the reader's own), throwing its TraceError. TraceWriter calls it before writing a
// record, TraceReader when it opens a trace: what one refuses the other never writes.
void validate_record_meta(RecordType type, const nlohmann::json& meta, const std::string& source, std::uint64_t offset);

// --- the trace as steps ------------------------------------------------------------------------

// The step_end records of a trace, one per step (the last one when a step has several), in step
// order: the curves of a recorded run. A record that fails its checksum or does not decode is
// left out and counted, so that a report can still draw a damaged trace.
struct RecordedSteps {
  std::vector<StepEndRecord> steps;
  std::int64_t unreadable = 0;
};
RecordedSteps recorded_steps(const TraceReader& trace);

}  // namespace retrace
