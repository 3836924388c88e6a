// Thin pybind11 shell over kv_blocks.h / kv_blocks_cuda.cuh / shm_segment.h /
// cuda_ipc.h / nccl_*.h: converts arguments, releases the GIL around copies
// and blocking calls, nothing else. The typed API callers use is psrl/kv/.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kv_blocks.h"
#include "nccl_loader.h"
#include "shm_segment.h"
#ifdef PSRL_WITH_CUDA
#include "cuda_ipc.h"
#include "kv_blocks_cuda.cuh"
#include "nccl_comm.h"
#endif

namespace py = pybind11;
using psrl::kv::CopyDirection;
using psrl::kv::CopyPlan;
using psrl::kv::KVCacheLayout;
using psrl::kv::ShmSegment;

namespace {

using BlockIds = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using OptInt = std::optional<int64_t>;

KVCacheLayout make_layout(std::vector<uintptr_t> layer_ptrs, int64_t num_blocks, int64_t block_size,
                          int64_t num_kv_heads, int64_t head_size, int64_t itemsize, int64_t kv_stride,
                          int64_t block_stride, OptInt token_stride, OptInt head_stride) {
  // Defaults: NHD with a contiguous block, the layout before strides were configurable.
  KVCacheLayout layout{std::move(layer_ptrs),
                       num_blocks,
                       block_size,
                       num_kv_heads,
                       head_size,
                       itemsize,
                       kv_stride,
                       block_stride,
                       token_stride.value_or(num_kv_heads * head_size),
                       head_stride.value_or(head_size)};
  psrl::kv::validate_layout(layout);
  return layout;
}

CopyPlan make_plan(const KVCacheLayout& layout, const BlockIds& block_ids, uintptr_t buffer_ptr,
                   size_t buffer_nbytes, CopyDirection direction, OptInt last_block_tokens) {
  if (block_ids.ndim() != 1) {
    throw py::value_error("block_ids must be one-dimensional");
  }
  // The plan copies the ids, so other Python threads cannot change them mid-copy.
  return psrl::kv::make_copy_plan(layout, block_ids.data(), static_cast<size_t>(block_ids.size()), buffer_ptr,
                                  buffer_nbytes, direction, last_block_tokens.value_or(-1));
}

template <CopyDirection kDirection>
void copy_host(const KVCacheLayout& layout, const BlockIds& block_ids, uintptr_t buffer_ptr, size_t buffer_nbytes,
               int num_threads, OptInt last_block_tokens) {
  const CopyPlan plan = make_plan(layout, block_ids, buffer_ptr, buffer_nbytes, kDirection, last_block_tokens);
  py::gil_scoped_release release;
  psrl::kv::copy_blocks_host(plan, kDirection, num_threads);
}

#ifdef PSRL_WITH_CUDA
template <CopyDirection kDirection>
void copy_cuda(const KVCacheLayout& layout, const BlockIds& block_ids, uintptr_t buffer_ptr, size_t buffer_nbytes,
               int device, uintptr_t stream, OptInt last_block_tokens) {
  const CopyPlan plan = make_plan(layout, block_ids, buffer_ptr, buffer_nbytes, kDirection, last_block_tokens);
  py::gil_scoped_release release;
  psrl::kv::copy_blocks_cuda(plan, kDirection, device, stream);
}
#endif

void bind_layout(py::module_& m) {
  py::class_<KVCacheLayout>(
      m, "KVCacheLayout",
      "Layer pointers, shape and strides of a paged KV cache, checked once: per layer\n"
      "[2, num_blocks, block_size, num_kv_heads, head_size] with kv_stride, block_stride, token_stride and\n"
      "head_stride in elements (None: NHD, token_stride = num_kv_heads * head_size, head_stride = head_size)\n"
      "and contiguous heads. Immutable.")
      .def(py::init(&make_layout), py::arg("layer_ptrs"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("itemsize"), py::arg("kv_stride"),
           py::arg("block_stride"), py::arg("token_stride") = py::none(), py::arg("head_stride") = py::none())
      .def_readonly("layer_ptrs", &KVCacheLayout::layer_ptrs)
      .def_readonly("num_blocks", &KVCacheLayout::num_blocks)
      .def_readonly("block_size", &KVCacheLayout::block_size)
      .def_readonly("num_kv_heads", &KVCacheLayout::num_kv_heads)
      .def_readonly("head_size", &KVCacheLayout::head_size)
      .def_readonly("itemsize", &KVCacheLayout::itemsize)
      .def_readonly("kv_stride", &KVCacheLayout::kv_stride)
      .def_readonly("block_stride", &KVCacheLayout::block_stride)
      .def_readonly("token_stride", &KVCacheLayout::token_stride)
      .def_readonly("head_stride", &KVCacheLayout::head_stride);
}

// --- ShmSegment with a buffer protocol that counts its exports ---------------------------------------
//
// pybind11's own buffer protocol cannot tell when a view is released, so close()
// could unmap memory a numpy array still points at. This one counts live views
// and close() refuses (BufferError) while any exist; views hold a reference to
// the segment, so it is never destroyed under them.

struct PyShmSegment {
  ShmSegment segment;
  Py_ssize_t exports = 0;

  void close() {
    if (exports > 0) {
      throw py::buffer_error("cannot close shared memory segment '" + segment.name() + "': " +
                             std::to_string(exports) + " buffer view(s) (numpy arrays, memoryviews, tensors) still "
                             "use it; delete them first");
    }
    segment.close();
  }
};

char g_empty_buffer = 0;  // what a zero-byte segment's views point at

int shm_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  PyShmSegment* self = nullptr;
  try {
    self = py::cast<PyShmSegment*>(py::handle(obj));
  } catch (const std::exception&) {
    PyErr_SetString(PyExc_TypeError, "not a ShmSegment");
    view->obj = nullptr;
    return -1;
  }
  if (!self->segment.is_open()) {
    PyErr_SetString(PyExc_ValueError, "shared memory segment is closed");
    view->obj = nullptr;
    return -1;
  }
  void* data = self->segment.data() != nullptr ? self->segment.data() : &g_empty_buffer;
  // Fails with BufferError if a writable view is asked of a read-only mapping.
  if (PyBuffer_FillInfo(view, obj, data, static_cast<Py_ssize_t>(self->segment.size()),
                        self->segment.readonly() ? 1 : 0, flags) != 0) {
    return -1;
  }
  ++self->exports;
  return 0;
}

void shm_releasebuffer(PyObject* obj, Py_buffer* /*view*/) {
  try {
    --py::cast<PyShmSegment*>(py::handle(obj))->exports;
  } catch (const std::exception&) {  // cannot happen for our own views; never throw into CPython
  }
}

void bind_shm(py::module_& m) {
  py::class_<PyShmSegment> cls(m, "ShmSegment", py::custom_type_setup([](PyHeapTypeObject* heap_type) {
                                 heap_type->ht_type.tp_as_buffer = &heap_type->as_buffer;
                                 heap_type->as_buffer.bf_getbuffer = shm_getbuffer;
                                 heap_type->as_buffer.bf_releasebuffer = shm_releasebuffer;
                               }));
  cls.doc() =
      "A POSIX shared-memory segment (shm_open + mmap), closed on garbage collection, never unlinked implicitly.\n"
      "Supports the buffer protocol (np.frombuffer(seg, dtype), memoryview(seg)) without copying; close()\n"
      "raises BufferError while such views are alive. Errors are OSError subclasses: FileNotFoundError\n"
      "(no such segment), FileExistsError (create with a taken name), PermissionError.";
  cls.def_static(
         "create",
         [](const std::string& name, size_t size) {
           return std::make_unique<PyShmSegment>(PyShmSegment{ShmSegment::create(name, size), 0});
         },
         py::arg("name"), py::arg("size"), py::call_guard<py::gil_scoped_release>(),
         "Create a new segment (O_CREAT | O_EXCL, mode 0600) of `size` zero bytes and map it read-write\n"
         "(pages reserved and mapped up front, with the GIL released).")
      .def_static(
          "open",
          [](const std::string& name, bool readonly) {
            return std::make_unique<PyShmSegment>(PyShmSegment{ShmSegment::open(name, readonly), 0});
          },
          py::arg("name"), py::arg("readonly") = false, py::call_guard<py::gil_scoped_release>(),
          "Map an existing segment, all of it (pages mapped up front, with the GIL released).")
      .def_static("unlink_name", &ShmSegment::unlink_name, py::arg("name"),
                  "shm_unlink a segment by name; False if it did not exist.")
      .def_static("normalize_name", &ShmSegment::normalize_name, py::arg("name"),
                  "The name with its leading '/', validated.")
      .def(
          "unlink", [](PyShmSegment& self) { return self.segment.unlink(); },
          "Remove the name (mappings stay valid); False if it was already gone. Idempotent.")
      .def("close", &PyShmSegment::close, "Unmap and close; idempotent. BufferError while views exist.")
      .def_property_readonly("name", [](const PyShmSegment& self) { return self.segment.name(); })
      .def_property_readonly("size", [](const PyShmSegment& self) { return self.segment.size(); })
      .def_property_readonly("address", [](const PyShmSegment& self) { return self.segment.address(); },
                             "Address of the mapping in this process (0 when closed or empty).")
      .def_property_readonly("readonly", [](const PyShmSegment& self) { return self.segment.readonly(); })
      .def_property_readonly("created", [](const PyShmSegment& self) { return self.segment.created(); },
                             "True in the process that created the segment.")
      .def_property_readonly("closed", [](const PyShmSegment& self) { return !self.segment.is_open(); })
      .def_property_readonly("linked", [](const PyShmSegment& self) { return self.segment.linked(); },
                             "Whether the segment still has a name (any process may have unlinked it).")
      .def_property_readonly("unlinked", [](const PyShmSegment& self) { return self.segment.unlinked(); },
                             "True once unlink() was called through this object.")
      .def_property_readonly("exports", [](const PyShmSegment& self) { return self.exports; },
                             "Live buffer views of the mapping.")
      .def("__len__", [](const PyShmSegment& self) { return self.segment.size(); })
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__", [](PyShmSegment& self, const py::args&) { self.close(); },
          "Close (not unlink) the segment.")
      .def("__repr__", [](const PyShmSegment& self) {
        return "<ShmSegment '" + self.segment.name() + "' " + std::to_string(self.segment.size()) + " bytes" +
               (self.segment.is_open() ? "" : " closed") + (self.segment.readonly() ? " readonly" : "") + ">";
      });
}

