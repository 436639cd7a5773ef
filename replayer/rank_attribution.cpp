#include <retrace/rank_attribution.h>

#include <retrace/number.h>
#include <retrace/records.h>
#include <retrace/verify.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace retrace {

const char* to_string(CulpritRank::Kind kind) {
  switch (kind) {
    case CulpritRank::Kind::kNonFinite: return "non_finite";
    case CulpritRank::Kind::kMagnitude: return "magnitude";
    case CulpritRank::Kind::kDesync: return "desync";
    case CulpritRank::Kind::kResult: return "result";
    case CulpritRank::Kind::kStopped: return "stopped";
    case CulpritRank::Kind::kRaised: return "raised";
    case CulpritRank::Kind::kStepEnd: return "step_end";
  }
  return "?";
}

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// One rank's view of one collective.
struct Seen {
  CollectiveRecord record;
  std::vector<std::pair<at::ScalarType, std::vector<std::int64_t>>> inputs, outputs;
  std::vector<Digest> results;
};

std::string key_text(const Seen& s) {
  std::ostringstream os;
  os << s.record.call.describe();
  for (const auto& [dtype, shape] : s.inputs) os << " " << describe(dtype, shape);
  return os.str();
}

bool same_key(const Seen& a, const Seen& b) {
  return a.record.call.op == b.record.call.op && a.record.call.reduce == b.record.call.reduce &&
         a.record.call.root == b.record.call.root && a.inputs == b.inputs && a.outputs == b.outputs;
}

// (step, seq) -> what the rank recorded; the first record of a key wins (a ring dump repeats it).
std::map<std::pair<std::int64_t, std::int64_t>, Seen> collectives_of(const TraceReader& trace) {
  std::map<std::pair<std::int64_t, std::int64_t>, Seen> out;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    if (trace.records()[i].type != RecordType::kCollective) continue;
    const Record rec = trace.read_table(i);
    Seen s;
    s.record = CollectiveRecord::decode(rec, trace.path());
    const auto key = std::make_pair(s.record.step, s.record.seq);
    if (out.count(key)) continue;
    for (const TensorEntry& e : rec.tensors) {
      if (e.name.rfind("input.", 0) == 0) s.inputs.emplace_back(e.dtype, e.shape);
      if (e.name.rfind("output.", 0) == 0) {
        s.outputs.emplace_back(e.dtype, e.shape);
        s.results.push_back(e.digest);
      }
    }
    out.emplace(key, std::move(s));
  }
  return out;
}

}  // namespace

std::string CulpritRank::message() const {
  std::ostringstream os;
  os << "step " << step;
  if (seq >= 0) os << " collective #" << seq << " " << collective;
  os << ": ";
  const std::string who = rank_list(ranks);
  switch (kind) {
    case Kind::kNonFinite: os << who << "'s contribution went non-finite first"; break;
    case Kind::kMagnitude: os << who << "'s contribution is an outlier in magnitude"; break;
    case Kind::kDesync: os << who << " called another collective than the others (desync)"; break;
    case Kind::kResult:
      os << who << " got another result than the others (a collective gives every rank the same bits)";
      break;
    case Kind::kStopped: os << who << " stopped recording here while the others went on or raised"; break;
    case Kind::kRaised: os << who << " raised outside any collective while the others waited in one"; break;
    case Kind::kStepEnd: os << who << " ended the step otherwise than the others, every collective agreeing"; break;
  }
  if (!detail.empty()) os << " (" << detail << ")";
  return os.str();
}

nlohmann::json CulpritRank::to_json() const {
  return {{"kind", to_string(kind)}, {"step", step},     {"seq", seq},          {"collective", collective},
          {"ranks", ranks},          {"detail", detail}, {"message", message()}};
}

std::string RankAttribution::verdict() const {
  if (culprit) return "culprit: " + culprit->message();
  return all_clean ? "no rank went bad: every collective agreed (same keys, finite contributions, equal results), "
                     "and every step ended with the same state on every rank, none non-finite that every rank did "
                     "not skip"
                   : "no collective disagreed, but not every rank ended cleanly (see the notes)";
}

nlohmann::json RankAttribution::to_json() const {
  return {{"world_size", run.world_size},
          {"run_id", run.run_id},
          {"traces", traces},
          {"collectives", collectives},
          {"culprit", culprit ? culprit->to_json() : nlohmann::json()},
          {"verdict", verdict()},
          {"all_clean", all_clean},
          {"notes", notes}};
}

