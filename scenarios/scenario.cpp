#include <retrace/scenario.h>

#include <retrace/error.h>

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace retrace {

namespace {

class Parser {
 public:
  explicit Parser(std::string origin) : origin_(std::move(origin)) {}

  [[noreturn]] void fail(const YAML::Node& node, const std::string& key, const std::string& what) const {
    std::string where = origin_;
    if (node.IsDefined() && node.Mark().line >= 0) where += ":" + std::to_string(node.Mark().line + 1);
    throw Error(where + ": key '" + key + "': " + what);
  }

  // Checks that `node` is a mapping whose keys are all in `known`.
  void keys(const YAML::Node& node, const std::string& prefix, const std::vector<std::string>& known) const {
    if (!node.IsMap()) fail(node, prefix, "must be a mapping of keys to values");
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string k = it->first.as<std::string>();
      if (std::find(known.begin(), known.end(), k) == known.end()) {
        std::string list;
        for (const auto& s : known) list += (list.empty() ? "" : ", ") + s;
        fail(it->first, prefix.empty() ? k : prefix + "." + k, "unknown key; known keys here: " + list);
      }
    }
  }

  std::int64_t integer(const YAML::Node& parent, const char* key, const std::string& full,
                       std::int64_t fallback, std::int64_t min, std::int64_t max) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return fallback;
    if (!n.IsScalar()) fail(n, full, "must be an integer");
    std::int64_t v;
    try {
      v = n.as<std::int64_t>();
    } catch (const YAML::Exception&) {
      fail(n, full, "must be an integer, got '" + n.Scalar() + "'");
    }
    if (v < min || v > max) {
      fail(n, full, "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + std::to_string(v));
    }
    return v;
  }

  double number(const YAML::Node& parent, const char* key, const std::string& full, double fallback,
                double min, double max) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return fallback;
    if (!n.IsScalar()) fail(n, full, "must be a number");
    double v;
    try {
      v = n.as<double>();
    } catch (const YAML::Exception&) {
      fail(n, full, "must be a number, got '" + n.Scalar() + "'");
    }
    if (!std::isfinite(v)) fail(n, full, "must be a finite number, got '" + n.Scalar() + "'");
    if (v < min || v > max) {
      std::ostringstream os;
      os << "must be between " << min << " and " << max << ", got " << v;
      fail(n, full, os.str());
    }
    return v;
  }

  std::string choice(const YAML::Node& parent, const char* key, const std::string& full,
                     const std::string& fallback, const std::vector<std::string>& allowed,
                     bool required = false) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) {
      if (required) fail(parent, full, "is required; one of " + join(allowed));
      return fallback;
    }
    if (!n.IsScalar()) fail(n, full, "must be one of " + join(allowed));
    const std::string v = n.Scalar();
    if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
      fail(n, full, "must be one of " + join(allowed) + ", got '" + v + "'");
    }
    return v;
  }

  std::string text(const YAML::Node& parent, const char* key, const std::string& full) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return "";
    if (!n.IsScalar()) fail(n, full, "must be a string");
    return n.Scalar();
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }

 private:
  std::string origin_;
};

constexpr std::int64_t kBig = std::int64_t{1} << 40;

