#include "cuda_ipc.h"

#include <cuda.h>  // CUresult / CUdeviceptr types only: the driver is reached through cudart
#include <cuda_runtime_api.h>

#include <cstring>
#include <stdexcept>
#include <utility>

#include "cuda_util.h"

namespace psrl::kv {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is 64 bytes");
static_assert(sizeof(cudaIpcEventHandle_t) == 64, "cudaIpcEventHandle_t is 64 bytes");

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// cuMemGetAddressRange through cudart's driver entry point, so the module needs
// no libcuda at link time (it must import on machines without a driver).
GetAddressRange address_range_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
  check_cuda(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &status),
             "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)");
#else
  check_cuda(cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &status),
             "cudaGetDriverEntryPoint(cuMemGetAddressRange)");
#endif
  if (fn == nullptr || status != cudaDriverEntryPointSuccess) {
    throw std::runtime_error("the CUDA driver does not provide cuMemGetAddressRange");
  }
  return reinterpret_cast<GetAddressRange>(fn);
}

template <typename Handle>
Handle handle_from_bytes(const std::string& bytes, const char* what) {
  Handle handle{};
  if (bytes.size() != sizeof(Handle)) {
    throw std::invalid_argument(std::string(what) + " must be " + std::to_string(sizeof(Handle)) +
                                " bytes, got " + std::to_string(bytes.size()));
  }
  std::memcpy(&handle, bytes.data(), sizeof(Handle));
  return handle;
}

}  // namespace

int pointer_device(uintptr_t ptr) {
  cudaPointerAttributes attrs{};
  check_cuda(cudaPointerGetAttributes(&attrs, reinterpret_cast<const void*>(ptr)), "cudaPointerGetAttributes");
  return attrs.type == cudaMemoryTypeDevice || attrs.type == cudaMemoryTypeManaged ? attrs.device : -1;
}

IpcExport ipc_export(uintptr_t ptr, int device) {
  if (ptr == 0) {
    throw std::invalid_argument("cannot export a null device pointer");
  }
  const int owner = pointer_device(ptr);
  if (owner < 0) {
    throw std::invalid_argument("pointer is not device memory: only cudaMalloc'd memory can be exported");
  }
  if (device >= 0 && device != owner) {
    throw std::invalid_argument("pointer lives on cuda:" + std::to_string(owner) + ", not cuda:" +
                                std::to_string(device));
  }
  DeviceGuard guard(owner);
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult res = address_range_fn()(&base, &size, static_cast<CUdeviceptr>(ptr));
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("cuMemGetAddressRange failed (CUresult " + std::to_string(static_cast<int>(res)) + ")");
  }
  cudaIpcMemHandle_t handle{};
  const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(err) +
                             " (the memory must come from cudaMalloc; with torch, turn expandable_segments off)");
  }
  IpcExport out;
  out.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  out.base = static_cast<uintptr_t>(base);
  out.offset = static_cast<size_t>(ptr - static_cast<uintptr_t>(base));
  out.alloc_size = size;
  out.device = owner;
  return out;
}

uintptr_t ipc_open(const std::string& bytes, int device) {
  const auto handle = handle_from_bytes<cudaIpcMemHandle_t>(bytes, "a CUDA IPC memory handle");
  DeviceGuard guard(device);
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uintptr_t>(ptr);
}

void ipc_close(uintptr_t base, int device) {
  if (base == 0) {
    throw std::invalid_argument("cannot close a null IPC pointer");
  }
  DeviceGuard guard(device);
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base)), "cudaIpcCloseMemHandle");
}

void memcpy_peer_async(uintptr_t dst, int dst_device, uintptr_t src, int src_device, size_t nbytes,
                       uintptr_t stream, int stream_device) {
  if (nbytes == 0) {
    return;
  }
  if (dst == 0 || src == 0) {
    throw std::invalid_argument("memcpy_peer_async: null pointer");
  }
  DeviceGuard guard(stream_device);
  check_cuda(cudaMemcpyPeerAsync(reinterpret_cast<void*>(dst), dst_device, reinterpret_cast<const void*>(src),
                                 src_device, nbytes, reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemcpyPeerAsync");
}

CudaEvent::CudaEvent(int device, bool interprocess) : device_(device), interprocess_(interprocess) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  const unsigned flags = cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0u);
  check_cuda(cudaEventCreateWithFlags(&event, flags), "cudaEventCreateWithFlags");
  event_ = event;
}

CudaEvent CudaEvent::from_ipc_handle(const std::string& bytes, int device) {
  const auto handle = handle_from_bytes<cudaIpcEventHandle_t>(bytes, "a CUDA IPC event handle");
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  check_cuda(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
  CudaEvent out;
  out.event_ = event;
  out.device_ = device;
  out.interprocess_ = true;
  return out;
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), device_(other.device_), interprocess_(other.interprocess_) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    destroy();
    event_ = std::exchange(other.event_, nullptr);
    device_ = other.device_;
    interprocess_ = other.interprocess_;
  }
  return *this;
}

CudaEvent::~CudaEvent() { destroy(); }

void CudaEvent::destroy() noexcept {
  if (event_ != nullptr) {
    // cudaEventDestroy needs no current-device switch and returns at once even
    // if recorded work is still pending (the event is released when it is done).
    cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    cudaGetLastError();
    event_ = nullptr;
  }
}

namespace {
cudaEvent_t require(void* event) {
  if (event == nullptr) {
    throw std::invalid_argument("the CUDA event was destroyed");
  }
  return static_cast<cudaEvent_t>(event);
}
}  // namespace

void CudaEvent::record(uintptr_t stream) {
  DeviceGuard guard(device_);
  check_cuda(cudaEventRecord(require(event_), reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
}

void CudaEvent::wait(uintptr_t stream) const {
  check_cuda(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), require(event_), 0), "cudaStreamWaitEvent");
}

bool CudaEvent::query() const {
  const cudaError_t err = cudaEventQuery(require(event_));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check_cuda(err, "cudaEventQuery");
  return true;
}

void CudaEvent::synchronize() const { check_cuda(cudaEventSynchronize(require(event_)), "cudaEventSynchronize"); }

std::string CudaEvent::ipc_handle() const {
  if (!interprocess_) {
    throw std::invalid_argument("event was not created with interprocess=True");
  }
  cudaIpcEventHandle_t handle{};
  check_cuda(cudaIpcGetEventHandle(&handle, require(event_)), "cudaIpcGetEventHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

}  // namespace psrl::kv
