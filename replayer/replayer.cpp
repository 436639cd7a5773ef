#include <retrace/replayer.h>

#include <retrace/records.h>
#include <retrace/restore.h>

#include "provenance.h"

#include <retrace/determinism.h>
#include <retrace/number.h>
#include <retrace/observer.h>
#include <retrace/parallel.h>
#include <retrace/rng.h>
#include <retrace/verify.h>

#include <ATen/Parallel.h>
#include <retrace/diff.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>

namespace retrace {

namespace {

nlohmann::json digest_json(const Digest& d) {
  return d.algorithm == DigestAlgorithm::kNone ? nlohmann::json() : nlohmann::json(d.hex());
}

}  // namespace

std::string Divergence::message() const {
  std::ostringstream os;
  os << "step " << step << ", " << (segment.empty() ? "(outside segments)" : "segment '" + segment + "'") << ", phase "
     << phase;
  if (!tensor.empty()) os << ", tensor " << tensor;
  if (!detail.empty()) os << ": " << detail;
  if (diff) os << ": " << diff->summary();
  else if (detail.empty()) os << ": digest " << recorded.hex() << " recorded, " << replayed.hex() << " replayed";
  if (!hint.empty()) os << "; " << hint;
  return os.str();
}

nlohmann::json Divergence::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"segment", segment},
                      {"phase", phase},
                      {"tensor", tensor},
                      {"recorded_digest", digest_json(recorded)},
                      {"replayed_digest", digest_json(replayed)},
                      {"detail", detail},
                      {"hint", hint},
                      {"message", message()}};
  if (diff) {
    j["diff"] = {{"differing", diff->differing},     {"numel", diff->numel},
                 {"first_index", diff->first_index}, {"max_abs_diff", json_number(diff->max_abs_diff)},
                 {"max_ulp", diff->max_ulp},         {"summary", diff->summary()}};
  } else {
    j["diff"] = nullptr;
  }
  return j;
}

std::string NonFiniteOrigin::message() const {
  std::ostringstream os;
  os << "first non-finite value at step " << step << ": op " << op
     << (inner_op.empty() ? "" : " (made inside it, first returned by its inner " + inner_op + ")") << " in "
     << (segment.empty() ? "(outside segments)" : "segment '" + segment + "'")
     << (by_observer ? " (by an observer of its output, an injection: not the segment's own code)" : "") << ", phase "
     << phase;
  const char* which = given_infinity ? " (an infinity it was given as an argument"
                                     : " (an infinity it made, handed infinities by design";
  if ((given_infinity || !carried_to.empty()) && nan_op.empty()) {
    os << which << ", which no later op absorbed: "
       << (carried_to.empty() ? "the step ended with it" : carried_to + " was the last op to carry it on") << ")";
  } else if (!nan_op.empty()) {
    os << which << ", which " << nan_op << " turned into NaN in "
       << (nan_segment.empty() ? "(outside segments)" : "segment '" + nan_segment + "'") << ", phase " << nan_phase
       << ")";
  }
  for (const TensorStats& s : outputs) {
    os << "; " << s.name << " " << s.meta << " nan=" << s.nonfinite.nan << " +inf=" << s.nonfinite.pos_inf
       << " -inf=" << s.nonfinite.neg_inf;
  }
  for (const TensorStats& s : inputs) {
    os << "; " << s.name << " " << s.meta;
    if (std::isnan(s.min)) os << " (no finite element)";  // min/max are over the finite elements
    else os << " min " << number_text(s.min) << " max " << number_text(s.max) << " |max| " << number_text(s.abs_max);
    os << " nan=" << s.nonfinite.nan << " inf=" << (s.nonfinite.pos_inf + s.nonfinite.neg_inf);
  }
  return os.str();
}

nlohmann::json NonFiniteOrigin::to_json() const {
  auto stats = [](const std::vector<TensorStats>& v) {
    nlohmann::json a = nlohmann::json::array();
    for (const TensorStats& s : v) {
      a.push_back({{"name", s.name},
                   {"meta", s.meta},
                   {"min", json_number(s.min)},
                   {"max", json_number(s.max)},
                   {"abs_max", json_number(s.abs_max)},
                   {"nan", s.nonfinite.nan},
                   {"pos_inf", s.nonfinite.pos_inf},
                   {"neg_inf", s.nonfinite.neg_inf}});
    }
    return a;
  };
  nlohmann::json j = {{"step", step}, {"segment", segment},      {"by_observer", by_observer}, {"phase", phase},
                      {"op", op},     {"inputs", stats(inputs)}, {"outputs", stats(outputs)},  {"message", message()}};
  if (!inner_op.empty()) j["inner_op"] = inner_op;
  if (given_infinity || !nan_op.empty() || !carried_to.empty()) {
    j["given_infinity"] = given_infinity;
    j["nan_op"] = nan_op.empty() ? nlohmann::json() : nlohmann::json(nan_op);
    j["nan_segment"] = nan_segment;
    j["nan_phase"] = nan_phase;
    j["carried_to"] = carried_to.empty() ? nlohmann::json() : nlohmann::json(carried_to);
  }
  return j;
}

nlohmann::json RaisedStep::to_json() const {
  return {{"step", step}, {"what", what}, {"recorded", recorded ? nlohmann::json(*recorded) : nlohmann::json()}};
}

nlohmann::json ReplayResult::to_json() const {
  nlohmann::json env = nlohmann::json::array();
  for (const auto& d : environment)
    env.push_back({{"field", d.field}, {"recorded", d.recorded}, {"current", d.current}});
  return {{"reproduced", reproduced},
          {"from_step", from_step},
          {"to_step", to_step},
          {"target_step", target_step},
          {"ended_early", ended_early},
          {"batch_draws_rng_from", batch_draws_rng_from},
          {"first_divergence", first_divergence ? first_divergence->to_json() : nlohmann::json()},
          {"not_shown", not_shown},
          {"first_nonfinite", first_nonfinite ? first_nonfinite->to_json() : nlohmann::json()},
          {"raised", raised ? raised->to_json() : nlohmann::json()},
          {"environment_differences", env},
          {"notes", notes}};
}

namespace {
std::string describe_differences(const std::vector<EnvironmentDifference>& diffs) {
  std::string s = "the trace's environment differs in what bitwise replay needs: ";
  for (std::size_t i = 0; i < diffs.size(); ++i) {
    const auto& d = diffs[i];
    if (i) s += "; ";
    s += d.field + " was " + d.recorded + ", is " + d.current;
    if (!d.fix.empty()) s += " (" + d.fix + ")";
  }
  return s + "; or replay anyway with ReplayOptions::force (retrace replay --force)";
}
}  // namespace

EnvironmentMismatch::EnvironmentMismatch(std::vector<EnvironmentDifference> d)
    : Error(describe_differences(d)), differences_(std::move(d)) {}

