#include <retrace/injectors.h>

#include <retrace/error.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>

namespace retrace {

namespace {

// A generator private to (seed, step, spec index, purpose): injections never touch LibTorch's.
std::mt19937_64 rng_for(std::uint64_t seed, std::int64_t step, std::size_t index, std::uint64_t purpose) {
  std::seed_seq seq{
      static_cast<std::uint32_t>(seed),  static_cast<std::uint32_t>(seed >> 32),
      static_cast<std::uint32_t>(step),  static_cast<std::uint32_t>(static_cast<std::uint64_t>(step) >> 32),
      static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(purpose)};
  return std::mt19937_64(seq);
}

// Portable draws from mt19937_64 (whose output sequence the standard fixes): the library's
// distributions and std::shuffle differ between standard libraries, and an injection must pick
// the same element on every toolchain for a trace to replay anywhere.
double uniform01(std::mt19937_64& gen) { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }
std::uint64_t below(std::mt19937_64& gen, std::uint64_t n) { return n == 0 ? 0 : gen() % n; }
template <typename T>
void shuffle(std::vector<T>& v, std::mt19937_64& gen) {  // Fisher-Yates
  for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(gen, i)]);
}

std::string number(double v) {
  std::ostringstream os;
  os << std::setprecision(4) << v;
  return os.str();
}

// Bit positions of a class for a float format: sign is the top bit, then exponent, then mantissa.
std::vector<int> bits_of_class(at::ScalarType dtype, const std::string& cls) {
  int width = 0, exponent = 0;
  switch (dtype) {
    case at::kFloat:
      width = 32;
      exponent = 8;
      break;
    case at::kDouble:
      width = 64;
      exponent = 11;
      break;
    case at::kHalf:
      width = 16;
      exponent = 5;
      break;
    case at::kBFloat16:
      width = 16;
      exponent = 8;
      break;
    default:
      width = static_cast<int>(c10::elementSize(dtype)) * 8;
      exponent = -1;
      break;
  }
  std::vector<int> out;
  const int mantissa = exponent < 0 ? width : width - 1 - exponent;
  for (int b = 0; b < width; ++b) {
    const bool is_sign = exponent >= 0 && b == width - 1;
    const bool is_exp = exponent >= 0 && b >= mantissa && b < width - 1;
    if (cls == "any" || (cls == "sign" && is_sign) || (cls == "exponent" && is_exp) ||
        (cls == "mantissa" && !is_sign && !is_exp)) {
      out.push_back(b);
    }
  }
  return out;
}

// A 0-dim view of element `index` (row-major order) of `t`, aliasing its storage whatever its
// strides (reshape would copy a non-contiguous tensor, and a write would be lost).
at::Tensor element_view(const at::Tensor& t, std::int64_t index) {
  at::Tensor e = t;
  std::int64_t rest = index;
  std::vector<std::int64_t> coords(static_cast<std::size_t>(t.dim()));
  for (std::int64_t d = t.dim() - 1; d >= 0; --d) {
    coords[static_cast<std::size_t>(d)] = rest % t.size(d);
    rest /= t.size(d);
  }
  for (std::int64_t c : coords) e = e.select(0, c);
  return e;
}

double element_value(const at::Tensor& t, std::int64_t index) { return element_view(t, index).item<double>(); }

// kBitFlip on `t` in place: draws the element, then the bits (of the spec's class, or its chosen
// bit), from `gen` in that order. Returns the element flipped and describes it in `detail`
// ("element E bit B (class) before -> after"), or -1 when the chosen bit is past the element's
// width (nothing fires).
std::int64_t flip_bits(const InjectionSpec& s, at::Tensor& t, std::mt19937_64& gen, std::string& detail) {
  const std::int64_t element = static_cast<std::int64_t>(below(gen, static_cast<std::uint64_t>(t.numel())));
  std::vector<int> pool = bits_of_class(t.scalar_type(), s.bit_class);
  shuffle(pool, gen);
  if (s.bit >= 0) pool = {s.bit};
  if (s.bit >= static_cast<int>(t.element_size()) * 8) return -1;
  const double before = element_value(t, element);
  std::string bits;
  for (int b = 0; b < std::min<int>(s.bits, static_cast<int>(pool.size())); ++b) {
    flip_bit(t, element, pool[b]);
    bits += (bits.empty() ? "" : ",") + std::to_string(pool[b]);
  }
  detail = "element " + std::to_string(element) + " bit " + bits + " (" +
           (s.bit >= 0 ? std::string("chosen") : s.bit_class) + ") " + number(before) + " -> " +
           number(element_value(t, element));
  return element;
}

}  // namespace

