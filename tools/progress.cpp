#include "progress.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/ioctl.h>
#include <unistd.h>

namespace retrace::cli {

namespace {

int terminal_columns() {
  winsize ws{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;  // a pseudo-terminal whose size was never set
}

void write_all(const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(STDERR_FILENO, s.data() + off, s.size() - off);
    if (n <= 0) return;  // the terminal went away: nothing to do about a progress bar
    off += static_cast<std::size_t>(n);
  }
}

}  // namespace

ProgressBar::ProgressBar(std::size_t total) : total_(total), start_(std::chrono::steady_clock::now()) {
  const char* term = std::getenv("TERM");
  enabled_ = ::isatty(STDERR_FILENO) == 1 && !(term && std::strcmp(term, "dumb") == 0) && total > 0;
}

ProgressBar::~ProgressBar() { clear(); }

void ProgressBar::update(std::size_t done, const std::string& current) {
  if (!enabled_) return;
  constexpr std::size_t kBar = 24;
  const std::size_t filled = total_ ? done * kBar / total_ : kBar;
  std::string bar = "[";
  for (std::size_t i = 0; i < kBar; ++i) bar += i < filled ? '=' : (i == filled && done < total_ ? '>' : ' ');
  bar += "]";
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  char text[96];
  std::snprintf(text, sizeof text, " %zu/%zu scenarios  %.1f s  ", done, total_, seconds);
  std::string line = bar + text + current;
  const std::size_t width = static_cast<std::size_t>(terminal_columns()) - 1;  // the last column would wrap
  if (line.size() > width) line = line.substr(0, width > 3 ? width - 3 : width) + (width > 3 ? "..." : "");
  write_all("\r" + line + "\033[K");
  drawn_ = true;
}

void ProgressBar::clear() {
  if (!enabled_ || !drawn_) return;
  write_all("\r\033[K");
  drawn_ = false;
}

}  // namespace retrace::cli
