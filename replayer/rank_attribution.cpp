#include <retrace/rank_attribution.h>

#include <retrace/number.h>
#include <retrace/records.h>

#include <algorithm>
#include <map>
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
  for (const auto& [dtype, shape] : s.inputs) {
    os << " " << c10::toString(dtype) << "[";
    for (std::size_t d = 0; d < shape.size(); ++d) os << (d ? ", " : "") << shape[d];
    os << "]";
  }
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
    const Record rec = trace.read(i);
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
      os << who << " got another result than rank 0 (a collective gives every rank the same bits)";
      break;
    case Kind::kStopped: os << who << " stopped recording here while the others went on or raised"; break;
  }
  if (!detail.empty()) os << " (" << detail << ")";
  return os.str();
}

nlohmann::json CulpritRank::to_json() const {
  return {{"kind", to_string(kind)}, {"step", step},     {"seq", seq},          {"collective", collective},
          {"ranks", ranks},          {"detail", detail}, {"message", message()}};
}

nlohmann::json RankAttribution::to_json() const {
  return {{"world_size", run.world_size},
          {"run_id", run.run_id},
          {"traces", traces},
          {"collectives", collectives},
          {"culprit", culprit ? culprit->to_json() : nlohmann::json()},
          {"notes", notes}};
}

