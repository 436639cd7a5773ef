// Tensor digests and RNG state: equal contents give equal digests, any single-bit change gives a
// different one, and RNG state survives serialize -> restore bit for bit.
#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/rng.h>

#include <torch/torch.h>

#include <cstring>
#include <set>

namespace retrace {
namespace {

TEST(Digest, EqualContentsInDistinctStoragesDigestEqual) {
  torch::manual_seed(0);
  const at::Tensor a = torch::randn({17, 5});
  const at::Tensor b = a.clone();
  ASSERT_NE(a.data_ptr(), b.data_ptr());
  EXPECT_EQ(digest(a), digest(b));
  EXPECT_EQ(digest(a).algorithm, DigestAlgorithm::kXxh3_128);
  EXPECT_EQ(digest(a).hex().size(), 32u);
}

// hex(): 32 lowercase digits, hi then lo, each half zero-padded (what traces and reports print).
TEST(Digest, HexIsHiThenLoInLowercaseZeroPaddedHalves) {
  EXPECT_EQ((Digest{0x0123456789abcdefULL, 0xfedcba9876543210ULL, DigestAlgorithm::kXxh3_128}.hex()),
            "fedcba98765432100123456789abcdef");
  EXPECT_EQ((Digest{1, 0, DigestAlgorithm::kXxh3_128}.hex()), "00000000000000000000000000000001");
  EXPECT_EQ((Digest{0, 0xa, DigestAlgorithm::kXxh3_128}.hex()), "000000000000000a0000000000000000");
}

TEST(Digest, EverySingleBitFlipChangesTheDigest) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kInt, at::kByte}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(1);
    const at::Tensor base = (torch::rand({3, 3}) * 100).to(dtype);
    const Digest reference = digest(base);
    std::set<std::pair<std::uint64_t, std::uint64_t>> seen{{reference.lo, reference.hi}};
    const std::size_t nbytes = base.nbytes();
    for (std::size_t byte = 0; byte < nbytes; ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        at::Tensor flipped = base.clone();
        static_cast<std::uint8_t*>(flipped.data_ptr())[byte] ^= static_cast<std::uint8_t>(1u << bit);
        const Digest d = digest(flipped);
        EXPECT_NE(d, reference) << "byte " << byte << " bit " << bit;
        seen.insert({d.lo, d.hi});
      }
    }
    EXPECT_EQ(seen.size(), nbytes * 8 + 1);  // all distinct, not merely different from the base
  }
}

TEST(Digest, DtypeAndShapeAreFoldedIn) {
  const at::Tensor a = torch::zeros({4, 4});
  EXPECT_NE(digest(a), digest(a.view({16})));
  EXPECT_NE(digest(a), digest(a.view({2, 8})));
  EXPECT_NE(digest(a), digest(a.view(at::kInt)));  // same bytes, another dtype
  EXPECT_NE(digest(torch::zeros({0})), digest(torch::zeros({0, 3})));
}

TEST(Digest, NonContiguousViewsDigestByValue) {
  torch::manual_seed(2);
  const at::Tensor a = torch::randn({6, 8});
  const at::Tensor t = a.t();
  ASSERT_FALSE(t.is_contiguous());
  EXPECT_EQ(digest(t), digest(t.contiguous()));
  EXPECT_NE(digest(t), digest(a));
  const at::Tensor strided = a.slice(1, 0, 8, 3);
  EXPECT_EQ(digest(strided), digest(strided.contiguous()));
  const at::Tensor expanded = torch::randn({1, 5}).expand({4, 5});
  EXPECT_EQ(digest(expanded), digest(expanded.contiguous()));
  const at::Tensor offset = a.view(-1).narrow(0, 3, 10);  // storage offset
  EXPECT_EQ(digest(offset), digest(offset.clone()));
}

TEST(Digest, NegativeAndConjugateViewsDigestByValue) {
  const at::Tensor c = torch::randn({4}, at::kComplexFloat);
  EXPECT_EQ(digest(c.conj()), digest(c.conj().resolve_conj()));
  EXPECT_NE(digest(c.conj()), digest(c));
}

