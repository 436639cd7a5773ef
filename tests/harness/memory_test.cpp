// Checkpointing must actually save memory: measured through the CPU allocator, not guessed.
#include <retrace/checkpoint.h>
#include <retrace/memory.h>
#include <retrace/models.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

namespace retrace {
namespace {

struct Measured {
  std::int64_t held_after_forward = 0;  // bytes the autograd graph keeps for backward
  std::int64_t peak = 0;                // peak over forward + backward
};

Measured measure(models::TinyGpt& model, const models::Batch& batch, int segments, bool selective = false,
                 std::optional<RecomputePolicy> policy = std::nullopt) {
  model.zero_grad();
  torch::manual_seed(3);
  Measured m;
  std::optional<RecomputePolicyScope> scope;
  if (policy) scope.emplace(*policy);
  CpuMemoryCounter counter;
  {
    at::Tensor loss = model.loss(batch, {segments, {}, selective});
    m.held_after_forward = counter.live_bytes();
    loss.backward();
  }
  m.peak = counter.peak_bytes();
  return m;
}

TEST(Memory, CheckpointingEightLayerGptCutsBytesSavedForBackward) {
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 8;
  c.d_model = 64;
  c.seq_len = 32;
  c.batch = 8;
  models::TinyGpt model(c);
  model.train();
  const models::Batch batch = model.make_batch(1);
  measure(model, batch, 0);  // warm-up: grads allocated, lazy init done

  const Measured plain = measure(model, batch, 0);
  const Measured ckpt = measure(model, batch, 8);
  const double cut = 1.0 - double(ckpt.held_after_forward) / double(plain.held_after_forward);
  RecordProperty("plain_saved_bytes", std::to_string(plain.held_after_forward));
  RecordProperty("checkpointed_saved_bytes", std::to_string(ckpt.held_after_forward));
  std::cout << "saved for backward: plain " << plain.held_after_forward << " B, 8 segments " << ckpt.held_after_forward
            << " B (cut " << 100 * cut << "%); peak plain " << plain.peak << " B, 8 segments " << ckpt.peak << " B\n";
  EXPECT_GT(plain.held_after_forward, 0);
  EXPECT_GE(cut, 0.40);
  EXPECT_LT(ckpt.peak, plain.peak);
}

// Selective recompute keeps less than the plain model and more than full recompute (which keeps
// only each block's input). Recomputing the attention core alone drops its softmax and dropout
// tensors; recomputing the norms, gelus and dropout masks as well keeps under half the plain
// model's bytes, on the benchmarks' 8-block model (bench/README.md) and on one whose attention
// core dominates (128 tokens). Control: the plain model's bytes, and the attention core alone.
TEST(Memory, SelectiveRecomputeKeepsLessThanPlainAndMoreThanFull) {
  for (const std::int64_t seq_len : {32, 128}) {
    SCOPED_TRACE(seq_len);
    torch::manual_seed(0);
    models::GptConfig c;
    c.layers = seq_len == 32 ? 8 : 4;
    c.d_model = 64;
    c.heads = 4;
    c.seq_len = seq_len;
    c.batch = seq_len == 32 ? 8 : 2;
    c.dropout = 0.1;
    models::TinyGpt model(c);
    model.train();
    const models::Batch batch = model.make_batch(1);
    measure(model, batch, 0);  // warm-up
    const Measured plain = measure(model, batch, 0);
    const Measured core = measure(model, batch, 0, false, RecomputePolicy::attention_core());
    const Measured selective = measure(model, batch, 0, true);
    const Measured full = measure(model, batch, static_cast<int>(c.layers));
    std::cout << seq_len << " tokens, saved for backward: plain " << plain.held_after_forward << " B, attention core "
              << core.held_after_forward << " B, selective " << selective.held_after_forward << " B, full "
              << full.held_after_forward << " B\n";
    EXPECT_LT(core.held_after_forward, plain.held_after_forward * (seq_len == 32 ? 0.8 : 0.7));
    EXPECT_LT(selective.held_after_forward, core.held_after_forward);
    EXPECT_LT(selective.held_after_forward, plain.held_after_forward * 0.5);
    EXPECT_GT(selective.held_after_forward, full.held_after_forward);
  }
}

TEST(Memory, CounterSeesAllocationsAndFrees) {
  CpuMemoryCounter counter;
  {
    const at::Tensor t = torch::empty({1024}, at::kFloat);
    EXPECT_GE(counter.live_bytes(), 4096);
  }
  EXPECT_EQ(counter.live_bytes(), 0);
  EXPECT_GE(counter.peak_bytes(), 4096);
  EXPECT_THROW(CpuMemoryCounter second, Error);
}

}  // namespace
}  // namespace retrace
