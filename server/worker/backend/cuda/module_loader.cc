#include "server/worker/backend/cuda/module_loader.h"

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/worker/backend/cuda/cuda_module.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "server/worker/backend/cuda/module_image.h"
#include "server/worker/backend/module_footprint.h"
#include "spdlog/spdlog.h"

namespace gpurpc::backend::cuda {
namespace {

// JIT log buffers for cuModuleLoadDataEx.
constexpr size_t kJitLogBytes = 16 << 10;

}  // namespace

absl::StatusOr<std::unique_ptr<Module>> LoadCudaModule(const std::shared_ptr<ContextCore>& core,
                                                       absl::Span<const uint8_t> image) {
  const DriverApi& api = core->api();
  // Refusals before the driver sees the image name the call that would have refused it,
  // as the driver's own refusals (and the fake's) do.
  const auto refused_early = [](const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuModuleLoadDataEx: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid) - ",
        status.message()));
  };
  absl::StatusOr<ModuleImage> prepared_or = ModuleImage::Prepare(image);
  if (!prepared_or.ok()) return refused_early(prepared_or.status());
  ModuleImage prepared = *std::move(prepared_or);
  // Before the driver allocates the globals: an image whose footprint cannot be known is
  // refused here.
  const absl::StatusOr<uint64_t> footprint = ModuleFootprintBytes(image);
  if (!footprint.ok()) return refused_early(footprint.status());
  const uint64_t device_memory_bytes = *footprint;
  GPURPC_RETURN_IF_ERROR(core->MakeCurrent());
  std::string error_log(kJitLogBytes, '\0');
  std::string info_log(kJitLogBytes, '\0');
  CUjit_option options[] = {
      CU_JIT_ERROR_LOG_BUFFER,
      CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
      CU_JIT_INFO_LOG_BUFFER,
      CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
  };
  // The size options are unsigned ints passed by value in the pointer slot.
  void* values[] = {
      error_log.data(),
      reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
      info_log.data(),
      reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
  };
  static_assert(sizeof(options) / sizeof(options[0]) == sizeof(values) / sizeof(values[0]));
  CUmodule module = nullptr;
  const CUresult result = api.cuModuleLoadDataEx(
      &module, prepared.data(), sizeof(options) / sizeof(options[0]), options, values);
  // The buffers were zero-filled and the driver was told one byte less than their size.
  error_log.resize(std::strlen(error_log.c_str()));
  info_log.resize(std::strlen(info_log.c_str()));
  if (result != CUDA_SUCCESS) {
    std::string detail = absl::StrCat(ModuleImageKindName(prepared.kind()), " image of ",
                                      prepared.size_bytes(), " bytes rejected");
    if (!error_log.empty()) absl::StrAppend(&detail, "; JIT error log: ", error_log);
    absl::Status status = core->Error(result, "cuModuleLoadDataEx", detail);
    switch (status.code()) {
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kAborted:
      case absl::StatusCode::kDataLoss:
      case absl::StatusCode::kUnavailable:
        return status;
      default:
        // Whatever the driver's reason, the image is what was wrong (backend.h).
        return absl::InvalidArgumentError(status.message());
    }
  }
  if (!info_log.empty()) spdlog::debug("cuModuleLoadDataEx info log: {}", info_log);
  return std::unique_ptr<Module>(std::make_unique<CudaModule>(core, module, device_memory_bytes));
}

