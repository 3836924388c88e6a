// NCCL loaded at run time with dlopen: the build never needs NCCL, and the
// module imports on machines without it. Only the handful of entry points the
// KV send/recv channel uses are resolved, by name, with NCCL 2.x's stable ABI
// declared here (no nccl.h needed).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace psrl::kv::nccl {

using Result = int;  // ncclResult_t; 0 = ncclSuccess
constexpr Result kSuccess = 0;
constexpr int kUint8 = 1;  // ncclUint8, the datatype byte-level send/recv use
constexpr size_t kUniqueIdBytes = 128;

struct UniqueId {  // ncclUniqueId
  char internal[kUniqueIdBytes];
};
using Comm = struct OpaqueComm*;  // ncclComm_t
using Stream = void*;             // cudaStream_t

struct Api {
  std::string path;  // what dlopen loaded
  int version = 0;   // ncclGetVersion, 0 if unknown
  Result (*get_unique_id)(UniqueId*) = nullptr;
  Result (*comm_init_rank)(Comm*, int, UniqueId, int) = nullptr;
  Result (*send)(const void*, size_t, int, int, Comm, Stream) = nullptr;
  Result (*recv)(void*, size_t, int, int, Comm, Stream) = nullptr;
  Result (*group_start)() = nullptr;
  Result (*group_end)() = nullptr;
  Result (*comm_destroy)(Comm) = nullptr;
  Result (*comm_abort)(Comm) = nullptr;             // optional
  const char* (*get_error_string)(Result) = nullptr;
};

// No loadable NCCL library (or one without the needed symbols).
class NcclUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An NCCL call returned an error.
class NcclError : public std::runtime_error {
 public:
  NcclError(Result code, const std::string& what) : std::runtime_error(what), code_(code) {}
  Result code() const noexcept { return code_; }

 private:
  Result code_;
};

// Loads NCCL once per process: tries each candidate path in order, then
// "libnccl.so.2" through the default loader path. The first success is kept
// (never unloaded); a failure is not cached, so a later call may pass other
// candidates. Throws NcclUnavailable listing every attempt.
const Api& load(const std::vector<std::string>& candidates);

// The loaded API, or nullptr if load() has not succeeded yet.
const Api* loaded() noexcept;

// Throws NcclError("<what>: <ncclGetErrorString>") unless result is success.
void check(const Api& api, Result result, const char* what);

// ncclGetUniqueId as 128 raw bytes, to hand to every rank out of band.
std::string get_unique_id(const std::vector<std::string>& candidates);

}  // namespace psrl::kv::nccl
