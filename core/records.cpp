#include <retrace/records.h>

#include <retrace/number.h>

#include "trace_fields.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <map>

namespace retrace {

// --- tensor names ------------------------------------------------------------------------------

namespace tensor_names {

namespace {
std::optional<std::string_view> after(std::string_view prefix, std::string_view entry) {
  if (entry.substr(0, prefix.size()) != prefix) return std::nullopt;
  return entry.substr(prefix.size());
}
}  // namespace

std::string state(std::string_view name) { return std::string(kStatePrefix) + std::string(name); }
std::string batch(std::string_view name) { return std::string(kBatchPrefix) + std::string(name); }
std::optional<std::string_view> state_name(std::string_view entry) { return after(kStatePrefix, entry); }
std::optional<std::string_view> batch_name(std::string_view entry) { return after(kBatchPrefix, entry); }

std::optional<std::string> segment_input(SegmentPhase phase, std::size_t i) {
  switch (phase) {
    case SegmentPhase::kForward: return "input." + std::to_string(i);
    case SegmentPhase::kRecompute: return std::nullopt;
    case SegmentPhase::kBackward: return "grad_output." + std::to_string(i);
  }
  return std::nullopt;
}

std::string segment_output(SegmentPhase phase, std::size_t i) {
  switch (phase) {
    case SegmentPhase::kForward:
    case SegmentPhase::kRecompute: return "output." + std::to_string(i);
    case SegmentPhase::kBackward: return "grad_input." + std::to_string(i);
  }
  return "output." + std::to_string(i);
}

std::string collective_input(std::size_t i) { return "input." + std::to_string(i); }
std::string collective_output(std::size_t i) { return "output." + std::to_string(i); }

}  // namespace tensor_names

std::optional<SegmentPhase> segment_phase_from_string(std::string_view name) {
  for (SegmentPhase p : {SegmentPhase::kForward, SegmentPhase::kRecompute, SegmentPhase::kBackward}) {
    if (name == to_string(p)) return p;
  }
  return std::nullopt;
}

namespace {

using format::Fields;

void expect_type(const Record& r, RecordType type, const std::string& source) {
  if (r.type != type) {
    throw TraceError(TraceError::Kind::kMalformed, r.offset,
                     source + ": the record at byte offset " + std::to_string(r.offset) + " is a " + to_string(r.type) +
                         " record, not a " + to_string(type) + " record");
  }
}

}  // namespace

// --- header --------------------------------------------------------------------------------------

nlohmann::json TraceHeader::to_meta() const {
  nlohmann::json meta = {{"environment", environment.to_json()}};
  if (program) meta["program"] = {{"name", program->name}, {"config", program->config}};
  if (recorder) {
    meta["recorder"] = {{"mode", recorder->mode},
                        {"every", recorder->every},
                        {"ring", recorder->ring},
                        {"write_ahead", recorder->write_ahead}};
    if (recorder->ring_every != 1) meta["recorder"]["ring_every"] = recorder->ring_every;  // older traces: 1
  }
  if (ranks) meta["ranks"] = {{"rank", ranks->rank}, {"world_size", ranks->world_size}, {"run_id", ranks->run_id}};
  return meta;
}

TraceHeader TraceHeader::decode(const nlohmann::json& meta, const std::string& source) {
  constexpr std::uint64_t kHeaderOffset = 12;  // the header record follows the 12-byte file header
  const Fields f(meta, source, kHeaderOffset, "the header record");
  TraceHeader h;
  const std::int64_t version = f.integer("format_version", 0);
  if (version < 0 || version > std::numeric_limits<std::uint32_t>::max()) f.fail("format_version", "is out of range");
  h.format_version = static_cast<std::uint32_t>(version);
  h.writer = f.text("writer", "");
  if (const nlohmann::json* env = f.find("environment")) {
    if (!env->is_object()) f.fail("environment", "is not an object");
    for (const char* part : {"bitwise", "info"}) {
      const auto it = env->find(part);
      if (it == env->end()) continue;
      if (!it->is_object()) f.fail(std::string("environment.") + part, "is not an object");
      for (auto kv = it->begin(); kv != it->end(); ++kv) {
        if (!kv.value().is_string()) f.fail(std::string("environment.") + part + "." + kv.key(), "is not a string");
      }
    }
    h.environment = Environment::from_json(*env);
  }
  if (const nlohmann::json* p = f.find("program")) {
    const Fields pf(*p, source, kHeaderOffset, "the header record");
    h.program = ProgramRef{pf.text("name"), pf.text("config")};
  }
  if (const nlohmann::json* r = f.find("recorder")) {
    const Fields rf(*r, source, kHeaderOffset, "the header record");
    RecorderSettings s;
    s.mode = rf.text("mode", "digest");
    s.every = rf.integer("every", 0);
    s.ring = rf.integer("ring", 0);
    s.ring_every = rf.integer("ring_every", 1);
    if (s.ring_every < 1) rf.fail("ring_every", "is not a positive step count");
    s.write_ahead = rf.flag("write_ahead", false);
    h.recorder = s;
  }
  if (const nlohmann::json* r = f.find("ranks")) {
    const Fields rf(*r, source, kHeaderOffset, "the header record's ranks");
    RankInfo info;
    const std::int64_t world = rf.integer("world_size");
    const std::int64_t rank = rf.integer("rank");
    if (world < 1 || world > kMaxWorldSize)
      rf.fail("world_size", "is out of range 1.." + std::to_string(kMaxWorldSize));
    if (rank < 0 || rank >= world) rf.fail("rank", "is not in 0..world_size-1 (" + std::to_string(rank) + ")");
    info.world_size = static_cast<int>(world);
    info.rank = static_cast<int>(rank);
    info.run_id = rf.text("run_id", "");
    h.ranks = std::move(info);
  }
  return h;
}

const ProgramRef& TraceHeader::require_program(const std::string& source) const {
  if (!program) throw Error(source + ": the trace header names no program; was it written by retrace record?");
  return *program;
}

// --- step_begin ----------------------------------------------------------------------------------

nlohmann::json StepBeginRecord::to_meta() const {
  nlohmann::json meta = {
      {"step", step}, {"lr", json_number(lr)}, {"loss_scale", json_number(loss_scale)}, {"full", full}};
  if (ring) meta["ring"] = true;
  if (batch_kinds) {
    nlohmann::json kinds = nlohmann::json::object();
    for (const auto& [name, kind] : *batch_kinds) kinds[name] = to_string(kind);
    meta["batch_kinds"] = std::move(kinds);
  }
  if (state_as_step_end) meta["state_as_step_end"] = *state_as_step_end;
  return meta;
}

StepBeginRecord StepBeginRecord::decode(const Record& record, const std::string& source) {
  expect_type(record, RecordType::kStepBegin, source);
  return decode(record.meta, record.offset, source);
}

StepBeginRecord StepBeginRecord::decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source) {
  const Fields f(meta, source, offset, "the step_begin record");
  StepBeginRecord b;
  b.step = f.step();
  b.lr = f.number("lr", 0.0);
  b.loss_scale = f.number("loss_scale", 1.0);
  b.full = f.flag("full", false);
  b.ring = f.flag("ring", false);
  if (const nlohmann::json* kinds = f.find("batch_kinds")) {
    if (!kinds->is_object()) f.fail("batch_kinds", "is not an object");
    std::map<std::string, TensorKind> out;
    for (auto it = kinds->begin(); it != kinds->end(); ++it) {
      if (!it.value().is_string()) f.fail("batch_kinds." + it.key(), "is not a string");
      out[it.key()] = tensor_kind_from_string(it.value().get<std::string>());  // a newer kind reads as other
    }
    b.batch_kinds = std::move(out);
  }
  if (f.find("state_as_step_end")) b.state_as_step_end = f.step("state_as_step_end");
  return b;
}

