// Device enumeration for the CUDA backend: what backend.h's DeviceInfo reports about a device,
// queried from the driver (cuda_backend.cc's Backend::ListDevices and OpenContext).
//
// QueryDeviceInfo reads the name, total memory, PCI bus id, the attributes DeviceInfo has
// fields for, and every other CUdevice_attribute the driver answers. NoDeviceError is the
// status for a driver that reports no device.
//
// Threading: no state; callable from any thread (DriverApi is immutable). Needs no context.
// Errors: the failed driver call's status (CuResultToStatus, cuda_status.h), naming the call
// and what was asked of which device. No context is involved, so nothing is poisoned.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_DEVICE_INFO_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_DEVICE_INFO_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {

// The DeviceInfo of device `ordinal` (is_fake = false).
absl::StatusOr<DeviceInfo> QueryDeviceInfo(const DriverApi& api, int ordinal);

// UNAVAILABLE: "no CUDA device: the NVIDIA driver (CUDA X.Y) reports 0 devices".
absl::Status NoDeviceError(const DriverApi& api);

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_DEVICE_INFO_H_
