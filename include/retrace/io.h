#pragma once
// The file layer under the trace writer. Everything the writer does to the disk goes through
// FileSystem, so that tests can substitute one that fails the Nth write, fsync or rename, makes
// short writes, or drops unsynced data (LevelDB's fault-injecting Env is the model).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace retrace::io {

// An open file written front to back. Methods throw retrace::Error (naming the path and the OS
// error) on failure.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all n bytes (retrying short writes).
  virtual void append(const void* data, std::size_t n) = 0;
  // Data and metadata durable on return (fsync).
  virtual void sync() = 0;
  virtual void close() = 0;
  virtual std::uint64_t size() const = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
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

}  // namespace retrace::io
