// retrace — deterministic replay and fault injection for LibTorch training.
#include "commands.h"

#include <retrace/error.h>
#include <retrace/version.h>

#include <boost/program_options/errors.hpp>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
};

const Command kCommands[] = {
    {"demo", "checkpoint a tiny GPT and verify its recompute bit for bit", retrace::cli::run_demo},
};

void usage(std::ostream& os) {
  os << "usage: retrace [--version] [--help] COMMAND [ARGS]\n\ncommands:\n";
  for (const Command& c : kCommands) os << "  " << c.name << "\t" << c.summary << "\n";
  os << "\nRun 'retrace COMMAND --help' for a command's options.\n"
        "Exit codes: 0 ok, 1 a check failed, 2 bad input or usage.\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "retrace: no command given; run 'retrace --help' for the list\n";
    return 2;
  }
  const std::string first = argv[1];
  if (first == "--version" || first == "version") {
    std::cout << "retrace " << retrace::kVersion << " (LibTorch " << TORCH_VERSION
              << ", CUDA sources " << (retrace::kBuiltWithCuda ? "built" : "not built") << ")\n";
    return 0;
  }
  if (first == "--help" || first == "-h" || first == "help") {
    usage(std::cout);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (first != c.name) continue;
    std::vector<std::string> args(argv + 2, argv + argc);
    try {
      return c.run(args);
    } catch (const boost::program_options::error& e) {
      std::cerr << "retrace " << c.name << ": " << e.what() << "; see 'retrace " << c.name
                << " --help'\n";
      return 2;
    } catch (const retrace::Error& e) {
      std::cerr << "retrace " << c.name << ": " << e.what() << "\n";
      return 2;
    } catch (const c10::Error& e) {
      std::cerr << "retrace " << c.name << ": " << e.what_without_backtrace() << "\n";
      return 1;
    } catch (const std::exception& e) {
      std::cerr << "retrace " << c.name << ": " << e.what() << "\n";
      return 1;
    }
  }
  std::cerr << "retrace: unknown command '" << first << "'; run 'retrace --help' for the list\n";
  return 2;
}
