#include <retrace/verify.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <iostream>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace retrace {

VerifyPolicy parse_verify_policy(const std::string& text) {
  if (text == "off") return VerifyPolicy::kOff;
  if (text == "warn") return VerifyPolicy::kWarn;
  if (text == "record") return VerifyPolicy::kRecord;
  if (text == "throw") return VerifyPolicy::kThrow;
  throw Error("unknown verify policy '" + text + "'; use off, warn, throw or record");
}

const char* to_string(VerifyPolicy policy) {
  switch (policy) {
    case VerifyPolicy::kOff: return "off";
    case VerifyPolicy::kWarn: return "warn";
    case VerifyPolicy::kRecord: return "record";
    case VerifyPolicy::kThrow: return "throw";
  }
  return "?";
}

std::string describe(const at::Tensor& tensor) {
  if (!tensor.defined()) return "undefined";
  return describe(tensor.scalar_type(), tensor.sizes());
}

std::string describe(at::ScalarType dtype, c10::IntArrayRef sizes) {
  std::string s = c10::toString(dtype);
  s += '[';
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + ']';
}

std::string RecomputeMismatch::message() const {
  std::string m = "recompute of segment '" + segment + "' (invocation " + std::to_string(invocation) +
                  ") is not bitwise equal to its forward: output " + std::to_string(output_index) + " forward " +
                  forward_meta + " digest " + forward.hex() + ", recompute " + recompute_meta + " digest " +
                  recompute.hex();
  if (diff) m += "; " + diff->summary();
  return m;
}

namespace {

// What a segment's forward left for its recompute.
struct Expected {
  std::vector<PendingDigest> digests;
  std::vector<std::string> meta;
  std::vector<at::Tensor> values;  // keep_values only
};

// One recompute against its forward, compared when every digest is in.
struct Comparison {
  std::string segment;
  std::uint64_t invocation = 0;
  Expected forward;
  std::vector<PendingDigest> recompute;
  std::vector<std::string> recompute_meta;
  std::vector<at::Tensor> recompute_values;  // keep_values only: the outputs themselves, not copies

  bool ready() const {
    const auto is_ready = [](const PendingDigest& d) { return d.ready(); };
    return std::all_of(forward.digests.begin(), forward.digests.end(), is_ready) &&
           std::all_of(recompute.begin(), recompute.end(), is_ready);
  }

  // Waits for the digests still on a device. Returns the number of outputs compared.
  std::size_t compare(bool keep_values, std::vector<RecomputeMismatch>& found) const {
    const std::size_t n = std::max(forward.digests.size(), recompute.size());
    for (std::size_t i = 0; i < n; ++i) {
      RecomputeMismatch m;
      m.segment = segment;
      m.invocation = invocation;
      m.output_index = i;
      const bool have_forward = i < forward.digests.size();
      const bool have_recompute = i < recompute.size();
      if (have_forward) {
        m.forward = forward.digests[i].get();
        m.forward_meta = forward.meta[i];
      } else {
        m.forward_meta = "missing";
      }
      if (have_recompute) {
        m.recompute = recompute[i].get();
        m.recompute_meta = recompute_meta[i];
      } else {
        m.recompute_meta = "missing";
      }
      if (have_forward && have_recompute && m.forward == m.recompute) continue;
      if (keep_values && have_forward && have_recompute) {
        m.diff = bitwise_diff(forward.values[i], recompute_values[i]);
      }
      found.push_back(std::move(m));
    }
    return n;
  }
};

}  // namespace

struct RecomputeVerifier::State {
  explicit State(VerifyOptions o) : options(std::move(o)) {
    if (!options.digest) options.digest = [](const at::Tensor& t) { return digest_async(t); };
  }

