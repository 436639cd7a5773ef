#include <retrace/collective_backend.h>

#include <retrace/collectives.h>
#include <retrace/error.h>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <utility>

namespace retrace {

const char* reduce_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "sum";
    case c10d::ReduceOp::AVG: return "avg";
    case c10d::ReduceOp::PRODUCT: return "product";
    case c10d::ReduceOp::MIN: return "min";
    case c10d::ReduceOp::MAX: return "max";
    case c10d::ReduceOp::BAND: return "band";
    case c10d::ReduceOp::BOR: return "bor";
    case c10d::ReduceOp::BXOR: return "bxor";
    case c10d::ReduceOp::PREMUL_SUM: return "premul_sum";
    default: return "unused";
  }
}

namespace {

// A work that is complete when made: the recording backend waited for the real one, the replay
// backend served the result itself.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(c10d::OpType type, std::vector<at::Tensor> result) : c10d::Work(-1, type), result_(std::move(result)) {
    finish();
  }
  std::vector<at::Tensor> result() override { return result_; }

 private:
  std::vector<at::Tensor> result_;
};

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

class RecordingBackend : public c10d::Backend {
 public:
  explicit RecordingBackend(c10::intrusive_ptr<c10d::Backend> inner)
      : Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}
  const std::string getBackendName() const override { return "retrace-recording(" + inner_->getBackendName() + ")"; }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const CollectiveCall call{CollectiveOp::kAllReduce, reduce_name(opts.reduceOp), -1};
    return run(call, c10d::OpType::ALLREDUCE, tensors, tensors, [&] { return inner_->allreduce(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const CollectiveCall call{CollectiveOp::kBroadcast, "", static_cast<int>(opts.rootRank)};
    return run(call, c10d::OpType::BROADCAST, tensors, tensors, [&] { return inner_->broadcast(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    const CollectiveCall call{CollectiveOp::kAllGather, "", -1};
    return run(call, c10d::OpType::ALLGATHER, inputs, flatten(outputs),
               [&] { return inner_->allgather(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    const CollectiveCall call{CollectiveOp::kBarrier, "", -1};
    return run(call, c10d::OpType::BARRIER, {}, {}, [&] { return inner_->barrier(opts); });
  }

 private:
  template <class F>
  c10::intrusive_ptr<c10d::Work> run(const CollectiveCall& call, c10d::OpType type,
                                     const std::vector<at::Tensor>& contribution, const std::vector<at::Tensor>& result,
                                     F&& collective) {
    CollectiveObserver* observer = collective_observer();
    if (observer) observer->before_collective(call, contribution);
    collective()->wait();
    if (observer) observer->after_collective(call, result);
    return c10::make_intrusive<CompletedWork>(type, result);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
};

class ReplayBackend : public c10d::Backend {
 public:
  ReplayBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "retrace-replay"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return serve({CollectiveOp::kAllReduce, reduce_name(opts.reduceOp), -1}, c10d::OpType::ALLREDUCE, tensors, tensors);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return serve({CollectiveOp::kBroadcast, "", static_cast<int>(opts.rootRank)}, c10d::OpType::BROADCAST, tensors,
                 tensors);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return serve({CollectiveOp::kAllGather, "", -1}, c10d::OpType::ALLGATHER, inputs, flatten(outputs));
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return serve({CollectiveOp::kBarrier, "", -1}, c10d::OpType::BARRIER, {}, {});
  }

 private:
  c10::intrusive_ptr<c10d::Work> serve(const CollectiveCall& call, c10d::OpType type,
                                       const std::vector<at::Tensor>& contribution,
                                       const std::vector<at::Tensor>& result) {
    CollectiveReplay* replay = collective_replay();
    if (!replay) {
      throw Error("rank " + std::to_string(getRank()) + " ran " + call.describe() +
                  " in replay outside a replayed step: a replayed rank has no peers, and its collectives come "
                  "from the trace of the step being replayed (retrace replay)");
    }
    replay->serve(call, contribution, result);
    return c10::make_intrusive<CompletedWork>(type, result);
  }
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_recording_backend(c10::intrusive_ptr<c10d::Backend> inner) {
  return c10::make_intrusive<RecordingBackend>(std::move(inner));
}

c10::intrusive_ptr<c10d::Backend> make_replay_backend(int rank, int world_size) {
  return c10::make_intrusive<ReplayBackend>(rank, world_size);
}

}  // namespace retrace
