#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_util.h"
#include "kv_blocks_cuda.cuh"

namespace psrl::kv {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGridBlocks = 65535;  // a grid-stride loop covers the rest

struct KernelArgs {
  const uintptr_t* layer_ptrs;  // device array [num_layers]
  const int64_t* block_ids;     // device array [num_ids]
  int64_t num_ids;
  int64_t num_units;            // num_layers * 2 * num_ids
  int64_t kv_stride_bytes;
  int64_t block_stride_bytes;
  int64_t token_stride_bytes;   // strided path only
  int64_t head_stride_bytes;    // strided path only
  int vecs_per_unit;            // block_bytes / sizeof(VecT)
  int vecs_last_unit;           // vectors of the last id's (maybe partial) block
  int vecs_per_row;             // head_size * itemsize / sizeof(VecT)
  int num_kv_heads;
  char* buffer;
};

// One CUDA block per (layer, kv, block) unit, all layers in one launch; threads
// stride over the unit's vectors. VecT is the widest type (up to 16 bytes)
// every address, stride and size is aligned to. kContiguous: the cache block
// is laid out like the buffer block (NHD), so the copy is linear; otherwise
// (HND, ...) each vector's token and head are derived from its buffer index.
template <typename VecT, bool kGather, bool kContiguous>
__global__ void copy_blocks_kernel(const KernelArgs args) {
  for (int64_t unit = blockIdx.x; unit < args.num_units; unit += gridDim.x) {
    const int64_t id_index = unit % args.num_ids;
    const int64_t layer_kv = unit / args.num_ids;
    const int64_t layer = layer_kv >> 1;
    const int64_t kv = layer_kv & 1;
    char* cache = reinterpret_cast<char*>(args.layer_ptrs[layer]) + kv * args.kv_stride_bytes +
                  args.block_ids[id_index] * args.block_stride_bytes;
    VecT* buffer = reinterpret_cast<VecT*>(args.buffer) + unit * args.vecs_per_unit;
    const int vecs = id_index + 1 == args.num_ids ? args.vecs_last_unit : args.vecs_per_unit;
    const int step = blockDim.x;
    int i = threadIdx.x;
    if constexpr (kContiguous) {
      VecT* __restrict__ dst = kGather ? buffer : reinterpret_cast<VecT*>(cache);
      const VecT* __restrict__ src = kGather ? reinterpret_cast<const VecT*>(cache) : buffer;
      // Issue kUnroll loads before their stores so each thread keeps several in flight.
      for (; i + (kUnroll - 1) * step < vecs; i += kUnroll * step) {
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
      for (; i < vecs; i += step) {
        dst[i] = src[i];
      }
    } else {
      for (; i < vecs; i += step) {
        const int row = i / args.vecs_per_row;  // token * num_kv_heads + head
        const int col = i - row * args.vecs_per_row;
        const int token = row / args.num_kv_heads;
        const int head = row - token * args.num_kv_heads;
        VecT* cache_vec = reinterpret_cast<VecT*>(cache + token * args.token_stride_bytes +
                                                  head * args.head_stride_bytes) + col;
        if (kGather) {
          buffer[i] = *cache_vec;
        } else {
          *cache_vec = buffer[i];
        }
      }
    }
    if (kGather) {  // a partial last block: zero the rest of its buffer slot
      for (i = vecs + threadIdx.x; i < args.vecs_per_unit; i += step) {
        buffer[i] = VecT{};
      }
    }
  }
}

template <typename VecT, bool kGather>
void launch_direction(const KernelArgs& args, bool contiguous, cudaStream_t stream) {
  const int64_t grid = args.num_units < kMaxGridBlocks ? args.num_units : kMaxGridBlocks;
  int threads = args.vecs_per_unit < kThreadsPerBlock ? args.vecs_per_unit : kThreadsPerBlock;
  threads = ((threads + 31) / 32) * 32;  // whole warps
  const dim3 grid_dim(static_cast<unsigned>(grid));
  const dim3 block_dim(static_cast<unsigned>(threads));
  if (contiguous) {
    copy_blocks_kernel<VecT, kGather, true><<<grid_dim, block_dim, 0, stream>>>(args);
  } else {
    copy_blocks_kernel<VecT, kGather, false><<<grid_dim, block_dim, 0, stream>>>(args);
  }
}

template <typename VecT>
void launch(KernelArgs args, const PagedCacheLayout& layout, int64_t last_block_tokens, CopyDirection direction,
            cudaStream_t stream) {
  const int64_t vec = static_cast<int64_t>(sizeof(VecT));
  args.vecs_per_unit = static_cast<int>(static_cast<int64_t>(layout.block_bytes()) / vec);
  args.vecs_last_unit = static_cast<int>(last_block_tokens * static_cast<int64_t>(layout.token_bytes()) / vec);
  args.vecs_per_row = static_cast<int>(static_cast<int64_t>(layout.row_bytes()) / vec);
  const bool contiguous = layout.block_is_contiguous();
  if (direction == CopyDirection::kGather) {
    launch_direction<VecT, true>(args, contiguous, stream);
  } else {
    launch_direction<VecT, false>(args, contiguous, stream);
  }
}

// Largest power of two <= 16 dividing every address, stride and size the kernel touches.
size_t common_alignment(const CopyPlan& plan) {
  const PagedCacheLayout& layout = plan.layout;
  uint64_t bits = plan.buffer | static_cast<uint64_t>(layout.block_bytes()) |
                  static_cast<uint64_t>(layout.kv_stride_bytes()) |
                  static_cast<uint64_t>(layout.block_stride_bytes());
  if (plan.partial_last_block()) {
    bits |= static_cast<uint64_t>(layout.token_bytes());
  }
  if (!layout.block_is_contiguous()) {
    bits |= static_cast<uint64_t>(layout.row_bytes()) | static_cast<uint64_t>(layout.token_stride_bytes()) |
            static_cast<uint64_t>(layout.head_stride_bytes());
  }
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
  if (plan.layout.block_bytes() > static_cast<size_t>(INT32_MAX)) {
    throw std::invalid_argument("a block of one layer is over 2 GiB: not supported by the CUDA path");
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
    const PagedCacheLayout& layout = plan.layout;
    KernelArgs args{};
    args.layer_ptrs = static_cast<const uintptr_t*>(device_args);
    args.block_ids = static_cast<const int64_t*>(device_args) + num_layers;
    args.num_ids = static_cast<int64_t>(num_ids);
    args.num_units = num_units;
    args.kv_stride_bytes = layout.kv_stride_bytes();
    args.block_stride_bytes = layout.block_stride_bytes();
    args.token_stride_bytes = layout.token_stride_bytes();
    args.head_stride_bytes = layout.head_stride_bytes();
    args.num_kv_heads = static_cast<int>(layout.num_kv_heads);
    args.buffer = reinterpret_cast<char*>(plan.buffer);
    const int64_t last = plan.last_block_tokens;
    switch (common_alignment(plan)) {
      case 16: launch<int4>(args, layout, last, direction, stream); break;
      case 8: launch<int2>(args, layout, last, direction, stream); break;
      case 4: launch<int>(args, layout, last, direction, stream); break;
      case 2: launch<short>(args, layout, last, direction, stream); break;
      default: launch<char>(args, layout, last, direction, stream); break;
    }
    err = cudaGetLastError();
  }
  const cudaError_t free_err = cudaFreeAsync(device_args, stream);
  check_cuda(err, direction == CopyDirection::kGather ? "gather_blocks kernel" : "scatter_blocks kernel");
  check_cuda(free_err, "cudaFreeAsync");
}

}  // namespace psrl::kv
