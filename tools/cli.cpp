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

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <iostream>
#include <sys/stat.h>

namespace retrace {

namespace cli {
namespace {
std::string g_default_program;
std::string g_binary_name = "retrace";
}

void check_threads_flag(int threads) {
  if (threads < 1 || threads > kMaxThreads)
    throw Error("--threads must be 1 to " + std::to_string(kMaxThreads) + ", got " + std::to_string(threads));
}

void refuse_output_path(const std::string& output, const char* flag,
                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  struct stat out {};
  if (output.empty() || output == "-" || ::stat(output.c_str(), &out) != 0) return;  // not there yet: nothing to lose
  if (S_ISDIR(out.st_mode)) throw Error(std::string(flag) + " '" + output + "' is a folder; name a file in it");
  for (const auto& [path, what] : inputs) {
    struct stat in {};
    if (!path.empty() && ::stat(path.c_str(), &in) == 0 && in.st_dev == out.st_dev && in.st_ino == out.st_ino) {
      throw Error(std::string(flag) + " '" + output + "' is " + what +
                  " itself; writing it would overwrite it: "
                  "choose another path");
    }
  }
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

namespace {
// Prints the help (nullopt) when --help was given; else checks the required options.
std::optional<boost::program_options::variables_map> help_or_notify(
    boost::program_options::variables_map vm, const boost::program_options::options_description& options) {
  if (vm.count("help")) {
    std::ostringstream text;
    text << options;
    std::string help = text.str();
    // The usage lines name this binary (a user's own, built on retrace::main).
    for (std::size_t at = 0; at != std::string::npos && at < help.size(); at = help.find('\n', at)) {
      if (at > 0) ++at;
      if (help.compare(at, 8, "retrace ") == 0) help.replace(at, 7, binary_name());
    }
    std::cout << help;
    return std::nullopt;
  }
  boost::program_options::notify(vm);
  return vm;
}
}  // namespace

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
  return help_or_notify(std::move(vm), options);
}

std::optional<boost::program_options::variables_map> parse_arguments(
    const std::vector<std::string>& args, const boost::program_options::options_description& options,
    const char* positional_name, std::vector<std::string>* positionals) {
  namespace po = boost::program_options;
  po::options_description hidden;
  hidden.add_options()(positional_name, po::value<std::vector<std::string>>(positionals));
  po::options_description all;
  all.add(options).add(hidden);
  po::positional_options_description pos;
  pos.add(positional_name, -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  return help_or_notify(std::move(vm), options);
}
const std::string& default_program() { return g_default_program; }
void set_default_program(const std::string& name) { g_default_program = name; }
const std::string& binary_name() { return g_binary_name; }
void set_binary_name(const std::string& name) { g_binary_name = name; }

std::string read_text_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + what + " '" + path + "' (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error("cannot read " + what + " '" + path + "'");
  return ss.str();
}
}  // namespace cli

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
  bool builtin_only = false;  // not offered by a user's binary (retrace::main with its own program)
};

const Command kCommands[] = {
    {"run", "run scenarios (fault x defense x expectation); no path: the built-in suite", cli::run_run},
    {"diagnose", "re-run a failing run under stability variants and rank what fixes it", cli::run_diagnose},
    {"record", "record a training run into a trace", cli::run_record},
    {"replay", "re-execute recorded steps bit for bit; name the first divergence and non-finite op", cli::run_replay},
    {"inspect", "list a trace's steps, segments, tensors and environment; export tensors", cli::run_inspect},
    {"demo", "checkpoint a tiny GPT and verify its recompute bit for bit", cli::run_demo, true},
};

bool offered(const Command& c) { return !c.builtin_only || cli::default_program().empty(); }

void usage(std::ostream& os) {
  const std::string& me = cli::binary_name();
  os << "usage: " << me << " [--version] [--help] COMMAND [ARGS]\n";
  if (!cli::default_program().empty()) {
    os << "\nretrace's subcommands for program '" << cli::default_program()
       << "': record it without a scenario, or run scenarios that name it (program: " << cli::default_program()
       << ").\n";
  }
  os << "\ncommands:\n";
  for (const Command& c : kCommands) {
    if (offered(c)) os << "  " << c.name << std::string(10 - std::strlen(c.name), ' ') << c.summary << "\n";
  }
  os << "\nRun '" << me
     << " COMMAND --help' for a command's options.\n"
        "Exit codes: 0 ok or reproduced, 1 a check failed or a replay diverged, 2 bad input or usage.\n";
}

}  // namespace

int main(int argc, char** argv) {
  register_builtin_programs();
  if (argc < 2) {
    std::cerr << cli::binary_name() << ": no command given; run '" << cli::binary_name() << " --help' for the list\n";
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
  const std::string me = cli::binary_name();
  for (const Command& c : kCommands) {
    if (first != c.name || !offered(c)) continue;
    const std::vector<std::string> args(argv + 2, argv + argc);
    try {
      return c.run(args);
    } catch (const boost::program_options::error& e) {
      std::cerr << me << " " << c.name << ": " << e.what() << "; see '" << me << " " << c.name << " --help'\n";
      return 2;
    } catch (const retrace::Error& e) {
      std::cerr << me << " " << c.name << ": " << e.what() << "\n";
      return 2;
    } catch (const nlohmann::json::exception& e) {
      std::cerr << me << " " << c.name << ": malformed metadata in the input (" << e.what() << ")\n";
      return 2;
    } catch (const c10::Error& e) {
      std::cerr << me << " " << c.name << ": " << e.what_without_backtrace() << "\n";
      return 1;
    } catch (const std::exception& e) {
      std::cerr << me << " " << c.name << ": " << e.what() << "\n";
      return 1;
    }
  }
  std::cerr << me << ": unknown command '" << first << "'; run '" << me << " --help' for the list\n";
  return 2;
}

int main(int argc, char** argv, const std::string& program_name, ProgramFactory factory) {
  register_program(program_name, std::move(factory));
  cli::set_default_program(program_name);
  if (argc > 0 && argv[0] && *argv[0]) {
    const std::string path = argv[0];
    cli::set_binary_name(path.substr(path.find_last_of('/') + 1));
  }
  return main(argc, argv);
}

}  // namespace retrace
