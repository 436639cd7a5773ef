#pragma once
// Triage of a failing run, the seed articles' manual walk made a command: from the last good
// state before the failure, re-run the next steps under each variant -- checkpointing off,
// clipping at 1.0 and 0.5, LR / 10 with warmup, fp32 instead of fp16/bf16, dynamic loss scaling,
// more and fewer segments, half batch, skipping non-finite steps -- and rank the variants that
// avoid the failure by their cost. And classify the failing step as persistent, transient or
// nondeterministic by re-executing it from its recorded state in the same process.

#include <retrace/runner.h>
#include <retrace/scenario.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace retrace {

struct DiagnoseOptions {
  std::int64_t steps = 0;     // steps re-run per variant (0: to the end of the run); must reach
                              // the failing step (retrace::Error otherwise)
  std::int64_t lookback = 1;  // start this many steps before the first failing step
  int threads = 1;            // LibTorch intra-op threads while variants are timed (0: leave as is)
  int repeats = 5;            // each variant's cost is the median over this many timed runs,
                              // taken in rounds over all variants after a warm-up run
};

struct VariantResult {
  std::string name;             // "clip 1.0"
  std::string change;           // the config change, e.g. "defenses.clip: global, max_norm 1"
  bool fixes = false;           // the failure does not occur, training goes on and the loss did
                                // not run away (above 2x the run's first loss)
  std::string outcome;          // "held (final loss X)" or what still fails
  std::string caveat;           // e.g. an injected segment fault that cannot fire without checkpointing
  double seconds_per_step = 0;  // CPU seconds per step (the process's), median over the repeats
  double cost = 0;              // seconds per step relative to the baseline (the run as it was)
  std::int64_t skipped_steps = 0;
  double final_loss = 0;
  std::vector<double> seconds_per_step_runs;  // one per repeat, taken in rounds over all variants
};

struct Classification {
  // persistent: re-executing the failing step from its state fails again, bit for bit.
  // transient: it does not fail again (a fault from outside the recorded state).
  // nondeterministic: two re-executions from the same state differ.
  // none: no step went non-finite (the failure is an expectation over the run).
  std::string kind = "none";
  std::int64_t step = -1;
  std::string detail;
  // persistent by the scenario's own injection, which is due again on later steps of the run (a
  // NaN injected on steps 3..10): no rollback, retry or earlier start gets past it.
  bool injected_fault_repeats = false;
};

struct Diagnosis {
  std::string source;              // scenario origin or trace path
  std::int64_t failing_step = -1;  // first step whose loss, gradient norm or parameters went
                                   // non-finite, or that raised
  // What failed: "loss", "gradient norm", "parameters" (non-finite after the step), "raised",
  // "expectation" (no step failed, the run missed an expectation: a final loss too high), or
  // "none". The scenario's and its trace's diagnoses agree on it.
  std::string failure_kind = "none";
  std::string failure;  // what failed in the run as it was
  std::int64_t from_step = 1, to_step = 1;
  std::int64_t lookback = 1;            // DiagnoseOptions::lookback as asked; from_step is later
                                        // where it reaches before step 1 (the report says so)
  VariantResult baseline;               // the run as it was, over the same window
  std::vector<VariantResult> variants;  // ranked: fixing ones first, cheapest first
  // Variants that cannot apply, one line each with why: a scenario on a registered program
  // (`program:`) owns its checkpointing, precision and batch size.
  std::vector<std::string> not_applicable;
  Classification classification;
  std::string report() const;      // the table a person reads
  nlohmann::json to_json() const;  // what --json writes (indented by 2)
};

Diagnosis diagnose_scenario(const ScenarioSpec& spec, const DiagnoseOptions& options = {});
// A trace recorded from a scenario ("retrace.scenario", a built-in model or a registered program): its first non-finite
// step is found in the trace, the state before it restored by replaying up to it.
Diagnosis diagnose_trace(const std::string& path, const DiagnoseOptions& options = {});

}  // namespace retrace
