#pragma once
// Small models for tests, demos and scenarios, each made of named checkpointable stages and
// sized so that a CPU training step takes milliseconds: a tiny GPT, an LSTM language model (the
// clipping article's RNN gradient explosion) and an MLP regressor.

#include <retrace/checkpoint.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>

#include <cstdint>
#include <string>
#include <vector>

namespace retrace::models {

// How the checkpointable body runs: segments == 0 runs it plainly; segments == N splits the
// stages into N checkpointed segments (checkpoint_sequential: full recompute). selective (with
// segments == 0): the stages run plainly under RecomputePolicy::selective(), so a model's
// selective regions (attention cores, the norms and activations feeding linear layers, dropout
// masks: checkpoint.h) recompute and every matmul output is kept.
struct CheckpointPlan {
  int segments = 0;
  CheckpointOptions options;
  bool selective = false;
};

struct Batch {
  at::Tensor input;   // token ids (int64) or features (float)
  at::Tensor target;  // next-token ids (int64) or regression targets (float)
};

// A model split into embed -> body (named stages, checkpointable) -> head -> criterion.
class SegmentedModel : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual at::Tensor embed(const at::Tensor& input) = 0;
  // The checkpointable stages, in order. The functions hold references to the submodules and
  // stay valid as long as the model does.
  virtual std::vector<Stage> stages() = 0;
  virtual at::Tensor head(const at::Tensor& hidden) = 0;
  virtual at::Tensor criterion(const at::Tensor& output, const at::Tensor& target) = 0;
  // A deterministic batch: the same seed gives the same bits on every run.
  virtual Batch make_batch(std::uint64_t seed) const = 0;

  // Runs the stages under `plan`.
  at::Tensor body(const at::Tensor& x, const CheckpointPlan& plan = {});
  // criterion(head(body(embed(input)))).
  at::Tensor loss(const Batch& batch, const CheckpointPlan& plan = {});
};

struct GptConfig {
  std::int64_t vocab = 64;
  std::int64_t d_model = 32;
  std::int64_t heads = 4;
  std::int64_t layers = 2;
  std::int64_t seq_len = 16;
  std::int64_t batch = 4;
  double dropout = 0.1;
  double layernorm_eps = 1e-5;
  bool layernorm_fp32 = false;  // compute every LayerNorm in fp32 whatever the autocast dtype
};

// Token + position embedding, pre-LayerNorm blocks (causal multi-head attention, GELU MLP,
// dropout on attention weights and on both residual branches), final LayerNorm, LM head,
// cross-entropy. Stages: "block0" .. "block{layers-1}".
class TinyGpt : public SegmentedModel {
 public:
  explicit TinyGpt(GptConfig config = {});
  at::Tensor embed(const at::Tensor& tokens) override;
  std::vector<Stage> stages() override;
  at::Tensor head(const at::Tensor& hidden) override;
  at::Tensor criterion(const at::Tensor& logits, const at::Tensor& target) override;
  // Arithmetic sequences mod vocab with a random start and step: learnable in context.
  Batch make_batch(std::uint64_t seed) const override;
  const GptConfig& config() const { return config_; }

 private:
  struct Block;
  GptConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  torch::nn::Dropout embedding_dropout_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};

struct LstmConfig {
  std::int64_t vocab = 64;
  std::int64_t hidden = 32;
  std::int64_t layers = 2;
  std::int64_t seq_len = 16;
  std::int64_t batch = 4;
  double dropout = 0.1;
};

// Embedding, one single-layer LSTM per stage ("lstm0", ...) each followed by dropout, LM head,
// cross-entropy.
class LstmLm : public SegmentedModel {
 public:
  explicit LstmLm(LstmConfig config = {});
  at::Tensor embed(const at::Tensor& tokens) override;
  std::vector<Stage> stages() override;
  at::Tensor head(const at::Tensor& hidden) override;
  at::Tensor criterion(const at::Tensor& logits, const at::Tensor& target) override;
  Batch make_batch(std::uint64_t seed) const override;
  const LstmConfig& config() const { return config_; }

 private:
  LstmConfig config_;
  torch::nn::Embedding embedding_{nullptr};
  std::vector<torch::nn::LSTM> layers_;
  torch::nn::Dropout dropout_{nullptr};
  torch::nn::Linear lm_head_{nullptr};
};

struct MlpConfig {
  std::int64_t in_features = 16;
  std::int64_t hidden = 64;
  std::int64_t out_features = 4;
  std::int64_t layers = 4;
  std::int64_t batch = 32;
  double dropout = 0.1;
};

// Input projection, hidden stages ("layer0", ...: Linear, GELU, dropout), output projection,
// mean squared error against sin(x W), W fixed (seed 0) and scaled by 1/sqrt(in_features): learnable.
class Mlp : public SegmentedModel {
 public:
  explicit Mlp(MlpConfig config = {});
  at::Tensor embed(const at::Tensor& features) override;
  std::vector<Stage> stages() override;
  at::Tensor head(const at::Tensor& hidden) override;
  at::Tensor criterion(const at::Tensor& output, const at::Tensor& target) override;
  Batch make_batch(std::uint64_t seed) const override;
  const MlpConfig& config() const { return config_; }

 private:
  MlpConfig config_;
  torch::nn::Linear input_{nullptr};
  std::vector<torch::nn::Linear> hidden_;
  torch::nn::Dropout dropout_{nullptr};
  torch::nn::Linear output_{nullptr};
};

}  // namespace retrace::models
