// `retrace demo`: trains a tiny GPT for a few steps with checkpointed segments and live
// recompute verification, checks that loss and every gradient are bitwise equal to the same step
// without checkpointing, then runs the negative control (RNG preservation off) and shows that the
// verifier catches it.
#include "commands.h"

#include <retrace/error.h>

#include <retrace/models.h>
#include <retrace/verify.h>

#include <boost/program_options.hpp>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <cstring>
#include <iomanip>
#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;

namespace {

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().const_data_ptr(), b.contiguous().const_data_ptr(), a.nbytes()) == 0;
}

// Loss and gradients of one step, without touching the parameters.
struct StepResult {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

StepResult run_step(models::TinyGpt& model, const models::Batch& batch, const models::CheckpointPlan& plan,
                    std::uint64_t seed) {
  model.zero_grad();
  torch::manual_seed(seed);
  at::Tensor loss = model.loss(batch, plan);
  loss.backward();
  StepResult r{loss.detach().clone(), {}};
  for (const auto& p : model.parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

}  // namespace

int run_demo(const std::vector<std::string>& args) {
  int layers = 4, segments = 2, steps = 3;
  std::string device_name = "cpu";
  po::options_description opts("retrace demo [options]");
  opts.add_options()("help,h", "show this help")("layers", po::value<int>(&layers)->default_value(4),
                                                 "transformer blocks")(
      "segments", po::value<int>(&segments)->default_value(2), "checkpointed segments (1..layers)")(
      "steps", po::value<int>(&steps)->default_value(3), "training steps")(
      "device", po::value<std::string>(&device_name)->default_value("cpu"), "cpu or cuda");
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(opts).run(), vm);
  if (vm.count("help")) {
    std::cout << opts;
    return 0;
  }
  po::notify(vm);
  if (layers < 1 || segments < 1 || segments > layers || steps < 1) {
    throw Error("need layers >= 1, 1 <= segments <= layers and steps >= 1 (got layers " + std::to_string(layers) +
                ", segments " + std::to_string(segments) + ", steps " + std::to_string(steps) + ")");
  }
  if (device_name != "cpu" && device_name != "cuda") {
    throw Error("--device must be cpu or cuda, got '" + device_name + "'");
  }
  const c10::Device device(device_name);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    throw Error("--device cuda: no CUDA device is visible on this machine; use --device cpu");
  }

  torch::manual_seed(1234);
  models::GptConfig config;
  config.layers = layers;
  models::TinyGpt model(config);
  model.to(device);
  model.train();
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(1e-3));
  const models::CheckpointPlan plain{0, {}};
  const models::CheckpointPlan checkpointed{segments, {}};

  std::cout << "retrace demo: tiny GPT, " << layers << " blocks, d_model " << config.d_model << ", dropout "
            << config.dropout << ", " << segments << " checkpointed segments, " << device.str() << "\n";
  bool ok = true;
  RecomputeVerifier verifier({VerifyPolicy::kWarn, /*keep_values=*/true});
  for (int step = 1; step <= steps; ++step) {
    models::Batch batch = model.make_batch(step);
    batch.input = batch.input.to(device);
    batch.target = batch.target.to(device);
    const StepResult reference = run_step(model, batch, plain, 100 + step);
    StepResult result;
    {
      ObserverScope scope(verifier);
      verifier.reset();
      result = run_step(model, batch, checkpointed, 100 + step);
    }
    std::size_t equal = 0;
    for (std::size_t i = 0; i < result.grads.size(); ++i) equal += same_bits(result.grads[i], reference.grads[i]);
    const bool loss_equal = same_bits(result.loss, reference.loss);
    const bool step_ok = verifier.mismatches().empty() && loss_equal && equal == result.grads.size();
    ok &= step_ok;
    std::cout << "step " << step << "  loss " << std::fixed << std::setprecision(6) << result.loss.item<double>()
              << "  recompute: " << verifier.verified_outputs() << " outputs verified, " << verifier.mismatches().size()
              << " mismatches  vs plain step: loss " << (loss_equal ? "bitwise equal" : "DIFFERS") << ", grads "
              << equal << "/" << result.grads.size() << " bitwise equal\n";
    optimizer.step();  // parameters move on with the checkpointed step's gradients
  }

  // Negative control: without RNG preservation, dropout draws new masks on recompute.
  models::CheckpointPlan broken = checkpointed;
  broken.options.preserve_rng_state = false;
  RecomputeVerifier control({VerifyPolicy::kWarn, false});
  {
    ObserverScope scope(control);
    models::Batch batch = model.make_batch(99);
    batch.input = batch.input.to(device);
    batch.target = batch.target.to(device);
    std::cerr.setstate(std::ios::failbit);  // the control's warnings are expected
    run_step(model, batch, broken, 7);
    std::cerr.clear();
  }
  const auto caught = control.mismatches();
  std::cout << "negative control (preserve_rng_state off): "
            << (caught.empty() ? "NOT caught" : "caught: " + caught.front().message()) << "\n";
  ok &= !caught.empty();
  std::cout << "result: " << (ok ? "PASS" : "FAIL") << "\n";
  return ok ? 0 : 1;
}

}  // namespace retrace::cli
