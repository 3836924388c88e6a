#include "nccl_comm.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <stdexcept>

#include "cuda_util.h"

namespace psrl::kv {

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int world_size, int rank, int device,
                                   const std::vector<std::string>& library_candidates)
    : world_size_(world_size), rank_(rank), device_(device) {
  if (unique_id.size() != nccl::kUniqueIdBytes) {
    throw std::invalid_argument("an NCCL unique id is " + std::to_string(nccl::kUniqueIdBytes) + " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("need 0 <= rank < world_size, got rank " + std::to_string(rank) +
                                " of world_size " + std::to_string(world_size));
  }
  api_ = &nccl::load(library_candidates);
  nccl::UniqueId id{};
  std::memcpy(id.internal, unique_id.data(), nccl::kUniqueIdBytes);
  DeviceGuard guard(device);
  nccl::Comm comm = nullptr;
  nccl::check(*api_, api_->comm_init_rank(&comm, world_size, id, rank), "ncclCommInitRank");
  comm_ = comm;
}

NcclCommunicator::~NcclCommunicator() {
  try {
    destroy(false);
  } catch (...) {  // destructors never throw; the communicator is gone either way
  }
}

nccl::Comm NcclCommunicator::require_comm() const {
  if (comm_ == nullptr) {
    throw std::invalid_argument("the NCCL communicator is closed");
  }
  return comm_;
}

void NcclCommunicator::check_peer(int peer) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_) {
    throw std::invalid_argument("peer " + std::to_string(peer) + " is not another rank of " +
                                std::to_string(world_size_) + " (this is rank " + std::to_string(rank_) + ")");
  }
}

void NcclCommunicator::send(uintptr_t ptr, size_t nbytes, int peer, uintptr_t stream) {
  nccl::Comm comm = require_comm();
  check_peer(peer);
  if (ptr == 0 && nbytes > 0) {
    throw std::invalid_argument("send: null pointer");
  }
  DeviceGuard guard(device_);
  nccl::check(*api_,
              api_->send(reinterpret_cast<const void*>(ptr), nbytes, nccl::kUint8, peer, comm,
                         reinterpret_cast<nccl::Stream>(stream)),
              "ncclSend");
}

void NcclCommunicator::recv(uintptr_t ptr, size_t nbytes, int peer, uintptr_t stream) {
  nccl::Comm comm = require_comm();
  check_peer(peer);
  if (ptr == 0 && nbytes > 0) {
    throw std::invalid_argument("recv: null pointer");
  }
  DeviceGuard guard(device_);
  nccl::check(*api_,
              api_->recv(reinterpret_cast<void*>(ptr), nbytes, nccl::kUint8, peer, comm,
                         reinterpret_cast<nccl::Stream>(stream)),
              "ncclRecv");
}

void NcclCommunicator::group_start() { nccl::check(*api_, api_->group_start(), "ncclGroupStart"); }

void NcclCommunicator::group_end() {
  DeviceGuard guard(device_);
  nccl::check(*api_, api_->group_end(), "ncclGroupEnd");
}

std::string NcclCommunicator::error_string(int code) const {
  const char* text = api_->get_error_string(code);
  return text != nullptr ? text : "unknown NCCL error";
}

void NcclCommunicator::destroy(bool abort) {
  if (comm_ == nullptr) {
    return;
  }
  nccl::Comm comm = comm_;
  comm_ = nullptr;
  DeviceGuard guard(device_);
  if (abort && api_->comm_abort != nullptr) {
    nccl::check(*api_, api_->comm_abort(comm), "ncclCommAbort");
  } else {
    nccl::check(*api_, api_->comm_destroy(comm), "ncclCommDestroy");
  }
}

}  // namespace psrl::kv
