// GPU tests: each skips, saying why, where no CUDA device is visible. scripts/gpu-check runs them
// on a GPU machine.
#include "../support/perturb.h"
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
#include <retrace/verify.h>
#include <retrace/version.h>

#include <torch/torch.h>
#if RETRACE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <unistd.h>

namespace retrace {
namespace {

// On the GPU machine scripts/gpu-check sets RETRACE_REQUIRE_GPU=1: there a GPU test that would
// skip fails instead, so a green run cannot hide an untested GPU path.
bool gpu_required() {
  const char* v = std::getenv("RETRACE_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

#define RETRACE_REQUIRE_CUDA()                                                                  \
  do {                                                                                          \
    const char* why = !kBuiltWithCuda                ? "retrace was built without CUDA sources" \
                      : !torch::cuda::is_available() ? "no CUDA device is visible"              \
                                                     : nullptr;                                 \
    if (why != nullptr && gpu_required()) FAIL() << why << " (RETRACE_REQUIRE_GPU=1)";          \
    if (why != nullptr) GTEST_SKIP() << why;                                                    \
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

// The batched digest (the recorder's path for the state and the gradients) equals the one-by-one
// digest for every tensor: 300 tensors (three launches), every size from empty to 6 MiB, odd byte
// counts, views at odd offsets, several dtypes. Control: one flipped bit changes that tensor's
// digest and no other's.
TEST(CudaDigest, BatchedDigestsEqualOneByOne) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(5);
  const at::Tensor big = torch::randn({1 << 20}, torch::kCUDA);
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 300; ++i) {
    const std::int64_t n = (i * 7919) % 4099;
    at::Tensor t = big.narrow(0, i % 5, n);  // offsets of 4 bytes: not 8-byte aligned when odd
    if (i % 3 == 1) t = t.to(at::kHalf);     // 2-byte elements: odd lengths leave a tail
    if (i % 3 == 2) t = t.to(at::kBFloat16).view({-1}).narrow(0, 0, n / 2).t();
    tensors.push_back(t);
  }
  tensors.push_back(big.view({1024, 1024}) * 3);  // 4 MiB
  tensors.push_back(torch::empty({0}, torch::kCUDA));
  const std::vector<PendingDigest> batched = digest_async_many(tensors);
  ASSERT_EQ(batched.size(), tensors.size());
  std::vector<Digest> got;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    got.push_back(batched[i].get());
    EXPECT_EQ(got.back(), digest(tensors[i])) << "tensor " << i << " of " << tensors.size();
  }
  // Control: flip one bit of tensor 41 (a copy) and batch again.
  std::vector<at::Tensor> flipped = tensors;
  at::Tensor host = tensors[41].contiguous().cpu();
  static_cast<std::uint8_t*>(host.data_ptr())[3] ^= 0x10;
  flipped[41] = host.to(torch::kCUDA);
  const std::vector<PendingDigest> again = digest_async_many(flipped);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (i == 41) {
      EXPECT_NE(again[i].get(), got[i]);
    } else {
      EXPECT_EQ(again[i].get(), got[i]) << i;
    }
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

// Under the determinism guard at::empty NaN-fills every new tensor; the snapshot's staging and
// pinned buffers and the digest's lanes are allocated without that fill (they are overwritten in
// full). They must still hold exactly the source's bytes.
TEST(CudaSnapshot, UnderTheDeterminismGuardHoldsTheRightBytes) {
  RETRACE_REQUIRE_CUDA();
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  DeterministicGuard deterministic;
  // Control: the guard's fill is on, so a buffer that skipped its copy would read NaN.
  EXPECT_TRUE(torch::empty({16}, torch::TensorOptions().pinned_memory(true)).isnan().all().item<bool>());
  torch::manual_seed(6);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor x = torch::randn({1024, 257}, torch::kCUDA).to(dtype);
    const at::Tensor expected = x.cpu();
    const HostSnapshot snap = snapshot_to_host(x);
    EXPECT_TRUE(snap.host.is_pinned());
    ASSERT_TRUE(snap.wait);
    snap.wait();
    EXPECT_BITWISE_EQ(expected, snap.host);
    const PendingDigest pending = digest_async(x);
    EXPECT_EQ(pending.get(), digest(x));
    EXPECT_EQ(pending.get(), digest(expected.cuda()));
    EXPECT_NE(pending.get(), digest((x + 1).contiguous()));  // control: other values, other digest
  }
}

using test::PerturbRecompute;

// The verifier on CUDA digests asynchronously and compares at the end of backward: a correct
// recompute verifies, and (controls) a perturbed one throws from backward() naming its segment,
// and one without RNG preservation is reported. No determinism guard: the forward and its
// recompute run the same kernels (no atomics) and agree bitwise without it.
TEST(CudaVerify, RecomputeOnTheDeviceIsVerifiedAtTheEndOfBackward) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 4;
  c.dropout = 0.2;
  models::TinyGpt model(c);
  model.to(torch::kCUDA);
  model.train();
  models::Batch batch = model.make_batch(3);
  batch.input = batch.input.cuda();
  batch.target = batch.target.cuda();
  {
    RecomputeVerifier verifier({VerifyPolicy::kThrow, false});
    ObserverScope scope(verifier);
    EXPECT_NO_THROW(model.loss(batch, {2, {}}).backward());
    EXPECT_EQ(verifier.verified_outputs(), 2u);
    EXPECT_TRUE(verifier.mismatches().empty());
  }
  {
    PerturbRecompute perturb("block2..block3", 1e-2);
    RecomputeVerifier verifier({VerifyPolicy::kThrow, /*keep_values=*/true});
    ObserverScope first(perturb);
    ObserverScope second(verifier);
    try {
      model.loss(batch, {2, {}}).backward();
      ADD_FAILURE() << "backward did not throw";
    } catch (const RecomputeMismatchError& e) {
      EXPECT_EQ(e.mismatch().segment, "block2..block3");
      EXPECT_NE(std::string(e.what()).find("1 of "), std::string::npos) << e.what();
    }
  }
  {
    RecomputeVerifier verifier({VerifyPolicy::kRecord, false});
    ObserverScope scope(verifier);
    models::CheckpointPlan unpreserved{2, {}};
    unpreserved.options.preserve_rng_state = false;  // control: other dropout masks on recompute
    model.loss(batch, unpreserved).backward();
    EXPECT_FALSE(verifier.mismatches().empty());
  }
}

#if RETRACE_WITH_CUDA
// Captures body() into `graph` on `stream` (capture cannot run on the default stream). A failure
// ends the capture, so that it stays in this test instead of leaving the stream capturing for the
// next one. Returns whether the graph can be replayed.
bool capture_graph(at::cuda::CUDAGraph& graph, const c10::cuda::CUDAStream& stream, const std::function<void()>& body) {
  c10::cuda::CUDAStreamGuard on_stream(stream);
  graph.capture_begin();
  bool ok = true;
  try {
    body();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "during capture: " << e.what();
    ok = false;
  }
  try {
    graph.capture_end();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "capture_end: " << e.what();
    ok = false;
  }
  return ok;
}

// Runs f three times on `stream` before a capture, as CUDA graphs require (kernels load lazily,
// the allocator warms up), with the device idle before and after.
void warm_up(const c10::cuda::CUDAStream& stream, const std::function<void()>& f) {
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_stream(stream);
    for (int i = 0; i < 3; ++i) f();
  }
  torch::cuda::synchronize();
}
#endif

