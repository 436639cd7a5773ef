#pragma once
// The state round-trip self-check: does Program::state() hold everything a step depends on?
//
// Replay loads a step's recorded state() into a freshly built program and re-executes the step.
// A program whose state() leaves something out (Adam's moments, a step counter, a schedule
// counter) replays from the run's first step -- where the missing part is still what the
// constructor made -- and diverges from any later snapshot. The check finds that at record time:
// a second program built from the registry by name and config is loaded with the live program's
// step-start state() and runs the same step on the same batch from the same RNG state; both must
// end the step with bitwise-equal state() digests, loss and gradient norm.
//
// record_run runs it once, at kStateCheckStep (RecorderOptions::state_check, on by default).

#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/program.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

// The step record_run checks: the first one whose start state is not the constructor's (at step
// 1 a missing optimizer moment is still absent in both programs, and nothing can differ).
inline constexpr std::int64_t kStateCheckStep = 2;

struct StateCheckResult {
  enum class Status {
    kNotRun,   // not (yet) attempted
    kPassed,   // the restored copy ended the step bit for bit as the live program did
    kFailed,   // it did not (or could not be rebuilt, or raised where the live step did not)
    kSkipped,  // the program is not registered, or the run ended before kStateCheckStep
  };
  Status status = Status::kNotRun;
  std::int64_t step = -1;
  // What the copy ended the step with differently, in the live program's state() order: state()
  // names ("param.fc.weight"; "NAME (only in the live program)" / "NAME (only in the copy)" for a
  // name one side lacks), then "(loss)", "(grad norm)", "(skipped)" for the outcome.
  std::vector<std::string> differing;
  std::size_t state_tensors = 0;  // entries of the live program's state() after the step
  std::string message;            // one line: what passed, why it was skipped, or what differs and the fix
};

// "not run" | "passed" | "failed" | "skipped"
const char* to_string(StateCheckResult::Status status);

// Thrown by record_run when the check fails, once the checked step's records are written (the
// trace then holds the steps up to it and the error as an `exception` event). what() is
// result().message.
class StateCheckError : public Error {
 public:
  explicit StateCheckError(StateCheckResult result);
  const StateCheckResult& result() const noexcept { return result_; }

 private:
  StateCheckResult result_;
};

// One check, in two halves around the live step.
//
// The constructor runs before `step` runs on `program`, whose state() must then be the step's
// start state: it rebuilds the program (make_program(name(), config())), loads a copy of that
// state into it, and runs the step on a copy of `batch` from the current RNG state, with no
// StepMonitor. It then puts every generator (RngState::capture_all) back as it found it, so the
// live step draws exactly what it would have drawn without the check; the live program is only
// read. It does so twice, one copy after the other: two copies that end the step differently show
// a step that is not deterministic (which no state() makes replayable), not an incomplete state().
// Observers attached process-wide (ObserverScope) see the copies' segment events; the Recorder
// ignores them (they come between its steps). Costs two program constructions and two steps, with
// one copy of the state at a time; each copy is gone once its step ran, only its digests are
// kept. A program not registered under its name() is skipped, not rebuilt.
//
// finish() runs after the live step: it digests `state_after` (the live state() after the step)
// and compares it and the outcome with the copy's.
class StateCheck {
 public:
  StateCheck(Program& program, std::int64_t step, const std::vector<NamedTensor>& batch);
  StateCheckResult finish(const StepOutcome& outcome, const std::vector<NamedTensor>& state_after) const;

 private:
  struct Named {
    std::string name;
    Digest digest;
  };
  // What one copy's run of the step ended with.
  struct Copy {
    std::optional<std::string> raised;  // its step raised this
    std::vector<Named> state_after;     // its state() after the step (not raised)
    StepOutcome outcome;
  };
  std::string program_;    // its registry name
  std::string described_;  // Program::describe(), for messages
  std::int64_t step_;
  std::optional<std::string> skipped_;      // why the copy was not run
  std::optional<std::string> not_rebuilt_;  // the factory threw rebuilding it
  static std::vector<std::string> differences(const Copy& a, const Copy& b, const std::string& a_name,
                                              const std::string& b_name);
  Copy copy_;    // the copy compared with the live program
  Copy second_;  // a second one from the same start: equal, or the step
                 // is not deterministic
};

}  // namespace retrace
