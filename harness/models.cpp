#include <retrace/models.h>

#include <retrace/error.h>
#include <retrace/program.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/loss.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace retrace::models {

namespace F = torch::nn::functional;

at::Tensor SegmentedModel::body(const at::Tensor& x, const CheckpointPlan& plan) {
  const std::vector<Stage> all = stages();
  if (plan.selective && plan.segments != 0) {
    throw Error("CheckpointPlan: selective recompute runs the stages plainly and recomputes the regions they mark; "
                "segments must be 0, got " +
                std::to_string(plan.segments));
  }
  if (plan.segments == 0) {
    std::optional<RecomputePolicyScope> policy;
    if (plan.selective) {
      RecomputePolicy p = RecomputePolicy::selective();
      p.options = plan.options;
      policy.emplace(std::move(p));
    }
    at::Tensor y = x;
    for (const Stage& s : all) y = s.fn(y);
    return y;
  }
  return checkpoint_sequential(all, plan.segments, x, plan.options);
}

at::Tensor SegmentedModel::loss(const Batch& batch, const CheckpointPlan& plan) {
  return criterion(head(body(embed(batch.input), plan)), batch.target);
}

namespace {
// A model config's sizes must be at least 1 and its dropout in [0, 1): one retrace::Error naming
// the config field, instead of an error from deep inside a LibTorch module constructor.
void check_sizes(const char* model, std::initializer_list<std::pair<const char*, std::int64_t>> sizes, double dropout) {
  for (const auto& [field, value] : sizes) {
    if (value < 1) {
      throw Error(std::string(model) + ": the config's " + field + " is " + std::to_string(value) +
                  "; it must be at least 1");
    }
  }
  if (!(dropout >= 0 && dropout < 1)) {
    throw Error(std::string(model) + ": the config's dropout is " + std::to_string(dropout) + "; it must be in [0, 1)");
  }
}

at::Generator seeded(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// nn::Linear(in, out) and nn::Embedding(n, dim), with their usual initial values; when the
// program's state will be restored from a snapshot (restoring_state(): a replay), with their
// parameters left uninitialized instead of drawn (the draws are most of a large model's
// construction). The module is made 1 x 1 (two draws from the global generator, which replay
// restores before each step) and its parameters given their real shape in place, so that the
// parameter tensors the module registered are the ones that get the snapshot.
torch::nn::Linear linear(std::int64_t in, std::int64_t out) {
  if (!restoring_state()) return torch::nn::Linear(in, out);
  torch::nn::Linear l(1, 1);
  l->options.in_features(in).out_features(out);
  l->weight.set_data(at::empty({out, in}));
  l->bias.set_data(at::empty({out}));
  return l;
}

torch::nn::Embedding embedding(std::int64_t n, std::int64_t dim) {
  if (!restoring_state()) return torch::nn::Embedding(n, dim);
  torch::nn::Embedding e(1, 1);
  e->options.num_embeddings(n).embedding_dim(dim);
  e->weight.set_data(at::empty({n, dim}));
  return e;
}

// Arithmetic sequences mod vocab: x_t = (start + step * t) mod vocab, step in [1, 3].
Batch arithmetic_sequences(std::uint64_t seed, std::int64_t batch, std::int64_t seq_len, std::int64_t vocab) {
  at::Generator gen = seeded(seed);
  const at::Tensor start = at::randint(vocab, {batch, 1}, gen, at::kLong);
  const at::Tensor step = at::randint(1, 4, {batch, 1}, gen, at::kLong);
  const at::Tensor t = at::arange(seq_len + 1, at::kLong).unsqueeze(0);
  const at::Tensor seq = (start + step * t).remainder(vocab);
  return {seq.narrow(1, 0, seq_len).contiguous(), seq.narrow(1, 1, seq_len).contiguous()};
}
}  // namespace

// --- TinyGpt ---------------------------------------------------------------------------------

// LayerNorm as the module computes it, or in fp32 whatever the input's (autocast) dtype -- the
// "fp32 LayerNorm" defense.
static at::Tensor layer_norm(torch::nn::LayerNorm& ln, const at::Tensor& x, bool fp32) {
  if (!fp32) return ln(x);
  const auto& o = ln->options;
  return F::layer_norm(x.to(at::kFloat), F::LayerNormFuncOptions(o.normalized_shape())
                                             .weight(ln->weight.to(at::kFloat))
                                             .bias(ln->bias.to(at::kFloat))
                                             .eps(o.eps()));
}

struct TinyGpt::Block : torch::nn::Module {
  Block(const GptConfig& c, std::string block_name)
      : name(std::move(block_name)), heads(c.heads), dropout(c.dropout), layernorm_fp32(c.layernorm_fp32) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(c.layernorm_eps)));
    qkv = register_module("qkv", linear(c.d_model, 3 * c.d_model));
    proj = register_module("proj", linear(c.d_model, c.d_model));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(c.layernorm_eps)));
    fc = register_module("fc", linear(c.d_model, 4 * c.d_model));
    fc_out = register_module("fc_out", linear(4 * c.d_model, c.d_model));
    causal_mask = register_buffer("causal_mask", at::ones({c.seq_len, c.seq_len}, at::kBool).triu(1));
  }

  // The region that norms the residual stream x for a linear layer: kept as x, not as its output,
  // under a policy recomputing norms (recompute_linear_input).
  TensorFn norm(torch::nn::LayerNorm ln) const {
    return [ln, fp32 = layernorm_fp32](const at::Tensor& x) mutable { return layer_norm(ln, x, fp32); };
  }

  // qkv(ln1(x)) through the attention core and the output projection.
  at::Tensor attention(const at::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto qkv_out =
        recompute_linear_input(name + ".ln1", RegionKind::kNorm, norm(ln1), x, qkv->weight, qkv->bias).chunk(3, -1);
    auto split = [&](const at::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    const at::Tensor q = split(qkv_out[0]), k = split(qkv_out[1]), v = split(qkv_out[2]);
    // The attention core: its softmax and dropout tensors are B x heads x T x T, what selective
    // recompute (RecomputePolicy::selective) does not keep.
    const at::Tensor core = recompute_region(
        name + ".attention_core", RegionKind::kAttentionCore,
        // The recompute runs in backward, after this call returns: the region holds the block.
        [self = std::static_pointer_cast<Block>(shared_from_this()), T, hd](const std::vector<at::Tensor>& in) {
          const Block& b = *self;
          at::Tensor att = at::matmul(in[0], in[1].transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
          att =
              att.masked_fill(b.causal_mask.narrow(0, 0, T).narrow(1, 0, T), -std::numeric_limits<double>::infinity());
          att = at::softmax(att, -1);
          att = recompute_dropout(b.name + ".attention_core.dropout", att, b.dropout, b.is_training());
          return std::vector<at::Tensor>{at::matmul(att, in[2])};
        },
        {q, k, v})[0];
    const at::Tensor y = core.transpose(1, 2).contiguous().view({B, T, C});
    return recompute_dropout(name + ".attention_dropout", proj(y), dropout, is_training());
  }

  // fc_out(gelu(fc(ln2(x)))): under a policy recomputing norms and activations, x and fc's output
  // are kept, not ln2's and gelu's outputs.
  at::Tensor mlp(const at::Tensor& x) {
    const at::Tensor h = recompute_linear_input(name + ".ln2", RegionKind::kNorm, norm(ln2), x, fc->weight, fc->bias);
    const at::Tensor out = recompute_linear_input(
        name + ".gelu", RegionKind::kActivation, [](const at::Tensor& u) { return at::gelu(u); }, h, fc_out->weight,
        fc_out->bias);
    return recompute_dropout(name + ".mlp_dropout", out, dropout, is_training());
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = x + attention(x);
    return h + mlp(h);
  }

  std::string name;  // "block3": its attention core is the region "block3.attention_core"
  std::int64_t heads;
  double dropout;
  bool layernorm_fp32;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_out{nullptr};
  at::Tensor causal_mask;
};

TinyGpt::TinyGpt(GptConfig config) : config_(config) {
  check_sizes("TinyGpt",
              {{"vocab", config.vocab},
               {"d_model", config.d_model},
               {"heads", config.heads},
               {"layers", config.layers},
               {"seq_len", config.seq_len}},
              config.dropout);
  if (config.d_model % config.heads != 0) {
    throw Error("TinyGpt: GptConfig::d_model (" + std::to_string(config.d_model) +
                ") must be divisible by GptConfig::heads (" + std::to_string(config.heads) + ")");
  }
  token_embedding_ = register_module("token_embedding", embedding(config.vocab, config.d_model));
  position_embedding_ = register_module("position_embedding", embedding(config.seq_len, config.d_model));
  embedding_dropout_ = register_module("embedding_dropout", torch::nn::Dropout(config.dropout));
  for (std::int64_t i = 0; i < config.layers; ++i) {
    const std::string name = "block" + std::to_string(i);
    blocks_.push_back(register_module(name, std::make_shared<Block>(config, name)));
  }
  final_norm_ = register_module(
      "final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model}).eps(config.layernorm_eps)));
  lm_head_ = register_module("lm_head", linear(config.d_model, config.vocab));
}

at::Tensor TinyGpt::embed(const at::Tensor& tokens) {
  const at::Tensor positions = at::arange(tokens.size(1), tokens.options().dtype(at::kLong));
  return embedding_dropout_(token_embedding_(tokens) + position_embedding_(positions).unsqueeze(0));
}

std::vector<Stage> TinyGpt::stages() {
  std::vector<Stage> out;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    out.push_back(
        {"block" + std::to_string(i), [block = blocks_[i]](const at::Tensor& x) { return block->forward(x); }});
  }
  return out;
}

at::Tensor TinyGpt::head(const at::Tensor& hidden) {
  return lm_head_(layer_norm(final_norm_, hidden, config_.layernorm_fp32));
}

at::Tensor TinyGpt::criterion(const at::Tensor& logits, const at::Tensor& target) {
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

Batch TinyGpt::make_batch(std::uint64_t seed) const {
  return arithmetic_sequences(seed, config_.batch, config_.seq_len, config_.vocab);
}

// --- LstmLm ----------------------------------------------------------------------------------

LstmLm::LstmLm(LstmConfig config) : config_(config) {
  check_sizes("LstmLm", {{"vocab", config.vocab}, {"hidden", config.hidden}, {"layers", config.layers}},
              config.dropout);
  embedding_ = register_module("embedding", embedding(config.vocab, config.hidden));
  for (std::int64_t i = 0; i < config.layers; ++i) {
    layers_.push_back(
        register_module("lstm" + std::to_string(i),
                        torch::nn::LSTM(torch::nn::LSTMOptions(config.hidden, config.hidden).batch_first(true))));
  }
  dropout_ = register_module("dropout", torch::nn::Dropout(config.dropout));
  lm_head_ = register_module("lm_head", linear(config.hidden, config.vocab));
}

at::Tensor LstmLm::embed(const at::Tensor& tokens) { return embedding_(tokens); }

std::vector<Stage> LstmLm::stages() {
  std::vector<Stage> out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    out.push_back({"lstm" + std::to_string(i), [lstm = layers_[i], dropout = dropout_](const at::Tensor& x) mutable {
                     return dropout(std::get<0>(lstm->forward(x)));
                   }});
  }
  return out;
}

at::Tensor LstmLm::head(const at::Tensor& hidden) { return lm_head_(hidden); }

at::Tensor LstmLm::criterion(const at::Tensor& logits, const at::Tensor& target) {
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

Batch LstmLm::make_batch(std::uint64_t seed) const {
  return arithmetic_sequences(seed, config_.batch, config_.seq_len, config_.vocab);
}

// --- Mlp -------------------------------------------------------------------------------------

Mlp::Mlp(MlpConfig config) : config_(config) {
  check_sizes("Mlp",
              {{"in_features", config.in_features},
               {"hidden", config.hidden},
               {"layers", config.layers},
               {"out_features", config.out_features}},
              config.dropout);
  input_ = register_module("input", linear(config.in_features, config.hidden));
  for (std::int64_t i = 0; i < config.layers; ++i) {
    hidden_.push_back(register_module("layer" + std::to_string(i), linear(config.hidden, config.hidden)));
  }
  dropout_ = register_module("dropout", torch::nn::Dropout(config.dropout));
  output_ = register_module("output", linear(config.hidden, config.out_features));
}

at::Tensor Mlp::embed(const at::Tensor& features) { return input_(features); }

std::vector<Stage> Mlp::stages() {
  std::vector<Stage> out;
  for (std::size_t i = 0; i < hidden_.size(); ++i) {
    out.push_back({"layer" + std::to_string(i), [linear = hidden_[i], dropout = dropout_](const at::Tensor& x) mutable {
                     return dropout(at::gelu(linear(x)));
                   }});
  }
  return out;
}

at::Tensor Mlp::head(const at::Tensor& hidden) { return output_(hidden); }

at::Tensor Mlp::criterion(const at::Tensor& output, const at::Tensor& target) { return F::mse_loss(output, target); }

Batch Mlp::make_batch(std::uint64_t seed) const {
  at::Generator gen = seeded(seed);
  const at::Tensor x = at::randn({config_.batch, config_.in_features}, gen);
  // The target map is fixed (seed 0) so that every batch describes the same function. The
  // projection is scaled so that its outputs are ~N(0, 1): sin is then smooth over them and the
  // task learnable (unscaled, x.w has std sqrt(in_features) and sin of it is close to noise).
  at::Generator target_gen = seeded(0);
  const at::Tensor w = at::randn({config_.in_features, config_.out_features}, target_gen) /
                       std::sqrt(static_cast<double>(config_.in_features));
  return {x, at::sin(at::matmul(x, w))};
}

}  // namespace retrace::models
