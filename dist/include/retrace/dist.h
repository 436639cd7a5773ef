#pragma once
// Data-parallel training on PyTorch's own distributed engine, c10d: N ranks as processes, each
// training on its own shard of the batch, gradients averaged by a bucketed all-reduce. Gloo on
// the CPU; NCCL for CUDA tensors where retrace was built with it.
//
// Every collective of a group goes through a recording backend that wraps the real one
// (collective_backend.h): with a Recorder attached (record_run does it), each rank's trace holds
// the key, its contribution's digest and non-finite count, and the result of every collective.
// In replay (ReplayedRankScope, set by program_from_trace) join() builds a group of this rank
// alone whose collectives are served from the trace: no peers, no network.
//
// A program in a user's loop:
//
//   auto group = retrace::RankGroup::join(retrace::RendezvousOptions::from_env(), config());
//   ...
//   defenses_.attach(*this, *optimizer_, params, traits);   // traits.gradient_sync = group.get()

#include <retrace/collectives.h>

#include <c10/core/Device.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace retrace {

// How the ranks find each other: c10d's rendezvous conventions (what torchrun sets).
struct RendezvousOptions {
  int rank = 0;
  int world_size = 1;
  // A TCP store served by rank 0 at master_addr:master_port (MASTER_ADDR, MASTER_PORT) ...
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // ... or a file store at this path, shared by the ranks (RETRACE_STORE); it wins when set.
  std::string store_path;
  // Bound on every wait: the rendezvous, each collective (RETRACE_DIST_TIMEOUT, seconds).
  std::chrono::milliseconds timeout{60000};
  std::string run_id;  // RETRACE_RUN_ID; "" lets rank 0 make one and hand it to the others

  // RANK, WORLD_SIZE (absent: 0 and 1), MASTER_ADDR, MASTER_PORT, RETRACE_STORE,
  // RETRACE_DIST_TIMEOUT, RETRACE_RUN_ID. Throws retrace::Error for a malformed value, naming the
  // variable and what it must be.
  static RendezvousOptions from_env();
};

// Ranks that did not meet: a rank with another config, a rank that never came, a bad store.
// what() says which rank, what differs, and how to fix it.
class RendezvousError : public Error {
 public:
  using Error::Error;
};

class RankGroup : public GradientSync {
 public:
  // Joins the group. Every rank publishes its `config` (the program's config text) in the store
  // and reads the others': a rank with another config is refused on every rank with a
  // RendezvousError naming the first line that differs, before any collective runs. A rank that
  // does not come within options.timeout is a RendezvousError too. `device`: where the program's
  // tensors live (Gloo for the CPU, NCCL for CUDA).
  //
  // With a ReplayedRankScope set (replay), options are ignored: the group is the replayed rank
  // alone, its collectives served by the attached CollectiveReplay.
  static std::unique_ptr<RankGroup> join(const RendezvousOptions& options, const std::string& config,
                                         c10::Device device = c10::kCPU);
  ~RankGroup() override;

  const RankInfo& ranks() const override { return ranks_; }
  // Mean over the ranks, in place: tensors packed into flat buckets of at most bucket_bytes per
  // dtype and device, each bucket all-reduced (sum) and divided by the world size. Every rank
  // ends with the same bits.
  void average(const std::vector<at::Tensor>& tensors) override;
  std::vector<int> ranks_with(bool flag) override;
  bool replayed() const { return replayed_; }
  // The c10d process group, for a program's own collectives (they are recorded and replayed like
  // the group's own). Its backends are the recording wrapper (replay: the replay backend).
  c10d::ProcessGroup& process_group();

  std::size_t bucket_bytes = std::size_t{25} << 20;  // PyTorch DDP's default bucket size

 private:
  RankGroup() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RankInfo ranks_;
  bool replayed_ = false;
};

}  // namespace retrace
