#include "kv_blocks.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

namespace psrl::kv {
namespace {

// Below this many bytes per worker, thread start-up costs more than it saves.
constexpr size_t kMinBytesPerThread = size_t{1} << 20;
constexpr int kMaxDefaultThreads = 8;

size_t checked_mul(size_t a, size_t b, const char* what) {
  size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw std::invalid_argument(std::string(what) + " overflows size_t");
  }
  return out;
}

void require_positive(int64_t value, const char* name) {
  if (value <= 0) {
    throw std::invalid_argument(std::string(name) + " must be positive, got " + std::to_string(value));
  }
}

// Rejects strides under which two elements of one layer's cache share memory:
// a scatter through them would depend on the order threads write in.
void check_no_overlap(const KVCacheLayout& layout) {
  struct Dim {
    int64_t size;
    int64_t stride;  // elements, absolute value
  };
  std::array<Dim, 5> dims{{{2, std::llabs(layout.kv_stride)},
                           {layout.num_blocks, std::llabs(layout.block_stride)},
                           {layout.block_size, std::llabs(layout.token_stride)},
                           {layout.num_kv_heads, std::llabs(layout.head_stride)},
                           {layout.head_size, 1}}};
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  // Sorted by stride, each dim must step past everything the smaller ones reach.
  int64_t reach = 0;
  for (const Dim& dim : dims) {
    if (dim.size <= 1) {
      continue;
    }
    if (dim.stride <= reach) {
      throw std::invalid_argument(
          "cache strides (kv " + std::to_string(layout.kv_stride) + ", block " + std::to_string(layout.block_stride) +
          ", token " + std::to_string(layout.token_stride) + ", head " + std::to_string(layout.head_stride) +
          " elements) make elements overlap: cannot scatter into it");
    }
    int64_t extent = 0;
    if (__builtin_mul_overflow(dim.size - 1, dim.stride, &extent) || __builtin_add_overflow(reach, extent, &reach)) {
      throw std::invalid_argument("cache strides overflow int64");
    }
  }
}

// One (layer, kv, block) unit -> its cache address, buffer address and token count.
struct UnitAddress {
  char* cache;
  char* buffer;
  int64_t tokens;
};

UnitAddress unit_address(const CopyPlan& plan, size_t unit, size_t block_bytes) {
  const size_t num_ids = plan.block_ids.size();
  const size_t id_index = unit % num_ids;
  const size_t layer_kv = unit / num_ids;
  const size_t layer = layer_kv / 2;
  const int64_t kv = static_cast<int64_t>(layer_kv % 2);
  const int64_t offset = kv * plan.layout.kv_stride_bytes() +
                         plan.block_ids[id_index] * plan.layout.block_stride_bytes();
  char* cache = reinterpret_cast<char*>(plan.layout.layer_ptrs[layer]) + offset;
  char* buffer = reinterpret_cast<char*>(plan.buffer) + unit * block_bytes;
  const int64_t tokens = id_index + 1 == num_ids ? plan.last_block_tokens : plan.layout.block_size;
  return {cache, buffer, tokens};
}

template <CopyDirection kDirection>
inline void move(char* cache, char* buffer, size_t nbytes) {
  if constexpr (kDirection == CopyDirection::kGather) {
    std::memcpy(buffer, cache, nbytes);
  } else {
    std::memcpy(cache, buffer, nbytes);
  }
}

template <CopyDirection kDirection>
void copy_unit_range(const CopyPlan& plan, size_t begin, size_t end) {
  const KVCacheLayout& layout = plan.layout;
  const size_t block_bytes = layout.block_bytes();
  const size_t token_bytes = layout.token_bytes();
  const size_t row_bytes = layout.row_bytes();
  const bool block_contiguous = layout.block_is_contiguous();
  const bool token_contiguous = layout.token_is_contiguous();
  const int64_t token_stride = layout.token_stride_bytes();
  const int64_t head_stride = layout.head_stride_bytes();
  for (size_t unit = begin; unit < end; ++unit) {
    const UnitAddress addr = unit_address(plan, unit, block_bytes);
    const size_t copied = static_cast<size_t>(addr.tokens) * token_bytes;
    if (block_contiguous) {
      move<kDirection>(addr.cache, addr.buffer, copied);
    } else if (token_contiguous) {
      for (int64_t t = 0; t < addr.tokens; ++t) {
        move<kDirection>(addr.cache + t * token_stride, addr.buffer + t * token_bytes, token_bytes);
      }
    } else {  // HND or any other stride order: one head row at a time
      char* buffer = addr.buffer;
      for (int64_t t = 0; t < addr.tokens; ++t) {
        char* token = addr.cache + t * token_stride;
        for (int64_t h = 0; h < layout.num_kv_heads; ++h, buffer += row_bytes) {
          move<kDirection>(token + h * head_stride, buffer, row_bytes);
        }
      }
    }
    if (kDirection == CopyDirection::kGather && copied < block_bytes) {
      std::memset(addr.buffer + copied, 0, block_bytes - copied);  // a defined tail for a partial block
    }
  }
}

void copy_unit_range_dispatch(const CopyPlan& plan, CopyDirection direction, size_t begin, size_t end) {
  if (direction == CopyDirection::kGather) {
    copy_unit_range<CopyDirection::kGather>(plan, begin, end);
  } else {
    copy_unit_range<CopyDirection::kScatter>(plan, begin, end);
  }
}

}  // namespace

