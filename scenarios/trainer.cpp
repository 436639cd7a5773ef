#include <retrace/trainer.h>

#include <retrace/error.h>

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <map>

namespace retrace {

namespace {

std::shared_ptr<models::SegmentedModel> build_model(const ScenarioSpec& s) {
  const ModelSpec& m = s.model;
  if (m.type == "tiny_gpt") {
    models::GptConfig c;
    c.vocab = m.vocab;
    c.d_model = m.d_model;
    c.heads = m.heads;
    c.layers = m.layers;
    c.seq_len = m.seq_len;
    c.batch = s.data.batch;
    c.dropout = m.dropout;
    return std::make_shared<models::TinyGpt>(c);
  }
  if (m.type == "lstm") {
    models::LstmConfig c;
    c.vocab = m.vocab;
    c.hidden = m.hidden;
    c.layers = m.layers;
    c.seq_len = m.seq_len;
    c.batch = s.data.batch;
    c.dropout = m.dropout;
    return std::make_shared<models::LstmLm>(c);
  }
  models::MlpConfig c;
  c.in_features = m.in_features;
  c.hidden = m.hidden;
  c.out_features = m.out_features;
  c.layers = m.layers;
  c.batch = s.data.batch;
  c.dropout = m.dropout;
  return std::make_shared<models::Mlp>(c);
}

// Adam and AdamW keep the same per-parameter state under different types.
template <typename State>
void save_adam(const State& st, const std::string& prefix, std::vector<NamedTensor>& out) {
  out.push_back({prefix + "step", at::scalar_tensor(st.step(), at::kLong)});
  out.push_back({prefix + "exp_avg", st.exp_avg()});
  out.push_back({prefix + "exp_avg_sq", st.exp_avg_sq()});
  if (st.max_exp_avg_sq().defined() && st.max_exp_avg_sq().numel() > 0) {
    out.push_back({prefix + "max_exp_avg_sq", st.max_exp_avg_sq()});
  }
}

const at::Tensor& need(const std::map<std::string, at::Tensor>& by_name, const std::string& name) {
  auto it = by_name.find(name);
  if (it == by_name.end()) throw Error("the recorded state lacks '" + name + "'; was it recorded by another scenario?");
  return it->second;
}

template <typename State>
std::unique_ptr<State> load_adam(const std::map<std::string, at::Tensor>& by_name, const std::string& prefix) {
  auto st = std::make_unique<State>();
  const at::Tensor& step = need(by_name, prefix + "step");
  if (step.numel() != 1 || step.is_floating_point()) throw Error("the recorded '" + prefix + "step' is not an integer scalar");
  st->step(step.item<std::int64_t>());
  st->exp_avg(need(by_name, prefix + "exp_avg").clone());
  st->exp_avg_sq(need(by_name, prefix + "exp_avg_sq").clone());
  if (auto it = by_name.find(prefix + "max_exp_avg_sq"); it != by_name.end()) st->max_exp_avg_sq(it->second.clone());
  return st;
}

}  // namespace

ScenarioProgram::ScenarioProgram(ScenarioSpec spec) : spec_(std::move(spec)) {
  if (spec_.training.device == "cuda") {
    if (!torch::cuda::is_available()) {
      throw Error(spec_.origin + ": key 'training.device': cuda, but no CUDA device is visible; use cpu");
    }
    device_ = c10::Device(c10::kCUDA, 0);
  }
  torch::manual_seed(spec_.training.seed);  // seeds CUDA generators too
  model_ = build_model(spec_);
  model_->to(device_);
  model_->train();
  const TrainingSpec& t = spec_.training;
  if (t.optimizer == "adamw") {
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  } else if (t.optimizer == "adam") {
    optimizer_ = std::make_unique<torch::optim::Adam>(
        model_->parameters(), torch::optim::AdamOptions(t.lr).weight_decay(t.weight_decay));
  } else {
    optimizer_ = std::make_unique<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
  }
}

ScenarioProgram::~ScenarioProgram() = default;

std::string ScenarioProgram::config() const { return to_yaml(spec_); }

std::vector<NamedTensor> ScenarioProgram::state() {
  std::vector<NamedTensor> out;
  const auto params = model_->named_parameters();
  for (const auto& p : params) out.push_back({"param." + p.key(), p.value()});
  for (const auto& b : model_->named_buffers()) out.push_back({"buffer." + b.key(), b.value()});
  auto& states = optimizer_->state();
  for (const auto& p : params) {
    auto it = states.find(p.value().unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const std::string prefix = "optim." + p.key() + ".";
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (s->momentum_buffer().defined()) out.push_back({prefix + "momentum_buffer", s->momentum_buffer()});
    }
  }
  return out;
}

void ScenarioProgram::load_state(const std::vector<NamedTensor>& state) {
  std::map<std::string, at::Tensor> by_name;
  for (const NamedTensor& n : state) by_name[n.name] = n.tensor;
  torch::NoGradGuard no_grad;
  auto copy_into = [&](const std::string& name, at::Tensor target) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw Error("the recorded state lacks '" + name + "'; was it recorded by another scenario?");
    if (it->second.sizes() != target.sizes() || it->second.scalar_type() != target.scalar_type()) {
      throw Error("the recorded state's '" + name + "' is " + std::string(c10::toString(it->second.scalar_type())) +
                  " of another shape than the model's; was it recorded by another scenario?");
    }
    target.copy_(it->second);
  };
  const auto params = model_->named_parameters();
  for (const auto& p : params) {
    copy_into("param." + p.key(), p.value());
    p.value().mutable_grad() = at::Tensor();  // gradients are not state; a step starts without them
  }
  for (const auto& b : model_->named_buffers()) copy_into("buffer." + b.key(), b.value());
  auto& states = optimizer_->state();
  states.clear();
  for (const auto& p : params) {
    const std::string prefix = "optim." + p.key() + ".";
    void* key = p.value().unsafeGetTensorImpl();
    const at::Device dev = p.value().device();
    std::map<std::string, at::Tensor> local;
    for (const auto& [name, t] : by_name) {
      if (name.rfind(prefix, 0) == 0) local[name] = t.to(dev);
    }
    if (local.empty()) continue;
    if (spec_.training.optimizer == "adamw") {
      states[key] = load_adam<torch::optim::AdamWParamState>(local, prefix);
    } else if (spec_.training.optimizer == "adam") {
      states[key] = load_adam<torch::optim::AdamParamState>(local, prefix);
    } else {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(need(local, prefix + "momentum_buffer").clone());
      states[key] = std::move(st);
    }
  }
}

