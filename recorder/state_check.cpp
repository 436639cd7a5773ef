#include <retrace/records.h>
#include <retrace/state_check.h>

#include <retrace/restore.h>

#include <retrace/rng.h>
#include <retrace/trace.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

namespace retrace {

const char* to_string(StateCheckResult::Status status) {
  switch (status) {
    case StateCheckResult::Status::kNotRun: return "not run";
    case StateCheckResult::Status::kPassed: return "passed";
    case StateCheckResult::Status::kFailed: return "failed";
    case StateCheckResult::Status::kSkipped: return "skipped";
  }
  return "?";
}

StateCheckError::StateCheckError(StateCheckResult result) : Error(result.message), result_(std::move(result)) {}

namespace {

// Bitwise, except that any NaN equals any NaN (a NaN's payload says nothing, number.h).
bool same_number(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

std::string name_list(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 4;
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > kShown) s += " and " + std::to_string(names.size() - kShown) + " more";
  return s;
}

}  // namespace

// What `b` ended the step with otherwise than `a`, in a's state() order: "NAME" for a tensor whose
// digest differs, "NAME (only in the A_NAME)" / "NAME (only in the B_NAME)", then "(loss)", "(grad
// norm)", "(skipped)" for the outcome.
std::vector<std::string> StateCheck::differences(const Copy& a, const Copy& b, const std::string& a_name,
                                                 const std::string& b_name) {
  std::vector<std::string> out;
  std::map<std::string, Digest> other;
  for (const Named& n : b.state_after) other.emplace(n.name, n.digest);
  for (const Named& n : a.state_after) {
    const auto it = other.find(n.name);
    if (it == other.end()) {
      out.push_back(n.name + " (only in the " + a_name + ")");
      continue;
    }
    if (n.digest != it->second) out.push_back(n.name);
    other.erase(it);
  }
  for (const Named& n : b.state_after) {
    if (other.count(n.name)) out.push_back(n.name + " (only in the " + b_name + ")");
  }
  if (!same_number(a.outcome.loss, b.outcome.loss)) out.push_back("(loss)");
  if (!same_number(a.outcome.grad_norm, b.outcome.grad_norm)) out.push_back("(grad norm)");
  if (a.outcome.skipped != b.outcome.skipped) out.push_back("(skipped)");
  return out;
}

StateCheck::StateCheck(Program& program, std::int64_t step, const std::vector<NamedTensor>& batch)
    : program_(program.name()), described_(program.describe()), step_(step) {
  const std::vector<std::string> known = registered_programs();
  if (std::find(known.begin(), known.end(), program_) == known.end()) {
    skipped_ = described_ + " is not registered (register_program), so it cannot be rebuilt by name";
    return;
  }
  const std::vector<NamedTensor> inputs = clone_all(batch);  // an injector may corrupt a batch in place
  const RngState rng = RngState::capture_all();
  // One copy's run of the step, from the live program's start state (the live step has not run
  // yet, so its state() is still that) and the captured RNG state.
  auto run_copy = [&](Copy& out) {
    std::unique_ptr<Program> copy;
    try {
      // Built as replay builds it (program_from_trace with BuildFor::kReplay): a program that
      // skips its initialization there must hold in state() all that it skipped, or the copy's
      // step comes out otherwise and the check says so.
      const RestoringStateScope restoring;
      copy = make_program(program_, program.config());
    } catch (const std::exception& e) {
      not_rebuilt_ = exception_message(e);
      return false;
    }
    // Restored as replay restores it: into its own tensors where they fit, through adopt_state.
    restore_as_replay_does(*copy, clone_all(program.state()));
    rng.restore();  // construction may have drawn (random init, seeding)
    try {
      out.outcome = copy->step(step, inputs, nullptr);
    } catch (const std::exception& e) {
      out.raised = exception_message(e);
      return true;
    }
    for (const NamedTensor& n : copy->state()) out.state_after.push_back({n.name, digest(n.tensor)});
    return true;
  };
  try {
    // Twice, one copy after the other (one copy's memory at a time): copies that disagree with each
    // other show a step that is not deterministic, which no state() can make replayable.
    if (run_copy(copy_)) run_copy(second_);
  } catch (...) {
    rng.restore();
    throw;
  }
  rng.restore();
}

StateCheckResult StateCheck::finish(const StepOutcome& outcome, const std::vector<NamedTensor>& state_after) const {
  StateCheckResult r;
  r.step = step_;
  r.state_tensors = state_after.size();
  const std::string at = "state round-trip self-check at step " + std::to_string(step_);
  if (skipped_) {
    r.status = StateCheckResult::Status::kSkipped;
    r.message = at + " skipped: " + *skipped_;
    return r;
  }
  const std::string copy =
      "a copy of " + described_ + " rebuilt from its name and config and loaded with the step's start state()";
  const std::string fix =
      "; add it to state() and load_state() (or, if its constructor skips initializing it under "
      "restoring_state(), initialize it there; and load_state() is given the program's own state() tensors "
      "where they can take the snapshot in place, so it must not clear one before copying into it), or turn "
      "the check off (RecorderOptions::state_check, retrace record --no-state-check)";
  r.status = StateCheckResult::Status::kFailed;
  if (not_rebuilt_) {
    r.message = at + " failed: rebuilding " + described_ + " from its name and config raised: " + *not_rebuilt_ +
                "; replay rebuilds it the same way and would fail too";
    return r;
  }
  // The step is not deterministic when the two copies, from the same start, end it differently.
  if (second_.raised != copy_.raised || (!copy_.raised && !differences(copy_, second_, "first", "second").empty())) {
    std::vector<std::string> apart;
    if (second_.raised != copy_.raised) {
      apart.push_back("one raised (" + copy_.raised.value_or(second_.raised.value_or("")) + "), the other did not");
    } else {
      apart = differences(copy_, second_, "first", "second");
    }
    r.differing = apart;
    r.message = at + " failed: two copies of " + described_ +
                ", each rebuilt from its name and config and loaded with the step's start state() and RNG state, "
                "ended it differently from each other in " +
                name_list(apart) +
                ": the step is not deterministic, so no replay reproduces it bit for bit, whatever state() holds; "
                "find what varies from run to run (a kernel without a deterministic implementation -- record "
                "--deterministic turns deterministic algorithms on --, a generator drawn without a seed, a "
                "thread, a clock), or turn the check off (RecorderOptions::state_check, retrace record "
                "--no-state-check)";
    return r;
  }
  if (copy_.raised) {
    r.message = at + " failed: " + copy + " raised where the live program did not: " + *copy_.raised +
                "; the program's state() is probably incomplete: it leaves out something the step depends on" + fix;
    return r;
  }
  Copy live;
  live.outcome = outcome;
  for (const NamedTensor& n : state_after) live.state_after.push_back({n.name, digest(n.tensor)});
  r.differing = differences(live, copy_, "live program", "copy");
  if (r.differing.empty()) {
    r.status = StateCheckResult::Status::kPassed;
    r.message = at + " passed: " + copy + " ended it bitwise equal (" + std::to_string(r.state_tensors) +
                " state() tensors, loss, gradient norm), and so did a second one";
    return r;
  }
  const auto in_state =
      std::count_if(r.differing.begin(), r.differing.end(), [](const std::string& n) { return n[0] != '('; });
  r.message = at + " failed: " + copy + " ended it otherwise than the live program in " + name_list(r.differing) +
              " (" + std::to_string(in_state) + " of " + std::to_string(r.state_tensors) +
              " state() tensors); the program's state() is probably incomplete: it leaves out something "
              "the step depends on (optimizer moments or step counts, a schedule counter, a loss-scale tracker), so "
              "a replay from a later snapshot cannot reproduce the run" +
              fix;
  return r;
}

}  // namespace retrace
