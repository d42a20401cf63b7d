// Launch and compile costs through gpurpcd against direct driver calls in the same run:
// launch+synchronize round trip (and a bare gRPC ping on the same channel), asynchronous
// launches per second through the command stream, NVRTC compile cold and cached.
#include <cstring>
#include <string>
#include <vector>

#include "tests/benchmarks/bench_common.h"

namespace gpurpc::bench {
namespace {

constexpr char kKernel[] = R"(
extern "C" __global__ void touch(float* x, int n) {
  if (n < 0) x[threadIdx.x] = 1.0f;  // never true: an empty kernel with real parameters
}
)";

struct Measurement {
  std::string what;
  double value;
  std::string unit;
};

int Main(int argc, char** argv) {
  DaemonUnderTest daemon = StartDaemon(argc, argv);
  const std::string address =
      daemon.unix_address.empty() ? daemon.tcp_address : daemon.unix_address;
  auto client = Client::Connect(address);
  Check(client.status(), "connect");
  auto session = client->OpenSession(0, "bench_compute");
  Check(session.status(), "open session");

  // Compile: cold (a source nobody compiled before) and cached.
  const std::string unique_source =
      kKernel + std::string("// ") + std::to_string(std::chrono::steady_clock::now()
                                                        .time_since_epoch()
                                                        .count()) + "\n";
  auto start = std::chrono::steady_clock::now();
  CompileOptions compile_options;
  compile_options.source = unique_source;
  auto cold = session->Compile(compile_options);
  const double cold_ms = Seconds(start) * 1e3;
  Check(cold.status(), "compile");
  if (!cold->success() || cold->response.cache_hit()) {
    std::fprintf(stderr, "cold compile failed or hit: %s\n", cold->log().c_str());
    return 1;
  }
  constexpr int kCachedCompiles = 200;
  start = std::chrono::steady_clock::now();
  bool all_hits = true;
  for (int i = 0; i < kCachedCompiles; ++i) {
    auto cached = session->Compile(compile_options);
    Check(cached.status(), "cached compile");
    all_hits &= cached->response.cache_hit();
  }
  const double cached_ms = Seconds(start) * 1e3 / kCachedCompiles;
  // The bare front-end ping, for the cached compile's share of it.
  constexpr int kPings = 5000;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPings; ++i) Check(session->KeepAlive().status(), "ping");
  const double ping_us = Seconds(start) * 1e6 / kPings;

  auto function = cold->module.GetFunction("touch");
  Check(function.status(), "get function");
  auto buffer = session->Allocate(1024);
  Check(buffer.status(), "allocate");
  LaunchConfig config;
  config.block = Dim3{32, 1, 1};

  // Launch + synchronize round trip through the command stream.
  constexpr int kRoundTrips = 5000;
  for (int i = 0; i < 100; ++i) Check(function->LaunchAsync(config, *buffer, 1), "warm up");
  Check(session->Synchronize(), "sync");
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRoundTrips; ++i) {
    Check(function->LaunchAsync(config, *buffer, 1), "launch");
    Check(session->Synchronize(), "sync");
  }
  const double daemon_round_trip_us = Seconds(start) * 1e6 / kRoundTrips;
  // The same with unary RPCs (one for the launch, one for the sync).
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRoundTrips / 5; ++i) {
    Check(function->Launch(config, *buffer, 1), "unary launch");
    Check(session->Synchronize(), "sync");
  }
  const double daemon_unary_round_trip_us = Seconds(start) * 1e6 / (kRoundTrips / 5);

  // Asynchronous launches per second through the command stream.
  constexpr int kLaunches = 300000;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kLaunches; ++i) Check(function->LaunchAsync(config, *buffer, 1), "launch");
  Check(session->Synchronize(), "sync");
  const double daemon_launch_rate = kLaunches / Seconds(start);

  // Direct driver calls on the same GPU, same cubin.
  const backend::cuda::DriverApi* api = DriverWithContext();
  CUmodule module;
  BENCH_CHECK_CU(api, api->cuModuleLoadDataEx(&module, cold->response.image().data(), 0,
                                              nullptr, nullptr));
  CUfunction kernel;
  BENCH_CHECK_CU(api, api->cuModuleGetFunction(&kernel, module, "touch"));
  CUdeviceptr x;
  BENCH_CHECK_CU(api, api->cuMemAlloc(&x, 1024));
  int n = 1;
  void* params[] = {&x, &n};
  for (int i = 0; i < 100; ++i) {
    BENCH_CHECK_CU(api, api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
  }
  BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRoundTrips; ++i) {
    BENCH_CHECK_CU(api, api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
  }
  const double direct_round_trip_us = Seconds(start) * 1e6 / kRoundTrips;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kLaunches; ++i) {
    BENCH_CHECK_CU(api, api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
  }
  BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
  const double direct_launch_rate = kLaunches / Seconds(start);

  std::printf("\nCompute path, one run (%s)\n", address.c_str());
  std::printf("%-55s %14s %14s %10s\n", "measure", "gpurpcd", "baseline", "ratio");
  std::printf("%-55s %11.1f us %11.1f us %9.2fx\n",
              "launch+sync round trip (command stream) vs bare ping", daemon_round_trip_us,
              ping_us, daemon_round_trip_us / ping_us);
  std::printf("%-55s %11.1f us %11.1f us %9.2fx\n",
              "launch+sync round trip (command stream) vs direct", daemon_round_trip_us,
              direct_round_trip_us, daemon_round_trip_us / direct_round_trip_us);
  std::printf("%-55s %11.1f us %11.1f us %9.2fx\n", "launch+sync round trip (unary RPCs) vs ping",
              daemon_unary_round_trip_us, ping_us, daemon_unary_round_trip_us / ping_us);
  std::printf("%-55s %12.0f/s %12.0f/s %9.2fx\n", "async launches per second vs cuLaunchKernel",
              daemon_launch_rate, direct_launch_rate, daemon_launch_rate / direct_launch_rate);
  std::printf("%-55s %11.3f ms %14s %10s\n", "NVRTC compile, cold (miss)", cold_ms, "-", "-");
  std::printf("%-55s %11.3f ms %11.1f us %9.2fx\n",
              all_hits ? "NVRTC compile, cached (hit) vs bare ping"
                       : "NVRTC compile, repeated (NOT ALL HITS) vs bare ping",
              cached_ms, ping_us, cached_ms * 1e3 / ping_us);
  std::printf("targets: >= 150000 launches/s; round trip <= 1.5x ping; cached compile <= 1 ms\n");
  api->cuMemFree(x);
  api->cuModuleUnload(module);
  return 0;
}

}  // namespace
}  // namespace gpurpc::bench

int main(int argc, char** argv) { return gpurpc::bench::Main(argc, argv); }
