#include "nccl_loader.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>

namespace psrl::kv::nccl {
namespace {

constexpr const char* kDefaultLibrary = "libnccl.so.2";

std::mutex g_mutex;
std::unique_ptr<Api> g_api;  // set once, never reset: NCCL is not safe to unload

template <typename Fn>
void resolve(void* handle, const char* symbol, Fn& out, bool required, const std::string& path) {
  dlerror();
  void* sym = dlsym(handle, symbol);
  if (sym == nullptr && required) {
    throw NcclUnavailable("NCCL library " + path + " lacks " + symbol + ": need NCCL >= 2.7");
  }
  out = reinterpret_cast<Fn>(sym);
}

std::unique_ptr<Api> try_load(const std::string& path, std::string& errors) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    errors += "\n  " + path + ": " + (err != nullptr ? err : "dlopen failed");
    return nullptr;
  }
  auto api = std::make_unique<Api>();
  api->path = path;
  try {
    resolve(handle, "ncclGetUniqueId", api->get_unique_id, true, path);
    resolve(handle, "ncclCommInitRank", api->comm_init_rank, true, path);
    resolve(handle, "ncclSend", api->send, true, path);
    resolve(handle, "ncclRecv", api->recv, true, path);
    resolve(handle, "ncclGroupStart", api->group_start, true, path);
    resolve(handle, "ncclGroupEnd", api->group_end, true, path);
    resolve(handle, "ncclCommDestroy", api->comm_destroy, true, path);
    resolve(handle, "ncclGetErrorString", api->get_error_string, true, path);
    resolve(handle, "ncclCommAbort", api->comm_abort, false, path);
    Result (*get_version)(int*) = nullptr;
    resolve(handle, "ncclGetVersion", get_version, false, path);
    if (get_version != nullptr && get_version(&api->version) != kSuccess) {
      api->version = 0;
    }
  } catch (const NcclUnavailable& e) {
    dlclose(handle);
    errors += std::string("\n  ") + e.what();
    return nullptr;
  }
  return api;
}

}  // namespace

const Api& load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api) {
    return *g_api;
  }
  std::string errors;
  std::vector<std::string> paths;
  for (const std::string& c : candidates) {
    if (!c.empty()) {
      paths.push_back(c);
    }
  }
  paths.emplace_back(kDefaultLibrary);
  for (const std::string& path : paths) {
    if (auto api = try_load(path, errors)) {
      g_api = std::move(api);
      return *g_api;
    }
  }
  throw NcclUnavailable(
      "no usable NCCL library (install the nvidia-nccl-cu12 or -cu13 wheel, or pass the path of "
      "libnccl.so.2); tried:" + errors);
}

const Api* loaded() noexcept {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_api.get();
}

void check(const Api& api, Result result, const char* what) {
  if (result != kSuccess) {
    const char* text = api.get_error_string != nullptr ? api.get_error_string(result) : nullptr;
    throw NcclError(result, std::string(what) + " failed: " + (text != nullptr ? text : "unknown NCCL error") +
                                " (ncclResult_t " + std::to_string(result) + ")");
  }
}

std::string get_unique_id(const std::vector<std::string>& candidates) {
  const Api& api = load(candidates);
  UniqueId id{};
  check(api, api.get_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, kUniqueIdBytes);
}

}  // namespace psrl::kv::nccl
