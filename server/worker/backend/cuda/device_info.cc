#include "server/worker/backend/cuda/device_info.h"

#include <cuda.h>

#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/worker/backend/cuda/cuda_status.h"

namespace gpurpc::backend::cuda {

absl::StatusOr<DeviceInfo> QueryDeviceInfo(const DriverApi& api, int ordinal) {
  CUdevice device = 0;
  CUresult result = api.cuDeviceGet(&device, ordinal);
  if (result != CUDA_SUCCESS) {
    return CuResultToStatus(&api, result, "cuDeviceGet", absl::StrCat("ordinal ", ordinal));
  }
  auto fail = [&](const char* call, absl::string_view what) {
    return CuResultToStatus(&api, result, call, absl::StrCat(what, " of device ", ordinal));
  };

  DeviceInfo info;
  info.ordinal = ordinal;

  char name[256] = {};
  result = api.cuDeviceGetName(name, sizeof(name) - 1, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceGetName", "name");
  info.name = name;

  size_t total_bytes = 0;
  result = api.cuDeviceTotalMem(&total_bytes, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceTotalMem", "total memory");
  info.total_memory_bytes = total_bytes;

  char bus_id[64] = {};
  result = api.cuDeviceGetPCIBusId(bus_id, sizeof(bus_id) - 1, device);
  if (result != CUDA_SUCCESS) return fail("cuDeviceGetPCIBusId", "PCI bus id");
  info.pci_bus_id = bus_id;

  const struct {
    CUdevice_attribute attribute;
    const char* attribute_name;
    int* value;
  } required[] = {
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
       &info.compute_capability_major},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
       &info.compute_capability_minor},
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
       &info.multiprocessor_count},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
       &info.max_threads_per_block},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X",
       &info.max_block_dim[0]},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y",
       &info.max_block_dim[1]},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, "CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z",
       &info.max_block_dim[2]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X",
       &info.max_grid_dim[0]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y",
       &info.max_grid_dim[1]},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z",
       &info.max_grid_dim[2]},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
       "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK", &info.max_shared_memory_per_block_bytes},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
       "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
       &info.max_shared_memory_per_block_optin_bytes},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, "CU_DEVICE_ATTRIBUTE_WARP_SIZE", &info.warp_size},
  };
  for (const auto& query : required) {
    result = api.cuDeviceGetAttribute(query.value, query.attribute, device);
    if (result != CUDA_SUCCESS) return fail("cuDeviceGetAttribute", query.attribute_name);
  }

  // Everything else the driver answers; values it does not know (reserved or removed
  // attributes) are left out.
  for (int attribute = 1; attribute < static_cast<int>(CU_DEVICE_ATTRIBUTE_MAX); ++attribute) {
    int value = 0;
    if (api.cuDeviceGetAttribute(&value, static_cast<CUdevice_attribute>(attribute), device) ==
        CUDA_SUCCESS) {
      info.attributes[attribute] = value;
    }
  }
  info.is_fake = false;
  return info;
}

absl::Status NoDeviceError(const DriverApi& api) {
  return absl::UnavailableError(
      absl::StrCat("no CUDA device: the NVIDIA driver (CUDA ", api.driver_version / 1000, ".",
                   (api.driver_version % 1000) / 10, ") reports 0 devices"));
}

}  // namespace gpurpc::backend::cuda
