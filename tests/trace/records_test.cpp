// The trace schema (records.h): every typed record round-trips through its encoder and decoder,
// each decoder refuses a field of the wrong type naming the key and the byte offset, the writer
// refuses what the reader would refuse, and the reader reads through io::FileSystem.
#include <retrace/records.h>

#include "fuzz/trace_framing.h"
#include "support/watched_reads.h"

#include <gtest/gtest.h>

#include <ATen/ops/arange.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <limits>

namespace retrace {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("retrace_records_" + name + "_" + std::to_string(::getpid()) + ".trace"))
      .string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// The message of the TraceError that `f` throws; "(none)" when it throws none.
template <class F>
std::string trace_error(F&& f, TraceError::Kind expected = TraceError::Kind::kMalformed) {
  try {
    f();
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), expected) << e.what();
    return e.what();
  }
  return "(none)";
}

TEST(Records, EveryTypedRecordRoundTrips) {
  StepBeginRecord b;
  b.step = 4;
  b.lr = 3e-4;
  b.loss_scale = 65536;
  b.full = true;
  b.ring = true;
  b.batch_kinds = std::map<std::string, TensorKind>{{"tokens", TensorKind::kInput}, {"labels", TensorKind::kTarget}};
  b.state_as_step_end = 3;
  const StepBeginRecord b2 = StepBeginRecord::decode(b.to_meta(), 100, "t");
  EXPECT_EQ(b2.step, 4);
  EXPECT_EQ(b2.lr, 3e-4);
  EXPECT_EQ(b2.loss_scale, 65536);
  EXPECT_TRUE(b2.full && b2.ring);
  EXPECT_EQ(b2.batch_kinds, b.batch_kinds);
  EXPECT_EQ(b2.state_as_step_end, 3);

  const SegmentRecord g{2, "block1", SegmentPhase::kRecompute, 1};
  const SegmentRecord g2 = SegmentRecord::decode(g.to_meta(), 0, "t");
  EXPECT_EQ(g2.step, 2);
  EXPECT_EQ(g2.segment, "block1");
  EXPECT_EQ(g2.phase, SegmentPhase::kRecompute);
  EXPECT_EQ(g2.ordinal, 1);

  StepEndRecord e;
  e.step = 7;
  e.loss = std::numeric_limits<double>::quiet_NaN();
  e.grad_norm = -std::numeric_limits<double>::infinity();
  e.loss_scale = 0.5;
  e.lr = 1e-3;
  e.skipped = true;
  e.finite = false;
  e.skip_reason = "non-finite gradients";
  e.rolled_back = true;
  e.rolled_back_to = 5;
  e.injected = {"grad_nan on grad.w"};
  const StepEndRecord e2 = StepEndRecord::decode(e.to_meta(), 0, "t");
  EXPECT_TRUE(std::isnan(e2.loss));
  EXPECT_EQ(e2.grad_norm, -std::numeric_limits<double>::infinity());
  EXPECT_EQ(e2.loss_scale, 0.5);
  EXPECT_TRUE(e2.skipped);
  EXPECT_FALSE(e2.finite);
  EXPECT_EQ(e2.skip_reason, e.skip_reason);
  EXPECT_TRUE(e2.rolled_back);
  EXPECT_EQ(e2.rolled_back_to, 5);
  EXPECT_EQ(e2.injected, e.injected);

  const EventRecord x = EventRecord::decode(ExceptionEvent{3, "boom", true}.to_meta(), 0, "t");
  ASSERT_EQ(x.kind, EventRecord::Kind::kException);
  EXPECT_EQ(x.exception->step, 3);
  EXPECT_EQ(x.exception->what, "boom");
  EXPECT_TRUE(x.exception->raised_by_step);
  const EventRecord d = EventRecord::decode(RingDumpEvent{"non-finite loss", {2, 3}}.to_meta(), 0, "t");
  ASSERT_EQ(d.kind, EventRecord::Kind::kRingDump);
  EXPECT_EQ(d.ring_dump->steps, (std::vector<std::int64_t>{2, 3}));
  EXPECT_TRUE(d.ring_dump->lost.empty());
  const RingDumpEvent none_lost{"x", {2, 3}, {}};
  EXPECT_FALSE(none_lost.to_meta().contains("lost"));  // written only when there are some
  const EventRecord l = EventRecord::decode(RingDumpEvent{"x", {2, 4}, {3}}.to_meta(), 0, "t");
  EXPECT_EQ(l.ring_dump->steps, (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(l.ring_dump->lost, (std::vector<std::int64_t>{3}));
  const EventRecord other = EventRecord::decode(nlohmann::json{{"event", "from_a_newer_writer"}}, 0, "t");
  EXPECT_EQ(other.kind, EventRecord::Kind::kOther);
  EXPECT_EQ(other.name, "from_a_newer_writer");

  TraceHeader h;
  h.environment.bitwise["intra_op_threads"] = "2";
  h.program = ProgramRef{"example.encoder", "precision: fp16\n"};
  h.recorder = RecorderSettings{"full", 2, 4, true, 3};
  const TraceHeader h2 = TraceHeader::decode(h.to_meta(), "t");
  EXPECT_EQ(h2.environment.bitwise.at("intra_op_threads"), "2");
  ASSERT_TRUE(h2.program.has_value());
  EXPECT_EQ(h2.program->config, "precision: fp16\n");
  EXPECT_EQ(h2.recorder->ring, 4);
  EXPECT_TRUE(h2.recorder->write_ahead);
  EXPECT_EQ(h2.recorder->ring_every, 3);
}

// What traces written before a field existed lack reads as the field's documented default.
TEST(Records, FieldsOlderTracesLackReadAsTheirDefaults) {
  const StepBeginRecord b = StepBeginRecord::decode(nlohmann::json{{"step", 1}}, 0, "t");
  EXPECT_FALSE(b.full);
  EXPECT_FALSE(b.batch_kinds.has_value());  // replay then names the built-in input and target
  EXPECT_FALSE(b.state_as_step_end.has_value());
  const EventRecord signal =
      EventRecord::decode(nlohmann::json{{"event", "exception"}, {"what", "signal SIGTERM"}, {"step", 7}}, 0, "t");
  EXPECT_FALSE(signal.exception->raised_by_step);
  const ExceptionEvent signal_event{7, "signal SIGTERM", false};
  EXPECT_FALSE(signal_event.to_meta().contains("raised_by_step"));  // written as before
  const StepEndRecord e =
      StepEndRecord::decode(nlohmann::json{{"step", 1}, {"loss", 2.0}, {"grad_norm", "inf"}}, 0, "t");
  EXPECT_FALSE(e.finite);  // derived from loss and grad_norm when the record does not say
  EXPECT_FALSE(TraceHeader::decode(nlohmann::json::object(), "t").program.has_value());
  EXPECT_EQ(TraceHeader::decode(nlohmann::json{{"recorder", {{"ring", 4}}}}, "t").recorder->ring_every, 1);
  TraceHeader every_step;
  every_step.recorder = RecorderSettings{"digest", 0, 4, false};
  EXPECT_FALSE(every_step.to_meta()["recorder"].contains("ring_every"));  // written as before
  EXPECT_THROW(TraceHeader::decode(nlohmann::json::object(), "t").require_program("t"), Error);
}

// Each decoder refuses a field of the wrong type (never converting it, never another exception),
// naming the record, the key and the byte offset. The controls: the same records, well typed, decode.
TEST(Records, AFieldOfTheWrongTypeIsMalformedNamingTheKeyAndOffset) {
  struct Case {
    RecordType type;
    nlohmann::json meta;
    const char* key;
  };
  const std::vector<Case> cases = {
      {RecordType::kStepBegin, {{"step", "1"}}, "'step'"},
      {RecordType::kStepBegin, {{"step", -2}}, "'step'"},
      {RecordType::kStepBegin, {{"step", 1}, {"full", 1}}, "'full'"},
      {RecordType::kStepBegin, {{"step", 1}, {"lr", "fast"}}, "'lr'"},
      {RecordType::kStepBegin, {{"step", 1}, {"batch_kinds", {{"x", 3}}}}, "'batch_kinds.x'"},
      {RecordType::kStepBegin, {{"step", 1}, {"state_as_step_end", 1.5}}, "'state_as_step_end'"},
      {RecordType::kSegment, {{"step", 1}, {"segment", 0}, {"phase", "forward"}}, "'segment'"},
      {RecordType::kSegment, {{"step", 1}, {"segment", "b"}, {"phase", "sideways"}}, "'phase'"},
      {RecordType::kSegment, {{"step", nullptr}, {"segment", "b"}, {"phase", "forward"}}, "'step'"},
      {RecordType::kStepEnd, {{"step", 1}, {"loss", nullptr}, {"grad_norm", 1}}, "'loss'"},
      {RecordType::kStepEnd, {{"step", 1}, {"grad_norm", 1}}, "'loss'"},
      {RecordType::kStepEnd, {{"step", 1}, {"loss", 1}, {"grad_norm", "big"}}, "'grad_norm'"},
      {RecordType::kStepEnd, {{"step", 1}, {"loss", 1}, {"grad_norm", 1}, {"injected", {1}}}, "'injected'"},
      {RecordType::kStepEnd, {{"step", 1}, {"loss", 1}, {"grad_norm", 1}, {"skipped", "no"}}, "'skipped'"},
      {RecordType::kEvent, {{"what", "x"}}, "'event'"},
      {RecordType::kEvent, {{"event", "exception"}, {"what", 5}, {"step", 3}}, "'what'"},
      {RecordType::kEvent, {{"event", "exception"}, {"what", "x"}, {"step", "3"}}, "'step'"},
      {RecordType::kEvent, {{"event", "ring_dump"}, {"steps", {"a"}}}, "'steps'"},
      {RecordType::kEvent, {{"event", "ring_dump"}, {"steps", {1}}, {"lost", {-2}}}, "'lost'"},
      {RecordType::kEvent, {{"event", "ring_dump"}, {"lost", 3}}, "'lost'"},
      {RecordType::kHeader, {{"program", {{"name", 1}, {"config", ""}}}}, "'name'"},
      {RecordType::kHeader,
       {{"environment", {{"bitwise", {{"intra_op_threads", 2}}}}}},
       "'environment.bitwise.intra_op_threads'"},
      {RecordType::kHeader, {{"recorder", {{"ring", "4"}}}}, "'ring'"},
      {RecordType::kHeader, {{"recorder", {{"ring", 4}, {"ring_every", 0}}}}, "'ring_every'"},
      {RecordType::kHeader, {{"recorder", {{"ring", 4}, {"ring_every", 2.5}}}}, "'ring_every'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.meta.dump());
    const std::string msg = trace_error([&] { validate_record_meta(c.type, c.meta, "my.trace", 4242); });
    EXPECT_NE(msg.find(c.key), std::string::npos) << msg;
    EXPECT_NE(msg.find("my.trace"), std::string::npos) << msg;
    if (c.type != RecordType::kHeader) {
      EXPECT_NE(msg.find("byte offset 4242"), std::string::npos) << msg;
    }
  }
  // Controls: well-typed versions of the same records.
  EXPECT_NO_THROW(validate_record_meta(RecordType::kStepBegin, {{"step", 1}, {"full", true}, {"lr", "nan"}}, "t", 0));
  EXPECT_NO_THROW(
      validate_record_meta(RecordType::kSegment, {{"step", 1}, {"segment", "b"}, {"phase", "backward"}}, "t", 0));
  EXPECT_NO_THROW(
      validate_record_meta(RecordType::kStepEnd, {{"step", 1}, {"loss", 1}, {"grad_norm", "-inf"}}, "t", 0));
  EXPECT_NO_THROW(
      validate_record_meta(RecordType::kEvent, {{"event", "exception"}, {"what", "x"}, {"step", -1}}, "t", 0));
  EXPECT_NO_THROW(validate_record_meta(RecordType::kHeader, {{"program", {{"name", "p"}, {"config", ""}}}}, "t", 0));
  EXPECT_NO_THROW(validate_record_meta(RecordType::kHeader, {{"recorder", {{"ring", 4}, {"ring_every", 3}}}}, "t", 0));
}

// A record the reader would refuse is never written: the writer runs the same decoders.
TEST(Records, TheWriterRefusesARecordTheReaderWouldRefuse) {
  const std::string path = temp_path("writer_refuses");
  TraceWriter w(path, nlohmann::json::object());
  try {
    w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.5}, {"skipped", "no"}}, {});
    ADD_FAILURE() << "written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'skipped' is not true or false"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the reader would refuse"), std::string::npos) << e.what();
  }
  w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.5}, {"grad_norm", 1.0}}, {});  // control
  w.close();
  EXPECT_EQ(TraceReader(path).records().size(), 1u);
  fs::remove(path);
}

