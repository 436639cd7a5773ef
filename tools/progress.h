#pragma once
// A one-line progress bar for `retrace run`, on stderr:
//   [=========>              ] 12/44 scenarios  3.1 s  fp16-overflow-loss-scaling, grad-nan-skip
// drawn only when stderr is a terminal (isatty) and TERM is not "dumb"; otherwise every call is a
// no-op, so logs and CI output stay free of carriage returns. Redrawn in place with \r, clipped
// to the terminal's width (a wrapped line could not be redrawn), erased by clear().

#include <chrono>
#include <string>

namespace retrace::cli {

class ProgressBar {
 public:
  explicit ProgressBar(std::size_t total);
  ~ProgressBar();  // clears the line
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  bool enabled() const { return enabled_; }
  // Redraws: `done` of the total finished, `current` (what is running) after the time.
  void update(std::size_t done, const std::string& current);
  // Erases the bar; call before printing anything else to the terminal, update() redraws it.
  void clear();

 private:
  bool enabled_ = false;
  bool drawn_ = false;
  std::size_t total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace retrace::cli
