#include <retrace/injection_spec.h>

#include <retrace/error.h>

namespace retrace {

namespace {

struct TypeName {
  InjectionType type;
  const char* name;
};
constexpr TypeName kTypes[] = {
    {InjectionType::kActivationOverflow, "activation_overflow"},
    {InjectionType::kLrSpike, "lr_spike"},
    {InjectionType::kLayerNormInput, "layernorm_input"},
    {InjectionType::kGradNonFinite, "grad_nonfinite"},
    {InjectionType::kLossSpike, "loss_spike"},
    {InjectionType::kBitFlip, "bit_flip"},
    {InjectionType::kRngDesync, "rng_desync"},
    {InjectionType::kCorruptBatch, "corrupt_batch"},
};

}  // namespace

const char* to_string(InjectionType type) {
  for (const auto& t : kTypes) {
    if (t.type == type) return t.name;
  }
  return "?";
}

std::vector<std::string> injection_type_names() {
  std::vector<std::string> out;
  for (const auto& t : kTypes) out.emplace_back(t.name);
  return out;
}

InjectionType parse_injection_type(const std::string& name) {
  for (const auto& t : kTypes) {
    if (name == t.name) return t.type;
  }
  std::string known;
  for (const auto& n : injection_type_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error("unknown injection type '" + name + "'; known types: " + known);
}

double InjectionSpec::effective_factor() const {
  if (factor != 0) return factor;
  switch (type) {
    case InjectionType::kActivationOverflow: return 1e6;
    case InjectionType::kLrSpike: return 1000;
    case InjectionType::kLayerNormInput: return 1e5;  // mode huge: |x| of the rows
    case InjectionType::kLossSpike: return 1e4;
    default: return 1;
  }
}

bool InjectionSpec::in_segment() const {
  return type == InjectionType::kActivationOverflow || type == InjectionType::kLayerNormInput ||
         type == InjectionType::kRngDesync || (type == InjectionType::kBitFlip && target == "activations");
}

bool InjectionSpec::operator==(const InjectionSpec& o) const {
  return type == o.type && step == o.step && duration == o.duration && probability == o.probability && seed == o.seed &&
         segment == o.segment && factor == o.factor && mode == o.mode && target == o.target &&
         bit_class == o.bit_class && bits == o.bits && bit == o.bit && rows == o.rows && phase == o.phase &&
         rank == o.rank;
}

}  // namespace retrace