// A well-framed trace (checksums right) whose step_end metadata has the wrong type: the reader
// refuses it at open, naming the record's offset, before any consumer sees it.
TEST(Records, TheReaderRefusesAWellFramedRecordOfTheWrongTypeAtOpen) {
  const std::string path = temp_path("reader_refuses");
  {
    TraceWriter w(path, nlohmann::json::object());
    w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.5}, {"grad_norm", 1.0}}, {});
    w.close();
  }
  EXPECT_EQ(TraceReader(path).records().size(), 1u);  // control: as written, it reads
  const std::uint64_t offset = TraceReader(path).records()[0].offset;
  const std::string bytes = read_bytes(path);
  fuzz::FramedTrace framed = fuzz::split_trace(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  ASSERT_EQ(framed.records.size(), 3u);  // header, step_end, index
  nlohmann::json meta = nlohmann::json::parse(framed.records[1].meta);
  meta["skipped"] = "yes";
  framed.records[1].meta = meta.dump();
  write_bytes(path, fuzz::seal_trace(framed, /*fix_index=*/true));
  const std::string msg = trace_error([&] { TraceReader r(path); });
  EXPECT_NE(msg.find("'skipped' is not true or false"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset " + std::to_string(offset)), std::string::npos) << msg;
  fs::remove(path);
}

// The reader parses metadata with simdjson and leaves what is not plainly well-typed (a key given
// twice, a float where an integer belongs, an integer past 64 bits, nesting at the cap) to
// nlohmann, whose parse and field checks decide: both paths read the same records the same way.
// Each case is a step_end record's metadata as raw JSON text, sealed into a trace; the controls
// are the canonical table (simdjson's path) and the same duplicate keys in the other order.
TEST(Records, MetadataReadsAlikeWhicheverParserReadsIt) {
  const std::string path = temp_path("two_parsers");
  {
    TraceWriter w(path, nlohmann::json::object());
    w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 0.5}, {"grad_norm", 1.0}}, {});
    w.close();
  }
  const std::string bytes = read_bytes(path);
  const fuzz::FramedTrace framed =
      fuzz::split_trace(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  ASSERT_EQ(framed.records.size(), 3u);  // header, step_end, index
  const auto with_meta = [&](const std::string& text) {
    fuzz::FramedTrace t = framed;
    t.records[1].meta = text;
    write_bytes(path, fuzz::seal_trace(t, /*fix_index=*/true));
    return TraceReader(path).read_table(0);
  };
  const std::string digest = R"("digest":"000102030405060708090a0b0c0d0e0f","digest_algorithm":1)";
  const std::string head = R"({"step":1,"loss":0.5,"grad_norm":1.0,)";
  const std::string entry = R"({"name":"loss","dtype":"float32","shape":[],)" + digest + R"(,"raw_bytes":4})";

  // The canonical table: entries in Record::tensors, not in meta.
  Record r = with_meta(head + R"("tensors":[)" + entry + "]}");
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_EQ(r.tensors[0].name, "loss");
  EXPECT_EQ(r.tensors[0].raw_bytes, 4u);
  EXPECT_EQ(r.tensors[0].digest.hi, 0x0001020304050607u);
  EXPECT_EQ(r.tensors[0].digest.lo, 0x08090a0b0c0d0e0fu);
  EXPECT_FALSE(r.meta.contains("tensors"));
  EXPECT_EQ(r.meta["step"], 1);

  // A key given twice in an entry: the last one counts, as nlohmann keeps it.
  r = with_meta(head + R"("tensors":[{"name":"loss","dtype":"float32","shape":[],)" + digest +
                R"(,"raw_bytes":7,"raw_bytes":4}]})");
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_EQ(r.tensors[0].raw_bytes, 4u);
  std::string msg = trace_error([&] {
    with_meta(head + R"("tensors":[{"name":"loss","dtype":"float32","shape":[],)" + digest +
              R"(,"raw_bytes":4,"raw_bytes":7}]})");
  });
  EXPECT_NE(msg.find("'loss' raw_bytes does not match its shape"), std::string::npos) << msg;

  // "tensors" given twice: the last list.
  r = with_meta(head + R"("tensors":[],"tensors":[)" + entry + "]}");
  EXPECT_EQ(r.tensors.size(), 1u);
  r = with_meta(head + R"("tensors":[)" + entry + R"(],"tensors":[]})");
  EXPECT_EQ(r.tensors.size(), 0u);

  // A float where an integer belongs: the field checks' own message.
  msg = trace_error([&] {
    with_meta(head + R"("tensors":[{"name":"loss","dtype":"float32","shape":[],)" + digest + R"(,"raw_bytes":4.0}]})");
  });
  EXPECT_NE(msg.find("tensor entry 0's 'raw_bytes' is not a non-negative integer (4.0)"), std::string::npos) << msg;

  // An integer past 64 bits (simdjson refuses it; nlohmann reads a float) in a field no decoder
  // reads, and a nested value under a key the table does not know: the record reads.
  r = with_meta(head + R"("note":18446744073709551616,"tensors":[{"name":"loss","dtype":"float32","shape":[],)" +
                digest + R"(,"raw_bytes":4,"extra":{"a":[1,[2]]}}]})");
  EXPECT_TRUE(r.meta["note"].is_number_float());
  EXPECT_EQ(r.tensors.size(), 1u);
  // -0 is the integer 0 either way; a negative integer stays signed, a positive one unsigned.
  r = with_meta(R"({"step":-0,"loss":0.5,"grad_norm":1.0,"a":-3,"b":3})");
  EXPECT_TRUE(r.meta["step"].is_number_integer());
  EXPECT_EQ(r.meta["step"], 0);
  EXPECT_FALSE(r.meta["a"].is_number_unsigned());
  EXPECT_TRUE(r.meta["b"].is_number_unsigned());

  // Nesting at the reader's cap (32) reads; one level more is refused, as counted.
  const auto nested = [](int depth) { return std::string(depth - 1, '[') + std::string(depth - 1, ']'); };
  r = with_meta(head + R"("deep":)" + nested(32) + "}");
  EXPECT_TRUE(r.meta["deep"].is_array());
  msg = trace_error([&] { with_meta(head + R"("deep":)" + nested(33) + "}"); });
  EXPECT_NE(msg.find("nesting deeper than 32"), std::string::npos) << msg;
  fs::remove(path);
}

