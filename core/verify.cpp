#include <retrace/verify.h>

#include <iostream>

namespace retrace {

VerifyPolicy parse_verify_policy(const std::string& text) {
  if (text == "off") return VerifyPolicy::kOff;
  if (text == "warn") return VerifyPolicy::kWarn;
  if (text == "record") return VerifyPolicy::kRecord;
  if (text == "throw") return VerifyPolicy::kThrow;
  throw Error("unknown verify policy '" + text + "'; use off, warn, throw or record");
}

const char* to_string(VerifyPolicy policy) {
  switch (policy) {
    case VerifyPolicy::kOff: return "off";
    case VerifyPolicy::kWarn: return "warn";
    case VerifyPolicy::kRecord: return "record";
    case VerifyPolicy::kThrow: return "throw";
  }
  return "?";
}

std::string describe(const at::Tensor& tensor) {
  if (!tensor.defined()) return "undefined";
  std::string s = c10::toString(tensor.scalar_type());
  s += '[';
  for (std::int64_t i = 0; i < tensor.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(tensor.size(i));
  }
  return s + ']';
}

std::string RecomputeMismatch::message() const {
  std::string m = "recompute of segment '" + segment + "' (invocation " +
                   std::to_string(invocation) + ") is not bitwise equal to its forward: output " +
                   std::to_string(output_index) + " forward " + forward_meta + " digest " +
                   forward.hex() + ", recompute " + recompute_meta + " digest " + recompute.hex();
  if (diff) m += "; " + diff->summary();
  return m;
}

RecomputeVerifier::RecomputeVerifier(VerifyOptions options) : options_(options) {}

void RecomputeVerifier::on_forward(SegmentEvent& event) {
  if (options_.policy == VerifyPolicy::kOff || !event.will_recompute) return;
  Expected e;
  e.digests.reserve(event.outputs.size());
  for (const at::Tensor& out : event.outputs) {
    e.digests.push_back(digest(out));
    e.meta.push_back(describe(out));
    if (options_.keep_values) e.values.push_back(out.detach().clone());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  pending_[event.invocation] = std::move(e);
}

void RecomputeVerifier::on_recompute(SegmentEvent& event) {
  if (options_.policy == VerifyPolicy::kOff) return;
  Expected e;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(event.invocation);
    if (it == pending_.end()) return;  // attached after this segment's forward ran
    e = std::move(it->second);
    pending_.erase(it);
  }
  std::vector<RecomputeMismatch> found;
  const std::size_t n = std::max(e.digests.size(), event.outputs.size());
  for (std::size_t i = 0; i < n; ++i) {
    RecomputeMismatch m;
    m.segment = event.segment;
    m.invocation = event.invocation;
    m.output_index = i;
    const bool have_forward = i < e.digests.size();
    const bool have_recompute = i < event.outputs.size();
    if (have_forward) {
      m.forward = e.digests[i];
      m.forward_meta = e.meta[i];
    } else {
      m.forward_meta = "missing";
    }
    if (have_recompute) {
      m.recompute = digest(event.outputs[i]);
      m.recompute_meta = describe(event.outputs[i]);
    } else {
      m.recompute_meta = "missing";
    }
    if (have_forward && have_recompute && m.forward == m.recompute) continue;
    if (options_.keep_values && have_forward && have_recompute) {
      m.diff = bitwise_diff(e.values[i], event.outputs[i].detach());
    }
    found.push_back(std::move(m));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    verified_ += n;
    mismatches_.insert(mismatches_.end(), found.begin(), found.end());
  }
  if (found.empty()) return;
  if (options_.policy == VerifyPolicy::kThrow) throw RecomputeMismatchError(found.front());
  if (options_.policy == VerifyPolicy::kRecord) return;
  for (const RecomputeMismatch& m : found) std::cerr << "retrace: warning: " << m.message() << "\n";
}

std::vector<RecomputeMismatch> RecomputeVerifier::mismatches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mismatches_;
}

std::size_t RecomputeVerifier::verified_outputs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return verified_;
}

std::size_t RecomputeVerifier::pending_segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.size();
}

void RecomputeVerifier::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.clear();
  mismatches_.clear();
  verified_ = 0;
}

}  // namespace retrace
