// The retrace CLI with the recorder's crash point (recorder/crash_point.h) armed from
// RETRACE_FAULT_KILL_AT_STEP: what the crash-consistency tests run. Child processes of `run`
// re-execute this binary and inherit the variable, so the crash point reaches them too. With
// RETRACE_FAULT_KILL_RANK set, only the data-parallel rank of that RANK arms it.
#include <retrace/cli.h>

#include "recorder/crash_point.h"

#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  const char* only_rank = std::getenv("RETRACE_FAULT_KILL_RANK");
  const char* rank = std::getenv("RANK");
  const bool this_rank = !only_rank || (rank && std::string(rank) == only_rank);
  if (const char* step = std::getenv("RETRACE_FAULT_KILL_AT_STEP"); step && this_rank) {
    retrace::internal::set_crash_after_step_begin(std::atoll(step));
  }
  return retrace::main(argc, argv);
}
