#pragma once
// checkpoint_sequential over a torch::nn::Sequential, the C++ form of
// torch.utils.checkpoint.checkpoint_sequential(functions, segments, input). A separate header
// because it needs LibTorch's module headers, which checkpoint.h keeps out.

#include <retrace/checkpoint.h>

#include <torch/nn/modules/container/sequential.h>

namespace retrace {

// Splits the Sequential's children into `segments` checkpointed segments named after the
// children ("0..3", or "encoder..head" when registered with names). Every child must take and
// return one tensor. The lambdas share the children, so the Sequential must stay alive until
// backward.
inline at::Tensor checkpoint_sequential(torch::nn::Sequential& sequential, int segments, const at::Tensor& input,
                                        const CheckpointOptions& options = {}) {
  std::vector<Stage> stages;
  const auto children = sequential->named_children();
  std::size_t i = 0;
  for (auto it = sequential->begin(); it != sequential->end(); ++it, ++i) {
    stages.push_back(
        {children[i].key(), [module = *it](const at::Tensor& x) mutable { return module.forward<at::Tensor>(x); }});
  }
  return checkpoint_sequential(stages, segments, input, options);
}

}  // namespace retrace
