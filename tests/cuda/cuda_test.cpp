// GPU tests: each skips, saying why, where no CUDA device is visible. scripts/gpu-check runs them
// on a GPU machine.
#include "../support/training.h"

#include <retrace/checkpoint.h>
#include <retrace/determinism.h>
#include <retrace/digest.h>
#include <retrace/gtest.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/rng.h>
#include <retrace/scenario.h>
#include <retrace/snapshot.h>
#include <retrace/trainer.h>
#include <retrace/version.h>

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <unistd.h>

namespace retrace {
namespace {

#define RETRACE_REQUIRE_CUDA()                                                        \
  do {                                                                                \
    if (!kBuiltWithCuda) GTEST_SKIP() << "retrace was built without CUDA sources";    \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible";    \
  } while (0)

TEST(CudaDigest, EqualTensorsDigestEqualOnDevice) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(0);
  const at::Tensor a = torch::randn({1000, 37}, torch::kCUDA);
  const Digest d = digest(a);
  EXPECT_EQ(d.algorithm, DigestAlgorithm::kDeviceLanes);
  EXPECT_EQ(d, digest(a.clone()));
  EXPECT_NE(d, digest(a.view({37, 1000})));
  EXPECT_EQ(digest(a.t()), digest(a.t().contiguous()));
  const at::Tensor odd = a.view(-1).narrow(0, 1, 999);  // 4-byte offset: not 8-byte aligned
  EXPECT_EQ(digest(odd), digest(odd.clone()));
}

TEST(CudaDigest, OneBitFlipChangesTheDigest) {
  RETRACE_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(1);
    const at::Tensor base = torch::randn({257}, torch::kCUDA).to(dtype);  // odd size: tail bytes
    const Digest reference = digest(base);
    const at::Tensor host = base.cpu();
    for (std::size_t byte = 0; byte < host.nbytes(); byte += 7) {
      for (int bit = 0; bit < 8; ++bit) {
        at::Tensor flipped = host.clone();
        static_cast<std::uint8_t*>(flipped.data_ptr())[byte] ^= static_cast<std::uint8_t>(1u << bit);
        EXPECT_NE(digest(flipped.to(torch::kCUDA)), reference) << "byte " << byte << " bit " << bit;
      }
    }
  }
}

TEST(CudaRng, StateRestoresTheSameDropoutMasks) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(3);
  const c10::Device dev(torch::kCUDA, 0);
  const RngState state = RngState::capture({dev});
  ASSERT_EQ(state.generators().size(), 2u);
  EXPECT_EQ(state.generators()[1].bytes.size(), 16u);  // seed + offset
  const at::Tensor first = torch::dropout(torch::ones({4096}, dev), 0.5, true);
  state.restore();
  EXPECT_BITWISE_EQ(first, torch::dropout(torch::ones({4096}, dev), 0.5, true));
}

TEST(CudaCheckpoint, TinyGptWithDropoutBitwiseEqualToPlain) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 4;
  c.dropout = 0.2;
  models::TinyGpt model(c);
  model.to(torch::kCUDA);
  model.train();
  models::Batch batch = model.make_batch(7);
  batch.input = batch.input.cuda();
  batch.target = batch.target.cuda();
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);  // cuBLAS determinism
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  const test::StepSnapshot plain = test::run_step(model, batch, {0, {}});
  const test::StepSnapshot ckpt = test::run_step(model, batch, {2, {}});
  at::globalContext().setDeterministicAlgorithms(false, false);
  EXPECT_BITWISE_EQ(plain.loss, ckpt.loss);
  EXPECT_BITWISE_EQ(plain.input_grad, ckpt.input_grad);
  for (std::size_t i = 0; i < plain.grads.size(); ++i) {
    SCOPED_TRACE(plain.grads[i].first);
    EXPECT_BITWISE_EQ(plain.grads[i].second, ckpt.grads[i].second);
  }
}

// digest_async queues the kernel and the 16-byte copy; finished, it equals digest().
TEST(CudaDigest, AsyncDigestEqualsTheSynchronousOne) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(2);
  const at::Tensor a = torch::randn({4096, 129}, torch::kCUDA).to(torch::kBFloat16);
  std::vector<PendingDigest> pending;
  for (int i = 0; i < 8; ++i) pending.push_back(digest_async(a.narrow(0, i * 512, 512)));
  for (int i = 0; i < 8; ++i) {
    EXPECT_FALSE(pending[i].ready());
    EXPECT_EQ(pending[i].get(), digest(a.narrow(0, i * 512, 512))) << i;
    EXPECT_EQ(pending[i].get(), pending[i].get());  // get() may be called again
  }
}

// An asynchronous snapshot is never torn by an in-place update queued after it, even when the
// device is busy and the copy to the host starts late.
TEST(CudaSnapshot, TakenBeforeAnInPlaceUpdateHoldsTheOldValues) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(4);
  at::Tensor x = torch::randn({64, 1024, 1024}, torch::kCUDA);  // 256 MiB: the copy takes a while
  const at::Tensor before = x.cpu();
  at::Tensor busy = torch::randn({4096, 4096}, torch::kCUDA);
  for (int i = 0; i < 20; ++i) busy = busy.matmul(busy).tanh_();  // keep the stream busy
  const HostSnapshot snap = snapshot_to_host(x);
  EXPECT_TRUE(snap.host.is_pinned());
  x.mul_(-3).add_(1);  // queued right behind the snapshot on the same stream
  x.zero_();
  ASSERT_TRUE(snap.wait);
  snap.wait();
  EXPECT_BITWISE_EQ(before, snap.host);
  // Control: a snapshot taken after the update holds the new values.
  const HostSnapshot after = snapshot_to_host(x);
  after.wait();
  EXPECT_BITWISE_EQ(torch::zeros_like(before), after.host);
}

