#pragma once
// Which rank went bad first in a data-parallel run: the rank traces of one run (retrace/dist.h,
// one trace per rank, sharing a run id) compared collective by collective.

#include <retrace/collectives.h>
#include <retrace/trace.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

struct CulpritRank {
  enum class Kind {
    kNonFinite,  // the ranks' contributions held NaN or Inf (the others' were finite)
    kMagnitude,  // a rank's contribution's max |x| is kMagnitudeOutlier times the others' largest
                 // or more (an exponent bit flip: finite, but no shard's gradients differ so)
    kDesync,     // the ranks called different collectives here (op, dtypes or shapes)
    kResult,     // the ranks got different results (a collective gives every rank the same bits)
    kStopped,    // the ranks' traces end here: they stopped recording while the others went on
    kRaised,     // the ranks raised outside any collective while the others waited in one
    kStepEnd,    // every collective agreed, but the ranks' step_end records do not: a rank's step
                 // ended non-finite, or the ranks' state after the step differs (seq -1)
  };
  Kind kind = Kind::kNonFinite;
  std::int64_t step = -1;
  std::int64_t seq = -1;        // the collective's position in the step
  std::string collective;       // "allreduce(sum)"
  std::vector<int> ranks;       // the culprits, ascending
  std::string detail;           // what each culprit's contribution held, or what differs
  std::string message() const;  // "step 3 collective #0 allreduce(sum): rank 1's contribution went non-finite ..."
  nlohmann::json to_json() const;
};
// "non_finite", "magnitude", "desync", "result", "stopped", "raised", "step_end"
const char* to_string(CulpritRank::Kind kind);

// The factor kMagnitude takes: shards of one batch give gradients within a few x of each other;
// an exponent bit flip multiplies one element by 2^64 or more.
inline constexpr double kMagnitudeOutlier = 1e6;

struct RankAttribution {
  RankInfo run;                     // world_size and run_id of the run
  std::vector<std::string> traces;  // the trace of rank r at index r ("" when not given)
  std::int64_t collectives = 0;     // collective keys compared
  std::optional<CulpritRank> culprit;
  // Every trace was closed and none noted an exception: with no culprit, no rank went bad. A
  // run that raised or died without a culprit only had no collective disagree (see notes).
  bool all_clean = true;
  std::vector<std::string> notes;  // missing ranks, truncated traces, exceptions, handled steps
  // One line: "culprit: ...", "no rank went bad: ..." (all_clean) or "no collective disagreed, ...".
  std::string verdict() const;
  nlohmann::json to_json() const;
};

// Compares the collective records of every given rank trace of one run, in (step, seq) order,
// and names the first collective where a rank's contribution went non-finite, the ranks called
// different collectives, their results differ, or some ranks' traces end. Where every collective
// agreed, the ranks' step_end records are compared step by step: a rank whose step ended
// non-finite while the others' did not (where every rank skipped it, a note, unless it never
// ended finite again), or state after the step that differs between ranks (kStepEnd). Needs two or more rank
// traces; throws retrace::Error when they are not of one data-parallel run (another run id or
// world size, a rank twice, a trace without ranks).
RankAttribution attribute_ranks(const std::vector<const TraceReader*>& traces);

}  // namespace retrace