  // Counts and keeps what a comparison found, then acts on it by the policy. `may_throw` is false
  // for the readers (mismatches(), verified_outputs()), which only record.
  void settle(std::size_t compared, std::vector<RecomputeMismatch> found, bool may_throw) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      verified += compared;
      mismatches.insert(mismatches.end(), found.begin(), found.end());
    }
    if (found.empty()) return;
    if (options.policy == VerifyPolicy::kThrow) {
      if (may_throw) throw RecomputeMismatchError(found.front());
      return;
    }
    if (options.policy == VerifyPolicy::kRecord) return;
    for (const RecomputeMismatch& m : found) std::cerr << "retrace: warning: " << m.message() << "\n";
  }

  // Compares every deferred recompute, waiting for its digests. One resolver at a time, so that a
  // reader returns only after a resolution in flight on another thread has been counted.
  void resolve_deferred(bool may_throw) {
    std::lock_guard<std::mutex> one_at_a_time(resolving);
    std::vector<Comparison> batch;
    {
      std::lock_guard<std::mutex> lock(mutex);
      batch.swap(deferred);
    }
    if (batch.empty()) return;
    std::size_t compared = 0;
    std::vector<RecomputeMismatch> found;
    for (const Comparison& c : batch) compared += c.compare(options.keep_values, found);
    settle(compared, std::move(found), may_throw);
  }

  VerifyOptions options;
  std::mutex resolving;
  mutable std::mutex mutex;                             // guards everything below
  std::unordered_map<std::uint64_t, Expected> pending;  // forwards waiting for their recompute
  std::vector<Comparison> deferred;                     // recomputes whose digests are on a device
  std::unordered_set<int> callbacks_queued;             // backward passes (graph task ids)
  std::vector<RecomputeMismatch> mismatches;
  std::size_t verified = 0;
};

RecomputeVerifier::RecomputeVerifier(VerifyOptions options) : state_(std::make_shared<State>(std::move(options))) {}

RecomputeVerifier::~RecomputeVerifier() = default;

void RecomputeVerifier::on_forward(SegmentEvent& event) {
  State& st = *state_;
  if (st.options.policy == VerifyPolicy::kOff || !event.will_recompute) return;
  Expected e;
  e.digests.reserve(event.outputs.size());
  for (const at::Tensor& out : event.outputs) {
    e.digests.push_back(st.options.digest(out));
    e.meta.push_back(describe(out));
    if (st.options.keep_values) e.values.push_back(out.detach().clone());
  }
  std::lock_guard<std::mutex> lock(st.mutex);
  st.pending[event.invocation] = std::move(e);
}

void RecomputeVerifier::on_recompute(SegmentEvent& event) {
  State& st = *state_;
  if (st.options.policy == VerifyPolicy::kOff) return;
  Comparison c;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    auto it = st.pending.find(event.invocation);
    if (it == st.pending.end()) return;  // attached after this segment's forward ran
    c.forward = std::move(it->second);
    st.pending.erase(it);
  }
  c.segment = event.segment;
  c.invocation = event.invocation;
  for (const at::Tensor& out : event.outputs) {
    c.recompute.push_back(st.options.digest(out));
    c.recompute_meta.push_back(describe(out));
    if (st.options.keep_values) c.recompute_values.push_back(out.detach());
  }
  // Digests on a device: compare when the backward pass that runs this recompute has finished.
  const int task = torch::autograd::get_current_graph_task_id();
  if (!c.ready() && task != -1) {
    bool queue = false;
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.deferred.push_back(std::move(c));
      queue = st.callbacks_queued.insert(task).second;
    }
    if (queue) {
      torch::autograd::Engine::get_default_engine().queue_callback([weak = std::weak_ptr<State>(state_), task] {
        const std::shared_ptr<State> alive = weak.lock();
        if (!alive) return;
        {
          std::lock_guard<std::mutex> lock(alive->mutex);
          alive->callbacks_queued.erase(task);
        }
        alive->resolve_deferred(/*may_throw=*/true);
      });
    }
    return;
  }
  std::vector<RecomputeMismatch> found;
  const std::size_t compared = c.compare(st.options.keep_values, found);
  st.settle(compared, std::move(found), /*may_throw=*/true);
}

std::vector<RecomputeMismatch> RecomputeVerifier::mismatches() const {
  state_->resolve_deferred(/*may_throw=*/false);
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->mismatches;
}

std::size_t RecomputeVerifier::verified_outputs() const {
  state_->resolve_deferred(/*may_throw=*/false);
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->verified;
}

std::size_t RecomputeVerifier::pending_segments() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->pending.size();
}

void RecomputeVerifier::reset() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->pending.clear();
  state_->deferred.clear();
  state_->mismatches.clear();
  state_->verified = 0;
}

}  // namespace retrace
