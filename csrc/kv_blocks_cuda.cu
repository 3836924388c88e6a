#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_blocks_cuda.cuh"

namespace psrl::kv {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGridBlocks = 65535;  // a grid-stride loop covers the rest

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

// Restores the caller's current device on scope exit.
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

struct KernelArgs {
  const uintptr_t* layer_ptrs;  // device array [num_layers]
  const int64_t* block_ids;     // device array [num_ids]
  int64_t num_ids;
  int64_t num_units;            // num_layers * 2 * num_ids
  int64_t kv_stride_bytes;
  int64_t block_stride_bytes;
  int64_t vecs_per_unit;        // block_bytes / sizeof(VecT)
  char* buffer;
};

// One CUDA block per (layer, kv, block) unit; threads stride over the unit's
// vectors. VecT is the widest type every address and size is aligned to.
template <typename VecT, bool kGather>
__global__ void copy_blocks_kernel(const KernelArgs args) {
  for (int64_t unit = blockIdx.x; unit < args.num_units; unit += gridDim.x) {
    const int64_t id_index = unit % args.num_ids;
    const int64_t layer_kv = unit / args.num_ids;
    const int64_t layer = layer_kv >> 1;
    const int64_t kv = layer_kv & 1;
    char* cache = reinterpret_cast<char*>(args.layer_ptrs[layer]) + kv * args.kv_stride_bytes +
                  args.block_ids[id_index] * args.block_stride_bytes;
    char* buffer = args.buffer + unit * args.vecs_per_unit * static_cast<int64_t>(sizeof(VecT));
    VecT* __restrict__ dst = reinterpret_cast<VecT*>(kGather ? buffer : cache);
    const VecT* __restrict__ src = reinterpret_cast<const VecT*>(kGather ? cache : buffer);
    // Issue kUnroll loads before their stores so each thread keeps several in flight.
    const int64_t step = blockDim.x;
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * step < args.vecs_per_unit; i += kUnroll * step) {
      VecT staged[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        staged[u] = src[i + u * step];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        dst[i + u * step] = staged[u];
      }
    }
    for (; i < args.vecs_per_unit; i += step) {
      dst[i] = src[i];
    }
  }
}

template <typename VecT>
void launch(const KernelArgs& args, CopyDirection direction, cudaStream_t stream) {
  const int64_t grid = args.num_units < kMaxGridBlocks ? args.num_units : kMaxGridBlocks;
  int64_t threads = args.vecs_per_unit < kThreadsPerBlock ? args.vecs_per_unit : kThreadsPerBlock;
  threads = ((threads + 31) / 32) * 32;  // whole warps
  if (direction == CopyDirection::kGather) {
    copy_blocks_kernel<VecT, true><<<static_cast<unsigned>(grid), static_cast<unsigned>(threads), 0, stream>>>(args);
  } else {
    copy_blocks_kernel<VecT, false><<<static_cast<unsigned>(grid), static_cast<unsigned>(threads), 0, stream>>>(args);
  }
}

// Largest power of two <= 16 dividing every address and size the kernel touches.
size_t common_alignment(const CopyPlan& plan) {
  uint64_t bits = plan.buffer | static_cast<uint64_t>(plan.layout.block_bytes()) |
                  static_cast<uint64_t>(plan.layout.kv_stride_bytes()) |
                  static_cast<uint64_t>(plan.layout.block_stride_bytes());
  for (uintptr_t p : plan.layer_ptrs) {
    bits |= p;
  }
  size_t align = 16;
  while (align > 1 && (bits & (align - 1)) != 0) {
    align >>= 1;
  }
  return align;
}

}  // namespace

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return count;
}

void copy_blocks_cuda(const CopyPlan& plan, CopyDirection direction, int device, uintptr_t stream_handle) {
  const int64_t num_units = static_cast<int64_t>(plan.num_units());
  if (num_units == 0) {
    return;
  }
  DeviceGuard guard(device);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);

  // Layer pointers and ids travel in one stream-ordered allocation; a
  // cudaMemcpyAsync from pageable memory is staged before it returns, so the
  // host vector may die right after, and nothing here waits for the device.
  const size_t num_layers = plan.layer_ptrs.size();
  const size_t num_ids = plan.block_ids.size();
  std::vector<int64_t> host_args(num_layers + num_ids);
  std::memcpy(host_args.data(), plan.layer_ptrs.data(), num_layers * sizeof(int64_t));
  std::memcpy(host_args.data() + num_layers, plan.block_ids.data(), num_ids * sizeof(int64_t));
  const size_t args_bytes = host_args.size() * sizeof(int64_t);
  void* device_args = nullptr;
  check_cuda(cudaMallocAsync(&device_args, args_bytes, stream), "cudaMallocAsync");
  cudaError_t err = cudaMemcpyAsync(device_args, host_args.data(), args_bytes, cudaMemcpyHostToDevice, stream);

  if (err == cudaSuccess) {
    KernelArgs args;
    args.layer_ptrs = static_cast<const uintptr_t*>(device_args);
    args.block_ids = static_cast<const int64_t*>(device_args) + num_layers;
    args.num_ids = static_cast<int64_t>(num_ids);
    args.num_units = num_units;
    args.kv_stride_bytes = plan.layout.kv_stride_bytes();
    args.block_stride_bytes = plan.layout.block_stride_bytes();
    args.buffer = reinterpret_cast<char*>(plan.buffer);
    const size_t align = common_alignment(plan);
    args.vecs_per_unit = static_cast<int64_t>(plan.layout.block_bytes() / align);
    switch (align) {
      case 16: launch<int4>(args, direction, stream); break;
      case 8: launch<int2>(args, direction, stream); break;
      case 4: launch<int>(args, direction, stream); break;
      case 2: launch<short>(args, direction, stream); break;
      default: launch<char>(args, direction, stream); break;
    }
    err = cudaGetLastError();
  }
  const cudaError_t free_err = cudaFreeAsync(device_args, stream);
  check_cuda(err, direction == CopyDirection::kGather ? "gather_blocks kernel" : "scatter_blocks kernel");
  check_cuda(free_err, "cudaFreeAsync");
}

}  // namespace psrl::kv
