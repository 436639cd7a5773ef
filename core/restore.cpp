#include <retrace/restore.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace retrace {

std::map<std::string_view, at::Tensor> in_place_targets(const std::vector<NamedTensor>& live) {
  std::map<std::string_view, at::Tensor> out;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;
  for (const NamedTensor& n : live) {
    const at::Tensor& t = n.tensor;
    if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || !t.is_cpu() || !t.is_contiguous() ||
        t.is_neg() || t.is_conj() || t.nbytes() == 0) {
      continue;
    }
    const auto begin = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
    spans.emplace_back(begin, begin + t.nbytes());
    out.emplace(n.name, t);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return {};
  }
  return out;
}

void restore_as_replay_does(Program& program, std::vector<NamedTensor> snapshot) {
  const std::vector<NamedTensor> live = program.state();
  const std::map<std::string_view, at::Tensor> targets = in_place_targets(live);
  {
    const c10::NoGradGuard no_grad;  // the targets are parameters, leaves that require grad
    for (NamedTensor& n : snapshot) {
      const auto it = targets.find(n.name);
      if (it == targets.end() || !n.tensor.defined() || it->second.scalar_type() != n.tensor.scalar_type() ||
          it->second.sizes() != n.tensor.sizes()) {
        continue;
      }
      it->second.copy_(n.tensor);
      n.tensor = it->second;
    }
  }
  program.adopt_state(std::move(snapshot));
}

}  // namespace retrace
