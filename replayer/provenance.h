#pragma once
// Op-level non-finite provenance. Replay only: the recorded run never pays for it.

#include <retrace/program.h>
#include <retrace/replayer.h>

#include <optional>

namespace retrace {

// Runs program.step(step, batch) with an at::RecordFunction callback on every op (forward,
// recompute, autograd backward functions, optimizer) and returns the first op whose output holds
// NaN or Inf, attributed to its checkpointed segment and phase, with stats of its inputs and
// outputs. The caller restores state and RNG first. Costs a non-finite scan of every op output
// and a copy of every in-place op's destination (its inputs are reported as they were before it).
// A step that raises ends the search: what was found before it is returned. `known_nonfinite`:
// the step's outcome or state is non-finite (false for a step re-run because it raised), which
// lets an infinity by design that ops carried on to the end be named though nothing holds it now.
std::optional<NonFiniteOrigin> find_first_nonfinite(Program& program, std::int64_t step,
                                                    const std::vector<NamedTensor>& batch, bool known_nonfinite);

// Min, max, |max| and non-finite counts of a tensor.
TensorStats tensor_stats(const std::string& name, const at::Tensor& t);

}  // namespace retrace
