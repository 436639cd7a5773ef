#pragma once
// Restoring a program's state() from a snapshot as replay does: into the program's own tensors
// where they can take it, the rest handed over with Program::adopt_state.

#include <retrace/program.h>

#include <ATen/core/Tensor.h>

#include <map>
#include <string_view>
#include <vector>

namespace retrace {

// The tensors of `live` (a program's state()) that a snapshot's tensor of the same name may be
// written into in place: dense, on the CPU, contiguous, not a negative or conjugate view, not
// empty, and sharing no memory with another (two tensors written into one buffer at once would
// race, and one of them would be lost). Empty when any two overlap. The keys view `live`'s
// names: keep `live` alive while the map is used. Cost: one pass over the list, a sort.
std::map<std::string_view, at::Tensor> in_place_targets(const std::vector<NamedTensor>& live);

// Restores `program` from `snapshot`, tensors the caller gives up, as Replayer::run does: each
// snapshot tensor that has an in-place target of its dtype and shape is copied into that target
// (which takes its place in the vector), and the vector goes to program.adopt_state(). load_state()
// and adopt_state() are thus given some of the program's own tensors, as in a replay: copying a
// tensor onto itself must leave it as it is (copy_ does). The recorder's state self-check restores
// its copy this way, so a program that breaks on it fails while recording, not at replay.
void restore_as_replay_does(Program& program, std::vector<NamedTensor> snapshot);

}  // namespace retrace