std::unique_ptr<Program> program_from_trace(const TraceReader& trace, BuildFor purpose) {
  const TraceHeader header = TraceHeader::decode(trace);
  const ProgramRef program = header.require_program(trace.path());
  // A rank of a data-parallel run is rebuilt alone: its group has no peers, its collectives are
  // served from the trace (collectives.h).
  std::optional<ReplayedRankScope> rank;
  if (header.ranks) rank.emplace(*header.ranks);
  std::optional<RestoringStateScope> restoring;
  if (purpose == BuildFor::kReplay) restoring.emplace();
  return make_program(program.name, program.config);
}

namespace {

struct StepRecords {
  std::vector<std::size_t> begins;       // record indices of step_begin records (regular, then ring)
  std::vector<std::size_t> segments;     // in file order
  std::vector<std::size_t> collectives;  // in file order (a ring dump's copies after the originals)
  std::optional<std::size_t> end;
  std::optional<std::string> raised;       // what the step raised (an exception event raised_by_step)
  bool exception = false;                  // an exception event names this step (raised by it or not)
  std::int64_t exception_collective = -1;  // ... and the collective it left (a data-parallel rank)
  // The trace holds what the step came to: its step_end, or the exception it raised. Without either,
  // the run died during it.
  bool has_outcome() const { return end || raised; }
};

// The last step with a step_begin record; -1 where none has one.
std::int64_t last_begun_step(const std::map<std::int64_t, StepRecords>& steps) {
  std::int64_t last = -1;
  for (const auto& [s, recs] : steps) {
    if (!recs.begins.empty()) last = s;
  }
  return last;
}

// With `hash`, the digests of a list of tensors' host (CPU) tensors, taken on LibTorch's intra-op
// threads (a post-step state is 1.2 GB for GPT-2 small with AdamW; one thread hashed it alone),
// and with `check_finite` whether every one of them is finite, each checked right after its hash while
// its bytes are still in the cache. Device tensors are left to the caller (nullopt): their
// digest runs on the program's stream.
struct HostScan {
  std::vector<std::optional<Digest>> digests;
  bool finite = true;  // every host tensor (with check_finite)
};

HostScan scan_host(const std::vector<NamedTensor>& tensors, bool hash, bool check_finite) {
  HostScan scan;
  scan.digests.resize(tensors.size());
  std::vector<std::exception_ptr> finite_errors(tensors.size());
  std::atomic<bool> finite{true};
  const auto host = [&](std::size_t i) { return tensors[i].tensor.defined() && tensors[i].tensor.is_cpu(); };
  parallel_for_by_size(
      tensors.size(), [&](std::size_t i) { return host(i) ? tensors[i].tensor.nbytes() : 0; },
      [&](std::size_t i) {
        if (!host(i)) return;
        const at::Tensor& t = tensors[i].tensor;
        try {
          if (hash) scan.digests[i] = digest(t);
        } catch (...) {
          // No digest: compare() takes it again and throws the error where it is compared.
        }
        if (!check_finite) return;  // every tensor checked, so that what is thrown is the same every run
        try {
          if (!retrace::all_finite(t)) finite.store(false, std::memory_order_relaxed);
        } catch (...) {
          finite_errors[i] = std::current_exception();
        }
      });
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (finite_errors[i]) std::rethrow_exception(finite_errors[i]);  // the first in list order
  }
  scan.finite = finite.load();
  return scan;
}

// Compares a re-executed step against its records, in order. The first difference wins.
class Comparer : public SegmentObserver, public StepMonitor {
 public:
  Comparer(const TraceReader& trace, std::int64_t step, const StepRecords& records)
      : trace_(trace), step_(step), records_(records) {
    if (records.end) end_ = trace.read_table(*records.end);
  }
  // True when the trace holds no outcome of the step: the run died during it, or raised.
  bool died() const { return !records_.end; }
  // finish() will compare the post-step state: nothing diverged yet and the step's end is recorded.
  bool compares_state() const { return !first && end_ && !records_.raised; }

  void on_forward(SegmentEvent& e) override {
    guarded([&] { segment(e); });
  }
  void on_recompute(SegmentEvent& e) override {
    guarded([&] { segment(e); });
  }
  void on_backward(SegmentEvent& e) override {
    guarded([&] { segment(e); });
  }

  void after_backward(const at::Tensor& loss, const std::vector<NamedTensor>& grads) override {
    reached_segment_.clear();
    reached_phase_ = "optimizer";
    if (first || !end_) return;
    guarded([&] {
      compare(*end_, std::string(tensor_names::kLoss), loss, "(loss)", "forward");
      if (first) return;
      const HostScan scan = scan_host(grads, true, false);
      for (std::size_t i = 0; i < grads.size(); ++i)
        compare(*end_, grads[i].name, grads[i].tensor, "(parameters)", "backward", scan.digests[i]);
    });
  }

  // After a step that completed: unconsumed segment records and the post-step state, whose host
  // tensors `scan` has hashed.
  void finish(const std::vector<NamedTensor>& state_after, const HostScan& scan) {
    unconsumed_segments();
    if (records_.raised) {
      diverge("", "optimizer", "",
              "the recorded run raised '" + *records_.raised + "' at this step; the replay completed it");
      return;
    }
    if (!end_) {
      // The run died during this step (write-ahead snapshot, no outcome): nothing to compare.
      unrecorded = true;
      return;
    }
    for (std::size_t i = 0; i < state_after.size(); ++i) {
      compare(*end_, tensor_names::state(state_after[i].name), state_after[i].tensor, "(state)", "optimizer",
              scan.digests[i]);
    }
    // Every tensor the recorded monitor saw after backward (the loss and the gradients, whatever
    // the program named them), and every state tensor.
    require_all(
        *end_, [](const std::string& n) { return !tensor_names::state_name(n); }, "(parameters)", "backward");
    require_all(
        *end_, [](const std::string& n) { return tensor_names::state_name(n).has_value(); }, "(state)", "optimizer");
  }

  // `known`: t's digest, already taken (HostScan); the comparison is the same.
  void compare(const Record& rec, const std::string& name, const at::Tensor& t, const std::string& segment,
               const std::string& phase, const std::optional<Digest>& known = std::nullopt) {
    if (first) return;
    compared_[rec.offset].push_back(name);
    const TensorEntry* entry = rec.find(name);
    if (!entry) {
      diverge(segment, phase, name, "the replay produced a tensor the trace does not hold");
      return;
    }
    // Compare like with like: a host digest recorded for a device tensor (traces from before the
    // recorder kept device digests for stored CUDA tensors) is recomputed on a host copy.
    const bool host_digest_of_device_tensor = entry->digest.algorithm == DigestAlgorithm::kXxh3_128 && !t.is_cpu();
    const Digest d = known ? *known : host_digest_of_device_tensor ? digest(t.detach().cpu()) : digest(t);
    if (d == entry->digest) return;
    Divergence div;
    div.step = step_;
    div.segment = segment;
    div.phase = phase;
    div.tensor = name;
    div.recorded = entry->digest;
    div.replayed = d;
    if (entry->has_data()) div.diff = bitwise_diff(trace_.decode(rec, *entry), t.detach().cpu());
    first = std::move(div);
  }

