#include <retrace/io.h>

#include <retrace/error.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

namespace retrace::io {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int err) { throw IoError(what, path, err); }

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, std::uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }
  void read_at(std::uint64_t offset, void* out, std::size_t n) const override {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail("read", path_, errno);
      if (r == 0) throw IoError("read", path_, "unexpected end of file");
      p += r;
      n -= static_cast<std::size_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }
  std::uint64_t size() const override { return size_; }

 private:
  std::string path_;
  int fd_;
  std::uint64_t size_;
};

class PosixFile final : public WritableFile {
 public:
  PosixFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const void* data, std::size_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("write", path_, errno);
      }
      p += w;
      n -= static_cast<std::size_t>(w);
      size_ += static_cast<std::uint64_t>(w);
    }
  }
  void append_all(const std::vector<ConstBytes>& pieces) override {
    std::vector<iovec> iov;
    iov.reserve(std::min<std::size_t>(pieces.size(), IOV_MAX));
    std::size_t next = 0;  // the first piece not yet in iov
    while (next < pieces.size() || !iov.empty()) {
      while (next < pieces.size() && iov.size() < static_cast<std::size_t>(IOV_MAX)) {
        if (pieces[next].size) iov.push_back({const_cast<void*>(pieces[next].data), pieces[next].size});
        ++next;
      }
      if (iov.empty()) break;
      const ssize_t w = ::writev(fd_, iov.data(), static_cast<int>(iov.size()));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("write", path_, errno);
      }
      size_ += static_cast<std::uint64_t>(w);
      // Drop what was written: whole pieces, then the front of a piece written in part.
      std::size_t left = static_cast<std::size_t>(w), done = 0;
      while (done < iov.size() && left >= iov[done].iov_len) left -= iov[done++].iov_len;
      iov.erase(iov.begin(), iov.begin() + static_cast<std::ptrdiff_t>(done));
      if (left) {
        iov.front().iov_base = static_cast<char*>(iov.front().iov_base) + left;
        iov.front().iov_len -= left;
      }
    }
  }
  void sync() override {
    if (::fsync(fd_) != 0) fail("fsync", path_, errno);
#ifdef __linux__
    // Everything is clean now: the pages release_before() found still being written go too.
    if (swept_ < dropped_) drop(swept_, dropped_ - swept_);
    swept_ = dropped_;
#endif
  }
  void release_before(std::uint64_t offset) override {
#ifdef __linux__
    if (!release_) return;
    // A backlog longer than the window and what one call starts (a 1.4 GB full-mode step of GPT-2
    // small with the 64 MiB window): those units are left to the kernel, as any file's, and go
    // at the next sync(). Starting their write-back here waited on the disk's queue behind the
    // kernel's own and made that model's full mode 10-20% slower (bench/README.md).
    const std::uint64_t window = size_ - std::min(offset, size_);
    if (size_ - started_ > window + kStartedPerCall * kReleaseUnit) {
      const std::uint64_t end = size_ / kReleaseUnit * kReleaseUnit;
      started_ = std::max(started_, end);
      dropped_ = std::max(dropped_, end);
    }
    // Starts the write-back of the whole units written so far, at most kStartedPerCall of them a
    // call: starting more can block while the disk's request queue is full (a 1.2 GB snapshot is
    // 150 units), and the rest are started by the calls after, or by the kernel. It is not waited
    // for: by the time a unit falls behind `offset`, usually a window later, it is on disk and its
    // pages can go. Units of 8 MiB: with 1 MiB ones, appending 6.9 MB took 8-18 ms on the 2-core
    // VM of bench/README.md against 3-4 ms with 4-16 MiB ones.
    const std::uint64_t started_before = started_;
    for (int n = 0; n < kStartedPerCall && size_ - started_ >= kReleaseUnit; ++n) {
      if (::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(kReleaseUnit),
                            SYNC_FILE_RANGE_WRITE) != 0) {
        if (errno == EINTR) continue;
        // A file system without it (or a sandbox refusing it): the kernel keeps deciding.
        if (errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP || errno == ESPIPE || errno == EPERM) {
          release_ = false;
          return;
        }
        fail("start the write-back of", path_, errno);
      }
      started_ += kReleaseUnit;
    }
    // Drops each unit behind `offset` whose write-back started in an earlier call, and gives the
    // unit two before it a second try: pages still dirty or being written the first time stay
    // (fadvise skips them); what the second try misses goes at the next sync().
    while (dropped_ + kReleaseUnit <= std::min(offset, started_before)) {
      drop(dropped_, kReleaseUnit);
      if (dropped_ >= 2 * kReleaseUnit) drop(dropped_ - 2 * kReleaseUnit, kReleaseUnit);
      dropped_ += kReleaseUnit;
    }
#else
    (void)offset;
#endif
  }
  void close() override {
    if (fd_ < 0) return;
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close", path_, errno);
  }
  std::uint64_t size() const override { return size_; }

 private:
  // Drops the clean pages of [offset, offset + n) from the page cache. A hint: it neither fails
  // in a way that loses data nor consumes a write-back error (a later fsync still reports it).
  void drop(std::uint64_t offset, std::uint64_t n) {
    ::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
  }
  static constexpr std::uint64_t kReleaseUnit = std::uint64_t{8} << 20;
  static constexpr int kStartedPerCall = 4;

  std::string path_;
  int fd_;
  std::uint64_t size_ = 0;
  std::uint64_t started_ = 0;  // write-back started for [0, started_)
  std::uint64_t dropped_ = 0;  // [0, dropped_) dropped from the page cache, but for pages not yet clean then
  std::uint64_t swept_ = 0;    // [0, swept_) dropped after an fsync: all of it
  bool release_ = true;        // false: sync_file_range is not supported here
};

class PosixFileSystem final : public FileSystem {
 public:
  std::unique_ptr<ReadableFile> open(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open", path, errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      fail("stat", path, err);
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      fail("read", path, EISDIR);
    }
    return std::make_unique<PosixReadableFile>(path, fd, static_cast<std::uint64_t>(st.st_size));
  }
  std::unique_ptr<WritableFile> create(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("create", path, errno);
    return std::make_unique<PosixFile>(path, fd);
  }
  void rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) fail("rename to '" + to + "' from", from, errno);
  }
  void sync_directory(const std::string& directory) override {
    const int fd = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fail("open directory", directory, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) fail("fsync directory", directory, err);
  }
  void remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) fail("remove", path, errno);
  }
};

}  // namespace

IoError::IoError(std::string operation, std::string path, int os_error)
    : IoError(std::move(operation), std::move(path), std::string(std::strerror(os_error))) {
  os_error_ = os_error;
}

IoError::IoError(std::string operation, std::string path, std::string reason)
    : Error("cannot " + operation + " '" + path + "': " + reason), path_(std::move(path)), reason_(std::move(reason)) {}

FileSystem& posix_file_system() {
  static PosixFileSystem fs;
  return fs;
}

void remove_tree(const std::string& path) noexcept {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (!S_ISDIR(st.st_mode)) {
    ::unlink(path.c_str());
    return;
  }
  std::vector<std::string> inside;
  if (DIR* d = ::opendir(path.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") inside.push_back(path + "/" + name);
    }
    ::closedir(d);
  }
  for (const std::string& p : inside) remove_tree(p);
  ::rmdir(path.c_str());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("open", path, errno);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace retrace::io
