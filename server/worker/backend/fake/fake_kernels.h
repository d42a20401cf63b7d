// The fake backend's built-in kernels: the few kernels it can run, implemented on the host and
// picked by name when a module defines them (fake_backend.cc), each with the parameter layout
// the CUDA compiler gives its C signature. The fake's memory model stays in fake_device.h
// (DeviceState): a kernel reaches device memory only through the `access` it is given.
#ifndef GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_KERNELS_H_
#define GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_KERNELS_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"

namespace gpurpc::backend::fake {

enum class KernelKind {
  kMultiplyThem,
  kAxpyF32,
  kFillU32,
  kAddOneF32,
  kCopyBytes,
  kFaultIllegalAddress,
  kSpinUs,
  kPrintI32,
};

struct BuiltinKernel {
  KernelKind kind;
  const char* name;
  // The C signature, for messages.
  const char* signature;
  // Laid out as the CUDA compiler lays out the C signature: each parameter at an offset
  // aligned to its size.
  std::vector<ParamInfo> params;
};

// Every built-in, in a fixed order.
const std::vector<BuiltinKernel>& BuiltinKernels();
// "multiply_them, axpy_f32, ...", for messages.
std::string BuiltinKernelNames();
// The built-in called `name`, or nullptr.
const BuiltinKernel* FindBuiltinKernel(absl::string_view name);

// The size of the kernel's packed arguments: the end of its last parameter.
uint64_t PackedSizeBytes(const BuiltinKernel& kernel);

// Parameter `index` from a packed argument buffer whose size has been checked.
template <typename T>
T Arg(const BuiltinKernel& kernel, absl::Span<const uint8_t> packed_args, size_t index) {
  T value;
  std::memcpy(&value, packed_args.data() + kernel.params[index].offset_bytes, sizeof(T));
  return value;
}

// Element i of a host buffer, through memcpy because the bytes carry no C++ object.
template <typename T>
T LoadElement(const uint8_t* base, uint64_t i) {
  T value;
  std::memcpy(&value, base + i * sizeof(T), sizeof(T));
  return value;
}

template <typename T>
void StoreElement(uint8_t* base, uint64_t i, T value) {
  std::memcpy(base + i * sizeof(T), &value, sizeof(T));
}

// Runs `kernel` with `threads` threads over `packed_args` (already checked against the
// layout). Element i is processed when i < threads (and i < n for kernels that take n).
// `access(ptr, count, element_size)` gives the host bytes of `count` (> 0) elements at device
// address `ptr`, or nullptr after the memory model has recorded the fault that access makes;
// every pointer's whole range is resolved before anything is written, so a faulting kernel
// writes nothing. `fault()` records fault_illegal_address's fault. spin_us does nothing here
// (the caller sleeps, without its lock); print_i32 prints to stdout.
void RunBuiltinKernel(const BuiltinKernel& kernel, uint64_t threads,
                      absl::Span<const uint8_t> packed_args,
                      absl::FunctionRef<uint8_t*(DevicePtr, uint64_t, uint64_t)> access,
                      absl::FunctionRef<void()> fault);

}  // namespace gpurpc::backend::fake

#endif  // GPURPC_SERVER_WORKER_BACKEND_FAKE_FAKE_KERNELS_H_
