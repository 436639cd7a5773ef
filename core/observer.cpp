#include <retrace/observer.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace retrace {

const char* to_string(SegmentPhase phase) {
  switch (phase) {
    case SegmentPhase::kForward: return "forward";
    case SegmentPhase::kRecompute: return "recompute";
    case SegmentPhase::kBackward: return "backward";
  }
  return "?";
}

namespace {
std::mutex g_mutex;
std::vector<SegmentObserver*>& observers() {
  static std::vector<SegmentObserver*> list;
  return list;
}
std::size_t g_first = 0;  // the first g_first observers were attached with ObserverOrder::kFirst
std::vector<SegmentObserver*>& firsts() {
  static std::vector<SegmentObserver*> list;
  return list;
}
std::atomic<int> g_count{0};
}  // namespace

ObserverScope::ObserverScope(SegmentObserver& observer, ObserverOrder order) : observer_(&observer) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (order == ObserverOrder::kFirst) {
    observers().insert(observers().begin() + static_cast<std::ptrdiff_t>(g_first), observer_);
    firsts().push_back(observer_);
    ++g_first;
  } else {
    observers().push_back(observer_);
  }
  g_count.store(static_cast<int>(observers().size()), std::memory_order_release);
}

ObserverScope::~ObserverScope() {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& list = observers();
  auto it = std::find(list.begin(), list.end(), observer_);
  TORCH_INTERNAL_ASSERT(it != list.end(), "observer detached twice");
  list.erase(it);
  auto f = std::find(firsts().begin(), firsts().end(), observer_);
  if (f != firsts().end()) {
    firsts().erase(f);
    --g_first;
  }
  g_count.store(static_cast<int>(list.size()), std::memory_order_release);
}

namespace detail {

bool observers_attached() noexcept { return g_count.load(std::memory_order_relaxed) != 0; }

void notify_observers(SegmentEvent& event) {
  std::vector<SegmentObserver*> snapshot;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    snapshot = observers();
  }
  for (SegmentObserver* o : snapshot) {
    switch (event.phase) {
      case SegmentPhase::kForward: o->on_forward(event); break;
      case SegmentPhase::kRecompute: o->on_recompute(event); break;
      case SegmentPhase::kBackward: o->on_backward(event); break;
    }
  }
}

}  // namespace detail
}  // namespace retrace