namespace {

// What one rank's trace says beyond its collectives.
struct RankTrace {
  const TraceReader* trace = nullptr;
  int rank = 0;
  std::map<std::pair<std::int64_t, std::int64_t>, Seen> collectives;
  std::set<std::int64_t> skipped;  // steps its step_end says were skipped (a defense handled them)
  std::optional<ExceptionEvent> exception;
  std::int64_t last_step = -1;  // of its step_begin records
  // Each step's step_end (the first of a step): the outcome and the state digests after it.
  struct End {
    StepEndRecord record;
    std::vector<std::pair<std::string, Digest>> state;  // state.* entries, in table order
  };
  std::map<std::int64_t, End> ends;
};

RankTrace read_rank(const TraceReader& t, int rank) {
  RankTrace r;
  r.trace = &t;
  r.rank = rank;
  r.collectives = collectives_of(t);
  for (std::size_t i = 0; i < t.records().size(); ++i) {
    const RecordInfo& info = t.records()[i];
    if (info.type == RecordType::kStepBegin) r.last_step = std::max(r.last_step, info.step);
    if (info.type == RecordType::kStepEnd) {
      const Record rec = t.read_table(i);
      RankTrace::End end;
      end.record = StepEndRecord::decode(rec, t.path());
      if (end.record.skipped) r.skipped.insert(info.step);
      for (const TensorEntry& e : rec.tensors) {
        if (tensor_names::state_name(e.name)) end.state.emplace_back(e.name, e.digest);
      }
      r.ends.emplace(end.record.step, std::move(end));
    }
    if (info.type == RecordType::kEvent) {
      const EventRecord e = EventRecord::decode(t.read_table(i), t.path());
      if (e.exception && !r.exception) r.exception = e.exception;  // the first one is what stopped it
    }
  }
  return r;
}

// The ranks (indices into `ranks`) outside the largest group of equal values; ties go to the group
// of the lowest rank. Empty when all agree.
template <class Same>
std::vector<std::size_t> minority(const std::vector<std::size_t>& have, Same same) {
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i : have) {
    bool placed = false;
    for (auto& g : groups) {
      if (same(g.front(), i)) {
        g.push_back(i);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({i});
  }
  if (groups.size() <= 1) return {};
  std::size_t best = 0;
  for (std::size_t g = 1; g < groups.size(); ++g) {
    if (groups[g].size() > groups[best].size()) best = g;
  }
  std::vector<std::size_t> out;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (g != best) out.insert(out.end(), groups[g].begin(), groups[g].end());
  }
  return out;
}

}  // namespace

