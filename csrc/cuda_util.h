// Small helpers shared by the CUDA translation units (CUDA runtime only).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace psrl::kv {

// Throws std::runtime_error("<what>: <CUDA error string>") on failure and
// clears the (non-sticky) error so later calls do not report it again.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) {
      cudaSetDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace psrl::kv