  void diverge(const std::string& segment, const std::string& phase, const std::string& tensor,
               const std::string& detail) {
    if (first) return;
    Divergence div;
    div.step = step_;
    div.segment = segment;
    div.phase = phase;
    div.tensor = tensor;
    div.detail = detail;
    first = std::move(div);
  }

  // Recorded entries of `rec` with `prefix` that the replay never produced.
  void require_all(const Record& rec, const std::function<bool(const std::string&)>& which, const std::string& segment,
                   const std::string& phase) {
    if (first) return;
    const std::vector<std::string>& seen = compared_[rec.offset];
    for (const TensorEntry& e : rec.tensors) {
      if (!which(e.name)) continue;
      if (std::find(seen.begin(), seen.end(), e.name) == seen.end()) {
        diverge(segment, phase, e.name, "the trace holds a tensor the replay did not produce");
        return;
      }
    }
  }

  // After a step whose replay raised `what`: the recorded run must have raised the same there,
  // after the same segment events.
  void finish_raised(const std::string& what) {
    if (records_.raised && what == *records_.raised) {
      unconsumed_segments();
      return;
    }
    if (records_.raised) {
      diverge(reached_segment_, reached_phase_, "",
              "the replay raised '" + what + "'; the recorded run raised '" + *records_.raised + "'");
    } else if (end_) {
      diverge(reached_segment_, reached_phase_, "",
              "the replay raised '" + what + "'; the recorded run completed the step");
    } else {
      unrecorded = true;  // the run died during this step: nothing to compare the exception with
    }
  }

  std::optional<Divergence> first;
  bool unrecorded = false;  // the trace holds no outcome of this step
  // Set when the comparer's own work failed (a corrupt record): that is bad input, not the
  // program raising.
  std::exception_ptr own_error;

 private:
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      own_error = std::current_exception();
      throw;
    }
  }

  void unconsumed_segments() {
    if (!first && next_ < records_.segments.size()) {
      const RecordInfo& info = trace_.records()[records_.segments[next_]];
      diverge(info.segment, info.phase, "", "the trace has more segment events than the replay produced");
    }
  }

  void segment(SegmentEvent& e) {
    const char* phase = to_string(e.phase);
    reached_segment_ = e.segment;
    reached_phase_ = phase;
    if (first) return;
    if (next_ >= records_.segments.size()) {
      if (died()) return;  // events after the crash were never recorded
      diverge(e.segment, phase, "", "the replay ran a segment event the trace does not hold");
      return;
    }
    const Record rec = trace_.read_table(records_.segments[next_++]);
    const SegmentRecord recorded = SegmentRecord::decode(rec, trace_.path());
    if (recorded.segment != e.segment || recorded.phase != e.phase) {
      diverge(e.segment, phase, "",
              "the trace's next event is segment '" + recorded.segment + "' phase " + to_string(recorded.phase));
      return;
    }
    for (std::size_t i = 0; i < e.inputs.size(); ++i) {
      const std::optional<std::string> name = tensor_names::segment_input(e.phase, i);
      if (name && e.inputs[i].defined()) compare(rec, *name, e.inputs[i], e.segment, phase);
    }
    for (std::size_t i = 0; i < e.outputs.size(); ++i) {
      if (e.outputs[i].defined())
        compare(rec, tensor_names::segment_output(e.phase, i), e.outputs[i], e.segment, phase);
    }
    require_all(
        rec, [](const std::string&) { return true; }, e.segment, phase);
  }

  const TraceReader& trace_;
  std::int64_t step_;
  const StepRecords& records_;
  std::optional<Record> end_;
  std::size_t next_ = 0;
  std::map<std::uint64_t, std::vector<std::string>> compared_;  // record offset -> names compared
  std::string reached_segment_, reached_phase_ = "forward";     // how far the replay got
};

// Serves a replayed step's collectives from its collective records, in place of the rank's peers:
// checks each call's key and this rank's contribution (by digest) against the record, then hands
// the program the recorded result. A contribution that differs is a divergence (the recorded result
// is served anyway: it is what the peers sent); another key is a desync that ends the step. With
// `comparer` null (provenance's re-run) it only serves.
class CollectiveTape : public CollectiveReplay {
 public:
  CollectiveTape(const TraceReader& trace, std::int64_t step, const StepRecords& records, Comparer* comparer)
      : trace_(trace),
        step_(step),
        comparer_(comparer),
        ended_(records.end.has_value()),
        exception_(records.exception),
        exception_collective_(records.exception_collective) {
    // Per seq, the record with stored results wins (a flight-ring dump's copy of a digest one).
    std::map<std::int64_t, std::pair<std::size_t, bool>> by_seq;
    for (std::size_t i : records.collectives) {
      const CollectiveRecord c = CollectiveRecord::decode(trace.read_table(i), trace.path());
      auto it = by_seq.find(c.seq);
      if (it == by_seq.end() || (c.values && !it->second.second)) by_seq[c.seq] = {i, c.values};
    }
    for (const auto& [seq, rec] : by_seq) order_.push_back(rec.first);
  }

  void serve(const CollectiveCall& call, const std::vector<at::Tensor>& contribution,
             const std::vector<at::Tensor>& result) override {
    const std::size_t seq = next_++;
    const std::string here = "collective #" + std::to_string(seq) + " " + call.describe();
    if (seq >= order_.size()) {
      if (!ended_ && (!exception_ || exception_collective_ == static_cast<std::int64_t>(seq))) {
        // The recorded run never finished this step: it died, or its collective #seq did not
        // return (a peer died, a timeout). Nothing to serve; the replay stops before this step.
        // (A step that raised elsewhere, outside this collective, is a desync below.)
        ran_out_ = true;
        throw CollectiveDesync("the recorded run stopped in step " + std::to_string(step_) + " before " + here +
                               " returned");
      }
      desync(here, "the trace holds " + std::to_string(order_.size()) + " collective(s) in this step");
    }
    const Record rec = trace_.read_table(order_[seq]);
    const CollectiveRecord recorded = CollectiveRecord::decode(rec, trace_.path());
    if (recorded.seq != static_cast<std::int64_t>(seq) || recorded.call.op != call.op ||
        recorded.call.reduce != call.reduce || recorded.call.root != call.root) {
      desync(here, "the trace's collective #" + std::to_string(seq) + " is " + recorded.call.describe());
    }
    for (std::size_t i = 0; i < contribution.size(); ++i) {
      const TensorEntry* e = rec.find(tensor_names::collective_input(i));
      if (!e || e->dtype != contribution[i].scalar_type() || e->shape != contribution[i].sizes().vec()) {
        desync(here, "its input " + std::to_string(i) + " is " + describe(contribution[i]) + ", the trace's " +
                         (e ? describe(e->dtype, e->shape) : std::string("is missing")));
      }
      if (comparer_) comparer_->compare(rec, e->name, contribution[i], "(" + here + ")", "collective");
    }
    for (std::size_t i = 0; i < result.size(); ++i) {
      const TensorEntry* e = rec.find(tensor_names::collective_output(i));
      if (!e || e->dtype != result[i].scalar_type() || e->shape != result[i].sizes().vec()) {
        desync(here, "its output " + std::to_string(i) + " is " + describe(result[i]) + ", the trace's " +
                         (e ? describe(e->dtype, e->shape) : std::string("is missing")));
      }
      if (!e->has_data()) {
        // The trace cannot serve it: bad input, not the program raising.
        const Error error(trace_.path() + ": step " + std::to_string(step_) + " " + here +
                          ": the trace holds only the digest of its result, and a rank replays alone from recorded "
                          "results; record with --mode full or --write-ahead (or replay the steps of a flight-ring "
                          "dump)");
        if (comparer_) comparer_->own_error = std::make_exception_ptr(error);
        throw error;
      }
      result[i].copy_(trace_.decode(rec, *e));
    }
  }

