// What the compute tests share (compute_*_test.cc, one binary `compute_test`, ctest label
// `service`): compile, launch, command-stream, fault, stream/event and module-global
// behaviour of the real gpurpcd with real worker processes on the fake backend, through the
// C++ client and, where the client hides the protocol, the raw gpurpc.v1 stubs.
//
// NVRTC compiles for real in the fake worker (compute_75 PTX); the fake then runs its
// built-in host "kernels" by name, so the sources below define real CUDA kernels with
// exactly the names and signatures of those built-ins (extern "C", so that the names are
// the plain ones on a GPU too).

#ifndef GPURPC_TESTS_SERVICE_COMPUTE_FIXTURE_H_
#define GPURPC_TESTS_SERVICE_COMPUTE_FIXTURE_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/shared_daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc::compute_test {

using ::gpurpc::testing::CompileFakeKernels;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::IsOkAndHolds;
using ::gpurpc::testing::SharedDaemonTest;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::Ge;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;
using ::testing::StartsWith;

// The fake backend's built-in kernels as real CUDA (tests/testing/fake_kernels.h).
inline constexpr const char* kFakeKernels = ::gpurpc::testing::kFakeKernelsSource;

// Module globals in device and constant memory, kept alive by a kernel that uses them.
inline constexpr char kGlobals[] = R"cuda(
__device__ float g[4];
__constant__ float c[4];
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += g[i % 4] + c[i % 4];
}
)cuda";

template <typename T>
std::vector<uint8_t> ToBytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

inline CompileOptions Source(std::string source, std::string program_name = "kernel.cu") {
  CompileOptions options;
  options.source = std::move(source);
  options.program_name = std::move(program_name);
  return options;
}

inline CompileOptions WithOptions(std::string source, std::vector<std::string> nvrtc_options) {
  CompileOptions options = Source(std::move(source));
  options.options = std::move(nvrtc_options);
  return options;
}

inline CompileOptions WithNames(std::string source, std::vector<std::string> name_expressions) {
  CompileOptions options = Source(std::move(source));
  options.name_expressions = std::move(name_expressions);
  return options;
}

// `grid` blocks of `block` threads, along x.
inline LaunchConfig Linear(uint32_t grid, uint32_t block, const Stream* stream = nullptr) {
  LaunchConfig config;
  config.grid.x = grid;
  config.block.x = block;
  config.stream = stream;
  return config;
}

inline TestDaemon::Options DaemonWithCache(const std::string& cache_dir) {
  TestDaemon::Options options;
  options.cache_dir = cache_dir;
  return options;
}

inline TestDaemon::Options NoWarmWorkers() {
  TestDaemon::Options options;
  options.warm_workers = 0;
  return options;
}

