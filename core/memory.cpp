#include <retrace/memory.h>

#include <retrace/error.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>

namespace retrace {

namespace {

// Wraps the CPU allocator that was installed before. It is never destroyed: tensors allocated
// through it may outlive the CpuMemoryCounter and still call its deleter.
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = inner_.load()->allocate(n);
    add(static_cast<std::int64_t>(n));
    auto* ctx = new Context{std::move(inner), static_cast<std::int64_t>(n), this};
    void* data = ctx->inner.get();
    const c10::Device device = ctx->inner.device();
    return {data, ctx, &Context::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void start(c10::Allocator* inner) {
    inner_.store(inner);
    live_.store(0);
    peak_.store(0);
  }
  c10::Allocator* inner() const { return inner_.load(); }
  std::int64_t live() const { return live_.load(std::memory_order_relaxed); }
  std::int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    std::int64_t bytes;
    CountingAllocator* owner;
    static void release(void* p) {
      auto* ctx = static_cast<Context*>(p);
      ctx->owner->add(-ctx->bytes);
      delete ctx;  // frees through the inner allocator's deleter
    }
  };
  void add(std::int64_t delta) {
    const std::int64_t now = live_.fetch_add(delta, std::memory_order_relaxed) + delta;
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  std::atomic<c10::Allocator*> inner_{nullptr};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
};

CountingAllocator& counting_allocator() {
  static auto* instance = new CountingAllocator();
  return *instance;
}

// SetCPUAllocator only replaces an allocator of lower or equal priority.
constexpr std::uint8_t kPriority = 200;
std::atomic<bool> g_active{false};

}  // namespace

CpuMemoryCounter::CpuMemoryCounter() {
  if (g_active.exchange(true)) {
    throw Error("retrace::CpuMemoryCounter: another counter is alive; only one can count at a time");
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  counting_allocator().start(current);
  c10::SetCPUAllocator(&counting_allocator(), kPriority);
}

CpuMemoryCounter::~CpuMemoryCounter() {
  c10::SetCPUAllocator(counting_allocator().inner(), kPriority);
  g_active.store(false);
}

std::int64_t CpuMemoryCounter::live_bytes() const { return counting_allocator().live(); }
std::int64_t CpuMemoryCounter::peak_bytes() const { return counting_allocator().peak(); }
void CpuMemoryCounter::reset_peak() { counting_allocator().reset_peak(); }

}  // namespace retrace