ScenarioSpec parse(const YAML::Node& root, const std::string& origin) {
  Parser p(origin);
  ScenarioSpec s;
  s.origin = origin;
  if (!root.IsDefined() || root.IsNull()) throw Error(origin + ": the scenario file is empty; it needs at least a 'model' section");
  p.keys(root, "", {"name", "description", "model", "data", "training"});
  s.name = p.text(root, "name", "name");
  s.description = p.text(root, "description", "description");

  const YAML::Node model = root["model"];
  if (!model.IsDefined()) p.fail(root, "model", "is required (a mapping with at least 'type')");
  p.keys(model, "model", {"type", "layers", "d_model", "heads", "hidden", "vocab", "seq_len",
                          "in_features", "out_features", "dropout"});
  ModelSpec& m = s.model;
  m.type = p.choice(model, "type", "model.type", "", {"tiny_gpt", "lstm", "mlp"}, /*required=*/true);
  m.layers = p.integer(model, "layers", "model.layers", m.layers, 1, 1024);
  m.d_model = p.integer(model, "d_model", "model.d_model", m.d_model, 1, 1 << 16);
  m.heads = p.integer(model, "heads", "model.heads", m.heads, 1, 1024);
  m.hidden = p.integer(model, "hidden", "model.hidden", m.hidden, 1, 1 << 16);
  m.vocab = p.integer(model, "vocab", "model.vocab", m.vocab, 2, 1 << 24);
  m.seq_len = p.integer(model, "seq_len", "model.seq_len", m.seq_len, 1, 1 << 20);
  m.in_features = p.integer(model, "in_features", "model.in_features", m.in_features, 1, 1 << 20);
  m.out_features = p.integer(model, "out_features", "model.out_features", m.out_features, 1, 1 << 20);
  m.dropout = p.number(model, "dropout", "model.dropout", m.dropout, 0.0, 0.999);
  if (m.type == "tiny_gpt" && m.d_model % m.heads != 0) {
    p.fail(model["heads"].IsDefined() ? model["heads"] : model, "model.heads",
           "d_model (" + std::to_string(m.d_model) + ") must be divisible by heads (" + std::to_string(m.heads) + ")");
  }

  if (const YAML::Node data = root["data"]; data.IsDefined()) {
    p.keys(data, "data", {"batch", "seed"});
    s.data.batch = p.integer(data, "batch", "data.batch", s.data.batch, 1, 1 << 20);
    s.data.seed = static_cast<std::uint64_t>(p.integer(data, "seed", "data.seed", 1, 0, kBig));
  }

  if (const YAML::Node t = root["training"]; t.IsDefined()) {
    p.keys(t, "training", {"steps", "seed", "optimizer", "lr", "weight_decay", "momentum", "segments",
                           "clip_grad_norm", "device"});
    TrainingSpec& tr = s.training;
    tr.steps = p.integer(t, "steps", "training.steps", tr.steps, 1, 1 << 30);
    tr.seed = static_cast<std::uint64_t>(p.integer(t, "seed", "training.seed", 0, 0, kBig));
    tr.optimizer = p.choice(t, "optimizer", "training.optimizer", tr.optimizer, {"adamw", "adam", "sgd"});
    tr.lr = p.number(t, "lr", "training.lr", tr.lr, 0.0, 1e12);
    tr.weight_decay = p.number(t, "weight_decay", "training.weight_decay", tr.weight_decay, 0.0, 1e3);
    tr.momentum = p.number(t, "momentum", "training.momentum", tr.momentum, 0.0, 1.0);
    tr.segments = static_cast<int>(p.integer(t, "segments", "training.segments", tr.segments, 0, 1 << 20));
    tr.clip_grad_norm = p.number(t, "clip_grad_norm", "training.clip_grad_norm", tr.clip_grad_norm, 0.0, 1e12);
    tr.device = p.choice(t, "device", "training.device", tr.device, {"cpu", "cuda"});
    if (tr.segments > m.layers) {
      p.fail(t["segments"], "training.segments",
             "is " + std::to_string(tr.segments) + " but the model has " + std::to_string(m.layers) +
                 " layers; use 0 (off) to " + std::to_string(m.layers));
    }
  }
  return s;
}

}  // namespace

ScenarioSpec parse_scenario_text(const std::string& text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(origin + ":" + std::to_string(e.mark.line + 1) + ": not valid YAML: " + e.msg);
  }
  return parse(root, origin);
}

ScenarioSpec parse_scenario_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open the scenario file (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(path + ": cannot read the scenario file");
  return parse_scenario_text(ss.str(), path);
}

std::string to_yaml(const ScenarioSpec& s) {
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << s.name;
  if (!s.description.empty()) out << YAML::Key << "description" << YAML::Value << s.description;
  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << s.model.type;
  out << YAML::Key << "layers" << YAML::Value << s.model.layers;
  out << YAML::Key << "d_model" << YAML::Value << s.model.d_model;
  out << YAML::Key << "heads" << YAML::Value << s.model.heads;
  out << YAML::Key << "hidden" << YAML::Value << s.model.hidden;
  out << YAML::Key << "vocab" << YAML::Value << s.model.vocab;
  out << YAML::Key << "seq_len" << YAML::Value << s.model.seq_len;
  out << YAML::Key << "in_features" << YAML::Value << s.model.in_features;
  out << YAML::Key << "out_features" << YAML::Value << s.model.out_features;
  out << YAML::Key << "dropout" << YAML::Value << s.model.dropout;
  out << YAML::EndMap;
  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "batch" << YAML::Value << s.data.batch;
  out << YAML::Key << "seed" << YAML::Value << s.data.seed;
  out << YAML::EndMap;
  out << YAML::Key << "training" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "steps" << YAML::Value << s.training.steps;
  out << YAML::Key << "seed" << YAML::Value << s.training.seed;
  out << YAML::Key << "optimizer" << YAML::Value << s.training.optimizer;
  out << YAML::Key << "lr" << YAML::Value << s.training.lr;
  out << YAML::Key << "weight_decay" << YAML::Value << s.training.weight_decay;
  out << YAML::Key << "momentum" << YAML::Value << s.training.momentum;
  out << YAML::Key << "segments" << YAML::Value << s.training.segments;
  out << YAML::Key << "clip_grad_norm" << YAML::Value << s.training.clip_grad_norm;
  out << YAML::Key << "device" << YAML::Value << s.training.device;
  out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace retrace
