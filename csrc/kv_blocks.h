// Gather/scatter of paged KV-cache blocks to/from one contiguous buffer.
//
// Per layer the cache uses vLLM's FlashAttention layout, logically
//   [2, num_blocks, block_size, num_kv_heads, head_size]
// where the kv, block, token and head dims may have any stride (NHD: heads
// inside tokens; HND: tokens inside heads, vLLM's "HND" stride order) and each
// head's head_size elements are contiguous. The buffer is always the canonical
//   [num_layers, 2, num_ids, block_size, num_kv_heads, head_size] (contiguous)
// so two caches with different strides can exchange blocks through it.
//
// A partial last block: only the first last_block_tokens tokens of the last
// id's block are copied; on gather the rest of that block's buffer slot is
// zeroed, on scatter the rest of the cache block is left untouched.
//
// Nothing here knows Python: errors are std::invalid_argument (-> ValueError)
// and std::out_of_range (-> IndexError) so the binding can map them 1:1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psrl::kv {

enum class CopyDirection { kGather, kScatter };

// Layer pointers, shape and strides of a paged cache (every layer shares the
// shape and strides). Built once per cache and checked by validate_layout.
struct KVCacheLayout {
  std::vector<uintptr_t> layer_ptrs;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t itemsize = 0;      // bytes per element: 2 (fp16/bf16) or 4 (fp32)
  int64_t kv_stride = 0;     // elements between the K and V halves
  int64_t block_stride = 0;  // elements between consecutive blocks
  int64_t token_stride = 0;  // elements between consecutive tokens of a block (NHD: heads * head_size)
  int64_t head_stride = 0;   // elements between consecutive heads of a token (NHD: head_size)

  size_t num_layers() const { return layer_ptrs.size(); }
  // Bytes of one block of one half (K or V) of one layer: the buffer's copy unit.
  size_t block_bytes() const;
  // Bytes of one token's heads in the buffer: num_kv_heads * head_size * itemsize.
  size_t token_bytes() const;
  // Bytes of one head of one token: head_size * itemsize, always contiguous.
  size_t row_bytes() const;
  int64_t kv_stride_bytes() const { return kv_stride * itemsize; }
  int64_t block_stride_bytes() const { return block_stride * itemsize; }
  int64_t token_stride_bytes() const { return token_stride * itemsize; }
  int64_t head_stride_bytes() const { return head_stride * itemsize; }
  // True when each cache block is laid out exactly like a buffer block (NHD,
  // contiguous), so a block (or its first tokens) moves with one memcpy.
  bool block_is_contiguous() const;
  // True when each token's heads are contiguous (NHD), so a token moves at once.
  bool token_is_contiguous() const;
};

// Checks the geometry (positive sizes, itemsize 2 or 4, no size_t overflow)
// and that there is at least one layer and no null layer pointer.
void validate_layout(const KVCacheLayout& layout);

// Everything a copy needs, validated once by make_copy_plan.
struct CopyPlan {
  KVCacheLayout layout;
  std::vector<int64_t> block_ids;
  uintptr_t buffer = 0;
  size_t buffer_nbytes = 0;
  int64_t last_block_tokens = 0;  // tokens copied from/to the last id's block (block_size: all)

  size_t num_units() const { return layout.num_layers() * 2 * block_ids.size(); }
  bool partial_last_block() const { return last_block_tokens < layout.block_size; }
};

// For a layout that passed validate_layout, checks the ids (in range; unique for
// scatter so the result does not depend on thread order), that buffer_nbytes is
// exactly the transfer size, that 1 <= last_block_tokens <= block_size (< 0: the
// whole block) and, for scatter, that no two elements of one layer's cache share
// memory.
CopyPlan make_copy_plan(const KVCacheLayout& layout, const int64_t* block_ids, size_t num_ids, uintptr_t buffer,
                        size_t buffer_nbytes, CopyDirection direction, int64_t last_block_tokens = -1);

// Bytes moved by a transfer of num_ids blocks of every layer.
size_t transfer_nbytes(const KVCacheLayout& layout, size_t num_ids);

// Default worker count: min(hardware_concurrency, 8), at least 1.
int default_num_threads();

// Copies every (layer, kv, block) unit; splits units over up to num_threads
// std::threads (<= 0: default; 1 or a small copy: runs inline on the caller).
void copy_blocks_host(const CopyPlan& plan, CopyDirection direction, int num_threads);

}  // namespace psrl::kv
