// Thin pybind11 shell over kv_blocks.h / kv_blocks_cuda.cuh: converts
// arguments, releases the GIL around the copy, nothing else. The typed API
// callers use is psrl/kv/blocks.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "kv_blocks.h"
#ifdef PSRL_WITH_CUDA
#include "kv_blocks_cuda.cuh"
#endif

namespace py = pybind11;
using psrl::kv::CopyDirection;
using psrl::kv::CopyPlan;
using psrl::kv::PagedCacheLayout;

namespace {

using BlockIds = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

CopyPlan plan_from_args(const std::vector<uintptr_t>& layer_ptrs, int64_t num_blocks, int64_t block_size,
                        int64_t num_kv_heads, int64_t head_size, int64_t itemsize, int64_t kv_stride,
                        int64_t block_stride, const BlockIds& block_ids, uintptr_t buffer_ptr,
                        size_t buffer_nbytes, CopyDirection direction) {
  if (block_ids.ndim() != 1) {
    throw py::value_error("block_ids must be one-dimensional");
  }
  PagedCacheLayout layout{num_blocks, block_size, num_kv_heads, head_size, itemsize, kv_stride, block_stride};
  // The plan copies the ids, so other Python threads cannot change them mid-copy.
  return psrl::kv::make_copy_plan(layout, layer_ptrs, block_ids.data(), static_cast<size_t>(block_ids.size()),
                                  buffer_ptr, buffer_nbytes, direction);
}

template <CopyDirection kDirection>
void copy_host(const std::vector<uintptr_t>& layer_ptrs, int64_t num_blocks, int64_t block_size,
               int64_t num_kv_heads, int64_t head_size, int64_t itemsize, int64_t kv_stride,
               int64_t block_stride, const BlockIds& block_ids, uintptr_t buffer_ptr, size_t buffer_nbytes,
               int num_threads) {
  const CopyPlan plan = plan_from_args(layer_ptrs, num_blocks, block_size, num_kv_heads, head_size, itemsize,
                                       kv_stride, block_stride, block_ids, buffer_ptr, buffer_nbytes, kDirection);
  py::gil_scoped_release release;
  psrl::kv::copy_blocks_host(plan, kDirection, num_threads);
}

#ifdef PSRL_WITH_CUDA
template <CopyDirection kDirection>
void copy_cuda(const std::vector<uintptr_t>& layer_ptrs, int64_t num_blocks, int64_t block_size,
               int64_t num_kv_heads, int64_t head_size, int64_t itemsize, int64_t kv_stride,
               int64_t block_stride, const BlockIds& block_ids, uintptr_t buffer_ptr, size_t buffer_nbytes,
               int device, uintptr_t stream) {
  const CopyPlan plan = plan_from_args(layer_ptrs, num_blocks, block_size, num_kv_heads, head_size, itemsize,
                                       kv_stride, block_stride, block_ids, buffer_ptr, buffer_nbytes, kDirection);
  py::gil_scoped_release release;
  psrl::kv::copy_blocks_cuda(plan, kDirection, device, stream);
}
#endif

}  // namespace

PYBIND11_MODULE(_kvx, m) {
  m.doc() = "Native gather/scatter of paged KV-cache blocks (use psrl.kv, not this module).";

  const char* host_args_doc =
      "Layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size] with kv_stride and\n"
      "block_stride in elements and a contiguous inner block. Buffer: contiguous\n"
      "[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_size].";

  m.def("gather_blocks", &copy_host<CopyDirection::kGather>, py::arg("layer_ptrs"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("itemsize"),
        py::arg("kv_stride"), py::arg("block_stride"), py::arg("block_ids"), py::arg("dst_ptr"),
        py::arg("dst_nbytes"), py::arg("num_threads") = 0,
        (std::string("Copy cache blocks block_ids of every layer into the buffer at dst_ptr.\n") + host_args_doc)
            .c_str());
  m.def("scatter_blocks", &copy_host<CopyDirection::kScatter>, py::arg("layer_ptrs"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("itemsize"),
        py::arg("kv_stride"), py::arg("block_stride"), py::arg("block_ids"), py::arg("src_ptr"),
        py::arg("src_nbytes"), py::arg("num_threads") = 0,
        (std::string("Copy the buffer at src_ptr into cache blocks block_ids (distinct) of every layer.\n") +
         host_args_doc)
            .c_str());
  m.def("default_num_threads", &psrl::kv::default_num_threads,
        "Worker threads used when num_threads is 0: min(hardware_concurrency, 8).");

#ifdef PSRL_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  m.def("cuda_gather_blocks", &copy_cuda<CopyDirection::kGather>, py::arg("layer_ptrs"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("itemsize"),
        py::arg("kv_stride"), py::arg("block_stride"), py::arg("block_ids"), py::arg("dst_ptr"),
        py::arg("dst_nbytes"), py::arg("device") = 0, py::arg("stream") = 0,
        "gather_blocks over device pointers: one kernel on `stream`, no sync (the caller syncs).");
  m.def("cuda_scatter_blocks", &copy_cuda<CopyDirection::kScatter>, py::arg("layer_ptrs"),
        py::arg("num_blocks"), py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"),
        py::arg("itemsize"), py::arg("kv_stride"), py::arg("block_stride"), py::arg("block_ids"),
        py::arg("src_ptr"), py::arg("src_nbytes"), py::arg("device") = 0, py::arg("stream") = 0,
        "scatter_blocks over device pointers: one kernel on `stream`, no sync (the caller syncs).");
  m.def("cuda_device_count", &psrl::kv::cuda_device_count, "Visible CUDA devices; 0 without a driver.");
#else
  m.attr("HAS_CUDA") = false;
  m.def("cuda_device_count", []() { return 0; }, "Always 0: built without CUDA.");
#endif
}