 private:
  [[noreturn]] void desync(const std::string& here, const std::string& why) {
    const std::string what =
        "collective desync: the replay ran " + here + " of step " + std::to_string(step_) + ", but " + why;
    if (comparer_) comparer_->diverge("(" + here + ")", "collective", "", what);
    throw CollectiveDesync(what);
  }

  const TraceReader& trace_;
  std::int64_t step_;
  Comparer* comparer_;
  bool ended_;                         // the step has a step_end record
  bool exception_;                     // an exception event names the step
  std::int64_t exception_collective_;  // ... and the collective it left (-1: none)
  std::vector<std::size_t> order_;     // record index per seq
  std::size_t next_ = 0;
  bool ran_out_ = false;

 public:
  // The replay asked for a collective past the last one a step that never ended recorded.
  bool ran_out() const { return ran_out_; }
  // Recorded collectives the replay did not run.
  std::size_t unconsumed() const { return next_ < order_.size() ? order_.size() - next_ : 0; }
};

// The record's state.* (or batch.*) tensors, decoded, under the program's names.
// Decoded on LibTorch's intra-op threads: a snapshot is hundreds of tensors. With `finite`: set
// to whether every one is finite, each checked right after its decode, while its bytes are still
// in the cache (a pass over the whole state afterwards read it all from memory again). With
// `into` (in_place_targets()): a tensor whose program name, dtype and shape match one of those is
// decoded into it, and the result holds that tensor (no new memory, no copy in load_state).
std::vector<NamedTensor> named_tensors(const TraceReader& trace, const Record& rec,
                                       std::optional<std::string_view> (*program_name)(std::string_view),
                                       bool* finite = nullptr,
                                       const std::map<std::string_view, at::Tensor>* into = nullptr) {
  std::vector<NamedTensor> out;
  std::vector<const TensorEntry*> entries;
  for (const TensorEntry& e : rec.tensors) {
    if (const auto name = program_name(e.name)) {
      at::Tensor target;
      if (into) {
        if (const auto it = into->find(*name); it != into->end() && it->second.scalar_type() == e.dtype &&
                                               it->second.sizes() == at::IntArrayRef(e.shape)) {
          target = it->second;
        }
      }
      out.push_back({std::string(*name), std::move(target)});
      entries.push_back(&e);
    }
  }
  std::atomic<bool> all{true};
  // A bad tensor's error is kept with it and the first in table order thrown, whichever thread
  // met it first: the message does not depend on the thread count.
  std::vector<std::exception_ptr> errors(out.size());
  parallel_for_by_size(
      out.size(), [&](std::size_t i) { return entries[i]->stored_bytes; },
      [&](std::size_t i) {
        try {
          if (out[i].tensor.defined()) {  // an in-place target (each i is this thread's alone)
            trace.decode_into(rec, *entries[i], out[i].tensor);
          } else {
            out[i].tensor = trace.decode(rec, *entries[i]);
          }
        } catch (...) {
          errors[i] = std::current_exception();
          return;
        }
        if (finite && all.load(std::memory_order_relaxed) && !retrace::all_finite(out[i].tensor))
          all.store(false, std::memory_order_relaxed);
      });
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  if (finite) *finite = all.load();
  return out;
}

// The recorded batch with the kinds the program gave its tensors. Traces from before kinds were
// recorded (no "batch_kinds") name the built-in program's input and target.
std::vector<NamedTensor> batch_of(const TraceReader& trace, const Record& begin, const StepBeginRecord& record) {
  std::vector<NamedTensor> batch = named_tensors(trace, begin, tensor_names::batch_name);
  for (NamedTensor& b : batch) {
    if (record.batch_kinds) {
      const auto k = record.batch_kinds->find(b.name);
      if (k != record.batch_kinds->end()) b.kind = k->second;
    } else {
      b.kind = b.name == "input" ? TensorKind::kInput : b.name == "target" ? TensorKind::kTarget : TensorKind::kOther;
    }
  }
  return batch;
}

std::vector<std::uint8_t> rng_bytes(const TraceReader& trace, const Record& rec, std::int64_t step) {
  const TensorEntry* e = rec.find(std::string(tensor_names::kRng));
  if (!e) throw Error("the step_begin record of step " + std::to_string(step) + " holds no RNG state");
  if (e->dtype != at::kByte || e->shape.size() != 1)
    throw Error("the RNG state of step " + std::to_string(step) + " is not a byte vector");
  const at::Tensor t = trace.decode(rec, *e);
  const auto* p = t.const_data_ptr<std::uint8_t>();
  return {p, p + t.numel()};
}

// Every recorded step's records, by step.
std::map<std::int64_t, StepRecords> index_steps(const TraceReader& trace) {
  std::map<std::int64_t, StepRecords> steps;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const RecordInfo& r = trace.records()[i];
    if (r.step < 0) continue;
    switch (r.type) {
      case RecordType::kStepBegin: steps[r.step].begins.push_back(i); break;
      case RecordType::kSegment: steps[r.step].segments.push_back(i); break;
      case RecordType::kCollective: steps[r.step].collectives.push_back(i); break;
      case RecordType::kStepEnd:
        if (steps[r.step].end) {
          throw Error(trace.path() + ": the trace holds two step_end records of step " + std::to_string(r.step) +
                      " (at byte offsets " + std::to_string(trace.records()[*steps[r.step].end].offset) + " and " +
                      std::to_string(r.offset) +
                      "); a recorder writes one: the trace was edited or pieced together, replay the original");
        }
        steps[r.step].end = i;
        break;
      case RecordType::kEvent:
        if (const EventRecord e = EventRecord::decode(trace.read_table(i), trace.path());
            e.exception && e.exception->step == r.step) {
          if (e.exception->raised_by_step) steps[r.step].raised = e.exception->what;
          steps[r.step].exception = true;
          steps[r.step].exception_collective = e.exception->collective;
        }
        break;
      default: break;
    }
  }
  // A step without its outcome is the step a run died in: its last. One with steps after it lost
  // its step_end record (the trace was edited or damaged), and replaying past it would compare
  // less than it says.
  const std::int64_t last = last_begun_step(steps);
  for (const auto& [s, recs] : steps) {
    if (s >= last || recs.begins.empty() || recs.end || recs.exception) continue;
    throw Error(trace.path() + ": step " + std::to_string(s) + " has a step_begin record (byte offset " +
                std::to_string(trace.records()[recs.begins.front()].offset) +
                ") but no step_end, and the trace goes on to step " + std::to_string(last) +
                ": a record is missing (a run that dies in a step records none after it); the trace was edited "
                "or damaged, replay the original");
  }
  return steps;
}

