#pragma once
// Little-endian byte writing and bounds-checked reading, for serialized state that may come from
// an untrusted file. ByteReader checks every length against what is left before it reads or
// allocates, and names the byte offset in its errors.

#include <retrace/error.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace retrace::detail {

// 16 lowercase hex digits of `value`, zero-padded, appended to `out` (a digest's halves, a
// stored tensor's checksum).
inline void append_hex(std::string& out, std::uint64_t value) {
  static constexpr char kHex[] = "0123456789abcdef";
  char buf[16];
  for (int i = 15; i >= 0; --i, value >>= 4) buf[i] = kHex[value & 0xf];
  out.append(buf, sizeof buf);
}

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));  // little-endian hosts only (x86-64, arm64)
  }
  void put_bytes(const void* data, std::size_t size) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + size);
  }
  std::vector<std::uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<std::uint8_t> bytes_;
};

class ByteReader {
 public:
  // `what` names the thing being parsed in errors, e.g. "RNG state".
  ByteReader(const std::uint8_t* data, std::size_t size, std::string what)
      : data_(data), size_(size), what_(std::move(what)) {}

  template <typename T>
  T get(const char* field) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), field);
    T value;
    std::memcpy(&value, data_ + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  std::vector<std::uint8_t> get_bytes(std::size_t n, const char* field) {
    need(n, field);
    std::vector<std::uint8_t> out(data_ + offset_, data_ + offset_ + n);
    offset_ += n;
    return out;
  }
  std::size_t offset() const { return offset_; }
  std::size_t remaining() const { return size_ - offset_; }
  [[noreturn]] void fail(const std::string& message) const { fail_at(offset_, message); }
  // For a field already read: names where it starts.
  [[noreturn]] void fail_at(std::size_t offset, const std::string& message) const {
    throw Error(what_ + ": " + message + " at byte offset " + std::to_string(offset));
  }

 private:
  void need(std::size_t n, const char* field) const {
    if (n > size_ - offset_) {
      fail(std::string("truncated ") + field + " (needs " + std::to_string(n) + " bytes, " +
           std::to_string(size_ - offset_) + " left)");
    }
  }
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t offset_ = 0;
  std::string what_;
};

}  // namespace retrace::detail
