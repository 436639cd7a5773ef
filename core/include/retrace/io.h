#pragma once
// The file layer under the trace writer. Everything the writer does to the disk goes through
// FileSystem, so that tests can substitute one that fails the Nth write, fsync or rename, makes
// short writes, or drops unsynced data (LevelDB's fault-injecting Env is the model).

#include <retrace/error.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace retrace::io {

// A failed file operation: what was done, on which path, and the OS's reason (errno and its
// text). what() is "cannot OPERATION 'PATH': REASON".
class IoError : public Error {
 public:
  IoError(std::string operation, std::string path, int os_error);
  IoError(std::string operation, std::string path, std::string reason);  // no errno (e.g. a short file)
  const std::string& path() const noexcept { return path_; }
  const std::string& reason() const noexcept { return reason_; }
  int os_error() const noexcept { return os_error_; }  // 0 when there is none

 private:
  std::string path_, reason_;
  int os_error_ = 0;
};

// An open file read at offsets. read_at may be called from several threads at once.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads exactly n bytes at `offset` (retrying short reads), or throws IoError: the OS's error,
  // or "unexpected end of file" where the file holds fewer bytes.
  virtual void read_at(std::uint64_t offset, void* out, std::size_t n) const = 0;
  // The size when opened.
  virtual std::uint64_t size() const = 0;
};

// Bytes somewhere in memory.
struct ConstBytes {
  const void* data = nullptr;
  std::size_t size = 0;
};

// An open file written front to back. Methods throw IoError on failure.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all n bytes (retrying short writes).
  virtual void append(const void* data, std::size_t n) = 0;
  // Writes the pieces one after the other, as append() of each does (the POSIX file: in one
  // writev() per IOV_MAX pieces, retrying short writes).
  virtual void append_all(const std::vector<ConstBytes>& pieces) {
    for (const ConstBytes& p : pieces) append(p.data, p.size);
  }
  // Data and metadata durable on return (fsync).
  virtual void sync() = 0;
  // A hint: the bytes before `offset` will not be read back soon. The POSIX file (Linux only)
  // starts the write-back of what it has written in 8 MiB units, at most 32 MiB a call
  // (sync_file_range), and drops the units before `offset` whose write-back it started in an
  // earlier call from the page cache (posix_fadvise(DONTNEED)); pages not yet clean then get one
  // more try two units later and go at the next sync(). A backlog of units not yet started
  // longer than the window and one call's four (a record much longer than the window) is left to
  // the kernel and goes at the next sync(). It does not wait for the write-back
  // (starting one may block while the disk's queue is full), and consumes no write-back error: a
  // later sync() reports it. Throws IoError when the write-back cannot be started; where
  // sync_file_range is not supported it does nothing. The default does nothing.
  virtual void release_before(std::uint64_t offset) { (void)offset; }
  virtual void close() = 0;
  virtual std::uint64_t size() const = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Opens an existing file for reading; IoError when it cannot (a directory: os_error EISDIR).
  virtual std::unique_ptr<ReadableFile> open(const std::string& path) = 0;
  // Creates or truncates.
  virtual std::unique_ptr<WritableFile> create(const std::string& path) = 0;
  // Atomic replace (rename(2)).
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // Makes a rename in `directory` durable (fsync of the directory).
  virtual void sync_directory(const std::string& directory) = 0;
  virtual void remove(const std::string& path) = 0;
};

// The real POSIX file system. Thread-safe; the returned files are not.
FileSystem& posix_file_system();

// The whole file, or retrace::Error naming the path.
std::string read_file(const std::string& path);

// Removes `path` and, for a folder, everything in it, as far as it can (errors are ignored: for
// cleaning up temporary files). Entry by entry with unlink(2) and rmdir(2), never
// std::filesystem::remove_all: libtorch.so exports its own copy of it, which crashes when called.
void remove_tree(const std::string& path) noexcept;

}  // namespace retrace::io