// The step to replay up to: the one asked for, or the last recorded.
std::int64_t target_step(const std::map<std::int64_t, StepRecords>& steps, const ReplayOptions& options) {
  const std::int64_t last = last_begun_step(steps);
  if (last < 0) throw Error("the trace holds no recorded step");
  const std::string range = std::to_string(steps.begin()->first) + ".." + std::to_string(last);
  std::int64_t target = last;
  if (options.step) {
    const auto it = steps.find(*options.step);
    if (it == steps.end() || it->second.begins.empty()) {
      throw Error("the trace holds no step " + std::to_string(*options.step) + "; it has steps " + range +
                  " (see retrace inspect)");
    }
    target = *options.step;
  }
  // A start after the last step to replay would replay none of what was asked for: said, not
  // clamped to the target.
  if (options.from && *options.from > target) {
    if (options.step) {
      throw Error("replay from step " + std::to_string(*options.from) + " is after the last step to replay, " +
                  std::to_string(target) + ": give a start at or before it");
    }
    throw Error("replay from step " + std::to_string(*options.from) + ": the trace's last step is " +
                std::to_string(last) + " (it has steps " + range + "; see retrace inspect)");
  }
  return target;
}

struct Anchor {
  Record begin;                    // its step_begin record
  std::optional<Record> end;       // the step_end its state is stored in, when not in `begin` (below)
  std::vector<NamedTensor> state;  // decoded once
  const Record& stored() const { return end ? *end : begin; }
};

// For a step_begin `b` that does not store its state itself (not full): the step_end it points at
// (state_as_step_end) when that step_end stored every state tensor, as a full-mode trace stores
// the state once between two steps. Null when the state is only digested there.
std::optional<Record> end_holding_state(const TraceReader& trace, const std::map<std::int64_t, StepRecords>& steps,
                                        const StepBeginRecord& b) {
  if (!b.state_as_step_end) return std::nullopt;
  const auto it = steps.find(*b.state_as_step_end);
  if (it == steps.end() || !it->second.end) return std::nullopt;
  Record end = trace.read_table(*it->second.end);
  bool any = false;
  for (const TensorEntry& e : end.tensors) {
    if (!tensor_names::state_name(e.name)) continue;
    if (!e.has_data()) return std::nullopt;
    any = true;
  }
  if (!any) return std::nullopt;
  return end;
}

// The anchor: the latest full snapshot at or before `latest` whose state is all finite (a
// snapshot that already holds NaN/Inf cannot show where they came from); failing that, the
// latest full snapshot. Its state is decoded into the program's own tensors where they fit
// (in_place_targets): the program's state is overwritten, the anchor's tensors are its own.
Anchor find_anchor(const TraceReader& trace, const std::map<std::int64_t, StepRecords>& steps, std::int64_t latest,
                   Program& program) {
  const std::vector<NamedTensor> live = program.state();
  const std::map<std::string_view, at::Tensor> into = in_place_targets(live);
  std::optional<Anchor> nonfinite;  // its state not kept: a later candidate is decoded over it
  for (auto it = steps.upper_bound(latest); it != steps.begin();) {
    --it;
    for (auto r = it->second.begins.rbegin(); r != it->second.begins.rend(); ++r) {
      Anchor a{trace.read_table(*r), std::nullopt, {}};
      if (const StepBeginRecord b = StepBeginRecord::decode(a.begin, trace.path()); !b.full) {
        a.end = end_holding_state(trace, steps, b);
        if (!a.end) continue;
      }
      bool finite = true;
      a.state = named_tensors(trace, a.stored(), tensor_names::state_name, &finite, &into);
      if (finite) return a;
      if (!nonfinite) {
        a.state.clear();
        nonfinite = std::move(a);
      }
    }
  }
  if (!nonfinite) throw Error("no full snapshot at or before step " + std::to_string(latest) + " to replay from");
  nonfinite->state = named_tensors(trace, nonfinite->stored(), tensor_names::state_name, nullptr, &into);
  return std::move(*nonfinite);
}

// What went non-finite first in step `s`, re-run from the state and RNG it started from.
void find_provenance(const TraceReader& trace, const StepRecords& recs, Program& program, std::int64_t s,
                     const std::vector<NamedTensor>& state_before, const std::vector<std::uint8_t>& rng,
                     const std::vector<NamedTensor>& batch, bool known_nonfinite, ReplayResult& result) {
  program.load_state(state_before);
  RngState::deserialize(rng.data(), rng.size()).restore();
  CollectiveTape tape(trace, s, recs, nullptr);  // the step's collectives again, served only
  CollectiveReplayScope collectives(tape);
  result.first_nonfinite = find_first_nonfinite(program, s, batch, known_nonfinite);
  if (result.first_nonfinite) result.first_nonfinite->step = s;
  // A rank replayed alone: where a collective of the step handed it non-finite values its own
  // contribution did not hold, they came from a peer, and the op named here is only where this
  // rank first computed with them (red-team finding: a victim rank's copy_ named as the source).
  for (const std::size_t i : recs.collectives) {
    const CollectiveRecord c = CollectiveRecord::decode(trace.read_table(i), trace.path());
    if (c.ring || c.output.nonfinite == 0) continue;
    if (c.input.nonfinite == 0) {
      result.notes.push_back(
          c.key() + " handed rank " + std::to_string(c.rank) + " " + std::to_string(c.output.nonfinite) +
          " non-finite value(s) though its own contribution was finite: they came from another rank, and the "
          "first non-finite op of this rank is where it first computed with them; replay every rank's trace "
          "together (retrace replay RANK_TRACE...) to name the rank they came from");
    }
    break;  // the step's first collective with non-finite output decides
  }
}

// Which generators' states in `now` differ from those `recorded` (RngState::serialize bytes):
// "the CPU generator's", "cuda:0's"; "" when none does.
std::string generators_differing(const RngState& now, const std::vector<std::uint8_t>& recorded) {
  if (now.serialize() == recorded) return "";
  return generators_differing(now, RngState::deserialize(recorded.data(), recorded.size()), "the recorded run");
}