TEST(Digest, RejectsWhatItCannotDigest) {
  EXPECT_THROW(digest(at::Tensor()), Error);
  EXPECT_THROW(digest(torch::empty({2}, torch::TensorOptions().device(at::kMeta))), Error);
  EXPECT_THROW(digest(torch::eye(3).to_sparse()), Error);
}

// The CPU side of digest_async_many: each result is digest() of its tensor, in order (the CUDA
// batch is tested in tests/cuda). Control: the digests differ where the tensors do.
TEST(Digest, ManyAtOnceEqualsOneByOneOnTheCpu) {
  torch::manual_seed(6);
  std::vector<at::Tensor> tensors = {torch::randn({5, 7}), torch::randn({3}).to(at::kHalf), torch::randn({4, 4}).t(),
                                     torch::empty({0})};
  const std::vector<PendingDigest> many = digest_async_many(tensors);
  ASSERT_EQ(many.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(many[i].ready());
    EXPECT_EQ(many[i].get(), digest(tensors[i])) << i;
  }
  EXPECT_NE(many[0].get(), many[2].get());
  EXPECT_TRUE(digest_async_many({}).empty());
}

TEST(Digest, RawBytes) {
  const char data[] = "retrace";
  EXPECT_EQ(digest_bytes(data, 7), digest_bytes(data, 7));
  EXPECT_NE(digest_bytes(data, 7), digest_bytes(data, 6));
}

// --- RNG state -------------------------------------------------------------------------------

TEST(RngState, SerializeRestoreGivesIdenticalRandomNumbers) {
  torch::manual_seed(123);
  torch::randn({10});  // move the generator off its seed state
  const RngState state = RngState::capture();
  const std::vector<std::uint8_t> bytes = state.serialize();
  const at::Tensor expected_normal = torch::randn({64});
  const at::Tensor expected_uniform = torch::rand({64});
  const at::Tensor expected_dropout = torch::dropout(torch::ones({64}), 0.5, true);

  torch::manual_seed(999);  // anything else
  RngState::deserialize(bytes.data(), bytes.size()).restore();
  EXPECT_BITWISE_EQ(expected_normal, torch::randn({64}));
  EXPECT_BITWISE_EQ(expected_uniform, torch::rand({64}));
  EXPECT_BITWISE_EQ(expected_dropout, torch::dropout(torch::ones({64}), 0.5, true));
  EXPECT_EQ(RngState::deserialize(bytes.data(), bytes.size()), state);
}

TEST(RngState, NegativeControlDifferentStateGivesDifferentNumbers) {
  torch::manual_seed(1);
  const RngState one = RngState::capture();
  const at::Tensor a = torch::randn({8});
  torch::manual_seed(2);
  EXPECT_NE(RngState::capture(), one);
  EXPECT_FALSE(bitwise_diff(a, torch::randn({8})).bitwise_equal());
}

TEST(RngState, ForkRestoresOnScopeExit) {
  torch::manual_seed(5);
  const at::Tensor expected = torch::rand({4});
  torch::manual_seed(5);
  {
    RngFork fork;
    torch::rand({1000});
  }
  EXPECT_BITWISE_EQ(expected, torch::rand({4}));
}

TEST(RngState, CpuStateIsTheMt19937Block) {
  const RngState s = RngState::capture();
  ASSERT_EQ(s.generators().size(), 1u);
  EXPECT_TRUE(s.generators()[0].device.is_cpu());
  EXPECT_EQ(s.generators()[0].bytes.size(), 5056u);
}

