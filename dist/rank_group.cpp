#include <retrace/dist.h>

#include <retrace/collective_backend.h>
#include <retrace/error.h>

#include "gloo_backend.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>

namespace retrace {

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::int64_t env_integer(const char* name, const std::string& text, std::int64_t lo, std::int64_t hi,
                         const char* what) {
  std::size_t used = 0;
  std::int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < lo || v > hi) {
    throw Error(std::string("environment variable ") + name + "='" + text + "' is not " + what + " (" +
                std::to_string(lo) + ".." + std::to_string(hi) + ")");
  }
  return v;
}

std::string bytes_text(const std::vector<std::uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<std::uint8_t> text_bytes(const std::string& s) { return {s.begin(), s.end()}; }

// "line 12: 'lr: 0.01' here, 'lr: 0.001' on rank 0"
std::string first_difference(const std::string& mine, const std::string& theirs, int their_rank) {
  std::istringstream a(mine), b(theirs);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool ga = static_cast<bool>(std::getline(a, la));
    const bool gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) return "the texts differ";
    if (!ga) la = "(end)";
    if (!gb) lb = "(end)";
    if (la != lb || !ga || !gb) {
      return "line " + std::to_string(line) + ": '" + la.substr(0, 80) + "' here, '" + lb.substr(0, 80) + "' on rank " +
             std::to_string(their_rank);
    }
  }
}

std::string make_run_id() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << std::chrono::system_clock::now().time_since_epoch().count() << "-" << rd();
  return os.str();
}

// Waits for `key` in the store, bounded by its timeout; a RendezvousError naming what is missing.
std::vector<std::uint8_t> wait_get(c10d::Store& store, const std::string& key, const std::string& missing,
                                   std::chrono::milliseconds timeout) {
  try {
    store.wait({key}, timeout);
    return store.get(key);
  } catch (const c10::Error& e) {
    throw RendezvousError(missing + " within " + std::to_string(timeout.count() / 1000) +
                          " s (RETRACE_DIST_TIMEOUT): did every rank start, with the same WORLD_SIZE and store?");
  }
}

}  // namespace

RendezvousOptions RendezvousOptions::from_env() {
  RendezvousOptions o;
  if (auto w = env("WORLD_SIZE"))
    o.world_size = static_cast<int>(env_integer("WORLD_SIZE", *w, 1, 65536, "a world size"));
  if (auto r = env("RANK")) {
    o.rank = static_cast<int>(env_integer("RANK", *r, 0, o.world_size - 1, "a rank below WORLD_SIZE"));
  }
  if (auto a = env("MASTER_ADDR")) o.master_addr = *a;
  if (auto p = env("MASTER_PORT")) o.master_port = static_cast<int>(env_integer("MASTER_PORT", *p, 1, 65535, "a port"));
  if (auto s = env("RETRACE_STORE")) o.store_path = *s;
  if (auto t = env("RETRACE_DIST_TIMEOUT")) {
    o.timeout = std::chrono::seconds(env_integer("RETRACE_DIST_TIMEOUT", *t, 1, 86400, "a number of seconds"));
  }
  if (auto id = env("RETRACE_RUN_ID")) o.run_id = *id;
  return o;
}

struct RankGroup::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Backend> backend;  // what group's collectives run on, for this device
  c10::Device device{c10::kCPU};
};

RankGroup::~RankGroup() = default;

c10d::ProcessGroup& RankGroup::process_group() { return *impl_->group; }