// The run's first recorded step, whose start state the program's constructor made, and whether
// the trace holds that state (a replay can start there: a digest- or full-mode trace does).
struct RunStart {
  std::int64_t step = -1;
  bool snapshot = false;
};

RunStart run_start(const TraceReader& trace, const std::map<std::int64_t, StepRecords>& steps) {
  for (const auto& [s, recs] : steps) {
    if (recs.begins.empty()) continue;
    RunStart start{s, false};
    for (const std::size_t i : recs.begins) {
      const StepBeginRecord b = StepBeginRecord::decode(trace.read_table(i), trace.path());
      start.snapshot = start.snapshot || b.full || end_holding_state(trace, steps, b).has_value();
    }
    return start;
  }
  return {};
}

// The same loss: equal, or both NaN (a loss's NaN payload is not kept by the trace's JSON).
bool same_double(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// Re-executes step `s` from `begin` and compares it with its records. Returns whether the replay
// goes on: not after the first divergence, a step that raised, or a non-finite step no defense
// handled. `anchor_state`: for the step restored from its snapshot, the record that snapshot is
// stored in (null for the steps after it); `start`: where the recorded run began.
bool replay_step(const TraceReader& trace, Program& program, std::int64_t s, const StepRecords& recs,
                 const Record& begin, const Record* anchor_state, const RunStart& start, const ReplayOptions& options,
                 ReplayResult& result, bool& stopped_before) {
  const bool anchor = anchor_state != nullptr;
  const bool trained_to = s > start.step;  // a step the recorded run reached by training
  Comparer comparer(trace, s, recs);
  const StepBeginRecord begin_record = StepBeginRecord::decode(begin, trace.path());
  const std::vector<std::uint8_t> rng = rng_bytes(trace, begin, s);
  if (!anchor) {
    // A step_begin that says its state is the previous step_end's was checked there.
    if (!begin_record.state_as_step_end) {
      for (const NamedTensor& st : program.state()) {
        comparer.compare(begin, tensor_names::state(st.name), st.tensor, "(state)", "step_begin");
      }
    }
    if (!comparer.first) {
      if (const std::string differ = generators_differing(RngState::capture_all(), rng); !differ.empty()) {
        // The state matched: the recorded run drew from that generator after the previous step and
        // before this one, where the replay, which runs only step() on the recorded batch, does
        // not. record_run calls Program::batch() there: where calling it now brings the generators
        // to the recorded state, batch() drew -- the program's contract broken (a batch must be
        // deterministic in (config, step)), not the step's: noted, and the replay goes on.
        (void)program.batch(s);
        if (generators_differing(RngState::capture_all(), rng).empty()) {
          const std::string note = "Program::batch() draws from the global generator (" + differ +
                                   "; first between steps " + std::to_string(s - 1) + " and " + std::to_string(s) +
                                   "): the steps replay from the recorded RNG state, but a batch must be "
                                   "deterministic in (config, step) -- draw it from a generator of its own seeded "
                                   "from the step, or a rerun from a snapshot (diagnose) trains on other batches";
          if (result.batch_draws_rng_from == 0) {
            result.batch_draws_rng_from = s;
            result.notes.push_back(note);
          }
        } else {
          comparer.diverge("", "step_begin", std::string(tensor_names::kRng),
                           "the RNG state differs from the recorded one (" + differ + ")");
          comparer.first->hint =
              "the state this step begins with matched, so the recorded run drew from that generator between "
              "steps " +
              std::to_string(s - 1) + " and " + std::to_string(s) +
              " where the replay draws nothing, and not in Program::batch() (calling it does not account for "
              "it): code the training loop runs between steps, or the previous step drawing otherwise than "
              "it did when recorded";
        }
      }
    }
  }
  RngState::deserialize(rng.data(), rng.size()).restore();
  std::vector<NamedTensor> batch = batch_of(trace, begin, begin_record);
  // The state the step starts from, for provenance's second run: the anchor's snapshot is decoded
  // again from its record when needed (load_state may have kept the decoded tensors, which the
  // step then changed), any other step's is copied now.
  std::vector<NamedTensor> copied;
  if (!anchor && options.provenance) copied = clone_all(program.state());
  const auto state_before = [&] {
    return anchor ? named_tensors(trace, *anchor_state, tensor_names::state_name) : copied;
  };

  StepOutcome outcome;
  std::optional<std::string> raised;
  CollectiveTape tape(trace, s, recs, &comparer);
  {
    ObserverScope scope(comparer);
    CollectiveReplayScope collectives(tape);
    try {
      outcome = program.step(s, batch, &comparer);
    } catch (const std::exception& e) {
      if (comparer.own_error) std::rethrow_exception(comparer.own_error);  // a bad trace, not the program
      raised = exception_message(e);
    }
  }
  if (raised && tape.ran_out()) {
    // A rank whose peers went away mid-step (SIGKILL, a timeout): the steps before it are the
    // replay's verdict; this one cannot be re-executed alone past its last recorded collective.
    result.notes.push_back("step " + std::to_string(s) + " did not finish in the recorded run: " + *raised +
                           (recs.raised ? " (it raised: " + *recs.raised + ")" : std::string()) +
                           "; replayed up to the last complete step " + std::to_string(s - 1));
    // What diverged before the collective that never returned still counts.
    if (comparer.first && !result.first_divergence) result.first_divergence = comparer.first;
    stopped_before = true;
    return false;
  }
  if (raised) {
    // The step raised: its verdict is whether the recorded run raised the same here. Nothing
    // after it can be replayed (the program stopped mid-step), so the replay ends here.
    comparer.finish_raised(*raised);
    if (comparer.first && !result.first_divergence) result.first_divergence = comparer.first;
    result.raised = RaisedStep{s, *raised, recs.raised};
    if (comparer.unrecorded) {
      result.notes.push_back("step " + std::to_string(s) +
                             " has no recorded outcome (the run died during it); re-executed " +
                             "from its snapshot, it raised: " + *raised);
    } else if (!comparer.first) {
      result.notes.push_back("step " + std::to_string(s) + " raised, as the recorded run did: " + *raised);
    }
    // What went non-finite before it raised (a non-finite gradient norm that clipping refuses).
    if (options.provenance && !result.first_nonfinite)
      find_provenance(trace, recs, program, s, state_before(), rng, batch, /*known_nonfinite=*/false, result);
    return false;
  }
  if (const std::size_t left = tape.unconsumed(); left > 0 && !comparer.first) {
    comparer.diverge("(collectives)", "collective", "",
                     "collective desync: the trace holds " + std::to_string(left) +
                         " more collective(s) in this step than the replay ran");
  }
  const std::vector<NamedTensor> state_after = program.state();
  const HostScan scan = scan_host(state_after, comparer.compares_state(), true);
  comparer.finish(state_after, scan);
  std::optional<StepEndRecord> recorded_end;
  if (recs.end) recorded_end = StepEndRecord::decode(trace.read_table(*recs.end), trace.path());
  if (!comparer.first && recorded_end && !recs.raised) {
    // The step's recorded outcome, field by field: what a defense decided (skip, rollback, loss
    // scale, LR) is the step's verdict too, not only the tensors it left (red-team finding: a
    // step_end saying "skipped" or another loss replayed "bitwise").
    const StepEndRecord& recorded = *recorded_end;
    std::string what;
    const auto differs = [&](const char* field, double was, double now) {
      if (what.empty() && !same_double(was, now)) {
        const int digits = digits_apart(was, now);  // enough digits to show them apart
        what = std::string(field) + " recorded " + number_text(was, digits) + ", replayed " + number_text(now, digits);
      }
    };
    differs("loss", recorded.loss, outcome.loss);
    if (!std::isnan(recorded.grad_norm)) differs("grad_norm", recorded.grad_norm, outcome.grad_norm);  // NaN: none
    differs("loss_scale", recorded.loss_scale, outcome.loss_scale);
    differs("lr", recorded.lr, outcome.lr);
    const auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
    if (what.empty() && recorded.skipped != outcome.skipped)
      what = "skipped recorded " + yes_no(recorded.skipped) + ", replayed " + yes_no(outcome.skipped);
    if (what.empty() && recorded.rolled_back != outcome.rolled_back)
      what = "rolled_back recorded " + yes_no(recorded.rolled_back) + ", replayed " + yes_no(outcome.rolled_back);
    if (!what.empty())
      comparer.diverge("(step_end)", "optimizer", "", "the step's recorded outcome differs from the replay's: " + what);
  }
  if (comparer.first && !result.first_divergence) {
    result.first_divergence = comparer.first;
    Divergence& d = *result.first_divergence;
    // Forward, backward, loss and gradients matched, the state after the optimizer did not, in
    // the step restored from a snapshot the run reached by training: the program holds
    // something state() does not give (a fresh program's constructor made it at step 1).
    // The recorded run rolled back in this step to a state from before it: its rollback defense
    // restored a snapshot its ring kept, which a replay starting here has not seen (the ring is
    // not in state(), docs/defenses.md). That, not an incomplete state(), is what differs.
    if (anchor && recorded_end && recorded_end->rolled_back && recorded_end->rolled_back_to >= 0 &&
        recorded_end->rolled_back_to < s) {
      d.hint = "the recorded run rolled back in step " + std::to_string(s) + " to the state from the start of step " +
               std::to_string(recorded_end->rolled_back_to) +
               ", a snapshot its rollback defense kept from before step " + std::to_string(s) +
               ", where this replay starts: a replay rebuilds that defense's ring from the steps it replays "
               "(the ring is not in state()); replay from step " +
               std::to_string(recorded_end->rolled_back_to) + " or earlier (--from " + std::to_string(start.step) +
               ") to reproduce it";
    } else if (anchor && trained_to && d.segment == "(state)" && d.phase == "optimizer" && d.detail.empty()) {
      d.hint = "the step re-executed from the snapshot of step " + std::to_string(s) +
               " matched up to the optimizer step; the program's state() is probably incomplete: it leaves out "
               "something the optimizer step depends on (optimizer moments or step counts, a schedule counter, a "
               "rollback defense's snapshots), "
               "which load_state() cannot restore (retrace record's state self-check finds this while "
               "recording, unless --no-state-check)";
    } else if (anchor && trained_to && d.phase != "step_begin") {
      // Its start state and RNG are the snapshot's own, so what differs is what the snapshot does
      // not hold, or what no snapshot fixes. Which one, a replay from the run's first step tells:
      // there the constructor made the missing part, in both runs.
      d.hint = "the step re-executed from the snapshot of step " + std::to_string(s) +
               ", the first one replayed, diverged in its " + d.phase +
               ": either the program's state() leaves out something the step depends on (a step or schedule "
               "counter, a warm-up, a loss-scale tracker), which load_state() cannot restore and retrace "
               "record's state self-check at step 2 sees only when it already matters there, or the program "
               "is not deterministic; " +
               (start.snapshot
                    ? "a replay from step " + std::to_string(start.step) + " (--from " + std::to_string(start.step) +
                          ") tells them apart: it reproduces when state() is incomplete"
                    : std::string("the trace holds no snapshot of the run's first step to tell them apart "
                                  "(retrace record always stores one: this trace was edited or cut)"));
    } else if (d.phase == "backward" && d.tensor.rfind("grad_output.", 0) == 0) {
      // Everything compared before it matched, the forward of every segment so far included: the
      // gradient handed to this segment's backward was made outside the segments, after its forward.
      // The loss is compared after backward (the step's monitor sees it there), so it is not the
      // first divergence even when it was computed differently: say whether it differs.
      d.hint = "every segment event before it matched, so the gradient flowing into '" + d.segment +
               "' was made outside the segments, by code that runs after its forward (the layers after it, the "
               "loss function, the targets) and computed differently";
      if (recorded_end && !same_double(recorded_end->loss, outcome.loss)) {
        const int digits = digits_apart(recorded_end->loss, outcome.loss);
        d.hint += "; the step's loss differs too (recorded " + number_text(recorded_end->loss, digits) + ", replayed " +
                  number_text(outcome.loss, digits) + ")";
      }
    }
  }
  if (comparer.unrecorded) {
    std::ostringstream note;
    note << "step " << s << " has no recorded outcome (the run died during it); re-executed from its "
         << "snapshot: loss " << number_text(outcome.loss) << ", grad norm " << number_text(outcome.grad_norm);
    result.notes.push_back(note.str());
  }
  if (!outcome.injected.empty()) {
    std::string tags;
    for (const std::string& i : outcome.injected) tags += (tags.empty() ? "" : "; ") + i;
    // The faults are the scenario's, not real ones; a non-finite value in the step may still be the
    // run's own (a configuration that breaks there anyway), which the first non-finite op tells.
    result.notes.push_back("step " + std::to_string(s) + " carries injected faults: " + tags +
                           " (injected by the scenario, not real ones; where a non-finite value came from, the "
                           "first non-finite op says)");
  }
  // The first non-finite tensor of the state after the step, in state() order, and the first
  // non-finite parameter: device tensors are checked here, on the program's stream.
  const NamedTensor* bad = nullptr;
  const NamedTensor* bad_param = nullptr;
  for (const NamedTensor& st : state_after) {
    if (bad_param) break;
    if (!st.tensor.defined() || (scan.finite && st.tensor.is_cpu()) || retrace::all_finite(st.tensor)) continue;
    if (!bad) bad = &st;
    if (st.kind == TensorKind::kParameter) bad_param = &st;
  }
  const bool params_ok = bad_param == nullptr;
  // A buffer or the optimizer's state non-finite with the loss and parameters finite does not end
  // the replay (it is said at a skipped step and at the last).
  const bool nonfinite = !outcome.finite() || !params_ok;
  // A non-finite step that a defense skipped (parameters still finite) does not end the run:
  // the replay goes on checking the steps after it.
  const bool handled = nonfinite && outcome.skipped && params_ok;
  // Provenance re-runs the step on this program; after a handled step the replay goes on, and a
  // second run of the step would move program state that state() does not hold (a rollback
  // ring), so a handled step is only noted -- unless it is the last step replayed, which nothing
  // follows (the step a run that never recovered ended on, or the one asked for with --step).
  const bool last = s == result.to_step;
  // What is non-finite after the step, for the notes.
  const std::string left = bad ? std::string(to_string(bad->kind)) + " '" + bad->name + "' is non-finite after it"
                               : std::string();
  if (handled) {
    result.notes.push_back(
        "step " + std::to_string(s) + " went non-finite and a defense skipped it (" + outcome.skip_reason + ")" +
        (bad ? "; its parameters are finite, but its " + left + " (a skip does not undo what the step's forward wrote)"
             : std::string()) +
        (last ? "" : "; the replay goes on"));
  }
  if (!nonfinite && bad && last) {
    result.notes.push_back("step " + std::to_string(s) + ", the last replayed: its loss and parameters are finite, " +
                           "but its " + left);
  }
  if (nonfinite && (!handled || last) && options.provenance && !result.first_nonfinite) {
    find_provenance(trace, recs, program, s, state_before(), rng, batch, /*known_nonfinite=*/true, result);
    if (!result.first_nonfinite && bad) {
      result.notes.push_back("step " + std::to_string(s) + ": no op's output was non-finite, yet its " + left +
                             ": written in place by an op that does not return it (BatchNorm's running statistics, "
                             "an optimizer's update)");
    }
  }
  const bool go_on = !result.first_divergence && !(nonfinite && !handled);
  if (!go_on && !last && result.ended_early.empty()) {
    std::string why;
    if (result.first_divergence) why = "diverged";
    else {
      why = "went non-finite (";
      if (!outcome.finite())
        why += "loss " + number_text(outcome.loss) + ", gradient norm " + number_text(outcome.grad_norm);
      if (bad) why += std::string(outcome.finite() ? "" : "; ") + left;
      why += outcome.skipped ? ") and a defense skipped it, but its parameters are non-finite"
                             : ") and no defense skipped it";
      why += ": a replay ends at such a step";
    }
    result.ended_early = "step " + std::to_string(s) + " " + why;
  }
  return go_on;
}

}  // namespace