// Inside a CUDA graph, an RngState taken during the capture and restored inside an RngFork draws
// the same dropout mask again on every replay, the masks are the ones eager execution draws from
// the same generator state, and the generator advances by the graph's own draws only.
TEST(CudaGraph, RngStateRestoredInsideACaptureRedrawsTheSameMask) {
  RETRACE_REQUIRE_CUDA();
#if RETRACE_WITH_CUDA
  const c10::Device dev(torch::kCUDA, 0);
  const at::Tensor ones = torch::ones({1 << 16}, dev);
  const auto drop = [&] { return torch::dropout(ones, 0.5, /*train=*/true); };
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
  warm_up(side, [&] {
    const RngState s = RngState::capture({dev});
    drop();
    RngFork fork({dev});
    s.restore();
    drop();
  });
  torch::manual_seed(21);
  torch::cuda::manual_seed_all(21);
  at::Tensor first, again, next;  // written by each replay
  at::cuda::CUDAGraph graph;
  ASSERT_TRUE(capture_graph(graph, side, [&] {
    const RngState state = RngState::capture({dev});
    EXPECT_TRUE(state.generators().size() == 2 && state.generators()[1].graph.has_value());
    first = drop();
    {
      RngFork fork({dev});
      state.restore();
      again = drop();
    }
    next = drop();  // the fork put the graph's own generator state back: this continues after `first`
  }));
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    torch::cuda::synchronize();
    const RngState before = RngState::capture({dev});
    graph.replay();
    torch::cuda::synchronize();
    const RngState after = RngState::capture({dev});
    const at::Tensor f = first.cpu(), a = again.cpu(), n = next.cpu();
    EXPECT_BITWISE_EQ(f, a);
    EXPECT_FALSE(f.equal(n)) << "consecutive draws were equal: the comparison above proves nothing";
    before.restore();
    EXPECT_BITWISE_EQ(drop().cpu(), f);
    EXPECT_BITWISE_EQ(drop().cpu(), n);
    EXPECT_TRUE(RngState::capture({dev}) == after) << "the replay advanced the generator by other than its two draws";
  }
  // Control: the same capture without restoring draws another mask.
  at::Tensor control_first, control_again;
  at::cuda::CUDAGraph control;
  ASSERT_TRUE(capture_graph(control, side, [&] {
    control_first = drop();
    RngFork fork({dev});
    control_again = drop();
  }));
  control.replay();
  torch::cuda::synchronize();
  EXPECT_FALSE(control_first.cpu().equal(control_again.cpu()));