void flip_bit(at::Tensor& t, std::int64_t index, int bit) {
  if (index < 0 || index >= t.numel()) {
    throw Error("flip_bit: element " + std::to_string(index) + " is not in a tensor of " + std::to_string(t.numel()) +
                " elements; use 0 .. " + std::to_string(t.numel() - 1));
  }
  const int width = static_cast<int>(t.element_size()) * 8;
  if (bit < 0 || bit >= width) {
    throw Error("flip_bit: bit " + std::to_string(bit) + " is not in a " + std::to_string(width) +
                "-bit element; use 0 .. " + std::to_string(width - 1));
  }
  at::NoGradGuard no_grad;
  // Through a contiguous CPU copy, so any layout and device works; written back with copy_.
  at::Tensor element = element_view(t, index);
  at::Tensor host = element.to(at::kCPU).clone();
  auto* bytes = static_cast<unsigned char*>(host.data_ptr());
  bytes[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));  // little-endian element
  element.copy_(host);
}

Injector::Injector(std::vector<InjectionSpec> specs) : specs_(std::move(specs)) {}

void Injector::begin_step(std::int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
  fired_.clear();
  lr_spikes_.clear();
  hit_invocations_.clear();
  segment_done_.assign(specs_.size(), 0);
}

bool Injector::scheduled(std::size_t index, std::int64_t step) const {
  const InjectionSpec& s = specs_.at(index);
  if (s.rank >= 0 && s.rank != rank_) return false;  // another rank's fault
  if (step < s.step || step >= s.step + s.duration) return false;
  if (s.probability >= 1.0) return true;
  auto gen = rng_for(s.seed, step, index, 1);
  return uniform01(gen) < s.probability;
}

std::vector<std::int64_t> Injector::due_steps(std::size_t index, std::int64_t first, std::int64_t last) const {
  const InjectionSpec& s = specs_.at(index);
  std::vector<std::int64_t> due;
  // Only the entry's own window is drawn: a duration may be far longer than the run.
  const std::int64_t to = s.duration > last - s.step ? last : s.step + s.duration - 1;
  for (std::int64_t step = std::max(first, s.step); step <= to; ++step) {
    if (scheduled(index, step)) due.push_back(step);
  }
  return due;
}

bool Injector::fires(std::size_t index) const { return scheduled(index, step_); }

void Injector::note(const InjectionSpec& spec, std::string where, std::string detail) {
  const auto entry = static_cast<std::size_t>(&spec - specs_.data());  // every caller passes one of specs_
  fired_.push_back({step_, to_string(spec.type), std::move(where), std::move(detail), entry});
}

std::vector<InjectionEvent> Injector::fired() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fired_;
}

double Injector::lr_factor() {
  std::lock_guard<std::mutex> lock(mutex_);
  double f = 1.0;
  lr_spikes_.clear();
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].type != InjectionType::kLrSpike || !fires(i)) continue;
    f *= specs_[i].effective_factor();
    lr_spikes_.push_back(i);
  }
  return f;
}

void Injector::lr_applied() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const std::size_t i : lr_spikes_) note(specs_[i], "lr", "x" + number(specs_[i].effective_factor()));
  lr_spikes_.clear();
}

void Injector::corrupt_batch(std::vector<NamedTensor>& batch, std::int64_t vocab) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const InjectionSpec& s = specs_[i];
    if (s.type != InjectionType::kCorruptBatch || !fires(i)) continue;
    for (NamedTensor& n : batch) {
      if (n.kind != TensorKind::kInput) continue;
      at::Tensor t = n.tensor.clone();
      auto gen = rng_for(s.seed, step_, i, 2);
      const std::int64_t rows = t.dim() > 0 ? t.size(0) : 1;
      const std::int64_t row = static_cast<std::int64_t>(below(gen, static_cast<std::uint64_t>(rows)));
      if (s.mode == "token_out_of_range") {
        if (t.is_floating_point())
          throw InjectionUnsupported(
              "injection corrupt_batch: mode token_out_of_range needs token ids; this model takes features "
              "(use nan_features)");
        t.select(0, row).fill_(vocab + 7);
        note(s, "batch",
             "row " + std::to_string(row) + " token id " + std::to_string(vocab + 7) + " (vocabulary " +
                 std::to_string(vocab) + ")");
      } else {
        if (!t.is_floating_point())
          throw InjectionUnsupported(
              "injection corrupt_batch: mode nan_features needs float features; this model takes token ids "
              "(use token_out_of_range)");
        t.select(0, row).fill_(std::numeric_limits<double>::quiet_NaN());
        note(s, "batch", "row " + std::to_string(row) + " features NaN");
      }
      n.tensor = t;
    }
  }
}

