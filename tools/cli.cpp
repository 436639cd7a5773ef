// Subcommand dispatch and error mapping for retrace::main.
#include "commands.h"

#include <retrace/cli.h>
#include <retrace/error.h>
#include <retrace/trainer.h>
#include <retrace/trace.h>
#include <retrace/version.h>

#include <boost/program_options.hpp>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace retrace {

namespace cli {
namespace {
std::string g_default_program;
}

void write_file(const std::string& path, std::string_view bytes, const std::string& what) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();  // a write error at close (a full disk) must not pass either
  if (!f) throw Error("cannot write " + (what.empty() ? std::string() : what + " ") + "'" + path + "'");
}

void write_output(const std::string& path, std::string_view text, const std::string& what) {
  if (path == "-") {
    std::cout << text;
    return;
  }
  write_file(path, text, what);
}

std::optional<boost::program_options::variables_map> parse_arguments(
    const std::vector<std::string>& args, const boost::program_options::options_description& options,
    const char* positional_name, std::string* positional) {
  namespace po = boost::program_options;
  po::options_description hidden;
  hidden.add_options()(positional_name, po::value<std::string>(positional));
  po::options_description all;
  all.add(options).add(hidden);
  po::positional_options_description pos;
  pos.add(positional_name, 1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  if (vm.count("help")) {
    std::cout << options;
    return std::nullopt;
  }
  po::notify(vm);
  return vm;
}
const std::string& default_program() { return g_default_program; }
void set_default_program(const std::string& name) { g_default_program = name; }
}  // namespace cli

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
};

const Command kCommands[] = {
    {"run", "run scenarios (fault x defense x expectation); no path: the built-in suite", cli::run_run},
    {"diagnose", "re-run a failing run under stability variants and rank what fixes it", cli::run_diagnose},
    {"record", "record a training run into a trace", cli::run_record},
    {"replay", "re-execute recorded steps bit for bit; name the first divergence and non-finite op", cli::run_replay},
    {"inspect", "list a trace's steps, segments, tensors and environment; export tensors", cli::run_inspect},
    {"demo", "checkpoint a tiny GPT and verify its recompute bit for bit", cli::run_demo},
};

void usage(std::ostream& os) {
  os << "usage: retrace [--version] [--help] COMMAND [ARGS]\n\ncommands:\n";
  for (const Command& c : kCommands) os << "  " << c.name << std::string(10 - std::strlen(c.name), ' ') << c.summary << "\n";
  os << "\nRun 'retrace COMMAND --help' for a command's options.\n"
        "Exit codes: 0 ok or reproduced, 1 a check failed or a replay diverged, 2 bad input or usage.\n";
}

}  // namespace

int main(int argc, char** argv) {
  register_builtin_programs();
  if (argc < 2) {
    std::cerr << "retrace: no command given; run 'retrace --help' for the list\n";
    return 2;
  }
  const std::string first = argv[1];
  if (first == "--version" || first == "version") {
    std::cout << "retrace " << kVersion << " (LibTorch " << TORCH_VERSION << ", CUDA sources "
              << (kBuiltWithCuda ? "built" : "not built") << ", writes trace format " << kTraceFormatVersion << ")\n";
    return 0;
  }
  if (first == "--help" || first == "-h" || first == "help") {
    usage(std::cout);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (first != c.name) continue;
    const std::vector<std::string> args(argv + 2, argv + argc);
    try {
      return c.run(args);
    } catch (const boost::program_options::error& e) {
      std::cerr << "retrace " << c.name << ": " << e.what() << "; see 'retrace " << c.name << " --help'\n";
      return 2;
    } catch (const retrace::Error& e) {
      std::cerr << "retrace " << c.name << ": " << e.what() << "\n";
      return 2;
    } catch (const nlohmann::json::exception& e) {
      std::cerr << "retrace " << c.name << ": malformed metadata in the input (" << e.what() << ")\n";
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

int main(int argc, char** argv, const std::string& program_name, ProgramFactory factory) {
  register_program(program_name, std::move(factory));
  cli::set_default_program(program_name);
  return main(argc, argv);
}

}  // namespace retrace