// --- segment -------------------------------------------------------------------------------------

nlohmann::json SegmentRecord::to_meta() const {
  return {{"step", step}, {"segment", segment}, {"phase", to_string(phase)}, {"ordinal", ordinal}};
}

SegmentRecord SegmentRecord::decode(const Record& record, const std::string& source) {
  expect_type(record, RecordType::kSegment, source);
  return decode(record.meta, record.offset, source);
}

SegmentRecord SegmentRecord::decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source) {
  const Fields f(meta, source, offset, "the segment record");
  SegmentRecord s;
  s.step = f.step();
  s.segment = f.text("segment");
  const std::string phase = f.text("phase");
  const std::optional<SegmentPhase> p = segment_phase_from_string(phase);
  if (!p) f.fail("phase", "is '" + phase.substr(0, 40) + "', not forward, recompute or backward");
  s.phase = *p;
  s.ordinal = f.integer("ordinal", -1);
  return s;
}

// --- step_end ------------------------------------------------------------------------------------

nlohmann::json StepEndRecord::to_meta() const {
  nlohmann::json meta = {{"step", step},
                         {"loss", json_number(loss)},
                         {"grad_norm", json_number(grad_norm)},
                         {"loss_scale", json_number(loss_scale)},
                         {"lr", json_number(lr)},
                         {"skipped", skipped},
                         {"finite", finite}};
  if (!skip_reason.empty()) meta["skip_reason"] = skip_reason;
  if (rolled_back) {
    meta["rolled_back"] = true;
    meta["rolled_back_to"] = rolled_back_to;
  }
  if (!injected.empty()) meta["injected"] = injected;
  return meta;
}

