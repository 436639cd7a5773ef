#pragma once
// The retrace CLI's subcommands. Each takes the arguments after its name and returns the exit
// code: 0 ok / reproduced, 1 a check failed or diverged, 2 bad input or usage.

#include <string>
#include <vector>

namespace retrace::cli {

int run_demo(const std::vector<std::string>& args);
int run_record(const std::vector<std::string>& args);
int run_replay(const std::vector<std::string>& args);
int run_inspect(const std::vector<std::string>& args);

// The program `record` uses when no scenario file is given (set by retrace::main's overload).
const std::string& default_program();
void set_default_program(const std::string& name);

}  // namespace retrace::cli
