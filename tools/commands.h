#pragma once
// The retrace CLI's subcommands. Each takes the arguments after its name and returns the exit
// code: 0 ok / reproduced, 1 a check failed or diverged, 2 bad input or usage.

#include <boost/program_options/options_description.hpp>
#include <boost/program_options/variables_map.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace retrace::cli {

// Parses `args` against `options` plus one positional argument stored into `positional`.
// Returns nullopt after printing the help when --help was given.
std::optional<boost::program_options::variables_map> parse_arguments(
    const std::vector<std::string>& args, const boost::program_options::options_description& options,
    const char* positional_name, std::string* positional);
// The same with any number of positional arguments (retrace inspect/replay RANK_TRACES...).
std::optional<boost::program_options::variables_map> parse_arguments(
    const std::vector<std::string>& args, const boost::program_options::options_description& options,
    const char* positional_name, std::vector<std::string>* positionals);

// Writes `bytes` to `path` (created or truncated) and closes it; throws retrace::Error
// "cannot write WHAT 'PATH'" when any of it fails, a full disk at close included.
void write_file(const std::string& path, std::string_view bytes, const std::string& what);
// write_file, or standard output when `path` is "-" (--json -).
void write_output(const std::string& path, std::string_view text, const std::string& what);

// --threads N: LibTorch intra-op threads, 1 to kMaxThreads (more only stalls the machine creating
// them); throws retrace::Error naming the flag otherwise.
inline constexpr int kMaxThreads = 1024;
void check_threads_flag(int threads);

// An output path that would destroy an input or cannot be a file: throws retrace::Error naming
// the flag when `output` is a folder, or the same file as one of `inputs` (what each is, e.g.
// "the scenario file"), which writing it would overwrite.
void refuse_output_path(const std::string& output, const char* flag,
                        const std::vector<std::pair<std::string, std::string>>& inputs);

int run_demo(const std::vector<std::string>& args);
int run_record(const std::vector<std::string>& args);
int run_replay(const std::vector<std::string>& args);
int run_inspect(const std::vector<std::string>& args);
int run_run(const std::vector<std::string>& args);
int run_diagnose(const std::vector<std::string>& args);

// The program `record` uses when no scenario file is given (set by retrace::main's overload).
const std::string& default_program();
void set_default_program(const std::string& name);
// What the binary calls itself in help and errors: "retrace", or a user binary's file name.
const std::string& binary_name();
void set_binary_name(const std::string& name);
// The whole of a text file; retrace::Error naming `what` and the path when it cannot be read.
std::string read_text_file(const std::string& path, const std::string& what);

}  // namespace retrace::cli
