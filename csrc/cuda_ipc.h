// CUDA IPC between replicas on one node, streams and events. Only compiled
// when PSRL_WITH_CUDA is set. Streams and devices travel as integers (a
// cudaStream_t's value, 0 = legacy default stream) so Python passes torch's.
//
// Nothing here synchronises the whole device: copies are enqueued on a stream
// and ordered with events (an interprocess event orders work across processes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace psrl::kv {

// A device allocation's IPC handle, and where `ptr` lies inside it: CUDA IPC
// shares whole allocations, so a pointer into a caching allocator's block is
// exported as (base's handle, offset).
struct IpcExport {
  std::string handle;  // cudaIpcMemHandle_t, 64 raw bytes
  uintptr_t base = 0;
  size_t offset = 0;      // ptr - base
  size_t alloc_size = 0;  // bytes of the whole allocation
  int device = 0;
};

// cudaIpcGetMemHandle for the allocation holding `ptr` (device < 0: the
// pointer's own device). The memory must come from cudaMalloc (torch's default
// caching allocator; not expandable segments, not cudaMallocAsync pools).
IpcExport ipc_export(uintptr_t ptr, int device);

// cudaIpcOpenMemHandle (lazy peer access) on `device` in this process: returns
// the allocation's base as seen here. Must be another process than the exporter.
uintptr_t ipc_open(const std::string& handle, int device);

// cudaIpcCloseMemHandle for a base returned by ipc_open.
void ipc_close(uintptr_t base, int device);

// cudaMemcpyPeerAsync on `stream` (issued with stream_device current). Works
// for IPC-opened pointers and for ordinary ones on either device.
void memcpy_peer_async(uintptr_t dst, int dst_device, uintptr_t src, int src_device, size_t nbytes,
                       uintptr_t stream, int stream_device);

// Device of a device pointer (cudaPointerGetAttributes), -1 for host memory.
int pointer_device(uintptr_t ptr);

// A CUDA event without timing. interprocess: its handle can be opened by a
// peer process, which can then make its stream wait for work recorded here.
class CudaEvent {
 public:
  CudaEvent(int device, bool interprocess);
  static CudaEvent from_ipc_handle(const std::string& handle, int device);
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent();

  void record(uintptr_t stream);
  void wait(uintptr_t stream) const;  // cudaStreamWaitEvent: the stream waits, the host does not
  bool query() const;                 // true once recorded work is done
  void synchronize() const;           // host waits for this event only
  std::string ipc_handle() const;     // cudaIpcEventHandle_t, 64 raw bytes
  void destroy() noexcept;

  int device() const noexcept { return device_; }
  bool interprocess() const noexcept { return interprocess_; }
  uintptr_t handle() const noexcept { return reinterpret_cast<uintptr_t>(event_); }
  bool valid() const noexcept { return event_ != nullptr; }

 private:
  CudaEvent() = default;
  void* event_ = nullptr;  // cudaEvent_t
  int device_ = 0;
  bool interprocess_ = false;
};

}  // namespace psrl::kv
