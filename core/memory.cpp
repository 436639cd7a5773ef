#include <retrace/memory.h>

#include <retrace/error.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace retrace {

namespace {

// Wraps the CPU allocator that was installed before. It is never destroyed: tensors allocated
// through it may outlive the CpuMemoryCounter and still call its deleter.
class CountingAllocator final : public c10::Allocator {
 public:
  // The context of every DataPtr is its data pointer, as raw_allocate() requires; the inner
  // allocation is found again through a table.
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = inner_.load()->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) return inner;  // zero-byte allocations
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_allocations_.emplace(data, Allocation{std::move(inner), static_cast<std::int64_t>(n)});
    }
    add(static_cast<std::int64_t>(n));
    return {data, data, &CountingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

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
  struct Allocation {
    c10::DataPtr inner;
    std::int64_t bytes;
  };
  static void release(void* data);
  void add(std::int64_t delta) {
    const std::int64_t now = live_.fetch_add(delta, std::memory_order_relaxed) + delta;
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  std::atomic<c10::Allocator*> inner_{nullptr};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::mutex mutex_;
  std::unordered_map<void*, Allocation> live_allocations_;
};

CountingAllocator& counting_allocator() {
  static auto* instance = new CountingAllocator();
  return *instance;
}

// SetCPUAllocator only replaces an allocator of lower or equal priority.
constexpr std::uint8_t kPriority = 200;
std::atomic<bool> g_active{false};

void CountingAllocator::release(void* data) {
  if (data == nullptr) return;  // raw_deallocate of an empty raw allocation
  CountingAllocator& self = counting_allocator();
  Allocation allocation;
  {
    std::lock_guard<std::mutex> lock(self.mutex_);
    auto it = self.live_allocations_.find(data);
    TORCH_INTERNAL_ASSERT(it != self.live_allocations_.end(), "freeing an allocation we never made");
    allocation = std::move(it->second);
    self.live_allocations_.erase(it);
  }
  self.add(-allocation.bytes);
  // allocation.inner frees through the inner allocator's deleter here.
}

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
