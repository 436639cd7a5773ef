#pragma once
// Test support: run one forward/backward of a SegmentedModel and snapshot what it produced.

#include <retrace/models.h>

#include <string>
#include <utility>
#include <vector>

namespace retrace::test {

struct StepSnapshot {
  at::Tensor loss;
  at::Tensor input_grad;                                  // grad of the embedding output (the body's input)
  std::vector<std::pair<std::string, at::Tensor>> grads;  // every parameter, by name
};

// Zeroes the grads, seeds the CPU generator with `seed`, runs loss + backward under `plan`.
inline StepSnapshot run_step(models::SegmentedModel& model, const models::Batch& batch,
                             const models::CheckpointPlan& plan, std::uint64_t seed = 42) {
  model.zero_grad();
  torch::manual_seed(seed);
  at::Tensor x = model.embed(batch.input);
  if (!x.requires_grad()) x.requires_grad_(true);
  x.retain_grad();
  at::Tensor loss = model.criterion(model.head(model.body(x, plan)), batch.target);
  loss.backward();
  StepSnapshot s;
  s.loss = loss.detach().clone();
  s.input_grad = x.grad().defined() ? x.grad().clone() : at::Tensor();
  for (const auto& item : model.named_parameters()) {
    s.grads.emplace_back(item.key(), item.value().grad().defined() ? item.value().grad().clone() : at::Tensor());
  }
  return s;
}

}  // namespace retrace::test