RankAttribution attribute_ranks(const std::vector<const TraceReader*>& traces) {
  if (traces.size() < 2) throw Error("naming a culprit rank needs the traces of two or more ranks of one run");
  RankAttribution out;
  std::vector<int> rank_of;
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
    std::string& slot = out.traces[static_cast<std::size_t>(h.ranks->rank)];
    if (!slot.empty())
      throw Error(t->path() + ": rank " + std::to_string(h.ranks->rank) + " is given twice (also " + slot + ")");
    slot = t->path();
    rank_of.push_back(h.ranks->rank);
    if (t->truncated()) out.notes.push_back(t->path() + ": " + t->warning());
  }
  for (int r = 0; r < out.run.world_size; ++r) {
    if (out.traces[static_cast<std::size_t>(r)].empty())
      out.notes.push_back("rank " + std::to_string(r) + "'s trace is not given: it is left out of the comparison");
  }
  std::vector<std::map<std::pair<std::int64_t, std::int64_t>, Seen>> seen;
  std::set<std::pair<std::int64_t, std::int64_t>> keys;
  for (const TraceReader* t : traces) {
    seen.push_back(collectives_of(*t));
    for (const auto& [k, v] : seen.back()) keys.insert(k);
  }
  for (const auto& key : keys) {
    ++out.collectives;
    std::vector<std::size_t> have, missing;
    for (std::size_t i = 0; i < seen.size(); ++i) (seen[i].count(key) ? have : missing).push_back(i);
    const Seen& first = seen[have.front()].at(key);
    CulpritRank c;
    c.step = key.first;
    c.seq = key.second;
    c.collective = first.record.call.describe();
    auto ranks = [&](const std::vector<std::size_t>& idx) {
      std::vector<int> r;
      for (std::size_t i : idx) r.push_back(rank_of[i]);
      std::sort(r.begin(), r.end());
      return r;
    };
    if (!missing.empty()) {
      c.kind = CulpritRank::Kind::kStopped;
      c.ranks = ranks(missing);
      c.detail = "their traces hold no record of it";
      out.culprit = std::move(c);
      return out;
    }
    // The majority key is rank 0's (or the first given); a rank with another key desynced.
    std::vector<std::size_t> other_key;
    for (std::size_t i : have) {
      if (!same_key(seen[i].at(key), first)) other_key.push_back(i);
    }
    if (!other_key.empty()) {
      c.kind = CulpritRank::Kind::kDesync;
      c.ranks = ranks(other_key);
      c.detail = "rank " + std::to_string(rank_of[have.front()]) + " ran " + key_text(first) + ", rank " +
                 std::to_string(rank_of[other_key.front()]) + " " + key_text(seen[other_key.front()].at(key));
      out.culprit = std::move(c);
      return out;
    }
    std::vector<std::size_t> nonfinite;
    for (std::size_t i : have) {
      if (seen[i].at(key).record.input.nonfinite > 0) nonfinite.push_back(i);
    }
    if (!nonfinite.empty()) {
      c.kind = CulpritRank::Kind::kNonFinite;
      c.ranks = ranks(nonfinite);
      std::ostringstream d;
      for (std::size_t n = 0; n < nonfinite.size(); ++n) {
        const CollectiveRecord& r = seen[nonfinite[n]].at(key).record;
        d << (n ? "; " : "") << "rank " << rank_of[nonfinite[n]] << ": " << r.input.nonfinite
          << " NaN/Inf element(s), max |x| of the finite " << number_text(r.input.abs_max);
      }
      c.detail = d.str();
      out.culprit = std::move(c);
      return out;
    }
    // A rank whose largest |x| dwarfs every other rank's: finite, but no shard differs so.
    std::vector<std::size_t> huge;
    std::ostringstream why;
    for (std::size_t i : have) {
      double others = 0;
      for (std::size_t j : have) {
        if (j != i) others = std::max(others, seen[j].at(key).record.input.abs_max);
      }
      const double mine = seen[i].at(key).record.input.abs_max;
      if (others > 0 && mine >= kMagnitudeOutlier * others) {
        huge.push_back(i);
        why << (why.tellp() > 0 ? "; " : "") << "rank " << rank_of[i] << ": max |x| " << number_text(mine)
            << ", the other ranks' at most " << number_text(others);
      }
    }
    if (!huge.empty()) {
      c.kind = CulpritRank::Kind::kMagnitude;
      c.ranks = ranks(huge);
      c.detail = why.str();
      out.culprit = std::move(c);
      return out;
    }
    std::vector<std::size_t> other_result;
    for (std::size_t i : have) {
      if (seen[i].at(key).results != first.results) other_result.push_back(i);
    }
    if (!other_result.empty()) {
      c.kind = CulpritRank::Kind::kResult;
      c.ranks = ranks(other_result);
      c.detail = "result digests differ";
      out.culprit = std::move(c);
      return out;
    }
  }
  // Every collective agreed. A rank killed mid-run (SIGKILL, the OOM killer) leaves a trace that
  // was never closed and notes no exception, while its peers time out in the next collective and
  // note that: the killed rank is the culprit.
  std::vector<std::size_t> vanished, raised;
  std::int64_t step = -1;
  std::string what;
  for (std::size_t i = 0; i < traces.size(); ++i) {
    std::optional<std::string> exception;
    std::int64_t last = -1;
    for (std::size_t r = 0; r < traces[i]->records().size(); ++r) {
      const RecordInfo& info = traces[i]->records()[r];
      if (info.type == RecordType::kStepBegin) last = std::max(last, info.step);
      if (info.type == RecordType::kEvent) {
        const EventRecord e = EventRecord::decode(traces[i]->read(r), traces[i]->path());
        if (e.exception) exception = e.exception->what;
      }
    }
    if (exception) {
      raised.push_back(i);
      what = *exception;
    } else if (!traces[i]->complete()) {
      vanished.push_back(i);
      step = last;
    }
  }
  if (!vanished.empty() && !raised.empty()) {
    CulpritRank c;
    c.kind = CulpritRank::Kind::kStopped;
    c.step = step;
    std::sort(vanished.begin(), vanished.end(), [&](std::size_t a, std::size_t b) { return rank_of[a] < rank_of[b]; });
    for (std::size_t i : vanished) c.ranks.push_back(rank_of[i]);
    c.detail = "its trace ends in step " + std::to_string(step) +
               " without a close or an exception (the process was killed); the others raised: " + what.substr(0, 200);
    out.culprit = std::move(c);
  }
  return out;
}

}  // namespace retrace
