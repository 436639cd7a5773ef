#pragma once
// A user's own training program under retrace: a pre-LN transformer encoder that classifies token
// sequences, trained with AdamW on its own synthetic data, each block checkpointed. None of it is
// retrace's; the lines that connect it are marked "retrace:" in encoder_classifier.cpp.
//
// Its config is YAML-like "key: value" lines (what a scenario's `config:` map becomes):
//   layers, d_model, heads, vocab, seq_len, classes, batch (integers), lr, dropout (numbers),
//   precision (fp32 | bf16 | fp16), seed (integer). Unknown keys are an error.

#include <retrace/defenses.h>
#include <retrace/program.h>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace example {

struct EncoderConfig {
  std::int64_t layers = 2, d_model = 32, heads = 4, vocab = 64, seq_len = 16, classes = 4, batch = 8;
  double lr = 3e-3, dropout = 0.1;
  std::string precision = "fp32";
  std::uint64_t seed = 0;
  // Parses the "key: value" lines; throws retrace::Error naming the line for a bad one.
  static EncoderConfig parse(const std::string& text);
};

// One pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const EncoderConfig& c);
  at::Tensor forward(const at::Tensor& x);  // [batch, seq, d_model]
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(Block);

// Embedding + positions, the blocks (each a checkpointed segment "block<i>"), final LayerNorm,
// mean pooling, a linear head.
struct EncoderImpl : torch::nn::Module {
  explicit EncoderImpl(const EncoderConfig& c);
  at::Tensor forward(const at::Tensor& tokens);  // [batch, seq] int64 -> logits [batch, classes]
  torch::nn::Embedding embed{nullptr}, position{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm final_ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Encoder);

class EncoderClassifier : public retrace::Program {
 public:
  static constexpr const char* kName = "example.encoder";
  explicit EncoderClassifier(const std::string& config);

  std::string name() const override { return kName; }
  std::string config() const override { return config_text_; }
  std::int64_t default_steps() const override { return 20; }
  std::vector<retrace::NamedTensor> state() override;
  void load_state(const std::vector<retrace::NamedTensor>& state) override;
  std::vector<retrace::NamedTensor> batch(std::int64_t step) override;
  retrace::StepOutcome step(std::int64_t step, const std::vector<retrace::NamedTensor>& batch,
                            retrace::StepMonitor* monitor) override;
  double lr() const override { return defenses_.next_lr(); }
  double loss_scale() const override { return defenses_.loss_scale(); }
  retrace::Defenses* defenses() override { return &defenses_; }

 private:
  std::string config_text_;
  EncoderConfig config_;
  Encoder model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<retrace::NamedTensor> parameters_;
  retrace::Defenses defenses_;
};

}  // namespace example
