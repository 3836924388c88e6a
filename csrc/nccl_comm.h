// A point-to-point NCCL communicator for moving KV buffers between replicas on
// different nodes. NCCL itself is dlopen'ed (nccl_loader.h); only compiled
// when PSRL_WITH_CUDA is set, since a communicator is bound to a CUDA device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nccl_loader.h"

namespace psrl::kv {

class NcclCommunicator {
 public:
  // ncclCommInitRank with `device` current; blocks until all `world_size`
  // ranks have joined with the same unique id (128 bytes from get_unique_id).
  NcclCommunicator(const std::string& unique_id, int world_size, int rank, int device,
                   const std::vector<std::string>& library_candidates);
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator();  // destroy()

  // Enqueue ncclSend / ncclRecv of nbytes raw bytes on `stream`; no host wait.
  void send(uintptr_t ptr, size_t nbytes, int peer, uintptr_t stream);
  void recv(uintptr_t ptr, size_t nbytes, int peer, uintptr_t stream);
  void group_start();
  void group_end();
  // ncclCommGetAsyncError; 0 when fine or not supported by the loaded NCCL.
  std::string error_string(int code) const;
  // ncclCommDestroy (abort=false) or ncclCommAbort; idempotent.
  void destroy(bool abort = false);

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  int device() const noexcept { return device_; }
  bool closed() const noexcept { return comm_ == nullptr; }
  const std::string& library_path() const noexcept { return api_->path; }
  int nccl_version() const noexcept { return api_->version; }

 private:
  nccl::Comm require_comm() const;
  void check_peer(int peer) const;

  const nccl::Api* api_ = nullptr;
  nccl::Comm comm_ = nullptr;
  int world_size_ = 0;
  int rank_ = 0;
  int device_ = 0;
};

}  // namespace psrl::kv