std::vector<NamedTensor> ScenarioProgram::batch(std::int64_t step) {
  const models::Batch b = model_->make_batch(spec_.data.seed * 1000003ULL + static_cast<std::uint64_t>(step));
  return {{"input", b.input.to(device_)}, {"target", b.target.to(device_)}};
}

StepOutcome ScenarioProgram::step(std::int64_t, const std::vector<NamedTensor>& batch, StepMonitor* monitor) {
  models::Batch b;
  for (const NamedTensor& n : batch) {
    if (n.name == "input") b.input = n.tensor.to(device_);
    if (n.name == "target") b.target = n.tensor.to(device_);
  }
  if (!b.input.defined() || !b.target.defined()) throw Error("the batch lacks 'input' or 'target'");
  optimizer_->zero_grad();
  at::Tensor loss = model_->loss(b, models::CheckpointPlan{spec_.training.segments, {}});
  loss.backward();
  std::vector<NamedTensor> grads;
  std::vector<at::Tensor> norms;
  for (const auto& p : model_->named_parameters()) {
    if (!p.value().grad().defined()) continue;
    grads.push_back({"grad." + p.key(), p.value().grad()});
    norms.push_back(p.value().grad().detach().to(at::kFloat).norm());
  }
  if (monitor) monitor->after_backward(loss, grads);
  StepOutcome out;
  out.loss = loss.item<double>();
  out.grad_norm = norms.empty() ? 0.0 : at::stack(norms).norm().item<double>();
  out.lr = spec_.training.lr;
  if (spec_.training.clip_grad_norm > 0) {
    torch::nn::utils::clip_grad_norm_(model_->parameters(), spec_.training.clip_grad_norm);
  }
  optimizer_->step();
  return out;
}

void register_builtin_programs() {
  register_program("retrace.scenario", [](const std::string& config) -> std::unique_ptr<Program> {
    return std::make_unique<ScenarioProgram>(parse_scenario_text(config, "<trace program config>"));
  });
}

}  // namespace retrace
