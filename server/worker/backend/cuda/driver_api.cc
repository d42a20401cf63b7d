#include "server/worker/backend/cuda/driver_api.h"

#include <dlfcn.h>

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/worker/backend/cuda/cuda_status.h"

namespace gpurpc::backend::cuda {
namespace {

constexpr char kDriverLibrary[] = "libcuda.so.1";

std::string DlErrorText() {
  const char* error = dlerror();
  return error != nullptr ? error : "unknown dlerror";
}

std::string CudaVersionText(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

// Resolves `symbol` for `cuda_version` into `*fn`, whose type must be the PFN_ typedef of
// the variant that the driver returns for that version.
template <typename Fn>
absl::Status Resolve(PFN_cuGetProcAddress_v12000 get_proc_address, const DriverApi* api,
                     const char* symbol, int cuda_version, Fn* fn) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  // LEGACY_STREAM: a null CUstream is the legacy default stream, never the per-thread
  // one. (CU_GET_PROC_ADDRESS_DEFAULT means the same for a caller built without
  // per-thread default streams, but says it less plainly.)
  const CUresult result =
      get_proc_address(symbol, &address, cuda_version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
  if (result != CUDA_SUCCESS) {
    return absl::UnavailableError(
        CuResultToStatus(api, result,
                         absl::StrCat("cuGetProcAddress(\"", symbol, "\", ", cuda_version, ")"))
            .message());
  }
  if (found != CU_GET_PROC_ADDRESS_SUCCESS || address == nullptr) {
    const char* why = found == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                          ? "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT"
                          : "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND";
    return absl::UnavailableError(absl::StrCat("the CUDA driver has no entry point ", symbol,
                                               " for CUDA ", CudaVersionText(cuda_version), " (",
                                               why, "); update the NVIDIA driver"));
  }
  // Function and object pointers have the same representation on every platform that
  // has dlsym; memcpy avoids the conditionally-supported cast.
  static_assert(sizeof(Fn) == sizeof(void*));
  std::memcpy(fn, &address, sizeof(address));
  return absl::OkStatus();
}

absl::StatusOr<const DriverApi*> Load() {
  // RTLD_LOCAL: nothing else in the process should bind to our copy of the driver's
  // symbols by accident. Never dlclose'd: the driver does not support being unloaded.
  void* library = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot load the CUDA driver (", kDriverLibrary, "): ", DlErrorText()));
  }
  dlerror();  // Clears any stale error before dlsym.
  void* symbol = dlsym(library, "cuGetProcAddress_v2");
  if (symbol == nullptr) {
    return absl::UnavailableError(absl::StrCat("the CUDA driver is too old: ", kDriverLibrary,
                                               " has no cuGetProcAddress_v2 (", DlErrorText(),
                                               "); gpurpc needs a driver for CUDA ",
                                               CudaVersionText(kCudaApiVersion), " or newer"));
  }
  PFN_cuGetProcAddress_v12000 get_proc_address = nullptr;
  std::memcpy(&get_proc_address, &symbol, sizeof(symbol));

  auto* api = new DriverApi();  // Process lifetime, like the library.

  // First what we need to explain the remaining failures: error names and the version,
  // each for the CUDA version that introduced it, which any driver with
  // cuGetProcAddress_v2 answers.
  PFN_cuDriverGetVersion_v2020 driver_get_version = nullptr;
  absl::Status status =
      Resolve(get_proc_address, nullptr, "cuGetErrorName", 6000, &api->cuGetErrorName);
  if (status.ok()) {
    status = Resolve(get_proc_address, nullptr, "cuGetErrorString", 6000, &api->cuGetErrorString);
  }
  if (status.ok()) {
    status = Resolve(get_proc_address, nullptr, "cuDriverGetVersion", 2020, &driver_get_version);
  }
  if (!status.ok()) {
    delete api;
    return status;
  }
  const CUresult version_result = driver_get_version(&api->driver_version);
  if (version_result != CUDA_SUCCESS) {
    absl::Status error = CuResultToStatus(api, version_result, "cuDriverGetVersion");
    delete api;
    return absl::UnavailableError(error.message());
  }
  if (api->driver_version < kCudaApiVersion) {
    const int version = api->driver_version;
    delete api;
    return absl::UnavailableError(
        absl::StrCat("the NVIDIA driver supports CUDA ", CudaVersionText(version),
                     " (cuDriverGetVersion = ", version, "); gpurpc needs CUDA ",
                     CudaVersionText(kCudaApiVersion), " or newer (driver 580 or newer)"));
  }

#define GPURPC_CUDA_RESOLVE(name, version)                                       \
  if (status.ok()) {                                                             \
    status = Resolve(get_proc_address, api, #name, kCudaApiVersion, &api->name); \
  }
  GPURPC_CUDA_DRIVER_FUNCTIONS(GPURPC_CUDA_RESOLVE)
#undef GPURPC_CUDA_RESOLVE
  if (!status.ok()) {
    delete api;
    return status;
  }

  const CUresult init_result = api->cuInit(0);
  if (init_result != CUDA_SUCCESS) {
    // Whatever the reason (no device, a stub library, a driver/kernel-module mismatch, an
    // unusable device node in a container), the backend cannot serve.
    absl::Status error = CuResultToStatus(api, init_result, "cuInit");
    delete api;
    return absl::UnavailableError(error.message());
  }
  return api;
}

}  // namespace

absl::StatusOr<const DriverApi*> LoadDriverApi() {
  static const auto* const result = new absl::StatusOr<const DriverApi*>(Load());
  return *result;
}

}  // namespace gpurpc::backend::cuda
