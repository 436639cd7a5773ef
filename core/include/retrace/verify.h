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
#include <functional>
#include <memory>
#include <optional>
#include <string>
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
  std::optional<DiffReport> diff;            // with keep_values
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
  // How outputs are digested; empty means digest_async(). A substitute whose digests are not
  // ready at once takes the device path below on any tensor (the tests run it on the CPU).
  std::function<PendingDigest(const at::Tensor&)> digest;
};

// Thread-safe. Attach with ObserverScope. A forward whose backward never runs leaves an entry
// behind; reset() drops them (the recorder calls it per step).
//
// When it compares. Digests are taken with digest_async(), so the training thread never waits
// for the device per segment, neither at forward nor at recompute. A segment whose digests are
// ready (CPU tensors) is compared in on_recompute, and kThrow throws from that recompute. One
// whose digests are still on a device (CUDA) is compared at the end of the backward pass that
// recomputed it, in an autograd final callback, after all of backward's work is queued: one wait
// per backward pass instead of two per segment. kThrow then throws RecomputeMismatchError from
// backward() as well, once the pass's work is done (the gradients are already accumulated), naming
// the first mismatching segment in recompute order; kWarn prints there. A recompute outside any
// backward pass (a direct on_recompute call) is compared at once. mismatches() and
// verified_outputs() first finish comparisons still outstanding (another thread's backward in
// flight); they record, never throw.
class RecomputeVerifier : public SegmentObserver {
 public:
  explicit RecomputeVerifier(VerifyOptions options = {});
  ~RecomputeVerifier() override;
  RecomputeVerifier(const RecomputeVerifier&) = delete;
  RecomputeVerifier& operator=(const RecomputeVerifier&) = delete;

  void on_forward(SegmentEvent& event) override;
  void on_recompute(SegmentEvent& event) override;

  std::vector<RecomputeMismatch> mismatches() const;
  std::size_t verified_outputs() const;  // outputs compared so far
  std::size_t pending_segments() const;  // forwards still waiting for their recompute
  // Drops pending forwards, outstanding comparisons and the results so far.
  void reset();

 private:
  struct State;
  // Shared with the final callbacks queued on backward passes, which hold it weakly: a verifier
  // destroyed before its callback runs is skipped, not used after free.
  std::shared_ptr<State> state_;
};

// "Float[4, 8]"
std::string describe(const at::Tensor& tensor);
// The same of a dtype and shape (a trace's tensor entry).
std::string describe(at::ScalarType dtype, c10::IntArrayRef sizes);

}  // namespace retrace
