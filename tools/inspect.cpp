// `retrace inspect TRACE`: what a trace holds; --export writes its tensors as .pt files.
#include "commands.h"

#include <retrace/number.h>
#include <retrace/rank_attribution.h>
#include <retrace/records.h>
#include <retrace/trace.h>

#include <boost/program_options.hpp>
#include <torch/serialize.h>

#include <filesystem>
#include <cmath>
#include <iostream>
#include <sstream>

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

// A recorded number as stored: finite ones in the shortest text that reads back to the same
// double, "nan", "inf", "-inf" bare (number.h).
std::string exact(double v) { return std::isfinite(v) ? nlohmann::json(v).dump() : number_text(v); }

// What the text listing says of a record after its index, offset and type, from its typed
// record (records.h).
std::string describe(const Record& r, const std::string& path) {
  std::ostringstream os;
  switch (r.type) {
    case RecordType::kStepBegin: {
      const StepBeginRecord b = StepBeginRecord::decode(r, path);
      os << " step " << b.step;
      if (b.full) {
        os << " full";
      } else if (b.state_as_step_end) {
        os << " state as step_end " << *b.state_as_step_end;  // stored there in full mode, digested in digest mode
      } else {
        os << " digest";
      }
      os << (b.ring ? " (flight ring)" : "");
      break;
    }
    case RecordType::kSegment: {
      const SegmentRecord g = SegmentRecord::decode(r, path);
      os << " step " << g.step << " " << g.segment << " " << to_string(g.phase);
      break;
    }
    case RecordType::kStepEnd: {
      const StepEndRecord e = StepEndRecord::decode(r, path);
      os << " step " << e.step << " loss " << exact(e.loss) << " grad_norm " << exact(e.grad_norm);
      if (e.skipped) os << " SKIPPED (" << (e.skip_reason.empty() ? "?" : e.skip_reason) << ")";
      if (e.rolled_back) os << " rolled back to the start of step " << e.rolled_back_to;
      for (const std::string& i : e.injected) os << " [injected: " << i << "]";
      break;
    }
    case RecordType::kEvent: {
      const EventRecord e = EventRecord::decode(r, path);
      if (e.exception) os << " step " << e.exception->step << " " << e.name << ": " << e.exception->what;
      else if (e.ring_dump) {
        os << " " << e.name << ": " << e.ring_dump->reason;
        if (!e.ring_dump->lost.empty()) {
          os << " (snapshot lost, the state changed while it was copied: step";
          for (const std::int64_t step : e.ring_dump->lost) os << " " << step;
          os << ")";
        }
      } else os << " " << e.name;
      break;
    }
    case RecordType::kCollective: {
      const CollectiveRecord c = CollectiveRecord::decode(r, path);
      os << " step " << c.step << " #" << c.seq << " " << c.call.describe() << " rank " << c.rank;
      if (c.input.nonfinite > 0) os << " contribution NON-FINITE (" << c.input.nonfinite << ")";
      if (c.ring) os << " (flight ring)";
      break;
    }
    case RecordType::kHeader:
    case RecordType::kIndex: break;
  }
  return os.str();
}

// `retrace inspect RANK_TRACE...`: which rank went bad first.
int inspect_ranks(const std::vector<std::string>& paths, bool json) {
  std::vector<TraceReader> traces;
  for (const std::string& p : paths) traces.emplace_back(p);
  std::vector<const TraceReader*> ptrs;
  for (const TraceReader& t : traces) ptrs.push_back(&t);
  const RankAttribution a = attribute_ranks(ptrs);
  if (json) {
    std::cout << a.to_json().dump(2) << "\n";
    return 0;
  }
  std::cout << "run " << a.run.run_id << ", world size " << a.run.world_size << ": " << traces.size()
            << " rank traces, " << a.collectives << " collectives compared\n";
  for (const std::string& n : a.notes) std::cout << "note: " << n << "\n";
  std::cout << a.verdict() << "\n";
  return 0;
}

}  // namespace