StepEndRecord StepEndRecord::decode(const Record& record, const std::string& source) {
  expect_type(record, RecordType::kStepEnd, source);
  return decode(record.meta, record.offset, source);
}

StepEndRecord StepEndRecord::decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source) {
  const Fields f(meta, source, offset, "the step_end record");
  StepEndRecord e;
  e.step = f.step();
  e.loss = f.number("loss");
  // Golden v1 and v2 traces (tests/data) hold step_end records without grad_norm or finite.
  const bool has_norm = f.find("grad_norm") != nullptr;
  e.grad_norm = f.number("grad_norm", std::numeric_limits<double>::quiet_NaN());
  e.loss_scale = f.number("loss_scale", 1.0);
  e.lr = f.number("lr", 0.0);
  e.skipped = f.flag("skipped", false);
  e.finite = f.flag("finite", std::isfinite(e.loss) && (!has_norm || std::isfinite(e.grad_norm)));
  e.skip_reason = f.text("skip_reason", "");
  e.rolled_back = f.flag("rolled_back", false);
  if (e.rolled_back && f.find("rolled_back_to")) e.rolled_back_to = f.integer("rolled_back_to");
  e.injected = f.texts("injected");
  return e;
}

// --- collective --------------------------------------------------------------------------------

nlohmann::json CollectiveRecord::to_meta() const {
  nlohmann::json meta = {{"step", step},
                         {"seq", seq},
                         {"op", to_string(call.op)},
                         {"rank", rank},
                         {"input_nonfinite", input.nonfinite},
                         {"input_abs_max", json_number(input.abs_max)},
                         {"output_nonfinite", output.nonfinite},
                         {"output_abs_max", json_number(output.abs_max)}};
  if (!call.reduce.empty()) meta["reduce"] = call.reduce;
  if (call.root >= 0) meta["root"] = call.root;
  if (values) meta["values"] = true;
  if (ring) meta["ring"] = true;
  return meta;
}

CollectiveRecord CollectiveRecord::decode(const Record& record, const std::string& source) {
  expect_type(record, RecordType::kCollective, source);
  return decode(record.meta, record.offset, source);
}

CollectiveRecord CollectiveRecord::decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source) {
  const Fields f(meta, source, offset, "the collective record");
  CollectiveRecord c;
  c.step = f.step();
  c.seq = f.step("seq");
  const std::string op = f.text("op");
  const std::optional<CollectiveOp> o = collective_op_from_string(op);
  if (!o) f.fail("op", "is '" + op.substr(0, 40) + "', not allreduce, broadcast, allgather or barrier");
  c.call.op = *o;
  c.call.reduce = f.text("reduce", "");
  const std::int64_t root = f.integer("root", -1);
  const std::int64_t rank = f.integer("rank");
  if (root < -1 || root >= kMaxWorldSize) f.fail("root", "is out of range");
  if (rank < 0 || rank >= kMaxWorldSize) f.fail("rank", "is out of range");
  c.call.root = static_cast<int>(root);
  c.rank = static_cast<int>(rank);
  c.input.nonfinite = f.integer("input_nonfinite", 0);
  c.input.abs_max = f.number("input_abs_max", 0.0);
  c.output.nonfinite = f.integer("output_nonfinite", 0);
  c.output.abs_max = f.number("output_abs_max", 0.0);
  if (c.input.nonfinite < 0) f.fail("input_nonfinite", "is negative");
  if (c.output.nonfinite < 0) f.fail("output_nonfinite", "is negative");
  c.values = f.flag("values", false);
  c.ring = f.flag("ring", false);
  return c;
}

