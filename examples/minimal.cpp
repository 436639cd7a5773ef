// The README's example: checkpoint each block of your own model with retrace::checkpoint and
// have every recompute verified bit for bit against its forward.
#include <retrace/checkpoint.h>  // retrace::core: checkpoint
#include <retrace/verify.h>      // retrace::core: RecomputeVerifier
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> blocks;
  std::vector<at::Tensor> parameters;
  for (int i = 0; i < 4; ++i) {
    blocks.emplace_back(torch::nn::Linear(64, 64), torch::nn::GELU(), torch::nn::Dropout(0.1));
    for (const auto& p : blocks.back()->parameters()) parameters.push_back(p);
  }
  torch::optim::AdamW optimizer(parameters, torch::optim::AdamWOptions(1e-3));

  retrace::RecomputeVerifier verifier({retrace::VerifyPolicy::kThrow, /*keep_values=*/false});
  retrace::ObserverScope verify(verifier);  // every recompute below is compared with its forward

  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = torch::randn({32, 64});
    at::Tensor h = x;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      h = retrace::checkpoint(
          "block" + std::to_string(i), [block = blocks[i]](const at::Tensor& in) mutable { return block->forward(in); },
          h);
    }
    at::Tensor loss = h.pow(2).mean();
    optimizer.zero_grad();
    loss.backward();  // recomputes each block under its forward's RNG state; throws on a mismatch
    optimizer.step();
    std::cout << "step " << step << " loss " << loss.item<float>() << ", " << verifier.verified_outputs()
              << " recomputed outputs verified bitwise\n";
  }
  return verifier.mismatches().empty() ? 0 : 1;
}