int run_inspect(const std::vector<std::string>& args) {
  std::string trace_path, export_dir;
  std::vector<std::string> paths;
  po::options_description opts(
      "retrace inspect TRACE [options]\n"
      "retrace inspect RANK_TRACE RANK_TRACE... [--json]\n\n"
      "Lists the trace's environment, steps, segments and tensors (sizes, digests), and checks every\n"
      "stored tensor's bytes against its checksum (exit 2 on the first that fails). Given the traces\n"
      "of the ranks of one data-parallel run, names the first collective where a rank's contribution\n"
      "went non-finite, the ranks desynchronized, their results differed, or a rank stopped.\n\noptions");
  opts.add_options()("help,h", "show this help")("json", "print JSON instead of text")(
      "tensors", "list every tensor of every record (text mode)")(
      "export", po::value<std::string>(&export_dir),
      "write every stored tensor to DIR as .pt files (torch.load(..., weights_only=True) opens them)");
  const auto parsed = parse_arguments(args, opts, "trace", &paths);
  if (!parsed) return 0;
  const po::variables_map& vm = *parsed;
  if (paths.empty()) throw Error("missing TRACE: the trace to inspect");
  if (paths.size() > 1) {
    if (vm.count("tensors") || vm.count("export"))
      throw Error("--tensors and --export list one trace; give one TRACE, or drop them to compare rank traces");
    return inspect_ranks(paths, vm.count("json") > 0);
  }
  trace_path = paths.front();
  const TraceReader trace(trace_path);

  if (!export_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(export_dir, ec);
    if (ec) throw Error("cannot create --export folder '" + export_dir + "': " + ec.message());
  }
  nlohmann::json records = nlohmann::json::array();
  std::vector<std::string> described;  // the text listing's words for each record
  std::size_t exported = 0;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read_table(i);  // each stored tensor then read, checked (and decoded) alone
    described.push_back(describe(r, trace_path));
    const RecordInfo& info = trace.records()[i];
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorEntry& e : r.tensors) {
      tensors.push_back({{"name", e.name},
                         {"dtype", c10::toString(e.dtype)},
                         {"shape", e.shape},
                         {"digest", e.digest.hex()},
                         {"stored", e.has_data()},
                         {"raw_bytes", e.raw_bytes},
                         {"stored_bytes", e.stored_bytes},
                         {"codec", to_string(e.codec)}});
      // Every stored tensor's bytes are checked against their checksum (a version-4 trace's open
      // reads none of them); --export decodes them, which checks them too.
      if (e.has_data() && export_dir.empty()) {
        trace.check_stored(r, e);
      } else if (e.has_data()) {
        const std::vector<char> bytes = torch::pickle_save(trace.decode(r, e));
        const std::string file = export_dir + "/" + std::to_string(i) + "_" + to_string(r.type) + "_step" +
                                 std::to_string(info.step) + "_" + safe(info.segment) +
                                 (r.type == RecordType::kSegment ? "_" + safe(info.phase) + "_" : "") + safe(e.name) +
                                 ".pt";
        write_file(file, std::string_view(bytes.data(), bytes.size()), "");
        ++exported;
      }
    }
    nlohmann::json meta = r.meta;
    meta.erase("tensors");
    records.push_back(
        {{"index", i}, {"type", to_string(r.type)}, {"offset", r.offset}, {"meta", meta}, {"tensors", tensors}});
  }

  if (vm.count("json")) {
    nlohmann::json doc = {{"path", trace_path},         {"complete", trace.complete()},
                          {"warning", trace.warning()}, {"file_bytes", trace.file_size()},
                          {"header", trace.header()},   {"records", records}};
    std::cout << doc.dump(2) << "\n";
  } else {
    const TraceHeader h = TraceHeader::decode(trace);
    std::cout << trace_path << ": " << trace.file_size() << " bytes, " << trace.records().size() << " records, "
              << (trace.complete() ? "complete" : "incomplete") << "\n";
    if (trace.truncated()) std::cout << "warning: " << trace.warning() << "\n";
    std::cout << "writer: " << (h.writer.empty() ? "?" : h.writer) << ", format " << h.format_version << "\n";
    if (h.program) std::cout << "program: " << h.program->name << "\n";
    if (h.ranks) {
      std::cout << "ranks: rank " << h.ranks->rank << " of " << h.ranks->world_size << ", run " << h.ranks->run_id
                << "\n";
    }
    if (h.recorder) {
      std::cout << "recorder: mode " << h.recorder->mode << ", every " << h.recorder->every << ", ring "
                << h.recorder->ring
                << (h.recorder->ring_every != 1 ? " (every " + std::to_string(h.recorder->ring_every) + " steps)" : "")
                << (h.recorder->write_ahead ? ", write-ahead" : "") << "\n";
    }
    if (!h.environment.bitwise.empty()) {
      std::cout << "environment:";
      for (const auto& [key, value] : h.environment.bitwise) std::cout << " " << key << "=" << value;
      std::cout << "\n";
    }
    for (std::size_t i = 0; i < records.size(); ++i) {
      const nlohmann::json& r = records[i];
      std::cout << "#" << i << " @" << r["offset"].get<std::uint64_t>() << " " << r["type"].get<std::string>()
                << described[i];
      std::uint64_t raw = 0, stored = 0;
      for (const auto& t : r["tensors"]) {
        raw += t["raw_bytes"].get<std::uint64_t>();
        stored += t["stored_bytes"].get<std::uint64_t>();
      }
      std::cout << "  [" << r["tensors"].size() << " tensors, " << raw << " B raw, " << stored << " B stored]\n";
      if (vm.count("tensors")) {
        for (const auto& t : r["tensors"]) {
          std::cout << "    " << t["name"].get<std::string>() << " " << t["dtype"].get<std::string>()
                    << shape(t["shape"].get<std::vector<std::int64_t>>()) << " " << t["digest"].get<std::string>()
                    << (t["stored"].get<bool>() ? " stored" : "") << "\n";
        }
      }
    }
  }
  if (!export_dir.empty()) std::cerr << "exported " << exported << " tensors to " << export_dir << "\n";
  return 0;
}

}  // namespace retrace::cli
