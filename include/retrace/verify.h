#pragma once
// Live recompute verification: a SegmentObserver that digests each segment's outputs at forward
// and again at recompute, and reports any segment whose recompute is not bitwise equal to its
// forward. PyTorch's determinism_check compares only shapes, dtypes and devices; this compares
// values.

#include <retrace/diff.h>
#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/observer.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace retrace {

// kRecord keeps the mismatches for mismatches() and says nothing (the scenario harness decides).
enum class VerifyPolicy { kOff, kWarn, kThrow, kRecord };
// "off" | "warn" | "throw" | "record"; throws retrace::Error for anything else.
VerifyPolicy parse_verify_policy(const std::string& text);
const char* to_string(VerifyPolicy policy);

struct RecomputeMismatch {
  std::string segment;
  std::uint64_t invocation = 0;
  std::size_t output_index = 0;
  Digest forward;
  Digest recompute;
  std::string forward_meta, recompute_meta;  // dtype and shape, e.g. "Float[4, 8]"
  std::optional<DiffReport> diff;           // with keep_values
  // One line naming the segment and output, plus the diff report when kept.
  std::string message() const;
};

class RecomputeMismatchError : public Error {
 public:
  explicit RecomputeMismatchError(RecomputeMismatch mismatch)
      : Error(mismatch.message()), mismatch_(std::move(mismatch)) {}
  const RecomputeMismatch& mismatch() const noexcept { return mismatch_; }

 private:
  RecomputeMismatch mismatch_;
};

struct VerifyOptions {
  VerifyPolicy policy = VerifyPolicy::kThrow;
  // Keep a copy of each forward output until its recompute, so a mismatch carries the full
  // DiffReport. Costs the memory that checkpointing saved; for debugging.
  bool keep_values = false;
};

// Thread-safe. Attach with ObserverScope. A forward whose backward never runs leaves an entry
// behind; reset() drops them (the recorder calls it per step).
class RecomputeVerifier : public SegmentObserver {
 public:
  explicit RecomputeVerifier(VerifyOptions options = {});

  void on_forward(SegmentEvent& event) override;
  void on_recompute(SegmentEvent& event) override;

  std::vector<RecomputeMismatch> mismatches() const;
  std::size_t verified_outputs() const;   // outputs compared so far
  std::size_t pending_segments() const;   // forwards still waiting for their recompute
  void reset();

 private:
  struct Expected {
    std::vector<Digest> digests;
    std::vector<std::string> meta;
    std::vector<at::Tensor> values;  // keep_values only
  };
  VerifyOptions options_;
  mutable std::mutex mutex_;
  std::unordered_map<std::uint64_t, Expected> pending_;
  std::vector<RecomputeMismatch> mismatches_;
  std::size_t verified_ = 0;
};

// "Float[4, 8]"
std::string describe(const at::Tensor& tensor);

}  // namespace retrace
