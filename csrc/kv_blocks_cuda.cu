#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "kv_blocks_cuda.cuh"

namespace psrl::kv {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGridBlocks = 65535;  // a grid-stride loop covers the rest

// The pointer table (layer pointers, then the block ids of one launch) travels
// in the kernel's parameters: nothing is allocated or copied per copy, and
// nothing waits for the device. Parameters up to 32764 bytes need sm_70 and
// CUDA 12.1; a transfer with more ids than fit is split over several launches.
constexpr int64_t kTableWords = 4000;

struct KernelArgs {
  int64_t table[kTableWords];  // [num_layers] layer pointers, then [launch_ids] block ids
  int64_t num_layers;
  int64_t launch_ids;          // block ids in this launch
  int64_t first_id;            // index in the transfer of this launch's first id
  int64_t num_ids;             // block ids in the whole transfer (the buffer's third dim)
  int64_t num_units;           // num_layers * 2 * launch_ids
  int64_t kv_stride_bytes;
  int64_t block_stride_bytes;
  int64_t token_stride_bytes;  // strided path only
  int64_t head_stride_bytes;   // strided path only
  int vecs_per_unit;           // block_bytes / sizeof(VecT)
  int vecs_last_unit;          // vectors of the last id's (maybe partial) block
  int vecs_per_row;            // head_size * itemsize / sizeof(VecT)
  int num_kv_heads;
  char* buffer;
};
static_assert(sizeof(KernelArgs) <= 32764, "kernel parameters are limited to 32764 bytes");

// One CUDA block per (layer, kv, block) unit, all layers in one launch; threads
// stride over the unit's vectors. VecT is the widest type (up to 16 bytes)
// every address, stride and size is aligned to. kContiguous: the cache block
// is laid out like the buffer block (NHD), so the copy is linear; otherwise
// (HND, ...) each vector's token and head are derived from its buffer index.
template <typename VecT, bool kGather, bool kContiguous>
__global__ void copy_blocks_kernel(const __grid_constant__ KernelArgs args) {
  for (int64_t unit = blockIdx.x; unit < args.num_units; unit += gridDim.x) {
    const int64_t local = unit % args.launch_ids;
    const int64_t layer_kv = unit / args.launch_ids;
    const int64_t layer = layer_kv >> 1;
    const int64_t kv = layer_kv & 1;
    const int64_t id_index = args.first_id + local;
    char* cache = reinterpret_cast<char*>(static_cast<uintptr_t>(args.table[layer])) + kv * args.kv_stride_bytes +
                  args.table[args.num_layers + local] * args.block_stride_bytes;
    VecT* buffer = reinterpret_cast<VecT*>(args.buffer) + (layer_kv * args.num_ids + id_index) * args.vecs_per_unit;
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
void launch(KernelArgs& args, const KVCacheLayout& layout, int64_t last_block_tokens, CopyDirection direction,
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
  const KVCacheLayout& layout = plan.layout;
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
  for (uintptr_t p : plan.layout.layer_ptrs) {
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
  const KVCacheLayout& layout = plan.layout;
  const int64_t num_layers = static_cast<int64_t>(layout.num_layers());
  if (num_layers >= kTableWords) {
    throw std::invalid_argument("the CUDA path copies at most " + std::to_string(kTableWords - 1) + " layers, got " +
                                std::to_string(num_layers));
  }
  DeviceGuard guard(device);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);

  // Large (32 KB) and built on the heap once per copy: the launches copy it into their parameters.
  auto args = std::make_unique<KernelArgs>();
  std::memcpy(args->table, layout.layer_ptrs.data(), layout.layer_ptrs.size() * sizeof(int64_t));
  args->num_layers = num_layers;
  args->num_ids = static_cast<int64_t>(plan.block_ids.size());
  args->kv_stride_bytes = layout.kv_stride_bytes();
  args->block_stride_bytes = layout.block_stride_bytes();
  args->token_stride_bytes = layout.token_stride_bytes();
  args->head_stride_bytes = layout.head_stride_bytes();
  args->num_kv_heads = static_cast<int>(layout.num_kv_heads);
  args->buffer = reinterpret_cast<char*>(plan.buffer);
  const int64_t last = plan.last_block_tokens;
  const size_t align = common_alignment(plan);
  const int64_t ids_per_launch = kTableWords - num_layers;
  for (int64_t first = 0; first < args->num_ids; first += ids_per_launch) {
    const int64_t count = std::min(ids_per_launch, args->num_ids - first);
    std::memcpy(args->table + num_layers, plan.block_ids.data() + first, static_cast<size_t>(count) * sizeof(int64_t));
    args->first_id = first;
    args->launch_ids = count;
    args->num_units = num_layers * 2 * count;
    switch (align) {
      case 16: launch<int4>(*args, layout, last, direction, stream); break;
      case 8: launch<int2>(*args, layout, last, direction, stream); break;
      case 4: launch<int>(*args, layout, last, direction, stream); break;
      case 2: launch<short>(*args, layout, last, direction, stream); break;
      default: launch<char>(*args, layout, last, direction, stream); break;
    }
    check_cuda(cudaGetLastError(),
               direction == CopyDirection::kGather ? "gather_blocks kernel" : "scatter_blocks kernel");
  }
}

}  // namespace psrl::kv