TEST(RngState, TruncatedOrCorruptBytesGiveAnErrorNamingTheOffset) {
  const std::vector<std::uint8_t> bytes = RngState::capture().serialize();
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    try {
      RngState::deserialize(bytes.data(), cut);
      ADD_FAILURE() << "a cut at " << cut << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("at byte offset"), std::string::npos) << e.what();
    }
  }
  std::vector<std::uint8_t> bad = bytes;
  bad[0] ^= 1;
  EXPECT_THROW(RngState::deserialize(bad.data(), bad.size()), Error);
  bad = bytes;
  for (int i = 12; i < 16; ++i) bad[i] = 0xff;  // state length (bytes 12..15) far beyond the cap
  EXPECT_THROW(RngState::deserialize(bad.data(), bad.size()), Error);
  bad = bytes;
  bad.push_back(0);
  EXPECT_THROW(RngState::deserialize(bad.data(), bad.size()), Error);
}

// An RNG state buffer with the CPU generator's state followed by one hand-made generator entry.
std::vector<std::uint8_t> with_generator(std::int8_t type, std::int8_t index, const std::vector<std::uint8_t>& state) {
  std::vector<std::uint8_t> bytes = RngState::capture().serialize();  // magic, version, count 1, CPU
  const std::uint32_t count = 2;
  std::memcpy(bytes.data() + 6, &count, sizeof count);
  bytes.push_back(static_cast<std::uint8_t>(type));
  bytes.push_back(static_cast<std::uint8_t>(index));
  const auto n = static_cast<std::uint32_t>(state.size());
  const auto* p = reinterpret_cast<const std::uint8_t*>(&n);
  bytes.insert(bytes.end(), p, p + sizeof n);
  bytes.insert(bytes.end(), state.begin(), state.end());
  return bytes;
}

// seed, then Philox offset, as CUDAGeneratorImpl::get_state() writes them.
std::vector<std::uint8_t> cuda_state(std::uint64_t seed, std::int64_t offset) {
  std::vector<std::uint8_t> s(16);
  std::memcpy(s.data(), &seed, 8);
  std::memcpy(s.data() + 8, &offset, 8);
  return s;
}