void validate_layout(const KVCacheLayout& layout) {
  require_positive(layout.num_blocks, "num_blocks");
  require_positive(layout.block_size, "block_size");
  require_positive(layout.num_kv_heads, "num_kv_heads");
  require_positive(layout.head_size, "head_size");
  if (layout.itemsize != 2 && layout.itemsize != 4) {
    throw std::invalid_argument("itemsize must be 2 (fp16/bf16) or 4 (fp32), got " +
                                std::to_string(layout.itemsize));
  }
  (void)layout.block_bytes();  // throws on overflow
  if (layout.layer_ptrs.empty()) {
    throw std::invalid_argument("layer_ptrs is empty: need at least one layer");
  }
  for (size_t i = 0; i < layout.layer_ptrs.size(); ++i) {
    if (layout.layer_ptrs[i] == 0) {
      throw std::invalid_argument("layer_ptrs[" + std::to_string(i) + "] is a null pointer");
    }
  }
}

size_t KVCacheLayout::row_bytes() const {
  return checked_mul(static_cast<size_t>(head_size), static_cast<size_t>(itemsize), "block size");
}

size_t KVCacheLayout::token_bytes() const {
  return checked_mul(static_cast<size_t>(num_kv_heads), row_bytes(), "block size");
}

size_t KVCacheLayout::block_bytes() const {
  return checked_mul(static_cast<size_t>(block_size), token_bytes(), "block size");
}

bool KVCacheLayout::token_is_contiguous() const {
  return num_kv_heads == 1 || head_stride == head_size;
}

bool KVCacheLayout::block_is_contiguous() const {
  return token_is_contiguous() && (block_size == 1 || token_stride == num_kv_heads * head_size);
}

size_t transfer_nbytes(const KVCacheLayout& layout, size_t num_ids) {
  const size_t units = checked_mul(checked_mul(layout.num_layers(), 2, "transfer"), num_ids, "transfer");
  return checked_mul(units, layout.block_bytes(), "transfer");
}

int default_num_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return std::max(1, std::min(static_cast<int>(hw), kMaxDefaultThreads));
}

CopyPlan make_copy_plan(const KVCacheLayout& layout, const int64_t* block_ids, size_t num_ids, uintptr_t buffer,
                        size_t buffer_nbytes, CopyDirection direction, int64_t last_block_tokens) {
  if (last_block_tokens < 0) {
    last_block_tokens = layout.block_size;
  } else if (last_block_tokens == 0 || last_block_tokens > layout.block_size) {
    throw std::invalid_argument("last_block_tokens must be in [1, block_size=" + std::to_string(layout.block_size) +
                                "], got " + std::to_string(last_block_tokens));
  }
  if (direction == CopyDirection::kScatter) {
    check_no_overlap(layout);
  }
  std::vector<bool> seen;
  if (direction == CopyDirection::kScatter) {
    seen.assign(static_cast<size_t>(layout.num_blocks), false);
  }
  for (size_t i = 0; i < num_ids; ++i) {
    const int64_t id = block_ids[i];
    if (id < 0 || id >= layout.num_blocks) {
      throw std::out_of_range("block_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                              " is out of range for a cache of " + std::to_string(layout.num_blocks) +
                              " blocks");
    }
    if (direction == CopyDirection::kScatter) {
      if (seen[static_cast<size_t>(id)]) {
        throw std::invalid_argument("block_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                                    " repeats: scatter targets must be distinct");
      }
      seen[static_cast<size_t>(id)] = true;
    }
  }
  const size_t expected = transfer_nbytes(layout, num_ids);
  if (buffer_nbytes != expected) {
    throw std::invalid_argument("buffer has " + std::to_string(buffer_nbytes) + " bytes, expected " +
                                std::to_string(expected) + " for " + std::to_string(layout.num_layers()) +
                                " layers x 2 x " + std::to_string(num_ids) + " blocks");
  }
  if (expected > 0 && buffer == 0) {
    throw std::invalid_argument("buffer is a null pointer");
  }
  CopyPlan plan;
  plan.layout = layout;
  plan.block_ids.assign(block_ids, block_ids + num_ids);
  plan.buffer = buffer;
  plan.buffer_nbytes = buffer_nbytes;
  plan.last_block_tokens = last_block_tokens;
  return plan;
}

void copy_blocks_host(const CopyPlan& plan, CopyDirection direction, int num_threads) {
  const size_t units = plan.num_units();
  if (units == 0) {
    return;
  }
  if (num_threads <= 0) {
    num_threads = default_num_threads();
  }
  const size_t by_size = std::max<size_t>(1, plan.buffer_nbytes / kMinBytesPerThread);
  const size_t workers = std::min({static_cast<size_t>(num_threads), units, by_size});
  if (workers <= 1) {
    copy_unit_range_dispatch(plan, direction, 0, units);
    return;
  }
  // Contiguous unit ranges keep each worker's buffer side sequential.
  const size_t per_worker = units / workers;
  const size_t remainder = units % workers;
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  size_t begin = 0;
  size_t caller_begin = 0;
  size_t caller_end = 0;
  for (size_t w = 0; w < workers; ++w) {
    const size_t end = begin + per_worker + (w < remainder ? 1 : 0);
    if (w + 1 == workers) {
      caller_begin = begin;  // the calling thread takes the last range itself
      caller_end = end;
    } else {
      try {
        threads.emplace_back(copy_unit_range_dispatch, std::cref(plan), direction, begin, end);
      } catch (const std::system_error&) {
        copy_unit_range_dispatch(plan, direction, begin, end);  // out of threads: do it here
      }
    }
    begin = end;
  }
  copy_unit_range_dispatch(plan, direction, caller_begin, caller_end);
  for (std::thread& t : threads) {
    t.join();
  }
}

}  // namespace psrl::kv