void translate_shm_error(const psrl::kv::ShmError& e) {
  // OSError(errno, message, filename) picks the subclass: FileNotFoundError, FileExistsError, ...
  const int err = e.code().value();
  const std::string message = e.action() + ": " + std::strerror(err);
  py::object exc = py::reinterpret_steal<py::object>(
      PyObject_CallFunction(PyExc_OSError, "iss", err, message.c_str(), e.name().c_str()));
  if (!exc) {
    return;  // the call set its own error
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

std::vector<std::string> as_paths(const std::optional<std::vector<std::string>>& paths) {
  return paths.value_or(std::vector<std::string>{});
}

#ifdef PSRL_WITH_CUDA
void bind_cuda_ipc(py::module_& m) {
  namespace kv = psrl::kv;
  m.def(
      "cuda_ipc_export",
      [](uintptr_t ptr, int device) {
        kv::IpcExport out;
        {
          py::gil_scoped_release release;
          out = kv::ipc_export(ptr, device);
        }
        return py::make_tuple(py::bytes(out.handle), out.offset, out.alloc_size, out.device);
      },
      py::arg("ptr"), py::arg("device") = -1,
      "IPC handle of the cudaMalloc allocation holding ptr: (handle: bytes[64], offset of ptr in it,\n"
      "allocation size, device). device < 0: the pointer's own device.");
  m.def(
      "cuda_ipc_open",
      [](const py::bytes& handle, int device) {
        const std::string raw = handle;
        py::gil_scoped_release release;
        return kv::ipc_open(raw, device);
      },
      py::arg("handle"), py::arg("device"),
      "Open a peer process's allocation on `device` (lazy peer access); returns its base pointer here.");
  m.def(
      "cuda_ipc_close",
      [](uintptr_t base, int device) {
        py::gil_scoped_release release;
        kv::ipc_close(base, device);
      },
      py::arg("base"), py::arg("device"), "Close a pointer returned by cuda_ipc_open.");
  m.def("cuda_pointer_device", &kv::pointer_device, py::arg("ptr"),
        "Device of a device pointer, -1 for host memory.");

  py::class_<kv::CudaEvent>(m, "CudaEvent",
                            "A CUDA event without timing; interprocess=True lets a peer process open it.")
      .def(py::init<int, bool>(), py::arg("device"), py::arg("interprocess") = false)
      .def_static(
          "from_ipc_handle",
          [](const py::bytes& handle, int device) { return kv::CudaEvent::from_ipc_handle(handle, device); },
          py::arg("handle"), py::arg("device"), "Open a peer process's interprocess event.")
      .def("record", &kv::CudaEvent::record, py::arg("stream"), "cudaEventRecord on `stream`.")
      .def("wait", &kv::CudaEvent::wait, py::arg("stream"),
           "Make `stream` wait for the recorded work (cudaStreamWaitEvent); the host does not wait.")
      .def("query", &kv::CudaEvent::query, "True once the recorded work is done.")
      .def("synchronize", &kv::CudaEvent::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block the host until this event (only) completes.")
      .def(
          "ipc_handle", [](const kv::CudaEvent& self) { return py::bytes(self.ipc_handle()); },
          "cudaIpcEventHandle_t (64 bytes) for from_ipc_handle in a peer process.")
      .def("destroy", &kv::CudaEvent::destroy, "Destroy now instead of at garbage collection.")
      .def_property_readonly("device", &kv::CudaEvent::device)
      .def_property_readonly("interprocess", &kv::CudaEvent::interprocess)
      .def_property_readonly("handle", &kv::CudaEvent::handle, "The cudaEvent_t as an integer.")
      .def_property_readonly("valid", &kv::CudaEvent::valid);

  m.def(
      "cuda_peer_copy_async",
      [](uintptr_t dst, int dst_device, uintptr_t src, int src_device, size_t nbytes, uintptr_t stream,
         int stream_device) {
        kv::CudaEvent done(stream_device, false);
        {
          py::gil_scoped_release release;
          kv::memcpy_peer_async(dst, dst_device, src, src_device, nbytes, stream, stream_device);
          done.record(stream);
        }
        return done;
      },
      py::arg("dst"), py::arg("dst_device"), py::arg("src"), py::arg("src_device"), py::arg("nbytes"),
      py::arg("stream"), py::arg("stream_device"),
      "cudaMemcpyPeerAsync on `stream`, then a CudaEvent recorded after it (wait on it or synchronize it).");

  py::class_<kv::NcclCommunicator>(m, "NcclCommunicator",
                                   "Point-to-point NCCL communicator over a dlopen'ed libnccl.")
      .def(py::init<const std::string&, int, int, int, const std::vector<std::string>&>(), py::arg("unique_id"),
           py::arg("world_size"), py::arg("rank"), py::arg("device"), py::arg("library_candidates"),
           py::call_guard<py::gil_scoped_release>(),
           "ncclCommInitRank; blocks until every rank has joined with the same unique id.")
      .def("send", &kv::NcclCommunicator::send, py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(), "Enqueue ncclSend of nbytes bytes on `stream`.")
      .def("recv", &kv::NcclCommunicator::recv, py::arg("ptr"), py::arg("nbytes"), py::arg("peer"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(), "Enqueue ncclRecv of nbytes bytes on `stream`.")
      .def("group_start", &kv::NcclCommunicator::group_start)
      .def("group_end", &kv::NcclCommunicator::group_end, py::call_guard<py::gil_scoped_release>())
      .def("error_string", &kv::NcclCommunicator::error_string, py::arg("code"))
      .def("destroy", &kv::NcclCommunicator::destroy, py::arg("abort") = false,
           py::call_guard<py::gil_scoped_release>(), "ncclCommDestroy (or ncclCommAbort); idempotent.")
      .def_property_readonly("rank", &kv::NcclCommunicator::rank)
      .def_property_readonly("world_size", &kv::NcclCommunicator::world_size)
      .def_property_readonly("device", &kv::NcclCommunicator::device)
      .def_property_readonly("closed", &kv::NcclCommunicator::closed)
      .def_property_readonly("library_path", &kv::NcclCommunicator::library_path)
      .def_property_readonly("nccl_version", &kv::NcclCommunicator::nccl_version);
}
#endif

}  // namespace

PYBIND11_MODULE(_kvx, m) {
  m.doc() = "Native KV-cache block movement: gather/scatter, shared memory, CUDA IPC, NCCL (use psrl.kv).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const psrl::kv::ShmError& e) {
      translate_shm_error(e);
    }
  });
  py::register_exception<psrl::kv::nccl::NcclUnavailable>(m, "NcclUnavailableError", PyExc_RuntimeError);

  bind_layout(m);
  const char* copy_doc =
      "Buffer: contiguous [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_size].\n"
      "last_block_tokens (None: all): tokens of the last id's block that move; on gather the rest of its\n"
      "buffer slot is zeroed.";

  m.def("gather_blocks", &copy_host<CopyDirection::kGather>, py::arg("layout"), py::arg("block_ids"),
        py::arg("dst_ptr"), py::arg("dst_nbytes"), py::arg("num_threads") = 0,
        py::arg("last_block_tokens") = py::none(),
        (std::string("Copy cache blocks block_ids of every layer into the buffer at dst_ptr.\n") + copy_doc).c_str());
  m.def("scatter_blocks", &copy_host<CopyDirection::kScatter>, py::arg("layout"), py::arg("block_ids"),
        py::arg("src_ptr"), py::arg("src_nbytes"), py::arg("num_threads") = 0,
        py::arg("last_block_tokens") = py::none(),
        (std::string("Copy the buffer at src_ptr into cache blocks block_ids (distinct) of every layer.\n") +
         copy_doc)
            .c_str());
  m.def("default_num_threads", &psrl::kv::default_num_threads,
        "Worker threads used when num_threads is 0: min(hardware_concurrency, 8).");

  bind_shm(m);

  m.def(
      "nccl_get_unique_id",
      [](const std::optional<std::vector<std::string>>& library_candidates) {
        const std::vector<std::string> paths = as_paths(library_candidates);
        std::string id;
        {
          py::gil_scoped_release release;
          id = psrl::kv::nccl::get_unique_id(paths);
        }
        return py::bytes(id);
      },
      py::arg("library_candidates") = py::none(),
      "ncclGetUniqueId (128 bytes). Loads NCCL on first use: each candidate path, then libnccl.so.2\n"
      "from the default loader path; NcclUnavailableError if none loads.");
  m.def(
      "nccl_load",
      [](const std::optional<std::vector<std::string>>& library_candidates) {
        const std::vector<std::string> paths = as_paths(library_candidates);
        const psrl::kv::nccl::Api* api = nullptr;
        {
          py::gil_scoped_release release;
          api = &psrl::kv::nccl::load(paths);
        }
        return py::make_tuple(api->path, api->version);
      },
      py::arg("library_candidates") = py::none(),
      "Load NCCL (see nccl_get_unique_id); returns (path loaded, ncclGetVersion code or 0).");

#ifdef PSRL_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  m.def("cuda_gather_blocks", &copy_cuda<CopyDirection::kGather>, py::arg("layout"), py::arg("block_ids"),
        py::arg("dst_ptr"), py::arg("dst_nbytes"), py::arg("device") = 0, py::arg("stream") = 0,
        py::arg("last_block_tokens") = py::none(),
        "gather_blocks over device pointers: one kernel over all layers on `stream`, no sync (the caller syncs).");
  m.def("cuda_scatter_blocks", &copy_cuda<CopyDirection::kScatter>, py::arg("layout"), py::arg("block_ids"),
        py::arg("src_ptr"), py::arg("src_nbytes"), py::arg("device") = 0, py::arg("stream") = 0,
        py::arg("last_block_tokens") = py::none(),
        "scatter_blocks over device pointers: one kernel over all layers on `stream`, no sync (the caller syncs).");
  m.def("cuda_device_count", &psrl::kv::cuda_device_count, "Visible CUDA devices; 0 without a driver.");
  bind_cuda_ipc(m);
#else
  m.attr("HAS_CUDA") = false;
  m.def("cuda_device_count", []() { return 0; }, "Always 0: built without CUDA.");
#endif
}
