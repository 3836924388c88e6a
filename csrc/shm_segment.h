// A POSIX shared-memory segment (shm_open + mmap) with RAII ownership of the
// mapping and the descriptor. Two processes exchange KV blocks through one:
// the source creates it and gathers straight into the mapping, the peer opens
// it by name and scatters straight out of it, so no byte is copied twice.
//
// Errors are ShmError (a std::system_error carrying errno and the name), which
// the binding turns into OSError, hence FileNotFoundError / FileExistsError /
// PermissionError in Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>

namespace psrl::kv {

class ShmError : public std::system_error {
 public:
  ShmError(int err, std::string action, std::string name)
      : std::system_error(err, std::generic_category(), action + " '" + name + "'"),
        action_(std::move(action)),
        name_(std::move(name)) {}
  // What failed ("cannot open shared memory segment"), without errno text or name.
  const std::string& action() const noexcept { return action_; }
  const std::string& name() const noexcept { return name_; }

 private:
  std::string action_;
  std::string name_;
};

class ShmSegment {
 public:
  // Creates a new segment of `size` bytes (fails with EEXIST if the name is
  // taken: O_CREAT | O_EXCL) readable and writable by this user only (0600).
  // A name is "/" + up to 254 characters without "/"; the leading "/" may be
  // left out. The memory reads as zeros.
  static ShmSegment create(const std::string& name, size_t size);
  // Maps an existing segment, its whole size (fstat).
  static ShmSegment open(const std::string& name, bool readonly = false);
  // shm_unlink by name; false if there was no such segment.
  static bool unlink_name(const std::string& name);
  // "/name" for "name" or "/name"; throws std::invalid_argument on a bad name.
  static std::string normalize_name(const std::string& name);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // close(), never unlink: the creator unlinks explicitly

  // Removes the name (existing mappings stay valid); false if already gone.
  bool unlink();
  // Unmaps and closes; idempotent.
  void close() noexcept;

  const std::string& name() const noexcept { return name_; }
  size_t size() const noexcept { return size_; }
  void* data() const noexcept { return data_; }
  uintptr_t address() const noexcept { return reinterpret_cast<uintptr_t>(data_); }
  bool readonly() const noexcept { return readonly_; }
  bool created() const noexcept { return created_; }
  bool is_open() const noexcept { return fd_ >= 0; }
  bool unlinked() const noexcept { return unlinked_; }
  // Whether the segment still has a name, whoever removed it (fstat's link count; false once closed).
  bool linked() const noexcept;

 private:
  ShmSegment(std::string name, int fd, void* data, size_t size, bool readonly, bool created)
      : name_(std::move(name)), fd_(fd), data_(data), size_(size), readonly_(readonly), created_(created) {}

  std::string name_;
  int fd_ = -1;
  void* data_ = nullptr;  // nullptr for a zero-byte segment (nothing to map)
  size_t size_ = 0;
  bool readonly_ = false;
  bool created_ = false;
  bool unlinked_ = false;
};

}  // namespace psrl::kv
