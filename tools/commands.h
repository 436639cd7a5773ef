#pragma once
// The retrace CLI's subcommands. Each takes the arguments after its name and returns the exit
// code: 0 ok / reproduced, 1 a check failed or diverged, 2 bad input or usage.

#include <string>
#include <vector>

namespace retrace::cli {

int run_demo(const std::vector<std::string>& args);

}  // namespace retrace::cli