absl::StatusOr<LinkedModule> LinkCudaModule(const std::shared_ptr<ContextCore>& core,
                                            absl::Span<const LinkInput> inputs, bool log_verbose) {
  if (inputs.empty()) return absl::InvalidArgumentError("cuLinkAddData: nothing to link");
  const DriverApi& api = core->api();
  GPURPC_RETURN_IF_ERROR(core->MakeCurrent());
  std::string error_log(kJitLogBytes, '\0');
  std::string info_log(kJitLogBytes, '\0');
  // The linker targets the current context's device. The log buffers stay valid until
  // cuLinkDestroy, which also frees the linked image.
  CUjit_option options[] = {
      CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
      CU_JIT_INFO_LOG_BUFFER,  CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
      CU_JIT_LOG_VERBOSE,
  };
  void* values[] = {
      error_log.data(),
      reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
      info_log.data(),
      reinterpret_cast<void*>(static_cast<uintptr_t>(kJitLogBytes - 1)),
      reinterpret_cast<void*>(static_cast<uintptr_t>(log_verbose ? 1 : 0)),
  };
  static_assert(sizeof(options) / sizeof(options[0]) == sizeof(values) / sizeof(values[0]));
  CUlinkState state = nullptr;
  CUresult result = api.cuLinkCreate(sizeof(options) / sizeof(options[0]), options, values, &state);
  if (result != CUDA_SUCCESS) return core->Error(result, "cuLinkCreate", "");
  struct Destroy {
    const DriverApi& api;
    std::shared_ptr<ContextCore> core;
    CUlinkState state;
    ~Destroy() {
      core->CleanUp("cuLinkDestroy", [&] { return api.cuLinkDestroy(state); });
    }
  } destroy{api, core, state};
  const auto logs = [&] {
    error_log.resize(std::strlen(error_log.c_str()));
    return error_log.empty() ? std::string() : absl::StrCat("; linker error log: ", error_log);
  };
  // An image the linker refuses, or a failed link, is what the caller sent (backend.h).
  const auto refused = [&](CUresult failed, const char* call, const std::string& detail) {
    absl::Status status = core->Error(failed, call, absl::StrCat(detail, logs()));
    switch (status.code()) {
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kAborted:
      case absl::StatusCode::kDataLoss:
      case absl::StatusCode::kUnavailable:
        return status;
      default:
        return absl::InvalidArgumentError(status.message());
    }
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    const LinkInput& input = inputs[i];
    std::vector<uint8_t> text;  // PTX must be NUL-terminated for the driver
    void* data = const_cast<uint8_t*>(input.data.data());
    size_t size = input.data.size();
    std::vector<uint64_t> aligned;  // binaries at 8-byte alignment, as ModuleImage does
    if (input.type == LinkInputType::kPtx && (size == 0 || input.data[size - 1] != 0)) {
      text.assign(input.data.begin(), input.data.end());
      text.push_back(0);
      data = text.data();
      size = text.size();
    } else if (input.type != LinkInputType::kPtx &&
               reinterpret_cast<uintptr_t>(data) % alignof(uint64_t) != 0) {
      aligned.assign(size / sizeof(uint64_t) + 1, 0);
      std::memcpy(aligned.data(), input.data.data(), size);
      data = aligned.data();
    }
    result = api.cuLinkAddData(state, static_cast<CUjitInputType>(input.type), data, size,
                               input.name.c_str(), 0, nullptr, nullptr);
    if (result != CUDA_SUCCESS) {
      return refused(result, "cuLinkAddData",
                     absl::StrCat("input ", i, " '", absl::CHexEscape(input.name), "' (",
                                  input.data.size(), " bytes) rejected"));
    }
  }
  void* linked = nullptr;
  size_t linked_bytes = 0;
  result = api.cuLinkComplete(state, &linked, &linked_bytes);
  if (result != CUDA_SUCCESS) return refused(result, "cuLinkComplete", "link failed");
  info_log.resize(std::strlen(info_log.c_str()));
  LinkedModule out;
  // The image is the linker's until cuLinkDestroy: LoadCudaModule reads it before that.
  GPURPC_ASSIGN_OR_RETURN(
      out.module, LoadCudaModule(core, absl::Span<const uint8_t>(
                                           static_cast<const uint8_t*>(linked), linked_bytes)));
  out.info_log = std::move(info_log);
  return out;
}

}  // namespace gpurpc::backend::cuda
