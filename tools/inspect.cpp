// `retrace inspect TRACE`: what a trace holds; --export writes its tensors as .pt files.
#include "commands.h"

#include <retrace/number.h>
#include <retrace/trace.h>

#include <boost/program_options.hpp>
#include <torch/serialize.h>

#include <filesystem>
#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;

namespace {

std::string safe(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_') ? c : '_';
  return out;
}

std::string shape(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// A step_end number as stored (json_number): finite ones as written, "nan", "inf", "-inf" bare.
std::string number(const nlohmann::json& v) {
  if (v.is_number()) return v.dump();
  const std::optional<double> d = number_from_json(v);
  return d ? number_text(*d) : v.dump();
}

}  // namespace

int run_inspect(const std::vector<std::string>& args) {
  std::string trace_path, export_dir;
  po::options_description opts(
      "retrace inspect TRACE [options]\n\n"
      "Lists the trace's environment, steps, segments and tensors (sizes, digests).\n\noptions");
  opts.add_options()("help,h", "show this help")("json", "print JSON instead of text")(
      "tensors", "list every tensor of every record (text mode)")(
      "export", po::value<std::string>(&export_dir),
      "write every stored tensor to DIR as .pt files (torch.load(..., weights_only=True) opens them)");
  const auto parsed = parse_arguments(args, opts, "trace", &trace_path);
  if (!parsed) return 0;
  const po::variables_map& vm = *parsed;
  if (trace_path.empty()) throw Error("missing TRACE: the trace to inspect");
  const TraceReader trace(trace_path);

  if (!export_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(export_dir, ec);
    if (ec) throw Error("cannot create --export folder '" + export_dir + "': " + ec.message());
  }
  nlohmann::json records = nlohmann::json::array();
  std::size_t exported = 0;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorEntry& e : r.tensors) {
      tensors.push_back({{"name", e.name}, {"dtype", c10::toString(e.dtype)}, {"shape", e.shape},
                         {"digest", e.digest.hex()}, {"stored", e.has_data()}, {"raw_bytes", e.raw_bytes},
                         {"stored_bytes", e.stored_bytes}, {"codec", to_string(e.codec)}});
      if (!export_dir.empty() && e.has_data()) {
        const std::vector<char> bytes = torch::pickle_save(trace.decode(r, e));
        const std::string file = export_dir + "/" + std::to_string(i) + "_" + to_string(r.type) + "_step" +
                                 std::to_string(r.meta.value("step", -1)) + "_" + safe(r.meta.value("segment", "")) +
                                 (r.meta.contains("segment") ? "_" + safe(r.meta.value("phase", "")) + "_" : "") + safe(e.name) + ".pt";
        write_file(file, std::string_view(bytes.data(), bytes.size()), "");
        ++exported;
      }
    }
    nlohmann::json meta = r.meta;
    meta.erase("tensors");
    records.push_back({{"index", i}, {"type", to_string(r.type)}, {"offset", r.offset}, {"meta", meta}, {"tensors", tensors}});
  }

  if (vm.count("json")) {
    nlohmann::json doc = {{"path", trace_path},      {"complete", trace.complete()}, {"warning", trace.warning()},
                          {"file_bytes", trace.file_size()}, {"header", trace.header()}, {"records", records}};
    std::cout << doc.dump(2) << "\n";
  } else {
    const nlohmann::json& h = trace.header();
    std::cout << trace_path << ": " << trace.file_size() << " bytes, " << trace.records().size() << " records, "
              << (trace.complete() ? "complete" : "incomplete") << "\n";
    if (trace.truncated()) std::cout << "warning: " << trace.warning() << "\n";
    std::cout << "writer: " << h.value("writer", "?") << ", format " << h.value("format_version", 0) << "\n";
    if (h.contains("program")) std::cout << "program: " << h["program"].value("name", "?") << "\n";
    if (h.contains("recorder")) std::cout << "recorder: " << h["recorder"].dump() << "\n";
    if (h.contains("environment") && h["environment"].contains("bitwise")) {
      std::cout << "environment:";
      for (auto it = h["environment"]["bitwise"].begin(); it != h["environment"]["bitwise"].end(); ++it) {
        std::cout << " " << it.key() << "=" << it.value().get<std::string>();
      }
      std::cout << "\n";
    }
    for (const nlohmann::json& r : records) {
      const nlohmann::json& m = r["meta"];
      std::cout << "#" << r["index"].get<std::size_t>() << " @" << r["offset"].get<std::uint64_t>() << " " << r["type"].get<std::string>();
      if (m.contains("step")) std::cout << " step " << m["step"].dump();
      if (m.contains("segment")) std::cout << " " << m["segment"].get<std::string>() << " " << m.value("phase", "");
      if (m.contains("full")) std::cout << (m["full"].get<bool>() ? " full" : " digest");
      if (m.value("ring", false)) std::cout << " (flight ring)";
      if (m.contains("loss")) std::cout << " loss " << number(m["loss"]) << " grad_norm " << number(m.value("grad_norm", nlohmann::json()));
      if (m.value("skipped", false)) std::cout << " SKIPPED (" << m.value("skip_reason", std::string("?")) << ")";
      if (m.contains("injected")) {
        for (const auto& i : m["injected"]) std::cout << " [injected: " << i.get<std::string>() << "]";
      }
      if (m.contains("event")) std::cout << " " << m["event"].get<std::string>() << ": " << m.value("reason", m.value("what", ""));
      std::uint64_t raw = 0, stored = 0;
      for (const auto& t : r["tensors"]) {
        raw += t["raw_bytes"].get<std::uint64_t>();
        stored += t["stored_bytes"].get<std::uint64_t>();
      }
      std::cout << "  [" << r["tensors"].size() << " tensors, " << raw << " B raw, " << stored << " B stored]\n";
      if (vm.count("tensors")) {
        for (const auto& t : r["tensors"]) {
          std::cout << "    " << t["name"].get<std::string>() << " " << t["dtype"].get<std::string>() << shape(t["shape"].get<std::vector<std::int64_t>>())
                    << " " << t["digest"].get<std::string>() << (t["stored"].get<bool>() ? " stored" : "") << "\n";
        }
      }
    }
  }
  if (!export_dir.empty()) std::cerr << "exported " << exported << " tensors to " << export_dir << "\n";
  return 0;
}

}  // namespace retrace::cli