Replayer::Replayer(const TraceReader& trace, Program& program) : trace_(trace), program_(program) {}

ReplayResult Replayer::run(const ReplayOptions& options) {
  ReplayResult result;
  if (trace_.truncated()) result.notes.push_back(trace_.warning());
  const Environment recorded = TraceHeader::decode(trace_).environment;
  // A run recorded under DeterministicGuard is replayed under it too.
  std::optional<DeterministicGuard> deterministic;
  if (auto it = recorded.bitwise.find("deterministic_algorithms"); it != recorded.bitwise.end() && it->second == "on") {
    deterministic.emplace();
  }
  result.environment = recorded.differences(Environment::current());
  if (!result.environment.empty() && !options.force) throw EnvironmentMismatch(result.environment);

  const std::map<std::int64_t, StepRecords> steps = index_steps(trace_);
  const std::int64_t target = target_step(steps, options);
  const RunStart start = run_start(trace_, steps);
  const auto last = steps.find(target);
  const bool died = last != steps.end() && !last->second.has_outcome();
  Anchor anchor = [&] {
    // The step the run died in has no outcome to compare: from a snapshot before it, where the
    // trace holds one, the steps before it are compared and it is re-executed after them.
    if (died && !options.from && target > steps.begin()->first) {
      try {
        return find_anchor(trace_, steps, target - 1, program_);
      } catch (const Error&) {  // none before it: from its own (write-ahead) snapshot
      }
    }
    return find_anchor(trace_, steps, options.from.value_or(target), program_);
  }();
  result.from_step = StepBeginRecord::decode(anchor.begin, trace_.path()).step;
  result.to_step = target;
  result.target_step = target;
  // The decoded snapshot is given to the program (its moments kept, not cloned): provenance
  // decodes the anchor's state again from its record when it needs it.
  program_.adopt_state(std::move(anchor.state));

  static const StepRecords kNone;
  for (std::int64_t s = result.from_step; s <= target; ++s) {
    const auto found = steps.find(s);
    const StepRecords& recs = found == steps.end() ? kNone : found->second;
    if (recs.begins.empty()) throw Error("the trace holds no step_begin record of step " + std::to_string(s));
    bool stopped_before = false;
    const bool go_on = replay_step(
        trace_, program_, s, recs, s == result.from_step ? anchor.begin : trace_.read_table(recs.begins.front()),
        s == result.from_step ? &anchor.stored() : nullptr, start, options, result, stopped_before);
    if (!go_on) {
      result.to_step = stopped_before ? s - 1 : s;
      if (result.to_step < target && result.ended_early.empty()) {
        result.ended_early = stopped_before  ? "the recorded run stopped in step " + std::to_string(s)
                             : result.raised ? "step " + std::to_string(s) + " raised"
                                             : "step " + std::to_string(s) + " ended the replay";
      }
      break;
    }
  }
  result.reproduced = !result.first_divergence;
  if (result.to_step < result.from_step) {
    // Not one step re-executed to its end: nothing was shown to reproduce.
    result.reproduced = false;
    result.not_shown = "no step was replayed to its end: the first one, " + std::to_string(result.from_step) +
                       ", did not finish in the recorded run";
  } else if (result.reproduced) {
    // Every step replayed lacks its outcome (the run died in the one step replayed): what it
    // computed was compared with its segment records at most, never its loss, gradients or state.
    bool outcome_compared = false;
    std::size_t segment_records = 0;
    for (std::int64_t s = result.from_step; s <= result.to_step; ++s) {
      const auto it = steps.find(s);
      if (it == steps.end()) continue;
      outcome_compared = outcome_compared || it->second.has_outcome();
      segment_records += it->second.segments.size();
    }
    if (!outcome_compared) {
      result.reproduced = false;
      result.not_shown = "step " + std::to_string(result.to_step) +
                         " has no recorded outcome (the run died during it): " +
                         (segment_records == 0 ? std::string("the trace holds nothing of it after its start to compare "
                                                             "with")
                                               : "only its " + std::to_string(segment_records) +
                                                     " segment record(s) were compared, matching as far as they go; "
                                                     "its loss, gradients and state after it were never recorded") +
                         " (replay from an earlier step, --from, to compare the steps before it)";
    }
  }
  return result;
}

}  // namespace retrace
