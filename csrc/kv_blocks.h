// Gather/scatter of paged KV-cache blocks to/from one contiguous buffer.
//
// Per layer the cache uses vLLM's FlashAttention layout
//   [2, num_blocks, block_size, num_kv_heads, head_size]
// where the kv and block dims may have any stride but each block's inner
// [block_size, num_kv_heads, head_size] region is contiguous. The buffer is
//   [num_layers, 2, num_ids, block_size, num_kv_heads, head_size] (contiguous).
//
// Nothing here knows Python: errors are std::invalid_argument (-> ValueError)
// and std::out_of_range (-> IndexError) so the binding can map them 1:1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psrl::kv {

enum class CopyDirection { kGather, kScatter };

// Shape and strides of one layer of the paged cache; all layers share it.
struct PagedCacheLayout {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t itemsize = 0;      // bytes per element: 2 (fp16/bf16) or 4 (fp32)
  int64_t kv_stride = 0;     // elements between the K and V halves
  int64_t block_stride = 0;  // elements between consecutive blocks

  // Bytes of one block of one half (K or V) of one layer: the copy unit.
  size_t block_bytes() const;
  int64_t kv_stride_bytes() const { return kv_stride * itemsize; }
  int64_t block_stride_bytes() const { return block_stride * itemsize; }
};

// Everything a copy needs, validated once by make_copy_plan.
struct CopyPlan {
  PagedCacheLayout layout;
  std::vector<uintptr_t> layer_ptrs;
  std::vector<int64_t> block_ids;
  uintptr_t buffer = 0;
  size_t buffer_nbytes = 0;

  size_t num_units() const { return layer_ptrs.size() * 2 * block_ids.size(); }
};

// Checks layout, pointers, ids (in range; unique for scatter so the result does
// not depend on thread order) and that buffer_nbytes is exactly the transfer size.
CopyPlan make_copy_plan(const PagedCacheLayout& layout, std::vector<uintptr_t> layer_ptrs,
                        const int64_t* block_ids, size_t num_ids, uintptr_t buffer,
                        size_t buffer_nbytes, CopyDirection direction);

// Bytes moved by a transfer of num_ids blocks across num_layers layers.
size_t transfer_nbytes(const PagedCacheLayout& layout, size_t num_layers, size_t num_ids);

// Default worker count: min(hardware_concurrency, 8), at least 1.
int default_num_threads();

// memcpy every (layer, kv, block) unit; splits units over up to num_threads
// std::threads (<= 0: default; 1 or a small copy: runs inline on the caller).
void copy_blocks_host(const CopyPlan& plan, CopyDirection direction, int num_threads);

}  // namespace psrl::kv
