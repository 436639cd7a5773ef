#pragma once
// A test-only seam of retrace::recorder (not installed): a crash point for the crash-consistency
// tests. With a step set, record_run dies by SIGKILL right after that step's step_begin record
// (before Program::step), as a machine losing power would. The `retrace` binary never sets it;
// tests/cli/crashable_main.cpp is the retrace::main that sets it from RETRACE_FAULT_KILL_AT_STEP.

#include <cstdint>

namespace retrace::internal {

// Steps are 1-based; 0 or less switches the crash point off (the default).
void set_crash_after_step_begin(std::int64_t step);

}  // namespace retrace::internal
