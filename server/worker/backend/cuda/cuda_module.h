// Loaded modules and their kernels in the CUDA backend (backend.h's Module and Function), and
// the launch parameters that pass a kernel its packed arguments.
//
// - CudaModule owns one CUmodule (cuModuleUnload when destroyed, skipped on a poisoned
//   context) and looks up kernels and globals by name. A kernel is looked up once
//   (cuModuleGetFunction, cuFuncLoad), with its parameter layout (cuFuncGetParamInfo: each
//   parameter's offset and size in the packed argument buffer) and its attributes
//   (cuFuncGetAttribute); the CudaFunction it makes lives as long as the module.
// - CudaFunction remembers the dynamic shared memory its launches may use, which Launch
//   raises when a launch asks for more (RaiseDynamicShared).
// - PackedLaunchArgs: the `extra` parameters of cuLaunchKernel / CUDA_KERNEL_NODE_PARAMS for
//   an argument buffer packed as CudaFunction::params() describes.
// Modules are made by module_loader.h.
//
// Threading: CudaModule serialises its lookups (one mutex per module); a CudaFunction's
// parameters and attributes are immutable, and its attribute changes are serialised by its
// own mutex while launches read the dynamic shared limit without it (an atomic).
// Errors: the failed driver call's status (ContextCore::Error), NOT_FOUND for a name the
// module does not have.
#ifndef GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_MODULE_H_
#define GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_MODULE_H_

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"
#include "server/worker/backend/cuda/context_core.h"

namespace gpurpc::backend::cuda {

class CudaFunction final : public Function {
 public:
  CudaFunction(CUfunction handle, std::string name, std::vector<ParamInfo> params,
               const FunctionAttributes& attributes)
      : handle_(handle),
        name_(std::move(name)),
        params_(std::move(params)),
        attributes_(attributes),
        dynamic_shared_limit_(
            static_cast<uint32_t>(std::max(0, attributes.max_dynamic_shared_size_bytes))) {}

  const std::vector<ParamInfo>& params() const override { return params_; }
  const FunctionAttributes& attributes() const override { return attributes_; }

  CUfunction handle() const { return handle_; }
  const std::string& name() const { return name_; }

  bool NeedsMoreDynamicShared(uint32_t bytes) const {
    return bytes > dynamic_shared_limit_.load(std::memory_order_acquire);
  }

  // Raises CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to at least `bytes`. Only ever
  // raises it, so concurrent launches asking for different sizes all stay valid.
  ABSL_ATTRIBUTE_NOINLINE absl::Status RaiseDynamicShared(ContextCore& core, uint32_t bytes)
      ABSL_LOCKS_EXCLUDED(raise_mu_);

  // cuFuncSetAttribute. A new MAX_DYNAMIC_SHARED_SIZE_BYTES is also where RaiseDynamicShared
  // starts from (it may lower it: a later launch that asks for more raises it again).
  absl::Status SetAttribute(ContextCore& core, CUfunction_attribute attribute,
                            const char* attribute_name, int value) ABSL_LOCKS_EXCLUDED(raise_mu_);

 private:
  const CUfunction handle_;
  const std::string name_;
  const std::vector<ParamInfo> params_;
  const FunctionAttributes attributes_;
  // Stored only with raise_mu_ held, but loaded without it on the launch path (hence an
  // atomic, and no ABSL_GUARDED_BY).
  std::atomic<uint32_t> dynamic_shared_limit_;
  // Serialises the cuFuncSetAttribute calls on handle_ with the check-and-store of
  // dynamic_shared_limit_ that goes with them.
  absl::Mutex raise_mu_;
};

class CudaModule final : public Module {
 public:
  CudaModule(std::shared_ptr<ContextCore> core, CUmodule module, uint64_t device_memory_bytes)
      : core_(std::move(core)), module_(module), device_memory_bytes_(device_memory_bytes) {}

  ~CudaModule() override;

  absl::StatusOr<Function*> GetFunction(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_) override;
  absl::StatusOr<Global> GetGlobal(const std::string& name) override;
  uint64_t device_memory_bytes() const override { return device_memory_bytes_; }

 private:
  const std::shared_ptr<ContextCore> core_;
  const CUmodule module_;
  const uint64_t device_memory_bytes_;
  absl::Mutex mu_;
  // Stable addresses: Function pointers are handed out.
  std::map<std::string, std::unique_ptr<CudaFunction>> functions_ ABSL_GUARDED_BY(mu_);
};

// The `extra` launch parameters (CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE) for `packed_args`.
// It points into `packed_args` and into itself, so it is neither copied nor moved: it lives
// on the caller's stack for the driver call (which copies the arguments). Allocates nothing.
class PackedLaunchArgs {
 public:
  explicit PackedLaunchArgs(absl::Span<const uint8_t> packed_args)
      : size_(packed_args.size()),
        extra_{
            CU_LAUNCH_PARAM_BUFFER_POINTER,
            const_cast<uint8_t*>(packed_args.data()),
            CU_LAUNCH_PARAM_BUFFER_SIZE,
            &size_,
            CU_LAUNCH_PARAM_END,
        } {}

  PackedLaunchArgs(const PackedLaunchArgs&) = delete;
  PackedLaunchArgs& operator=(const PackedLaunchArgs&) = delete;

  size_t size_bytes() const { return size_; }
  // What the driver takes as `extra`: nullptr for a kernel without parameters.
  void** extra() { return size_ == 0 ? nullptr : extra_; }

 private:
  size_t size_;
  void* extra_[5];
};

}  // namespace gpurpc::backend::cuda

#endif  // GPURPC_SERVER_WORKER_BACKEND_CUDA_CUDA_MODULE_H_