std::unique_ptr<RankGroup> RankGroup::join(const RendezvousOptions& options, const std::string& config,
                                           c10::Device device) {
  std::unique_ptr<RankGroup> g(new RankGroup());
  g->impl_ = std::make_unique<Impl>();
  g->impl_->device = device;
  const c10::DeviceType type = device.type();
  if (const std::optional<RankInfo> replayed = replayed_rank()) {
    g->ranks_ = *replayed;
    g->replayed_ = true;
    g->impl_->backend = make_replay_backend(replayed->rank, replayed->world_size);
    g->impl_->group = c10::make_intrusive<c10d::ProcessGroup>(replayed->rank, replayed->world_size);
  } else {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
      throw RendezvousError("rank " + std::to_string(options.rank) + " of world size " +
                            std::to_string(options.world_size) + " is not a rank of the group (RANK, WORLD_SIZE)");
    }
    c10::intrusive_ptr<c10d::Store> store;
    try {
      if (!options.store_path.empty()) {
        store = c10::make_intrusive<c10d::FileStore>(options.store_path, options.world_size);
        store->setTimeout(options.timeout);
      } else {
        if (options.master_port <= 0) {
          throw RendezvousError(
              "a data-parallel run needs a rendezvous: set MASTER_ADDR and MASTER_PORT (a TCP store on rank 0) or "
              "RETRACE_STORE (a file path every rank shares), or launch with retrace record --ranks N");
        }
        c10d::TCPStoreOptions tcp;
        tcp.port = static_cast<std::uint16_t>(options.master_port);
        tcp.isServer = options.rank == 0;
        tcp.numWorkers = options.world_size;
        tcp.waitWorkers = false;
        tcp.timeout = options.timeout;
        store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, tcp);
      }
    } catch (const c10::Error& e) {
      throw RendezvousError("rank " + std::to_string(options.rank) + " could not reach the store (" +
                            (options.store_path.empty()
                                 ? options.master_addr + ":" + std::to_string(options.master_port)
                                 : options.store_path) +
                            "): " + e.what_without_backtrace());
    }
    // Every rank must run the same program config: compared before any collective, so that a
    // mismatch is a refusal on every rank, not a hang in the first all-reduce.
    const std::string me = std::to_string(options.rank);
    store->set("retrace/config/" + me, text_bytes(config));
    for (int r = 0; r < options.world_size; ++r) {
      if (r == options.rank) continue;
      const std::string theirs = bytes_text(wait_get(*store, "retrace/config/" + std::to_string(r),
                                                     "rank " + std::to_string(r) + " did not join", options.timeout));
      if (theirs != config) {
        throw RendezvousError("rank " + me + " refuses the group: rank " + std::to_string(r) +
                              " runs another config (" + first_difference(config, theirs, r) +
                              "); every rank must run the same scenario and program config");
      }
    }
    std::string run_id = options.run_id;
    if (run_id.empty()) {
      if (options.rank == 0) store->set("retrace/run_id", text_bytes(make_run_id()));
      run_id = bytes_text(wait_get(*store, "retrace/run_id", "rank 0 did not hand out the run id", options.timeout));
    }
    g->ranks_ = RankInfo{options.rank, options.world_size, run_id};
    auto backend_store = c10::make_intrusive<c10d::PrefixStore>("retrace/backend", store);
    c10::intrusive_ptr<c10d::Backend> real;
    try {
      real = type == c10::kCUDA
                 ? dist_internal::make_nccl_backend(backend_store, options.rank, options.world_size, options.timeout)
                 : dist_internal::make_gloo_backend(backend_store, options.rank, options.world_size, options.timeout,
                                                    options.master_addr.empty() ? "127.0.0.1" : options.master_addr);
    } catch (const c10::Error& e) {
      throw RendezvousError("rank " + me + " could not connect its " + (type == c10::kCUDA ? "NCCL" : "Gloo") +
                            " backend to the others: " + e.what_without_backtrace());
    }
    g->impl_->backend = make_recording_backend(real);
    g->impl_->group = c10::make_intrusive<c10d::ProcessGroup>(store, options.rank, options.world_size);
  }
  const auto backend_type = c10d::ProcessGroup::BackendType::CUSTOM;
  g->impl_->group->setBackend(type, backend_type, g->impl_->backend);
  g->impl_->group->setDefaultBackend(backend_type);
  return g;
}

void RankGroup::average(const std::vector<at::Tensor>& tensors) {
  if (ranks_.world_size == 1 && !replayed_) return;
  // Buckets in order: consecutive tensors of one dtype and device, up to bucket_bytes each.
  std::size_t i = 0;
  while (i < tensors.size()) {
    std::vector<at::Tensor> bucket{tensors[i]};
    std::size_t bytes = tensors[i].nbytes();
    std::size_t j = i + 1;
    for (; j < tensors.size(); ++j) {
      const at::Tensor& t = tensors[j];
      if (t.scalar_type() != tensors[i].scalar_type() || t.device() != tensors[i].device() ||
          bytes + t.nbytes() > bucket_bytes)
        break;
      bucket.push_back(t);
      bytes += t.nbytes();
    }
    std::vector<at::Tensor> flat{torch::cat([&] {
      std::vector<at::Tensor> views;
      for (const at::Tensor& t : bucket) views.push_back(t.reshape({-1}));
      return views;
    }())};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;  // Gloo has no AVG: sum, then divide on every rank alike
    impl_->backend->allreduce(flat, opts)->wait();
    flat[0].div_(ranks_.world_size);
    std::int64_t offset = 0;
    for (const at::Tensor& t : bucket) {
      const std::int64_t n = t.numel();
      t.copy_(flat[0].narrow(0, offset, n).view(t.sizes()));
      offset += n;
    }
    i = j;
  }
}

std::vector<int> RankGroup::ranks_with(bool flag) {
  if (ranks_.world_size == 1 && !replayed_) return flag ? std::vector<int>{0} : std::vector<int>{};
  std::vector<at::Tensor> flags{torch::zeros({ranks_.world_size}, torch::TensorOptions().device(impl_->device))};
  if (flag) flags[0][ranks_.rank] = 1.0;
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  impl_->backend->allreduce(flags, opts)->wait();
  const at::Tensor host = flags[0].cpu();
  std::vector<int> out;
  for (int r = 0; r < ranks_.world_size; ++r) {
    if (host[r].item<float>() != 0.0f) out.push_back(r);
  }
  return out;
}

}  // namespace retrace