inline uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A packed argument blob laid out by a function's parameter offsets.
class Blob {
 public:
  explicit Blob(size_t size_bytes) : bytes_(size_bytes, '\0') {}
  template <typename T>
  Blob& Put(uint32_t offset_bytes, T value) {
    std::memcpy(bytes_.data() + offset_bytes, &value, sizeof(T));
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

inline void SetDim(uint32_t x, uint32_t y, uint32_t z, v1::Dim3* dim) {
  dim->set_x(x);
  dim->set_y(y);
  dim->set_z(z);
}

// The raw gpurpc.v1 API for one session: what the C++ client does not expose (typed
// arguments, destroying by id, the command stream's replies).
class RawSession {
 public:
  RawSession(const Client& client, const Session& session)
      : session_id_(std::to_string(session.id())),
        execution_(v1::ExecutionService::NewStub(client.channel())),
        modules_(v1::ModuleService::NewStub(client.channel())) {}

  void Prepare(grpc::ClientContext* context) const {
    context->AddMetadata(kSessionMetadataKey, session_id_);
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  v1::ExecutionService::Stub& execution() { return *execution_; }

  absl::Status Launch(const v1::LaunchCommand& launch, bool synchronize = false) {
    v1::LaunchRequest request;
    *request.mutable_launch() = launch;
    request.set_synchronize(synchronize);
    v1::LaunchResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->Launch(&context, request, &response));
  }

  absl::StatusOr<uint64_t> CreateStream() {
    v1::CreateStreamResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->CreateStream(&context, v1::CreateStreamRequest(), &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.stream_id();
  }

  absl::Status DestroyStream(uint64_t stream_id) {
    v1::DestroyStreamRequest request;
    request.set_stream_id(stream_id);
    v1::DestroyStreamResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->DestroyStream(&context, request, &response));
  }

  absl::StatusOr<uint64_t> CreateEvent() {
    v1::CreateEventResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->CreateEvent(&context, v1::CreateEventRequest(), &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.event_id();
  }

  absl::Status DestroyEvent(uint64_t event_id) {
    v1::DestroyEventRequest request;
    request.set_event_id(event_id);
    v1::DestroyEventResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    return FromGrpcStatus(execution_->DestroyEvent(&context, request, &response));
  }

  absl::StatusOr<float> ElapsedTime(uint64_t start_event_id, uint64_t end_event_id) {
    v1::EventElapsedTimeRequest request;
    request.set_start_event_id(start_event_id);
    request.set_end_event_id(end_event_id);
    v1::EventElapsedTimeResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = execution_->EventElapsedTime(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response.elapsed_ms();
  }

  absl::StatusOr<v1::GetFunctionResponse> GetFunction(uint64_t module_id, const std::string& name) {
    v1::GetFunctionRequest request;
    request.set_module_id(module_id);
    request.set_name(name);
    v1::GetFunctionResponse response;
    grpc::ClientContext context;
    Prepare(&context);
    grpc::Status status = modules_->GetFunction(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }

 private:
  const std::string session_id_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
};

// A temporary folder shared by daemons started one after the other.
class TempDir {
 public:
  TempDir() {
    char path[] = "/tmp/gpurpc-compute-test-XXXXXX";
    if (mkdtemp(path) != nullptr) path_ = path;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The cache file that holds `cache_key`, searched for under `dir`.
inline std::optional<std::filesystem::path> FindCacheFile(const std::string& dir,
                                                          const std::string& cache_key) {
  std::error_code error;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (it->is_regular_file() &&
        it->path().filename().string().find(cache_key) != std::string::npos) {
      return it->path();
    }
  }
  return std::nullopt;
}

class ComputeTest : public SharedDaemonTest<ComputeTest> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SharedDaemonTest::SetUp());
    auto client = Client::Connect(daemon().address());
    ASSERT_OK(client.status());
    client_.emplace(*std::move(client));
    ASSERT_OK_AND_ASSIGN(session_, client_->OpenSession());
  }

  absl::StatusOr<Function> FakeFunction(const std::string& name) {
    if (!fake_module_.has_value()) {
      absl::StatusOr<Module> module = CompileFakeKernels(session_);
      if (!module.ok()) return module.status();
      fake_module_.emplace(*std::move(module));
    }
    return fake_module_->GetFunction(name);
  }

  static std::vector<float> Iota(size_t n, float start, float step) {
    std::vector<float> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = start + step * static_cast<float>(i);
    return values;
  }

  absl::StatusOr<std::vector<float>> DownloadFloats(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<float>(*bytes);
  }

  absl::StatusOr<std::vector<uint32_t>> DownloadU32(const Buffer& buffer) {
    absl::StatusOr<std::vector<uint8_t>> bytes = buffer.Download();
    if (!bytes.ok()) return bytes.status();
    return FromBytes<uint32_t>(*bytes);
  }

  // A launch of axpy_f32 with valid arguments for the raw API, to be spoiled by a test.
  v1::LaunchCommand ValidAxpyLaunch(const Function& axpy, const Buffer& x, const Buffer& y,
                                    uint64_t n) {
    v1::LaunchCommand launch;
    launch.set_function_id(axpy.id());
    SetDim(1, 1, 1, launch.mutable_grid());
    SetDim(static_cast<uint32_t>(n), 1, 1, launch.mutable_block());
    launch.add_args()->set_f32(2.0f);
    launch.add_args()->mutable_buffer()->set_buffer_id(x.id());
    launch.add_args()->mutable_buffer()->set_buffer_id(y.id());
    launch.add_args()->set_u64(n);
    return launch;
  }

  std::optional<Client> client_;
  Session session_;
  std::optional<Module> fake_module_;
};

}  // namespace gpurpc::compute_test

#endif  // GPURPC_TESTS_SERVICE_COMPUTE_FIXTURE_H_