std::string CollectiveRecord::key() const {
  return "step " + std::to_string(step) + " collective #" + std::to_string(seq) + " " + call.describe();
}

// --- events --------------------------------------------------------------------------------------

nlohmann::json ExceptionEvent::to_meta() const {
  nlohmann::json meta = {{"event", "exception"}, {"what", what}, {"step", step}};
  if (raised_by_step) meta["raised_by_step"] = true;
  if (collective >= 0) meta["collective"] = collective;
  return meta;
}

nlohmann::json RingDumpEvent::to_meta() const {
  nlohmann::json meta = {{"event", "ring_dump"}, {"reason", reason}, {"steps", steps}};
  if (!lost.empty()) meta["lost"] = lost;
  return meta;
}

EventRecord EventRecord::decode(const Record& record, const std::string& source) {
  expect_type(record, RecordType::kEvent, source);
  return decode(record.meta, record.offset, source);
}

EventRecord EventRecord::decode(const nlohmann::json& meta, std::uint64_t offset, const std::string& source) {
  const Fields f(meta, source, offset, "the event record");
  EventRecord e;
  e.name = f.text("event");
  if (e.name == "exception") {
    e.kind = Kind::kException;
    ExceptionEvent x;
    x.step = f.integer("step", -1);
    if (x.step < -1) f.fail("step", "is below -1 (" + std::to_string(x.step) + ")");
    x.what = f.text("what");
    x.raised_by_step = f.flag("raised_by_step", false);
    x.collective = f.integer("collective", -1);
    if (x.collective < -1) f.fail("collective", "is below -1 (" + std::to_string(x.collective) + ")");
    e.exception = std::move(x);
  } else if (e.name == "ring_dump") {
    e.kind = Kind::kRingDump;
    RingDumpEvent d;
    d.reason = f.text("reason", "");
    for (const auto& [key, out] : {std::pair{"steps", &d.steps}, std::pair{"lost", &d.lost}}) {
      if (const nlohmann::json* steps = f.find(key)) {
        if (!steps->is_array()) f.fail(key, "is not a list");
        for (const nlohmann::json& s : *steps) {
          if (!s.is_number_integer() || s.get<std::int64_t>() < 0)
            f.fail(key, "holds a non-step (" + s.dump().substr(0, 40) + ")");
          out->push_back(s.get<std::int64_t>());
        }
      }
    }
    e.ring_dump = std::move(d);
  }
  return e;
}

std::string exception_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

void validate_record_meta(RecordType type, const nlohmann::json& meta, const std::string& source,
                          std::uint64_t offset) {
  switch (type) {
    case RecordType::kHeader: TraceHeader::decode(meta, source); break;
    case RecordType::kStepBegin: StepBeginRecord::decode(meta, offset, source); break;
    case RecordType::kSegment: SegmentRecord::decode(meta, offset, source); break;
    case RecordType::kStepEnd: StepEndRecord::decode(meta, offset, source); break;
    case RecordType::kEvent: EventRecord::decode(meta, offset, source); break;
    case RecordType::kCollective: CollectiveRecord::decode(meta, offset, source); break;
    case RecordType::kIndex: break;
  }
}

// --- the trace as steps --------------------------------------------------------------------------

RecordedSteps recorded_steps(const TraceReader& trace) {
  RecordedSteps out;
  std::map<std::int64_t, StepEndRecord> by_step;  // the last step_end of a step wins
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const RecordInfo& info = trace.records()[i];
    if (info.type != RecordType::kStepEnd) continue;
    try {
      StepEndRecord e = StepEndRecord::decode(trace.read(i), trace.path());
      by_step[e.step] = std::move(e);
    } catch (const Error&) {
      ++out.unreadable;  // a damaged record: the curves go without that step
    }
  }
  for (auto& [s, e] : by_step) out.steps.push_back(std::move(e));
  return out;
}

}  // namespace retrace
