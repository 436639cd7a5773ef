#include <retrace/collectives.h>

#include <atomic>
#include <mutex>

namespace retrace {

const char* to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce: return "allreduce";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kAllGather: return "allgather";
    case CollectiveOp::kBarrier: return "barrier";
  }
  return "?";
}

std::optional<CollectiveOp> collective_op_from_string(std::string_view name) {
  for (CollectiveOp op :
       {CollectiveOp::kAllReduce, CollectiveOp::kBroadcast, CollectiveOp::kAllGather, CollectiveOp::kBarrier}) {
    if (name == to_string(op)) return op;
  }
  return std::nullopt;
}

std::string CollectiveCall::describe() const {
  std::string s = to_string(op);
  if (!reduce.empty()) s += "(" + reduce + ")";
  if (root >= 0) s += "(root " + std::to_string(root) + ")";
  return s;
}

namespace {
std::mutex g_mutex;
std::atomic<CollectiveObserver*> g_observer{nullptr};
std::atomic<CollectiveReplay*> g_replay{nullptr};
std::optional<RankInfo> g_replayed_rank;
}  // namespace

CollectiveObserverScope::CollectiveObserverScope(CollectiveObserver& observer)
    : previous_(g_observer.exchange(&observer)) {}
CollectiveObserverScope::~CollectiveObserverScope() { g_observer.store(previous_); }

CollectiveReplayScope::CollectiveReplayScope(CollectiveReplay& replay) : previous_(g_replay.exchange(&replay)) {}
CollectiveReplayScope::~CollectiveReplayScope() { g_replay.store(previous_); }

CollectiveObserver* collective_observer() { return g_observer.load(std::memory_order_acquire); }
CollectiveReplay* collective_replay() { return g_replay.load(std::memory_order_acquire); }

ReplayedRankScope::ReplayedRankScope(RankInfo rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  previous_ = g_replayed_rank;
  g_replayed_rank = std::move(rank);
}
ReplayedRankScope::~ReplayedRankScope() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_replayed_rank = previous_;
}
std::optional<RankInfo> replayed_rank() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_replayed_rank;
}

}  // namespace retrace
