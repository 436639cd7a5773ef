#pragma once
// Test support for the trace reader's file layer: the POSIX file system with a hook called before
// every read (TraceReader reads through ReaderOptions::fs). The hook may count the bytes, or throw
// an io::IoError to fail that read.

#include <retrace/io.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace retrace {

class WatchedReads : public io::FileSystem {
 public:
  // Called with each read's offset and size before the read.
  using Hook = std::function<void(std::uint64_t offset, std::size_t n)>;
  explicit WatchedReads(Hook hook) : hook_(std::move(hook)) {}

  std::unique_ptr<io::ReadableFile> open(const std::string& path) override {
    struct File : io::ReadableFile {
      const Hook* hook;
      std::unique_ptr<io::ReadableFile> f;
      void read_at(std::uint64_t offset, void* out, std::size_t n) const override {
        (*hook)(offset, n);
        f->read_at(offset, out, n);
      }
      std::uint64_t size() const override { return f->size(); }
    };
    auto file = std::make_unique<File>();
    file->hook = &hook_;
    file->f = io::posix_file_system().open(path);
    return file;
  }
  std::unique_ptr<io::WritableFile> create(const std::string& p) override { return io::posix_file_system().create(p); }
  void rename(const std::string& a, const std::string& b) override { io::posix_file_system().rename(a, b); }
  void sync_directory(const std::string& d) override { io::posix_file_system().sync_directory(d); }
  void remove(const std::string& p) override { io::posix_file_system().remove(p); }

 private:
  Hook hook_;
};

}  // namespace retrace
