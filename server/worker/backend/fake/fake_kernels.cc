#include "server/worker/backend/fake/fake_kernels.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_join.h"

namespace gpurpc::backend::fake {

const std::vector<BuiltinKernel>& BuiltinKernels() {
  static const auto* const kKernels = new std::vector<BuiltinKernel>{
      // PyCUDA's canonical example.
      {KernelKind::kMultiplyThem,
       "multiply_them",
       "(float* dest, const float* a, const float* b)",
       {{0, 8}, {8, 8}, {16, 8}}},
      {KernelKind::kAxpyF32,
       "axpy_f32",
       "(float a, const float* x, float* y, unsigned long long n)",
       {{0, 4}, {8, 8}, {16, 8}, {24, 8}}},
      {KernelKind::kFillU32,
       "fill_u32",
       "(unsigned* out, unsigned value, unsigned long long n)",
       {{0, 8}, {8, 4}, {16, 8}}},
      {KernelKind::kAddOneF32,
       "add_one_f32",
       "(float* data, unsigned long long n)",
       {{0, 8}, {8, 8}}},
      {KernelKind::kCopyBytes,
       "copy_bytes",
       "(char* dst, const char* src, unsigned long long n)",
       {{0, 8}, {8, 8}, {16, 8}}},
      {KernelKind::kFaultIllegalAddress, "fault_illegal_address", "()", {}},
      {KernelKind::kSpinUs, "spin_us", "(unsigned long long microseconds)", {{0, 8}}},
      // Device printf: one line "<name> <i> <value>" per element, as a GPU would print
      // them (to the worker's stdout, which device_output.h hands to the client).
      {KernelKind::kPrintI32,
       "print_i32",
       "(const int* values, unsigned long long n)",
       {{0, 8}, {8, 8}}},
  };
  return *kKernels;
}

std::string BuiltinKernelNames() {
  return absl::StrJoin(BuiltinKernels(), ", ",
                       [](std::string* out, const BuiltinKernel& k) { out->append(k.name); });
}

const BuiltinKernel* FindBuiltinKernel(absl::string_view name) {
  for (const BuiltinKernel& kernel : BuiltinKernels()) {
    if (kernel.name == name) return &kernel;
  }
  return nullptr;
}

uint64_t PackedSizeBytes(const BuiltinKernel& kernel) {
  if (kernel.params.empty()) return 0;
  return uint64_t{kernel.params.back().offset_bytes} + kernel.params.back().size_bytes;
}

void RunBuiltinKernel(const BuiltinKernel& k, uint64_t threads, absl::Span<const uint8_t> args,
                      absl::FunctionRef<uint8_t*(DevicePtr, uint64_t, uint64_t)> access_memory,
                      absl::FunctionRef<void()> fault) {
  const auto access = [&](size_t param, uint64_t count, uint64_t element_size_bytes) {
    return access_memory(Arg<DevicePtr>(k, args, param), count, element_size_bytes);
  };
  switch (k.kind) {
    case KernelKind::kMultiplyThem: {
      const uint64_t n = threads;
      uint8_t* const dest = access(0, n, sizeof(float));
      if (dest == nullptr) return;
      const uint8_t* const a = access(1, n, sizeof(float));
      if (a == nullptr) return;
      const uint8_t* const b = access(2, n, sizeof(float));
      if (b == nullptr) return;
      for (uint64_t i = 0; i < n; ++i) {
        StoreElement<float>(dest, i, LoadElement<float>(a, i) * LoadElement<float>(b, i));
      }
      return;
    }
    case KernelKind::kAxpyF32: {
      const float alpha = Arg<float>(k, args, 0);
      const uint64_t n = std::min(threads, Arg<uint64_t>(k, args, 3));
      if (n == 0) return;
      const uint8_t* const x = access(1, n, sizeof(float));
      if (x == nullptr) return;
      uint8_t* const y = access(2, n, sizeof(float));
      if (y == nullptr) return;
      for (uint64_t i = 0; i < n; ++i) {
        StoreElement<float>(y, i, alpha * LoadElement<float>(x, i) + LoadElement<float>(y, i));
      }
      return;
    }
    case KernelKind::kFillU32: {
      const uint32_t value = Arg<uint32_t>(k, args, 1);
      const uint64_t n = std::min(threads, Arg<uint64_t>(k, args, 2));
      if (n == 0) return;
      uint8_t* const out = access(0, n, sizeof(uint32_t));
      if (out == nullptr) return;
      for (uint64_t i = 0; i < n; ++i) StoreElement<uint32_t>(out, i, value);
      return;
    }
    case KernelKind::kAddOneF32: {
      const uint64_t n = std::min(threads, Arg<uint64_t>(k, args, 1));
      if (n == 0) return;
      uint8_t* const data = access(0, n, sizeof(float));
      if (data == nullptr) return;
      for (uint64_t i = 0; i < n; ++i) {
        StoreElement<float>(data, i, LoadElement<float>(data, i) + 1.0f);
      }
      return;
    }
    case KernelKind::kCopyBytes: {
      const uint64_t n = std::min(threads, Arg<uint64_t>(k, args, 2));
      if (n == 0) return;
      uint8_t* const dst = access(0, n, 1);
      if (dst == nullptr) return;
      const uint8_t* const src = access(1, n, 1);
      if (src == nullptr) return;
      std::memmove(dst, src, n);
      return;
    }
    case KernelKind::kFaultIllegalAddress:
      fault();
      return;
    case KernelKind::kSpinUs:
      return;  // SpinLocked
    case KernelKind::kPrintI32: {
      const uint64_t n = std::min(threads, Arg<uint64_t>(k, args, 1));
      if (n == 0) return;
      const uint8_t* const values = access(0, n, sizeof(int32_t));
      if (values == nullptr) return;
      for (uint64_t i = 0; i < n; ++i) {
        std::printf("print_i32 %llu %d\n", static_cast<unsigned long long>(i),
                    LoadElement<int32_t>(values, i));
      }
      return;
    }
  }
}

}  // namespace gpurpc::backend::fake
