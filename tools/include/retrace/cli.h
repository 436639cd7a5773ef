#pragma once
// The retrace command line as a library: the `retrace` binary is retrace::main(argc, argv), and
// a user's own training binary gets the same subcommands (run, diagnose, record, replay, inspect)
// for its own program, the way BENCHMARK_MAIN() works:
//
//   int main(int argc, char** argv) {
//     return retrace::main(argc, argv, "my.trainer", [](const std::string& config) {
//       return std::make_unique<MyTrainer>(config);
//     });
//   }
//
// `record` without a scenario file then records that program (config "", or the text of
// `--config FILE`), `replay` rebuilds it from the trace header, and `run`, `diagnose` and
// `record` take scenario files that name it (`program: my.trainer`). Help and errors name the
// binary; `demo` (the built-in tiny GPT's) is left out.

#include <retrace/program.h>

#include <string>

namespace retrace {

// Exit codes: 0 ok / reproduced, 1 a check failed or a replay diverged, 2 bad input or usage.
int main(int argc, char** argv);
int main(int argc, char** argv, const std::string& program_name, ProgramFactory factory);

}  // namespace retrace