void Injector::flip_state(const std::vector<NamedTensor>& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const InjectionSpec& s = specs_[i];
    if (s.type != InjectionType::kBitFlip || s.target == "activations" || s.target == "gradients" || !fires(i))
      continue;
    const TensorKind kind = s.target == "optimizer" ? TensorKind::kOptimizerState : TensorKind::kParameter;
    std::vector<const NamedTensor*> candidates;
    for (const NamedTensor& n : state) {
      if (n.kind == kind && n.tensor.is_floating_point() && n.tensor.numel() > 0) candidates.push_back(&n);
    }
    if (candidates.empty()) continue;  // no optimizer state yet (Adam's exists after the first step): nothing fires
    auto gen = rng_for(s.seed, step_, i, 3);
    const NamedTensor& victim = *candidates[gen() % candidates.size()];
    at::Tensor t = victim.tensor;
    std::string detail;
    if (flip_bits(s, t, gen, detail) >= 0) note(s, victim.name, detail);  // else past the width: nothing fires
  }
}

at::Tensor Injector::on_loss(const at::Tensor& loss) {
  std::lock_guard<std::mutex> lock(mutex_);
  at::Tensor out = loss;
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].type != InjectionType::kLossSpike || !fires(i)) continue;
    out = out * specs_[i].effective_factor();
    // Each micro-batch's loss of an accumulating step is spiked; the step notes it once.
    const bool noted = std::any_of(fired_.begin(), fired_.end(),
                                   [&](const InjectionEvent& e) { return e.entry == i && e.step == step_; });
    if (!noted) note(specs_[i], "loss", "x" + number(specs_[i].effective_factor()));
  }
  return out;
}

void Injector::on_grads(const std::vector<NamedTensor>& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const InjectionSpec& s = specs_[i];
    if (s.type == InjectionType::kBitFlip && s.target == "gradients" && !grads.empty() && fires(i)) {
      std::vector<const NamedTensor*> candidates;
      for (const NamedTensor& g : grads) {
        if (g.tensor.is_floating_point() && g.tensor.numel() > 0) candidates.push_back(&g);
      }
      if (candidates.empty()) continue;
      auto gen = rng_for(s.seed, step_, i, 3);
      const NamedTensor& victim = *candidates[gen() % candidates.size()];
      at::Tensor t = victim.tensor;
      std::string detail;
      at::NoGradGuard no_grad;
      if (flip_bits(s, t, gen, detail) >= 0) note(s, victim.name, detail);  // else past the width: nothing fires
      continue;
    }
    if (s.type != InjectionType::kGradNonFinite || !fires(i) || grads.empty()) continue;
    auto gen = rng_for(s.seed, step_, i, 4);
    const NamedTensor& g = grads[gen() % grads.size()];
    const std::int64_t element =
        static_cast<std::int64_t>(below(gen, static_cast<std::uint64_t>(std::max<std::int64_t>(1, g.tensor.numel()))));
    const double v = s.mode == "inf" ? std::numeric_limits<double>::infinity()
                                     : std::numeric_limits<double>::quiet_NaN();
    at::NoGradGuard no_grad;
    element_view(g.tensor, element).fill_(v);
    note(s, g.name, "element " + std::to_string(element) + " = " + (s.mode == "inf" ? "inf" : "nan"));
  }
}

bool Injector::targets(const InjectionSpec& spec, const std::string& segment) const {
  return segment_targeted(spec.segment, segment);
}

bool segment_targeted(const std::string& wanted, const std::string& segment) {
  if (wanted.empty() || wanted == segment) return true;
  // A stage inside a range "block0..block3": same prefix, number within the range.
  const auto dots = segment.find("..");
  if (dots == std::string::npos) return false;
  auto split = [](const std::string& s, std::string& prefix, long& n) {
    std::size_t d = s.size();
    while (d > 0 && std::isdigit(static_cast<unsigned char>(s[d - 1]))) --d;
    if (d == s.size()) return false;
    prefix = s.substr(0, d);
    n = std::stol(s.substr(d));
    return true;
  };
  std::string pa, pb, ps;
  long a = 0, b = 0, x = 0;
  if (!split(segment.substr(0, dots), pa, a) || !split(segment.substr(dots + 2), pb, b) || !split(wanted, ps, x)) {
    return false;
  }
  return pa == pb && pa == ps && a <= x && x <= b;
}

