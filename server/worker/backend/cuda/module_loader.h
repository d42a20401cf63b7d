// Module loading and linking for the CUDA backend: the bodies of Context::LoadModule and
// Context::LinkModule (backend.h), which cuda_backend.cc forwards to.
//
// LoadCudaModule checks and prepares the image (module_image.h), bounds the device memory its
// globals take (ModuleFootprintBytes, module_footprint.h) before the driver sees it, then
// loads it with cuModuleLoadDataEx with JIT error and info logs. LinkCudaModule links the
// inputs with the driver's JIT linker (cuLinkCreate, cuLinkAddData, cuLinkComplete) and
// loads the result as LoadCudaModule does. Both make the context current themselves.
//
// Threading: no state of their own; they may be called from several threads at once, as
// the Context's methods may (backend.h).
// Errors (backend.h): an image or input that is refused, before the driver or by it, is
// INVALID_ARGUMENT naming the driver call, with the JIT or linker error log; out of memory,
// sticky faults and a missing driver keep their codes (RESOURCE_EXHAUSTED, ABORTED,
// DATA_LOSS, UNAVAILABLE).
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_LOADER_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_LOADER_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/context_core.h"

namespace gpurpc::backend::cuda {

// Context::LoadModule: a CudaModule (cuda_module.h) of `image` in `core`'s context.
absl::StatusOr<std::unique_ptr<Module>> LoadCudaModule(const std::shared_ptr<ContextCore>& core,
                                                       absl::Span<const uint8_t> image);

// Context::LinkModule: `inputs` (at least one) linked for `core`'s device and loaded.
absl::StatusOr<LinkedModule> LinkCudaModule(const std::shared_ptr<ContextCore>& core,
                                            absl::Span<const LinkInput> inputs, bool log_verbose);

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_MODULE_LOADER_H_
