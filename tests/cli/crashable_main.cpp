// The retrace CLI with the recorder's crash point (recorder/crash_point.h) armed from
// RETRACE_FAULT_KILL_AT_STEP: what the crash-consistency tests run. Child processes of `run`
// re-execute this binary and inherit the variable, so the crash point reaches them too.
#include <retrace/cli.h>

#include "recorder/crash_point.h"

#include <cstdlib>

int main(int argc, char** argv) {
  if (const char* step = std::getenv("RETRACE_FAULT_KILL_AT_STEP")) {
    retrace::internal::set_crash_after_step_begin(std::atoll(step));
  }
  return retrace::main(argc, argv);
}
