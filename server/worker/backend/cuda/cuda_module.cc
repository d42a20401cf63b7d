#include "server/worker/backend/cuda/cuda_module.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/worker/backend/cuda/driver_api.h"

namespace gpurpc::backend::cuda {
namespace {

// More parameters than fit in the 32764-byte parameter space means the driver never said
// "no more".
constexpr size_t kMaxKernelParams = 32764;

}  // namespace

absl::Status CudaFunction::RaiseDynamicShared(ContextCore& core, uint32_t bytes) {
  absl::MutexLock lock(&raise_mu_);
  if (bytes <= dynamic_shared_limit_.load(std::memory_order_acquire)) {
    return absl::OkStatus();
  }
  const CUresult result = core.api().cuFuncSetAttribute(
      handle_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(bytes));
  if (result != CUDA_SUCCESS) {
    return core.Error(result, "cuFuncSetAttribute",
                      absl::StrCat("kernel ", name_, ": cannot allow ", bytes,
                                   " bytes of dynamic shared memory (the kernel uses ",
                                   attributes_.shared_size_bytes,
                                   " bytes of static shared memory; see the device's "
                                   "max_shared_memory_per_block_optin_bytes)"));
  }
  dynamic_shared_limit_.store(bytes, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status CudaFunction::SetAttribute(ContextCore& core, CUfunction_attribute attribute,
                                        const char* attribute_name, int value) {
  absl::MutexLock lock(&raise_mu_);
  const CUresult result = core.api().cuFuncSetAttribute(handle_, attribute, value);
  if (result != CUDA_SUCCESS) {
    return core.Error(result, "cuFuncSetAttribute",
                      absl::StrCat(attribute_name, " = ", value, " for kernel ", name_));
  }
  if (attribute == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    dynamic_shared_limit_.store(static_cast<uint32_t>(std::max(0, value)),
                                std::memory_order_release);
  }
  return absl::OkStatus();
}

CudaModule::~CudaModule() {
  functions_.clear();  // Handles only; the driver frees them with the module.
  const DriverApi& api = core_->api();
  core_->CleanUp("cuModuleUnload", [&] { return api.cuModuleUnload(module_); });
}

absl::StatusOr<Function*> CudaModule::GetFunction(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (auto it = functions_.find(name); it != functions_.end()) return it->second.get();

  GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
  const DriverApi& api = core_->api();
  CUfunction handle = nullptr;
  CUresult result = api.cuModuleGetFunction(&handle, module_, name.c_str());
  if (result != CUDA_SUCCESS) {
    return core_->Error(result, "cuModuleGetFunction",
                        result == CUDA_ERROR_NOT_FOUND
                            ? absl::StrCat("the module has no kernel named \"", name, "\"")
                            : absl::StrCat("kernel \"", name, "\""));
  }
  // Under lazy loading (the default since CUDA 12.2) some attributes need a fully
  // loaded function; load it now rather than on the first launch.
  result = api.cuFuncLoad(handle);
  if (result != CUDA_SUCCESS) {
    return core_->Error(result, "cuFuncLoad", absl::StrCat("kernel \"", name, "\""));
  }

  std::vector<ParamInfo> params;
  for (size_t i = 0;; ++i) {
    if (i > kMaxKernelParams) {
      return absl::InternalError(absl::StrCat("cuFuncGetParamInfo: kernel \"", name,
                                              "\" reports more than ", kMaxKernelParams,
                                              " parameters"));
    }
    size_t offset = 0;
    size_t size = 0;
    result = api.cuFuncGetParamInfo(handle, i, &offset, &size);
    if (result == CUDA_ERROR_INVALID_VALUE) break;  // Past the last parameter.
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuFuncGetParamInfo",
                          absl::StrCat("kernel \"", name, "\" parameter ", i));
    }
    params.push_back(ParamInfo{static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
  }

  FunctionAttributes attributes;
  const struct {
    CUfunction_attribute attribute;
    const char* attribute_name;
    int* value;
  } queries[] = {
      {CU_FUNC_ATTRIBUTE_NUM_REGS, "CU_FUNC_ATTRIBUTE_NUM_REGS", &attributes.num_regs},
      {CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES",
       &attributes.shared_size_bytes},
      {CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES",
       &attributes.const_size_bytes},
      {CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES",
       &attributes.local_size_bytes},
      {CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
       &attributes.max_threads_per_block},
      {CU_FUNC_ATTRIBUTE_PTX_VERSION, "CU_FUNC_ATTRIBUTE_PTX_VERSION", &attributes.ptx_version},
      {CU_FUNC_ATTRIBUTE_BINARY_VERSION, "CU_FUNC_ATTRIBUTE_BINARY_VERSION",
       &attributes.binary_version},
      {CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
       "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
       &attributes.max_dynamic_shared_size_bytes},
  };
  for (const auto& query : queries) {
    result = api.cuFuncGetAttribute(query.value, query.attribute, handle);
    if (result != CUDA_SUCCESS) {
      return core_->Error(result, "cuFuncGetAttribute",
                          absl::StrCat(query.attribute_name, " of kernel \"", name, "\""));
    }
  }

  auto function = std::make_unique<CudaFunction>(handle, name, std::move(params), attributes);
  Function* raw = function.get();
  functions_.emplace(name, std::move(function));
  return raw;
}

absl::StatusOr<Module::Global> CudaModule::GetGlobal(const std::string& name) {
  GPURPC_RETURN_IF_ERROR(core_->MakeCurrent());
  CUdeviceptr address = 0;
  size_t size = 0;
  const CUresult result = core_->api().cuModuleGetGlobal(&address, &size, module_, name.c_str());
  if (result != CUDA_SUCCESS) {
    return core_->Error(result, "cuModuleGetGlobal",
                        result == CUDA_ERROR_NOT_FOUND
                            ? absl::StrCat("the module has no global named \"", name, "\"")
                            : absl::StrCat("global \"", name, "\""));
  }
  return Global{static_cast<DevicePtr>(address), static_cast<uint64_t>(size)};
}

}  // namespace gpurpc::backend::cuda