#endif
}

// A capture-time state has no meaning outside its capture, and restoring it needs a fork.
TEST(CudaGraph, CaptureTimeStateRestoresOnlyInItsCaptureInsideAFork) {
  RETRACE_REQUIRE_CUDA();
#if RETRACE_WITH_CUDA
  const c10::Device dev(torch::kCUDA, 0);
  const at::Tensor ones = torch::ones({1024}, dev);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
  warm_up(side, [&] { torch::dropout(ones, 0.5, true); });
  RngState taken;
  std::string without_fork, serialized;
  at::Tensor out;
  at::cuda::CUDAGraph graph;
  ASSERT_TRUE(capture_graph(graph, side, [&] {
    taken = RngState::capture({dev});
    out = torch::dropout(ones, 0.5, true);
    try {
      taken.restore();
    } catch (const Error& e) {
      without_fork = e.what();
    }
    try {
      taken.serialize();
    } catch (const Error& e) {
      serialized = e.what();
    }
  }));
  EXPECT_NE(without_fork.find("only inside a retrace::RngFork"), std::string::npos) << without_fork;
  EXPECT_NE(serialized.find("cannot be serialized"), std::string::npos) << serialized;
  std::string outside;
  try {
    taken.restore();
  } catch (const Error& e) {
    outside = e.what();
  }
  EXPECT_NE(outside.find("restores only during that same capture"), std::string::npos) << outside;
  const RngState eager = RngState::capture({dev});  // control: a state taken outside restores
  EXPECT_NO_THROW(eager.restore());
  EXPECT_NO_THROW(graph.replay());
  torch::cuda::synchronize();
#endif
}

// A checkpointed dropout segment captured in a CUDA graph together with its backward: the
// recompute inside the graph draws the forward's mask. With x = 1, y = dropout(x) and dy/dx = y,
// so the gradient equals the output exactly when the masks agree. Control: without RNG
// preservation the recompute draws another mask.
TEST(CudaGraph, CheckpointedDropoutCapturedWithItsBackwardRecomputesTheForwardMask) {
  RETRACE_REQUIRE_CUDA();
#if RETRACE_WITH_CUDA
  const c10::Device dev(torch::kCUDA, 0);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev.index());
  constexpr std::int64_t kSize = 1 << 16;
  struct Replayed {
    at::Tensor output, grad, eager_output;
  };
  const auto run = [&](bool preserve) {
    CheckpointOptions options;
    options.preserve_rng_state = preserve;
    at::Tensor x = torch::ones({kSize}, torch::TensorOptions().device(dev).requires_grad(true));
    at::Tensor y;
    const auto step = [&] {
      y = checkpoint(
          "drop", [](const at::Tensor& in) { return torch::dropout(in, 0.5, /*train=*/true); }, x, options);
      y.sum().backward();
    };
    warm_up(side, [&] {
      x.mutable_grad().reset();
      step();
    });
    x.mutable_grad().reset();  // the graph allocates the gradient from its own pool
    Replayed r;
    at::cuda::CUDAGraph graph;
    if (!capture_graph(graph, side, step)) return r;
    torch::cuda::synchronize();
    const RngState before = RngState::capture({dev});
    graph.replay();
    torch::cuda::synchronize();
    EXPECT_TRUE(x.grad().defined());
    if (!x.grad().defined()) return r;
    r.output = y.detach().cpu();
    r.grad = x.grad().cpu();
    before.restore();
    r.eager_output = torch::dropout(torch::ones({kSize}, dev), 0.5, true).cpu();
    return r;
  };
  const Replayed preserved = run(true);
  ASSERT_TRUE(preserved.grad.defined());
  EXPECT_BITWISE_EQ(preserved.output, preserved.eager_output);  // the graph's forward draws eager's mask
  EXPECT_BITWISE_EQ(preserved.grad, preserved.output);          // the recompute drew it again
  EXPECT_GT(preserved.output.eq(0).sum().item<std::int64_t>(), 0) << "dropout dropped nothing";
  const Replayed unpreserved = run(false);
  ASSERT_TRUE(unpreserved.grad.defined());
  EXPECT_FALSE(unpreserved.grad.equal(unpreserved.output));
#endif
}

std::string temp_trace(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("retrace_cuda_" + name + "_" + std::to_string(::getpid()) + ".trace"))
      .string();
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
