#pragma once
// The c10d backends behind a RankGroup (dist.h), for a program that builds its own
// c10d::ProcessGroup: wrap its real backend in make_recording_backend() and its collectives are
// recorded (and, in replay, served) like the group's own.

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace retrace {

// Wraps `inner`: every allreduce, broadcast, allgather and barrier runs on `inner` and is waited
// for (the returned work is complete: collectives do not overlap compute), and the attached
// CollectiveObserver (collectives.h) sees the contribution before and the result after. Other
// collectives are refused with the backend's "does not support" error.
c10::intrusive_ptr<c10d::Backend> make_recording_backend(c10::intrusive_ptr<c10d::Backend> inner);

// A backend of this rank alone for replay: every collective is served by the attached
// CollectiveReplay (collectives.h); with none attached it is a retrace::Error.
c10::intrusive_ptr<c10d::Backend> make_replay_backend(int rank, int world_size);

// The reduce operation's name in a trace ("sum", "avg", "product", "min", "max", ...).
const char* reduce_name(const c10d::ReduceOp& op);

}  // namespace retrace