// The reader goes through io::FileSystem like the writer: a failing read is a kIo TraceError
// naming the byte offset, and opening a missing file or a folder says so.
class FailingReads : public WatchedReads {
 public:
  explicit FailingReads(int fail_at)
      : WatchedReads([this, fail_at](std::uint64_t, std::size_t) {
          if (++reads == fail_at) throw io::IoError("read", "the.trace", EIO);
        }) {}
  int reads = 0;
};

TEST(Records, TheReaderReadsThroughTheFileSystemAndEveryFailingReadIsTyped) {
  const std::string path = temp_path("reads");
  {
    TraceWriter w(path, nlohmann::json::object());
    w.append(RecordType::kStepBegin, {{"step", 1}, {"full", true}},
             {{"state.w", at::arange(6, at::kFloat), true, std::nullopt}});
    w.close();
  }
  FailingReads count(0);  // control: never fails; counts the reads of an open and a read()
  {
    ReaderOptions options;
    options.fs = &count;
    const TraceReader r(path, options);
    r.decode(r.read(0), r.read(0).tensors.at(0));
  }
  ASSERT_GT(count.reads, 4);
  for (int n = 1; n <= count.reads; ++n) {
    SCOPED_TRACE("failing read " + std::to_string(n));
    FailingReads failing(n);
    ReaderOptions options;
    options.fs = &failing;
    const std::string msg = trace_error(
        [&] {
          const TraceReader r(path, options);
          r.decode(r.read(0), r.read(0).tensors.at(0));
        },
        TraceError::Kind::kIo);
    EXPECT_NE(msg.find("at byte offset"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  }
  EXPECT_NE(trace_error([&] { TraceReader r(path + ".nope"); }, TraceError::Kind::kIo).find("cannot open trace"),
            std::string::npos);
  EXPECT_NE(trace_error([&] { TraceReader r(fs::temp_directory_path().string()); }, TraceError::Kind::kIo)
                .find("is a directory"),
            std::string::npos);
  fs::remove(path);
}

TEST(Records, TensorNamesAreOneDefinition) {
  EXPECT_EQ(tensor_names::state("param.w"), "state.param.w");
  EXPECT_EQ(tensor_names::state_name("state.param.w"), std::optional<std::string_view>("param.w"));
  EXPECT_FALSE(tensor_names::state_name("batch.input").has_value());
  EXPECT_EQ(tensor_names::batch_name("batch.input"), std::optional<std::string_view>("input"));
  EXPECT_EQ(tensor_names::segment_input(SegmentPhase::kForward, 0), std::optional<std::string>("input.0"));
  EXPECT_FALSE(tensor_names::segment_input(SegmentPhase::kRecompute, 0).has_value());
  EXPECT_EQ(tensor_names::segment_input(SegmentPhase::kBackward, 1), std::optional<std::string>("grad_output.1"));
  EXPECT_EQ(tensor_names::segment_output(SegmentPhase::kRecompute, 2), "output.2");
  EXPECT_EQ(tensor_names::segment_output(SegmentPhase::kBackward, 0), "grad_input.0");
}

// recorded_steps: one step_end per step (the last wins), in step order.
TEST(Records, RecordedStepsAreTheLastStepEndOfEachStepInOrder) {
  const std::string path = temp_path("steps");
  {
    TraceWriter w(path, nlohmann::json::object());
    w.append(RecordType::kStepEnd, {{"step", 2}, {"loss", 2.0}, {"grad_norm", 1.0}}, {});
    w.append(RecordType::kStepEnd, {{"step", 1}, {"loss", 1.0}, {"grad_norm", 1.0}}, {});
    w.append(RecordType::kStepEnd, {{"step", 2}, {"loss", "nan"}, {"grad_norm", 1.0}}, {});
    w.close();
  }
  const RecordedSteps steps = recorded_steps(TraceReader(path));
  ASSERT_EQ(steps.steps.size(), 2u);
  EXPECT_EQ(steps.steps[0].step, 1);
  EXPECT_TRUE(std::isnan(steps.steps[1].loss));
  EXPECT_EQ(steps.unreadable, 0);
  fs::remove(path);
}

}  // namespace
}  // namespace retrace
