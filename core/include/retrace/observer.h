#pragma once
// The segment observer interface: the one seam that the recorder, the injectors and the live
// recompute verifier hang on. A checkpointed segment reports three events:
//   forward    inputs and outputs of the no-grad forward
//   recompute  inputs and outputs of the recompute in backward (under the forward's RNG and
//              autocast state)
//   backward   incoming output grads and the grads it produced for its inputs
// With no observer attached, a segment pays one relaxed atomic load per event.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace retrace {

enum class SegmentPhase : std::uint8_t { kForward = 0, kRecompute = 1, kBackward = 2 };
const char* to_string(SegmentPhase phase);

struct SegmentEvent {
  const std::string& segment;  // the name given to checkpoint()
  std::uint64_t invocation;    // unique per checkpoint() call in this process, ties recompute
                               // and backward to their forward
  SegmentPhase phase;
  // forward/recompute: the segment's inputs. backward: the grads flowing into its outputs
  // (undefined where an output got none).
  const std::vector<at::Tensor>& inputs;
  // forward/recompute: the outputs; an observer may replace them (injectors do), and the
  // replacement is what flows on. backward: the grads for the inputs (undefined where an input
  // does not require grad); an observer may replace them too.
  std::vector<at::Tensor>& outputs;
  // forward only: true when backward will recompute this segment (grad mode on).
  bool will_recompute = false;
};

// Observers are called on the thread that runs the event (backward events on the autograd
// engine's thread) and must be thread-safe. An exception thrown by an observer propagates out of
// the forward call or out of backward().
class SegmentObserver {
 public:
  virtual ~SegmentObserver() = default;
  virtual void on_forward(SegmentEvent& event) {}
  virtual void on_recompute(SegmentEvent& event) {}
  virtual void on_backward(SegmentEvent& event) {}
};

// Where an observer goes in the call order. kFirst is for observers that replace outputs
// (injectors): everyone else -- recorder, verifiers, replay's comparer -- then sees the values
// that actually flow on.
enum class ObserverOrder { kLast, kFirst };

// Attaches an observer for the lifetime of the scope, process-wide. Observers are called in
// attach order, kFirst ones before all others. The observer must outlive the scope.
class ObserverScope {
 public:
  explicit ObserverScope(SegmentObserver& observer, ObserverOrder order = ObserverOrder::kLast);
  ~ObserverScope();
  ObserverScope(const ObserverScope&) = delete;
  ObserverScope& operator=(const ObserverScope&) = delete;

 private:
  SegmentObserver* observer_;
};

// The innermost checkpointed segment running on the calling thread: its name and whether its
// function is running forward, being recomputed, or being back-propagated. Empty outside any
// segment. Replay's op-level instrumentation uses it to attribute an op to a segment.
struct ActiveSegment {
  std::string segment;
  SegmentPhase phase = SegmentPhase::kForward;
};
bool current_segment(ActiveSegment* out);
// The segment whose event (its forward's or recompute's outputs) the attached observers are
// handling on the calling thread, outside the segment itself: an injector replacing its output,
// the recorder digesting it. Empty otherwise. Replay's op-level instrumentation names such an op
// as the observer's, not the segment's own code.
bool observed_segment(ActiveSegment* out);

namespace detail {
// True when at least one observer is attached. Cost: one relaxed atomic load.
bool observers_attached() noexcept;
// Calls every attached observer's handler for event.phase.
void notify_observers(SegmentEvent& event);
}  // namespace detail

}  // namespace retrace
