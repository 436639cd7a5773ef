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

StateCheck::StateCheck(Program& program, std::int64_t step, const std::vector<NamedTensor>& batch)
    : program_(program.name()), step_(step) {
  const std::vector<std::string> known = registered_programs();
  if (std::find(known.begin(), known.end(), program_) == known.end()) {
    skipped_ = "program '" + program_ + "' is not registered (register_program), so it cannot be rebuilt by name";
    return;
  }
  std::vector<NamedTensor> start = clone_all(program.state());
  const std::vector<NamedTensor> inputs = clone_all(batch);  // an injector may corrupt a batch in place
  const RngState rng = RngState::capture_all();
  try {
    std::unique_ptr<Program> copy;
    try {
      // Built as replay builds it (program_from_trace with BuildFor::kReplay): a program that
      // skips its initialization there must hold in state() all that it skipped, or the copy's
      // step comes out otherwise and the check says so.
      const RestoringStateScope restoring;
      copy = make_program(program_, program.config());
    } catch (const std::exception& e) {
      not_rebuilt_ = exception_message(e);
    }
    if (copy) {
      // Restored as replay restores it: into its own tensors where they fit, through adopt_state.
      restore_as_replay_does(*copy, std::move(start));
      rng.restore();  // construction may have drawn (random init, seeding)
      try {
        outcome_ = copy->step(step, inputs, nullptr);
      } catch (const std::exception& e) {
        raised_ = exception_message(e);
      }
      if (!raised_) {
        for (const NamedTensor& n : copy->state()) state_after_.push_back({n.name, digest(n.tensor)});
      }
    }
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
      "a copy of program '" + program_ + "' rebuilt from its name and config and loaded with the step's start state()";
  const std::string fix =
      "; add it to state() and load_state() (or, if its constructor skips initializing it under "
      "restoring_state(), initialize it there; and load_state() is given the program's own state() tensors "
      "where they can take the snapshot in place, so it must not clear one before copying into it), or turn "
      "the check off (RecorderOptions::state_check, retrace record --no-state-check)";
  r.status = StateCheckResult::Status::kFailed;
  if (not_rebuilt_) {
    r.message = at + " failed: rebuilding program '" + program_ +
                "' from its name and config raised: " + *not_rebuilt_ +
                "; replay rebuilds it the same way and would fail too";
    return r;
  }
  if (raised_) {
    r.message = at + " failed: " + copy + " raised where the live program did not: " + *raised_ +
                "; the program's state() is probably incomplete: it leaves out something the step depends on" + fix;
    return r;
  }
  std::map<std::string, Digest> copied;
  for (const Named& n : state_after_) copied.emplace(n.name, n.digest);
  for (const NamedTensor& live : state_after) {
    const auto it = copied.find(live.name);
    if (it == copied.end()) {
      r.differing.push_back(live.name + " (only in the live program)");
      continue;
    }
    if (digest(live.tensor) != it->second) r.differing.push_back(live.name);
    copied.erase(it);
  }
  for (const Named& n : state_after_) {
    if (copied.count(n.name)) r.differing.push_back(n.name + " (only in the copy)");
  }
  if (!same_number(outcome.loss, outcome_.loss)) r.differing.push_back("(loss)");
  if (!same_number(outcome.grad_norm, outcome_.grad_norm)) r.differing.push_back("(grad norm)");
  if (outcome.skipped != outcome_.skipped) r.differing.push_back("(skipped)");
  if (r.differing.empty()) {
    r.status = StateCheckResult::Status::kPassed;
    r.message = at + " passed: " + copy + " ended it bitwise equal (" + std::to_string(r.state_tensors) +
                " state() tensors, loss, gradient norm)";
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
