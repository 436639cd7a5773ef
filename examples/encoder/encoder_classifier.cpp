#include "encoder_classifier.h"

#include <retrace/checkpoint.h>
#include <retrace/error.h>

#include <sstream>

namespace example {

EncoderConfig EncoderConfig::parse(const std::string& text) {
  EncoderConfig c;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty() || line[0] == '#') continue;
    const auto colon = line.find(':');
    const std::string key = line.substr(0, colon), value = colon == std::string::npos ? "" : line.substr(colon + 1);
    auto fail = [&](const std::string& why) -> void {
      throw retrace::Error("example.encoder config line " + std::to_string(n) + ": key '" + key + "': " + why);
    };
    if (colon == std::string::npos || value.find_first_not_of(' ') == std::string::npos) fail("expected 'key: value'");
    std::istringstream v(value);
    // The whole value, nothing after it ("2.5" is not the integer 2).
    auto whole = [&](bool read) { return read && (v >> std::ws).eof(); };
    auto integer = [&](std::int64_t& out, std::int64_t most) {
      if (!whole(static_cast<bool>(v >> out)) || out < 1 || out > most)
        fail("must be an integer from 1 to " + std::to_string(most) + ", got '" + value.substr(1) + "'");
    };
    if (key == "layers") integer(c.layers, 1024);
    else if (key == "d_model") integer(c.d_model, 1 << 16);
    else if (key == "heads") integer(c.heads, 1024);
    else if (key == "vocab") integer(c.vocab, 1 << 24);
    else if (key == "seq_len") integer(c.seq_len, 1 << 20);
    else if (key == "classes") integer(c.classes, 1 << 20);
    else if (key == "batch") integer(c.batch, 1 << 20);
    else if (key == "lr") {
      if (!whole(static_cast<bool>(v >> c.lr)) || !(c.lr > 0) || c.lr > 1e12) fail("must be a number in (0, 1e12]");
    } else if (key == "dropout") {
      if (!whole(static_cast<bool>(v >> c.dropout)) || c.dropout < 0 || c.dropout >= 1) fail("must be in [0, 1)");
    } else if (key == "seed") {
      std::int64_t seed = 0;
      if (!whole(static_cast<bool>(v >> seed)) || seed < 0) fail("must be a non-negative integer");
      c.seed = static_cast<std::uint64_t>(seed);
    } else if (key == "precision") {
      v >> c.precision;
      if (!whole(true) || (c.precision != "fp32" && c.precision != "bf16" && c.precision != "fp16"))
        fail("must be fp32, bf16 or fp16");
    } else {
      fail(
          "unknown; the keys are layers, d_model, heads, vocab, seq_len, classes, batch, lr, dropout, precision, seed");
    }
  }
  if (c.d_model % c.heads != 0) throw retrace::Error("example.encoder config: d_model must be divisible by heads");
  return c;
}

BlockImpl::BlockImpl(const EncoderConfig& c) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  attn = register_module("attn", torch::nn::MultiheadAttention(
                                     torch::nn::MultiheadAttentionOptions(c.d_model, c.heads).dropout(c.dropout)));
  mlp = register_module(
      "mlp", torch::nn::Sequential(torch::nn::Linear(c.d_model, 4 * c.d_model), torch::nn::GELU(),
                                   torch::nn::Linear(4 * c.d_model, c.d_model), torch::nn::Dropout(c.dropout)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = ln1(x).transpose(0, 1);  // MultiheadAttention is sequence-first
  const at::Tensor a = std::get<0>(attn(h, h, h)).transpose(0, 1);
  const at::Tensor y = x + a;
  return y + mlp->forward(ln2(y));
}

EncoderImpl::EncoderImpl(const EncoderConfig& c) {
  embed = register_module("embed", torch::nn::Embedding(c.vocab, c.d_model));
  position = register_module("position", torch::nn::Embedding(c.seq_len, c.d_model));
  for (std::int64_t i = 0; i < c.layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
  final_ln = register_module("final_ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  head = register_module("head", torch::nn::Linear(c.d_model, c.classes));
}

at::Tensor EncoderImpl::forward(const at::Tensor& tokens) {
  at::Tensor x = embed(tokens) + position(torch::arange(tokens.size(1), tokens.options()));
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    x = retrace::checkpoint(
        "block" + std::to_string(i), [b = blocks[i]](const at::Tensor& in) mutable { return b(in); }, x);
  }
  return head(final_ln(x).mean(1));
}

EncoderClassifier::EncoderClassifier(const std::string& config)
    : config_text_(config), config_(EncoderConfig::parse(config)) {
  torch::manual_seed(config_.seed);
  model_ = Encoder(config_);
  model_->train();
  optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                     torch::optim::AdamWOptions(config_.lr).weight_decay(0.01));
  // retrace: the pipeline acts on the optimizer and these parameters; the forward runs under
  // autocast to the configured precision, and token ids lie below the vocabulary.
  parameters_ = retrace::named_parameters(*model_);
  retrace::TrainingTraits traits;
  traits.autocast = config_.precision == "fp16" ? at::kHalf : config_.precision == "bf16" ? at::kBFloat16 : at::kFloat;
  traits.vocab = config_.vocab;
  defenses_.attach(*this, *optimizer_, parameters_, traits);
}

std::vector<retrace::NamedTensor> EncoderClassifier::state() {
  std::vector<retrace::NamedTensor> out = parameters_;
  for (auto& n : retrace::optimizer_state(*optimizer_, parameters_)) out.push_back(std::move(n));
  for (auto& n : defenses_.state()) out.push_back(std::move(n));  // retrace: loss scale, schedule
  return out;
}

void EncoderClassifier::load_state(const std::vector<retrace::NamedTensor>& state) {
  retrace::copy_state_into(parameters_, state);
  retrace::load_optimizer_state(*optimizer_, parameters_, state);
  defenses_.load_state(state);  // retrace
}

// The data: random token sequences; the label is the residue class (token % classes) that
// occurs most often. Deterministic in (seed, step).
std::vector<retrace::NamedTensor> EncoderClassifier::batch(std::int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(config_.seed * 1000003ULL + static_cast<std::uint64_t>(step));
  const at::Tensor tokens = at::randint(config_.vocab, {config_.batch, config_.seq_len}, gen, at::kLong);
  const at::Tensor counts = at::one_hot(tokens.remainder(config_.classes), config_.classes).sum(1);
  const at::Tensor labels = counts.argmax(1);
  return {{"tokens", tokens, retrace::TensorKind::kInput}, {"labels", labels, retrace::TensorKind::kTarget}};
}

retrace::StepOutcome EncoderClassifier::step(std::int64_t step, const std::vector<retrace::NamedTensor>& batch_in,
                                             retrace::StepMonitor* monitor) {
  retrace::DefendedStep s = defenses_.begin(step, monitor);           // retrace
  const std::vector<retrace::NamedTensor> batch = s.batch(batch_in);  // retrace
  if (s.done()) return s.finish();                                    // retrace: an invalid batch is skipped
  optimizer_->zero_grad();
  at::Tensor loss;
  {
    const auto forward = s.forward();  // retrace
    loss = torch::cross_entropy_loss(model_->forward(batch[0].tensor), batch[1].tensor);
  }
  s.backward(loss);   // retrace: instead of loss.backward()
  return s.finish();  // retrace: instead of optimizer_->step()
}

}  // namespace example