RankAttribution attribute_ranks(const std::vector<const TraceReader*>& traces) {
  if (traces.size() < 2) throw Error("naming a culprit rank needs the traces of two or more ranks of one run");
  RankAttribution out;
  std::vector<RankTrace> ranks;
  std::optional<ProgramRef> program;  // the first trace's: every rank of one run runs one config
  for (const TraceReader* t : traces) {
    const TraceHeader h = TraceHeader::decode(*t);
    if (!h.ranks) {
      throw Error(t->path() + ": the trace is of a single-process run (its header names no ranks); give the traces "
                              "of one data-parallel run, one per rank");
    }
    if (out.traces.empty()) {
      out.run = *h.ranks;
      out.traces.assign(static_cast<std::size_t>(h.ranks->world_size), "");
    } else if (h.ranks->run_id != out.run.run_id || h.ranks->world_size != out.run.world_size) {
      throw Error(t->path() + ": the trace is of another run (run " + h.ranks->run_id + ", world size " +
                  std::to_string(h.ranks->world_size) + ") than " + traces.front()->path() + " (run " + out.run.run_id +
                  ", world size " + std::to_string(out.run.world_size) + ")");
    }
    // The ranks of one run joined with one program config (RankGroup::join refuses another): a
    // run id shared by two runs (a launcher of one's own reusing RETRACE_RUN_ID) is caught here.
    if (t == traces.front()) {
      program = h.program;
    } else if (program.has_value() != h.program.has_value() ||
               (program && (program->name != h.program->name || program->config != h.program->config))) {
      throw Error(t->path() + ": the trace is of another run than " + traces.front()->path() +
                  " (the same run id and world size, but another program or config: " +
                  (h.program ? "'" + h.program->name + "'" : std::string("none")) + " against " +
                  (program ? "'" + program->name + "'" : std::string("none")) +
                  (program && h.program && program->name == h.program->name ? ", configs differ" : "") +
                  "); give the traces of one run");
    }
    std::string& slot = out.traces[static_cast<std::size_t>(h.ranks->rank)];
    if (!slot.empty())
      throw Error(t->path() + ": rank " + std::to_string(h.ranks->rank) + " is given twice (also " + slot + ")");
    slot = t->path();
    if (t->truncated()) out.notes.push_back(t->path() + ": " + t->warning());
    ranks.push_back(read_rank(*t, h.ranks->rank));
  }
  // In rank order, whatever order the traces came in.
  std::sort(ranks.begin(), ranks.end(), [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  for (int r = 0; r < out.run.world_size; ++r) {
    if (out.traces[static_cast<std::size_t>(r)].empty())
      out.notes.push_back("rank " + std::to_string(r) + "'s trace is not given: it is left out of the comparison");
  }
  for (const RankTrace& r : ranks) {
    if (r.exception) {
      out.all_clean = false;
      out.notes.push_back("rank " + std::to_string(r.rank) + " raised in step " + std::to_string(r.exception->step) +
                          (r.exception->collective >= 0
                               ? " inside collective #" + std::to_string(r.exception->collective)
                               : std::string(" outside any collective")) +
                          ": " + r.exception->what.substr(0, 200));
    } else if (!r.trace->complete()) {
      out.all_clean = false;
      out.notes.push_back("rank " + std::to_string(r.rank) + "'s trace was never closed (the process died)");
    }
  }
  auto rank_list_of = [&](const std::vector<std::size_t>& idx) {
    std::vector<int> v;
    for (std::size_t i : idx) v.push_back(ranks[i].rank);
    std::sort(v.begin(), v.end());
    return v;
  };
  // The steps' ends, each after its step's collectives agreed, over the steps every given rank
  // ended (red-team finding: a weight of rank 1 flipped to 3.4e38, every later step skipped for its NaN
  // gradients -- the flag the ranks exchange agreeing -- and an LR spike on rank 1 alone, its
  // parameters apart from rank 0's, both read "no rank went bad").
  std::set<std::int64_t> steps;  // those every given rank ended
  for (const auto& [step, end] : ranks.front().ends) {
    if (std::all_of(ranks.begin(), ranks.end(), [&](const RankTrace& r) { return r.ends.count(step) > 0; }))
      steps.insert(step);
  }
  const std::int64_t last_common = steps.empty() ? -1 : *steps.rbegin();
  std::vector<std::size_t> all(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) all[i] = i;
  // Whether step `step`'s ends name a culprit (then in out.culprit).
  auto ends_disagree = [&](std::int64_t step) {
    auto end = [&](std::size_t i) -> const RankTrace::End& { return ranks[i].ends.at(step); };
    CulpritRank c;
    c.kind = CulpritRank::Kind::kStepEnd;
    c.step = step;
    std::vector<std::size_t> nonfinite;
    for (std::size_t i : all) {
      if (!end(i).record.finite) nonfinite.push_back(i);
    }
    if (!nonfinite.empty() && nonfinite.size() < ranks.size()) {
      std::ostringstream d;
      for (std::size_t n = 0; n < nonfinite.size(); ++n) {
        const StepEndRecord& e = end(nonfinite[n]).record;
        d << (n ? "; " : "") << "rank " << ranks[nonfinite[n]].rank << "'s step ended non-finite: loss "
          << number_text(e.loss) << ", gradient norm " << number_text(e.grad_norm);
      }
      const std::size_t fine =
          *std::find_if(all.begin(), all.end(), [&](std::size_t i) { return end(i).record.finite; });
      d << "; rank " << ranks[fine].rank << "'s loss " << number_text(end(fine).record.loss);
      const bool handled = std::all_of(all.begin(), all.end(), [&](std::size_t i) { return end(i).record.skipped; });
      if (handled && step != last_common) {
        out.notes.push_back("step " + std::to_string(step) + ": " + d.str() + "; every rank skipped the step (a " +
                            "defense handled it)");
      } else {
        if (handled) d << "; every rank skipped it, and no step ended finite on every rank after it";
        c.ranks = rank_list_of(nonfinite);
        c.detail = d.str();
        out.culprit = std::move(c);
        return true;
      }
    }
    if (const std::vector<std::size_t> other =
            minority(all, [&](std::size_t a, std::size_t b) { return end(a).state == end(b).state; });
        !other.empty()) {
      const bool tie = other.size() * 2 == all.size();
      const std::size_t base = *std::find_if(all.begin(), all.end(), [&](std::size_t i) {
        return tie ? i != other.front() : std::find(other.begin(), other.end(), i) == other.end();
      });
      const auto& a = end(base).state;
      const auto& b = end(other.front()).state;
      std::size_t differing = 0;
      std::string first;
      for (std::size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
        if (a[k] == b[k]) continue;
        if (first.empty()) first = b[k].first;
        ++differing;
      }
      std::ostringstream d;
      d << "the state after the step differs: rank " << ranks[other.front()].rank << "'s from rank " << ranks[base].rank
        << "'s in " << (a.size() == b.size() ? differing : std::max(a.size(), b.size())) << " of "
        << std::max(a.size(), b.size()) << " tensors" << (first.empty() ? "" : " (first " + first + ")");
      if (tie) d << ", with no majority";
      // What fired where: a fault one rank's step notes is where to look.
      for (std::size_t i : all) {
        for (const std::string& line : end(i).record.injected)
          d << "; rank " << ranks[i].rank << "'s step notes an injected fault: " << line;
      }
      c.ranks = rank_list_of(tie ? all : other);
      c.detail = d.str();
      out.culprit = std::move(c);
      return true;
    }
    return false;
  };
  auto next_end = steps.begin();  // the steps whose ends are not compared yet
  std::set<std::pair<std::int64_t, std::int64_t>> keys;
  for (const RankTrace& r : ranks) {
    for (const auto& [k, v] : r.collectives) keys.insert(k);
  }
  for (const auto& key : keys) {
    for (; next_end != steps.end() && *next_end < key.first; ++next_end) {
      if (ends_disagree(*next_end)) return out;
    }
    ++out.collectives;
    std::vector<std::size_t> have, missing;
    for (std::size_t i = 0; i < ranks.size(); ++i) (ranks[i].collectives.count(key) ? have : missing).push_back(i);
    auto at = [&](std::size_t i) -> const Seen& { return ranks[i].collectives.at(key); };
    CulpritRank c;
    c.step = key.first;
    c.seq = key.second;
    c.collective = at(have.front()).record.call.describe();
    if (!missing.empty()) {
      c.kind = CulpritRank::Kind::kStopped;
      c.ranks = rank_list_of(missing);
      c.detail = "their traces hold no record of it";
      out.culprit = std::move(c);
      return out;
    }
    if (const std::vector<std::size_t> other =
            minority(have, [&](std::size_t a, std::size_t b) { return same_key(at(a), at(b)); });
        !other.empty()) {
      c.kind = CulpritRank::Kind::kDesync;
      c.ranks = rank_list_of(other);
      const std::size_t majority = *std::find_if(have.begin(), have.end(), [&](std::size_t i) {
        return std::find(other.begin(), other.end(), i) == other.end();
      });
      c.detail = "rank " + std::to_string(ranks[majority].rank) + " ran " + key_text(at(majority)) + ", rank " +
                 std::to_string(ranks[other.front()].rank) + " " + key_text(at(other.front()));
      out.culprit = std::move(c);
      return out;
    }
    // What each rank put in: for a broadcast, only the root's buffer is a contribution.
    std::vector<std::size_t> contributors;
    for (std::size_t i : have) {
      const CollectiveCall& call = at(i).record.call;
      if (call.op != CollectiveOp::kBroadcast || call.root == ranks[i].rank) contributors.push_back(i);
    }
    // A step every rank skipped was handled by a defense: noted, and the comparison goes on.
    const bool handled =
        std::all_of(have.begin(), have.end(), [&](std::size_t i) { return ranks[i].skipped.count(key.first) > 0; });
    std::vector<std::size_t> nonfinite;
    for (std::size_t i : contributors) {
      if (at(i).record.input.nonfinite > 0) nonfinite.push_back(i);
    }
    std::vector<std::size_t> huge;
    std::ostringstream why;
    for (std::size_t i : contributors) {
      double others = 0;
      for (std::size_t j : contributors) {
        if (j != i) others = std::max(others, at(j).record.input.abs_max);
      }
      const double mine = at(i).record.input.abs_max;
      if (others > 0 && mine >= kMagnitudeOutlier * others) {
        huge.push_back(i);
        why << (why.tellp() > 0 ? "; " : "") << "rank " << ranks[i].rank << ": max |x| " << number_text(mine)
            << ", the other ranks' at most " << number_text(others);
      }
    }
    // Ranks whose traces were not given: where every given contribution was finite and the result
    // was not, the non-finite part came from one of them (red-team finding: rank 2's NaN, its trace
    // left out, made "ranks 0, 1 ... every rank's: no single culprit" a step later, exit 0).
    std::vector<int> absent;
    for (int r = 0; r < out.run.world_size; ++r) {
      if (out.traces[static_cast<std::size_t>(r)].empty()) absent.push_back(r);
    }
    const bool result_nonfinite =
        std::any_of(have.begin(), have.end(), [&](std::size_t i) { return at(i).record.output.nonfinite > 0; });
    if (!absent.empty() && nonfinite.empty() && result_nonfinite && !handled) {
      c.kind = CulpritRank::Kind::kNonFinite;
      c.ranks = absent;
      c.detail = "the given ranks' contributions were finite and the result was not: the rank(s) whose traces are "
                 "not given contributed the NaN/Inf (give every rank's trace to confirm)";
      out.culprit = std::move(c);
      return out;
    }
    if (!nonfinite.empty() || !huge.empty()) {
      const bool non_finite = !nonfinite.empty();
      const std::vector<std::size_t>& bad = non_finite ? nonfinite : huge;
      std::ostringstream d;
      if (non_finite) {
        if (bad.size() == contributors.size() && contributors.size() > 1)
          d << (absent.empty() ? "every rank's: no single culprit, a cause they share (the parameters, an fp16 "
                                 "overflow); "
                               : "every given rank's (some ranks' traces are not given): a cause they share, or "
                                 "one the others' earlier steps passed on; ");
        for (std::size_t n = 0; n < bad.size(); ++n) {
          const CollectiveRecord& r = at(bad[n]).record;
          d << (n ? "; " : "") << "rank " << ranks[bad[n]].rank << ": " << r.input.nonfinite
            << " NaN/Inf element(s), max |x| of the finite " << number_text(r.input.abs_max);
        }
      } else {
        d << why.str();
      }
      if (handled) {
        out.notes.push_back("step " + std::to_string(key.first) + " collective #" + std::to_string(key.second) + ": " +
                            d.str() + "; every rank skipped the step (a defense handled it)");
        continue;
      }
      c.kind = non_finite ? CulpritRank::Kind::kNonFinite : CulpritRank::Kind::kMagnitude;
      c.ranks = rank_list_of(bad);
      c.detail = d.str();
      out.culprit = std::move(c);
      return out;
    }
    if (const std::vector<std::size_t> other =
            minority(have, [&](std::size_t a, std::size_t b) { return at(a).results == at(b).results; });
        !other.empty()) {
      c.kind = CulpritRank::Kind::kResult;
      // Two groups of equal size: a disagreement, but no majority to name a culprit by.
      const bool tie = other.size() * 2 == have.size();
      c.ranks = rank_list_of(tie ? have : other);
      c.detail = tie ? "the ranks' result digests differ, with no majority"
                     : "result digests differ from the majority's";
      out.culprit = std::move(c);
      return out;
    }
  }
  for (; next_end != steps.end(); ++next_end) {
    if (ends_disagree(*next_end)) return out;
  }
  // Every collective agreed. A rank killed mid-run (SIGKILL, the OOM killer) leaves a trace never
  // closed that notes no exception, while its peers time out inside the next collective and note
  // that: the killed rank is the culprit. A rank that raised outside any collective while the
  // others raised inside one (waiting for it) is the culprit too.
  std::vector<std::size_t> vanished, outside, inside;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].exception) (ranks[i].exception->collective >= 0 ? inside : outside).push_back(i);
    else if (!ranks[i].trace->complete()) vanished.push_back(i);
  }
  if (!vanished.empty() && !inside.empty()) {
    CulpritRank c;
    c.kind = CulpritRank::Kind::kStopped;
    c.step = ranks[vanished.front()].last_step;
    c.ranks = rank_list_of(vanished);
    c.detail = "its trace ends in step " + std::to_string(c.step) +
               " without a close or an exception (the process was killed); the others raised inside a collective: " +
               ranks[inside.front()].exception->what.substr(0, 200);
    out.culprit = std::move(c);
  } else if (!outside.empty() && !inside.empty()) {
    CulpritRank c;
    c.kind = CulpritRank::Kind::kRaised;
    c.step = ranks[outside.front()].exception->step;
    c.ranks = rank_list_of(outside);
    c.detail = ranks[outside.front()].exception->what.substr(0, 200);
    out.culprit = std::move(c);
  }
  return out;
}

}  // namespace retrace
