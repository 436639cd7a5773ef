#pragma once
// `--ranks N`: runs a subcommand as N data-parallel ranks, processes of this binary on this
// machine, the way torchrun would -- RANK, WORLD_SIZE, a file store they share (RETRACE_STORE),
// one run id (RETRACE_RUN_ID), and LibTorch threads split between them (OMP_NUM_THREADS).

#include <string>
#include <vector>

namespace retrace::cli {

// True when this process is already a rank of a launched run (WORLD_SIZE set), not a launcher.
bool launched_as_rank();

// Starts `ranks` processes running `args` (a subcommand and its arguments, without --ranks),
// waits for every one, and says which failed. Returns 0 when all exited 0, 2 when one refused
// its input (exit 2), 1 otherwise (a rank failed, or died by a signal).
int launch_ranks(int ranks, const std::vector<std::string>& args);

// `args` without `--ranks N` / `--ranks=N`.
std::vector<std::string> without_ranks_flag(const std::vector<std::string>& args);

// The trace of rank `rank` for output `path`: "run.trace" -> "run.rank1.trace", "out" -> "out.rank1".
std::string rank_trace_path(const std::string& path, int rank);

}  // namespace retrace::cli
