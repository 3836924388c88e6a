// CUDA gather/scatter of paged KV-cache blocks; same layout and semantics as
// kv_blocks.h, over device pointers. Only compiled when PSRL_WITH_CUDA is set.
#pragma once

#include <cstdint>

#include "kv_blocks.h"

namespace psrl::kv {

// Number of visible CUDA devices; 0 when there is no driver or no device.
int cuda_device_count() noexcept;

// Enqueues one kernel over all layers on `stream` (a cudaStream_t as an
// integer, 0 = legacy default stream) on `device`; one per ~4000 block ids
// when there are more. Allocates and copies nothing through the runtime and
// returns without a device sync; the caller syncs. Throws std::runtime_error
// on CUDA errors.
void copy_blocks_cuda(const CopyPlan& plan, CopyDirection direction, int device, uintptr_t stream);

}  // namespace psrl::kv