std::string deserialize_error(const std::vector<std::uint8_t>& bytes) {
  try {
    RngState::deserialize(bytes.data(), bytes.size());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

constexpr std::int8_t kCpuType = static_cast<std::int8_t>(c10::kCPU);
constexpr std::int8_t kCudaType = static_cast<std::int8_t>(c10::kCUDA);

// A CUDA generator takes exactly its 16 bytes (seed, offset), the offset a multiple of 4; LibTorch
// would answer anything else with its own error at restore, or accept 8 bytes as a bare seed.
TEST(RngState, CudaStateOfAnyOtherSizeOrOffsetIsRejectedNamingTheOffset) {
  const std::vector<std::uint8_t> valid = with_generator(kCudaType, 0, cuda_state(7, 12));
  const RngState parsed = RngState::deserialize(valid.data(), valid.size());  // control: accepted
  ASSERT_EQ(parsed.generators().size(), 2u);
  EXPECT_EQ(parsed.generators()[1].device, c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(parsed.generators()[1].bytes, cuda_state(7, 12));
  EXPECT_EQ(parsed.serialize(), valid);

  std::vector<std::uint8_t> short_state = cuda_state(7, 12);
  short_state.pop_back();
  std::vector<std::uint8_t> long_state = cuda_state(7, 12);
  long_state.push_back(0);
  for (const auto& state : {short_state, long_state, std::vector<std::uint8_t>(8)}) {
    SCOPED_TRACE(state.size());
    const std::string what = deserialize_error(with_generator(kCudaType, 0, state));
    EXPECT_NE(what.find("a CUDA generator state is 16 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("at byte offset"), std::string::npos) << what;
  }
  const std::size_t offset_field = valid.size() - 8;
  const std::string odd = deserialize_error(with_generator(kCudaType, 0, cuda_state(7, 13)));
  EXPECT_NE(odd.find("not a multiple of 4 at byte offset " + std::to_string(offset_field)), std::string::npos) << odd;
  const std::string bad_index = deserialize_error(with_generator(kCudaType, -1, cuda_state(7, 12)));
  EXPECT_NE(bad_index.find("CUDA device index -1 is invalid"), std::string::npos) << bad_index;
}

TEST(RngState, CpuStateOfAnyOtherSizeIsRejected) {
  const std::vector<std::uint8_t> cpu = RngState::capture().generators()[0].bytes;
  ASSERT_EQ(cpu.size(), 5056u);
  EXPECT_EQ(deserialize_error(with_generator(kCpuType, -1, cpu)), "");  // control: accepted
  std::vector<std::uint8_t> short_state(cpu.begin(), cpu.end() - 1);
  std::vector<std::uint8_t> legacy(cpu.begin(), cpu.begin() + 5048);  // set_state's old layout: never written
  std::vector<std::uint8_t> long_state = cpu;
  long_state.push_back(0);
  for (const auto& state : {short_state, legacy, long_state}) {
    SCOPED_TRACE(state.size());
    const std::string what = deserialize_error(with_generator(kCpuType, -1, state));
    EXPECT_NE(what.find("a CPU generator state is 5056 bytes"), std::string::npos) << what;
  }
  const std::string bad_index = deserialize_error(with_generator(kCpuType, 3, cpu));
  EXPECT_NE(bad_index.find("CPU device index 3 is invalid"), std::string::npos) << bad_index;
}

// A well-formed state that the generator itself rejects (here an mt19937 block never seeded) is a
// retrace::Error naming the device, not LibTorch's error.
TEST(RngState, StateTheGeneratorRejectsIsARetraceErrorAtRestore) {
  torch::manual_seed(8);
  const RngState good = RngState::capture();
  const std::vector<std::uint8_t> zeros = with_generator(kCpuType, -1, std::vector<std::uint8_t>(5056, 0));
  const RngState bad = RngState::deserialize(zeros.data(), zeros.size());
  try {
    bad.restore();
    ADD_FAILURE() << "an unseeded mt19937 state was restored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the generator of cpu rejected the state"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a retrace::Error: " << e.what();
  }
  EXPECT_NO_THROW(good.restore());  // control: a valid state restores
  EXPECT_EQ(RngState::capture(), good);
}

// A trace recorded on a machine with more GPUs than this one.
TEST(RngState, CudaStateForADeviceThatIsNotVisibleIsARetraceErrorAtRestore) {
  const auto beyond = static_cast<std::int8_t>(torch::cuda::device_count());
  const std::vector<std::uint8_t> bytes = with_generator(kCudaType, beyond, cuda_state(7, 12));
  const RngState state = RngState::deserialize(bytes.data(), bytes.size());
  const std::string device = "cuda:" + std::to_string(beyond);
  try {
    state.restore();
    ADD_FAILURE() << device << " was restored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the state is for " + device + " but this process sees"), std::string::npos)
        << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a retrace::Error: " << e.what();
  }
}

}  // namespace
}  // namespace retrace

// DeterministicGuard: flags on while alive, restored after; cuBLAS configured before CUDA use.
#include <retrace/determinism.h>

namespace retrace {
namespace {

TEST(DeterministicGuard, TurnsFlagsOnAndRestoresThem) {
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(false, false);
  ctx.setBenchmarkCuDNN(true);
  {
    DeterministicGuard guard;
    EXPECT_TRUE(ctx.deterministicAlgorithms());
    EXPECT_FALSE(ctx.deterministicAlgorithmsWarnOnly());
    EXPECT_TRUE(ctx.deterministicCuDNN());
    EXPECT_FALSE(ctx.benchmarkCuDNN());
    EXPECT_TRUE(cublas_workspace_config_is_deterministic());  // set by the guard (no CUDA used yet)
  }
  EXPECT_FALSE(ctx.deterministicAlgorithms());
  EXPECT_TRUE(ctx.benchmarkCuDNN());
  ctx.setBenchmarkCuDNN(false);
}

TEST(DeterministicGuard, RecognizesTheDocumentedWorkspaceConfigs) {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);
  EXPECT_TRUE(cublas_workspace_config_is_deterministic());
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":1024:2", 1);
  EXPECT_FALSE(cublas_workspace_config_is_deterministic());
  ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
  EXPECT_FALSE(cublas_workspace_config_is_deterministic());
}

}  // namespace
}  // namespace retrace
