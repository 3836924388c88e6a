#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <stdexcept>
#include <utility>

namespace psrl::kv {
namespace {

constexpr size_t kMaxNameLength = 255;  // NAME_MAX, including the leading '/'

[[noreturn]] void throw_errno(int err, const std::string& what, const std::string& name) {
  throw ShmError(err, what, name);
}

void* map(int fd, size_t size, bool readonly, const std::string& name) {
  if (size == 0) {
    return nullptr;  // mmap rejects length 0; an empty segment has no bytes to address
  }
  const int prot = readonly ? PROT_READ : PROT_READ | PROT_WRITE;
  // MAP_POPULATE: fill the page tables now, in one call, rather than by a fault per page during the first copy
  // (segments are kept mapped between transfers: the copies after the first touch no new page).
  void* data = ::mmap(nullptr, size, prot, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    throw_errno(errno, "mmap of shared memory segment", name);
  }
  return data;
}

}  // namespace

std::string ShmSegment::normalize_name(const std::string& name) {
  std::string out = !name.empty() && name[0] == '/' ? name : "/" + name;
  if (out.size() < 2) {
    throw std::invalid_argument("shared memory name is empty");
  }
  if (out.size() > kMaxNameLength) {
    throw std::invalid_argument("shared memory name is longer than " + std::to_string(kMaxNameLength) +
                                " characters");
  }
  if (out.find('/', 1) != std::string::npos || out.find('\0') != std::string::npos) {
    throw std::invalid_argument("shared memory name '" + name + "' may not contain '/' (after the first) or NUL");
  }
  return out;
}

ShmSegment ShmSegment::create(const std::string& raw_name, size_t size) {
  const std::string name = normalize_name(raw_name);
  if (size > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    throw std::invalid_argument("shared memory size " + std::to_string(size) + " is too large");
  }
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw_errno(errno, "cannot create shared memory segment", name);
  }
  try {
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      throw_errno(errno, "cannot size shared memory segment to " + std::to_string(size) + " bytes", name);
    }
    // Reserve the pages now: on a full tmpfs a write to an unbacked page is a SIGBUS that kills the process,
    // while this fails cleanly (ENOSPC) and the caller falls back.
    if (size > 0) {
      const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
      if (rc != 0) {
        throw_errno(rc, "cannot reserve " + std::to_string(size) + " bytes for shared memory segment", name);
      }
    }
    void* data = map(fd, size, false, name);
    return ShmSegment(name, fd, data, size, false, true);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(name.c_str());  // ours (O_EXCL): never leave a half-made segment behind
    throw;
  }
}

ShmSegment ShmSegment::open(const std::string& raw_name, bool readonly) {
  const std::string name = normalize_name(raw_name);
  const int fd = ::shm_open(name.c_str(), (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC, 0);
  if (fd < 0) {
    throw_errno(errno, "cannot open shared memory segment", name);
  }
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      throw_errno(errno, "cannot stat shared memory segment", name);
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* data = map(fd, size, readonly, name);
    return ShmSegment(name, fd, data, size, readonly, false);
  } catch (...) {
    ::close(fd);
    throw;
  }
}

bool ShmSegment::unlink_name(const std::string& raw_name) {
  const std::string name = normalize_name(raw_name);
  if (::shm_unlink(name.c_str()) == 0) {
    return true;
  }
  if (errno == ENOENT) {
    return false;
  }
  throw_errno(errno, "cannot unlink shared memory segment", name);
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      readonly_(other.readonly_),
      created_(other.created_),
      unlinked_(other.unlinked_) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    close();
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    readonly_ = other.readonly_;
    created_ = other.created_;
    unlinked_ = other.unlinked_;
  }
  return *this;
}

ShmSegment::~ShmSegment() { close(); }

bool ShmSegment::unlink() {
  if (unlinked_ || name_.empty()) {
    return false;
  }
  const bool removed = unlink_name(name_);
  unlinked_ = true;
  return removed;
}

bool ShmSegment::linked() const noexcept {
  struct stat st {};
  return fd_ >= 0 && ::fstat(fd_, &st) == 0 && st.st_nlink > 0;
}

void ShmSegment::close() noexcept {
  if (data_ != nullptr) {
    ::munmap(data_, size_);
    data_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace psrl::kv