std::string temp_trace(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("retrace_cuda_" + name + "_" + std::to_string(::getpid()) + ".trace")).string();
}

std::string gpt_yaml(const std::string& name, const std::string& device, const std::string& training_extra,
                     const std::string& sections = "") {
  // The CPU variant (which checks the test itself on every machine) is smaller: fp16 autocast is
  // slow on CPUs.
  const std::string model = device == "cuda" ? "layers: 4, d_model: 64, heads: 4" : "layers: 2, d_model: 16, heads: 2";
  return "name: " + name + "\nmodel: {type: tiny_gpt, " + model + ", dropout: 0.1}\n" +
         "data: {batch: 4, seed: 5}\ntraining: {steps: 4, optimizer: adamw, lr: 0.001, segments: 2, device: " + device +
         ", " + training_extra + "}\n" + sections;
}

// Record, then replay: tiny GPT in bf16, and in fp16 with dynamic loss scaling, in digest mode and
// full mode, under the determinism guard. Run on the GPU, and on the CPU so that the test's own
// logic is exercised on every machine.
struct RecordedCase {
  std::string label;
  std::vector<StepOutcome> outcomes;  // as recorded
  ReplayResult replay;                // of steps 1..4
};

std::vector<RecordedCase> record_then_replay_bf16_fp16(const std::string& device) {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  DeterministicGuard deterministic;
  register_builtin_programs();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bf16", gpt_yaml("bf16", device, "precision: bf16")},
      {"fp16", gpt_yaml("fp16", device, "precision: fp16", "defenses: {loss_scaling: {init_scale: 65536}}\n")}};
  std::vector<RecordedCase> results;
  for (const auto& [name, yaml] : cases) {
    for (RecordMode mode : {RecordMode::kDigest, RecordMode::kFull}) {
      RecordedCase c;
      c.label = device + " " + name + (mode == RecordMode::kFull ? " full" : " digest");
      const std::string path = temp_trace(device + name);
      {
        ScenarioProgram program(parse_scenario_text(yaml, name));
        RecorderOptions options;
        options.mode = mode;
        Recorder recorder(path, program, options);
        c.outcomes = record_run(program, recorder, 4);
        recorder.close();
      }
      const TraceReader trace(path);
      std::unique_ptr<Program> program = program_from_trace(trace);
      ReplayOptions all;
      all.from = 1;
      c.replay = Replayer(trace, *program).run(all);
      results.push_back(std::move(c));
      std::filesystem::remove(path);
    }
  }
  return results;
}

void expect_four_finite_steps_reproduced(const std::vector<RecordedCase>& results) {
  ASSERT_EQ(results.size(), 4u);
  for (const RecordedCase& c : results) {
    SCOPED_TRACE(c.label);
    ASSERT_EQ(c.outcomes.size(), 4u);
    for (const StepOutcome& o : c.outcomes) EXPECT_TRUE(o.finite());
    EXPECT_TRUE(c.replay.reproduced) << c.replay.to_json().dump(2);
    EXPECT_EQ(c.replay.from_step, 1);
    EXPECT_EQ(c.replay.to_step, 4);
  }
}

TEST(CudaRecordReplay, TinyGptBf16AndFp16WithLossScalingReproduceBitwise) {
  RETRACE_REQUIRE_CUDA();
  expect_four_finite_steps_reproduced(record_then_replay_bf16_fp16("cuda"));
}

TEST(CudaRecordReplay, SameCasesOnTheCpu) { expect_four_finite_steps_reproduced(record_then_replay_bf16_fp16("cpu")); }

// A full training step (forward, backward with recompute, AdamW) from a fresh program built from
// one scenario, under the determinism guard, with the global RNG seeded `seed`: the state before
// and after the step.
struct OneStep {
  std::vector<at::Tensor> before, after;
};

OneStep full_step(const std::string& device, std::uint64_t seed) {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  DeterministicGuard deterministic;
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(gpt_yaml("twice", device, "precision: bf16"), "twice"));
  OneStep r;
  for (const NamedTensor& s : program.state()) r.before.push_back(s.tensor.cpu());
  torch::manual_seed(seed);
  if (device == "cuda") torch::cuda::manual_seed_all(seed);
  program.step(1, program.batch(1), nullptr);
  for (const NamedTensor& s : program.state()) r.after.push_back(s.tensor.cpu());
  return r;
}

// Same seed twice: identical bits. Controls: the step changed the state, and another seed (other
// dropout masks) gives other bits, so the comparison can fail.
void expect_step_deterministic(const std::string& device) {
  const OneStep first = full_step(device, 11), second = full_step(device, 11), other = full_step(device, 12);
  ASSERT_FALSE(first.after.empty());
  ASSERT_EQ(first.after.size(), second.after.size());
  for (std::size_t i = 0; i < first.after.size(); ++i) EXPECT_BITWISE_EQ(first.after[i], second.after[i]) << i;
  bool stepped = false, seed_matters = false;
  for (std::size_t i = 0; i < first.after.size(); ++i) {
    stepped = stepped || !first.after[i].equal(first.before[i]);
    seed_matters = seed_matters || !first.after[i].equal(other.after[i]);
  }
  EXPECT_TRUE(stepped) << "the step left the state unchanged: the comparison proves nothing";
  EXPECT_TRUE(seed_matters) << "another seed gave the same bits: the comparison cannot fail";
}

TEST(CudaDeterminism, AFullStepTwiceGivesIdenticalBits) {
  RETRACE_REQUIRE_CUDA();
  expect_step_deterministic("cuda");
}

TEST(CudaDeterminism, SameOnTheCpu) { expect_step_deterministic("cpu"); }

}  // namespace
}  // namespace retrace