at::Tensor Injector::apply_segment_fault(std::size_t index, const at::Tensor& output, const std::string& segment,
                                         bool log) {
  // Differentiable: in the recompute the replacement must stay in the autograd graph, so that
  // backward runs through the segment (the faulted elements aside, gradients flow as usual).
  const InjectionSpec& s = specs_[index];
  switch (s.type) {
    case InjectionType::kActivationOverflow: {
      const double f = s.effective_factor();
      at::Tensor out = output * f;
      if (activation_dtype_ != out.scalar_type() && c10::isFloatingType(activation_dtype_)) {
        out = out.to(activation_dtype_).to(output.scalar_type());
      }
      if (log) {
        const std::int64_t inf = at::isinf(out).sum().item<std::int64_t>();
        note(s, segment,
             "outputs x" + number(f) + " (" + std::to_string(inf) + " of " + std::to_string(out.numel()) +
                 " overflow to Inf in " + c10::toString(activation_dtype_) + ")");
      }
      return out;
    }
    case InjectionType::kLayerNormInput: {
      at::Tensor values = output.detach().contiguous().clone();
      at::Tensor rows = values.reshape({-1, values.size(-1)});
      at::Tensor mask = at::zeros({rows.size(0), 1}, values.options().dtype(at::kBool));
      const std::int64_t n = rows.size(0);
      const std::int64_t hit =
          std::max<std::int64_t>(1, static_cast<std::int64_t>(std::floor(s.rows * static_cast<double>(n))));
      auto gen = rng_for(s.seed, step_, index, 5);
      std::vector<std::int64_t> order(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
      shuffle(order, gen);
      {
        at::NoGradGuard no_grad;
        for (std::int64_t i = 0; i < hit; ++i) {
          const std::int64_t r = order[static_cast<std::size_t>(i)];
          at::Tensor row = rows.select(0, r);
          mask[r][0] = true;
          if (s.mode == "nan") {
            row.fill_(std::numeric_limits<double>::quiet_NaN());
          } else if (s.mode == "huge") {
            // Alternating +-factor: mean 0, variance factor^2 (overflows an fp16 variance).
            row.copy_(at::arange(row.numel(), row.options().dtype(at::kFloat))
                          .remainder(2)
                          .mul(2)
                          .sub(1)
                          .mul(s.effective_factor())
                          .to(row.scalar_type()));
          } else {
            row.fill_(row.mean().item<double>());  // constant: zero variance
          }
        }
      }
      if (log)
        note(s, segment,
             std::to_string(hit) + " of " + std::to_string(n) + " rows " + (s.mode.empty() ? "constant" : s.mode));
      // The hit rows take the injected values (no gradient flows into them, as into any
      // constant); the others are the output itself.
      return at::where(mask.expand_as(rows).reshape(output.sizes()), values, output);
    }
    case InjectionType::kBitFlip: {
      at::Tensor values = output.detach().contiguous().clone();
      auto gen = rng_for(s.seed, step_, index, 6);
      std::string detail;
      const std::int64_t element = flip_bits(s, values, gen, detail);
      if (element < 0) return output;  // past the width: nothing fires
      if (log) note(s, segment, "output " + detail);
      at::Tensor mask = at::zeros({values.numel()}, values.options().dtype(at::kBool));
      mask[element] = true;
      return at::where(mask.reshape(output.sizes()), values, output);
    }
    default: return output;
  }
}

void Injector::on_forward(SegmentEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const InjectionSpec& s = specs_[i];
    if (!s.in_segment() || !targets(s, event.segment) || !fires(i)) continue;
    // Once per step and spec: the first matching forward.
    if (segment_done_[i]) continue;
    segment_done_[i] = 1;
    if (s.type == InjectionType::kRngDesync) {
      // Consume the CPU generator after this forward: the recompute sees other random numbers
      // unless the checkpoint restores the forward's generator state.
      (void)at::rand({64}, at::TensorOptions().dtype(at::kFloat));
      note(s, event.segment, "CPU generator advanced by 64 draws after the forward");
      continue;
    }
    if (!event.outputs.empty() && event.outputs[0].defined()) {
      if (s.phase == "recompute") {
        note(s, event.segment, "armed for the recompute of this forward");
      } else {
        event.outputs[0] = apply_segment_fault(i, event.outputs[0], event.segment, true);
      }
      if (s.phase != "forward") hit_invocations_.emplace_back(event.invocation, i);
    }
  }
}

void Injector::on_recompute(SegmentEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const std::pair<std::uint64_t, std::size_t> key{event.invocation, i};
    if (std::find(hit_invocations_.begin(), hit_invocations_.end(), key) == hit_invocations_.end()) continue;
    if (!event.outputs.empty() && event.outputs[0].defined()) {
      event.outputs[0] = apply_segment_fault(i, event.outputs[0], event.segment, specs_[i].phase == "recompute");
    }
  }
}

}  // namespace retrace
