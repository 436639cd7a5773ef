#pragma once
// Ranks of a data-parallel run, and the seam its collectives pass through. The collectives
// themselves run on c10d (retrace/dist.h): a recording backend wraps the real one (Gloo, NCCL)
// and reports every collective to the attached CollectiveObserver (the recorder); in replay a
// backend with no peers asks the attached CollectiveReplay (the replayer) for the recorded result.
// With nothing attached a collective costs a branch.
//
// This header needs no c10d: a program's training step (the defense pipeline, defenses.h) sees
// its group through the GradientSync interface, so that only retrace::dist links the engine.

#include <retrace/error.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace retrace {

// Which rank of how many a process is, and the run all ranks share (every rank's trace names it).
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  std::string run_id;  // "" for a single-process run
  bool distributed() const { return world_size > 1; }
};

enum class CollectiveOp : std::uint8_t { kAllReduce, kBroadcast, kAllGather, kBarrier };
const char* to_string(CollectiveOp op);  // "allreduce", "broadcast", "allgather", "barrier"
std::optional<CollectiveOp> collective_op_from_string(std::string_view name);

// One collective as this rank called it. Its key in a trace is (step, seq, op, reduce, root and
// the dtype and shape of each tensor).
struct CollectiveCall {
  CollectiveOp op = CollectiveOp::kAllReduce;
  std::string reduce;  // allreduce: "sum", "avg", "max", "min", "product"; "" otherwise
  int root = -1;       // broadcast: the source rank; -1 otherwise
  // "allreduce(sum)", "broadcast(root 0)", "allgather", "barrier"
  std::string describe() const;
};

// Sees every collective of this process while attached: before it runs (`contribution`: this
// rank's input tensors) and after (`result`: the output tensors, on this rank).
class CollectiveObserver {
 public:
  virtual ~CollectiveObserver() = default;
  virtual void before_collective(const CollectiveCall& call, const std::vector<at::Tensor>& contribution) = 0;
  virtual void after_collective(const CollectiveCall& call, const std::vector<at::Tensor>& result) = 0;
};

// Serves collectives in replay, in place of the peers: checks the call and this rank's
// `contribution` against the trace and writes the recorded result into `result` (same tensors
// as the real backend would write; for allreduce and broadcast `result` is `contribution`).
// Throws CollectiveDesync when the trace holds another collective at this point.
class CollectiveReplay {
 public:
  virtual ~CollectiveReplay() = default;
  virtual void serve(const CollectiveCall& call, const std::vector<at::Tensor>& contribution,
                     const std::vector<at::Tensor>& result) = 0;
};

// The replay asked for a collective the trace does not hold at this point (another op, dtype or
// shape, or more collectives than the step recorded): the rank desynchronized from its record.
class CollectiveDesync : public Error {
 public:
  using Error::Error;
};

// Attach for the scope's lifetime, process-wide; one of each at a time (the last attached wins,
// the previous one comes back when the scope ends). The object must outlive the scope.
class CollectiveObserverScope {
 public:
  explicit CollectiveObserverScope(CollectiveObserver& observer);
  ~CollectiveObserverScope();
  CollectiveObserverScope(const CollectiveObserverScope&) = delete;
  CollectiveObserverScope& operator=(const CollectiveObserverScope&) = delete;

 private:
  CollectiveObserver* previous_;
};
class CollectiveReplayScope {
 public:
  explicit CollectiveReplayScope(CollectiveReplay& replay);
  ~CollectiveReplayScope();
  CollectiveReplayScope(const CollectiveReplayScope&) = delete;
  CollectiveReplayScope& operator=(const CollectiveReplayScope&) = delete;

 private:
  CollectiveReplay* previous_;
};
CollectiveObserver* collective_observer();  // nullptr: none attached
CollectiveReplay* collective_replay();

// While set, a program that joins a data-parallel group (retrace/dist.h) joins a replayed one:
// this rank alone, no peers, no network, its collectives served by collective_replay(). Replay
// sets it from the trace's header while it rebuilds the program (program_from_trace).
class ReplayedRankScope {
 public:
  explicit ReplayedRankScope(RankInfo rank);
  ~ReplayedRankScope();
  ReplayedRankScope(const ReplayedRankScope&) = delete;
  ReplayedRankScope& operator=(const ReplayedRankScope&) = delete;

 private:
  std::optional<RankInfo> previous_;
};
std::optional<RankInfo> replayed_rank();

// A program's data-parallel group as its training step uses it: average the gradients over the
// ranks, and agree on a flag. retrace::dist's RankGroup implements it on c10d.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual const RankInfo& ranks() const = 0;
  // Replaces each tensor by its mean over the ranks, in place (bucketed all-reduce).
  virtual void average(const std::vector<at::Tensor>& tensors) = 0;
  // Every rank learns which ranks set `flag` (ascending): an all-gather of one byte per rank.
  virtual std::vector<int> ranks_with(bool flag) = 0;
};

}  // namespace retrace
