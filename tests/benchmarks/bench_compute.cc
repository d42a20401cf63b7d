// Launch and compile costs through gpurpcd against direct driver calls in the same run:
// launch+synchronize round trip (and a bare gRPC ping on the same channel; through the front
// end, and on a same-host session's direct channel to its worker), asynchronous
// launches per second through the command stream, NVRTC compile cold and cached, and a
// 100-kernel CUDA graph replayed with one command against the same 100 kernels launched one
// by one (through gpurpcd, and locally with cuLaunchKernel and cuGraphLaunch). On a daemon
// with several devices, also the aggregate launch rate of one session per device at once
// against one device alone.
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/benchmarks/bench_common.h"

namespace gpurpc::bench {
namespace {

// Launched with n = 0: an empty kernel with real parameters. Its name and parameter layout
// are the fake backend's built-in add_one_f32, so the program also runs on the fake backend
// (--daemon-arg=--backend=fake), where only the daemon's own costs are measured.
constexpr char kKernel[] = R"(
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}
)";
constexpr char kKernelName[] = "add_one_f32";

// Round trips are measured in rounds that interleave the paths (ping, command stream, unary
// RPCs), so that drift in the machine's load (a shared CI box) hits every path alike; each
// path's figure is its median over the rounds, each ratio the median of the rounds' ratios.
constexpr int kRounds = 7;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

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
      kKernel + std::string("// ") +
      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) + "\n";
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
  auto function = cold->module.GetFunction(kKernelName);
  Check(function.status(), "get function");
  auto buffer = session->Allocate(1024);
  Check(buffer.status(), "allocate");
  LaunchConfig config;
  config.block = Dim3{32, 1, 1};
  const uint64_t n = 0;

  // Warm up every path.
  for (int i = 0; i < 200; ++i) Check(session->KeepAlive().status(), "ping");
  for (int i = 0; i < 100; ++i) Check(function->LaunchAsync(config, *buffer, n), "warm up");
  Check(session->Synchronize(), "sync");
  for (int i = 0; i < 50; ++i) Check(function->Launch(config, *buffer, n), "warm up");
  Check(session->Synchronize(), "sync");

  // A second session on the same-host direct channel (Session::UseDirectChannel: the client
  // talks to its worker over a socket of its own, not through the front end), when the
  // daemon is reached over its Unix socket and serves a region socket.
  std::optional<Session> direct_session;
  std::optional<Function> direct_function;
  std::optional<Buffer> direct_buffer;
  std::string direct_note;
  if (!daemon.unix_address.empty()) {
    auto opened = client->OpenSession(0, "bench_compute direct");
    Check(opened.status(), "open the direct session");
    if (absl::Status chosen = opened->UseDirectChannel(); !chosen.ok()) {
      direct_note = std::string(chosen.message());
    } else {
      direct_session.emplace(*std::move(opened));
      auto compiled = direct_session->Compile(compile_options);
      Check(compiled.status(), "compile on the direct session");
      auto got = compiled->module.GetFunction(kKernelName);
      Check(got.status(), "get function (direct)");
      direct_function.emplace(*std::move(got));
      auto allocated = direct_session->Allocate(1024);
      Check(allocated.status(), "allocate (direct)");
      direct_buffer.emplace(*std::move(allocated));
      for (int i = 0; i < 200; ++i) {
        Check(direct_function->LaunchAsync(config, *direct_buffer, n), "warm up (direct)");
        Check(direct_session->Synchronize(), "sync (direct)");
      }
    }
  } else {
    direct_note = "the daemon is reached over TCP";
  }

  // The bare front-end ping (KeepAlive: answered by the front end, no worker), the
  // launch + synchronize round trip through the command stream (the launch is queued, the
  // sync marker sends it and waits for the worker's answer), and the same with unary RPCs
  // (one for the launch, relayed to the worker, then the sync; and one Launch with
  // `synchronize`, the launch and its wait in one relayed RPC).
  const int pings = daemon.fake() ? 500 : 1000;
  const int round_trips = daemon.fake() ? 500 : 1000;
  const int unary_round_trips = round_trips / 4;
  std::vector<double> ping_samples, stream_samples, unary_samples, stream_ratios, unary_ratios;
  std::vector<double> direct_samples, direct_ratios, unary_launch_samples;
  std::vector<double> fused_samples, fused_ratios;
  for (int round = 0; round < kRounds; ++round) {
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < pings; ++i) Check(session->KeepAlive().status(), "ping");
    const double ping = Seconds(start) * 1e6 / pings;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < round_trips; ++i) {
      Check(function->LaunchAsync(config, *buffer, n), "launch");
      Check(session->Synchronize(), "sync");
    }
    const double stream = Seconds(start) * 1e6 / round_trips;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < unary_round_trips; ++i) {
      Check(function->Launch(config, *buffer, n), "unary launch");
      Check(session->Synchronize(), "sync");
    }
    const double unary = Seconds(start) * 1e6 / unary_round_trips;
    // The unary launch alone (the work queues on the device; one RPC through the relay).
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < unary_round_trips; ++i) {
      Check(function->Launch(config, *buffer, n), "unary launch");
    }
    unary_launch_samples.push_back(Seconds(start) * 1e6 / unary_round_trips);
    Check(session->Synchronize(), "sync");
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < unary_round_trips; ++i) {
      Check(function->LaunchAndSynchronize(config, *buffer, n), "launch and synchronize");
    }
    const double fused = Seconds(start) * 1e6 / unary_round_trips;
    fused_samples.push_back(fused);
    fused_ratios.push_back(fused / ping);
    if (direct_session) {
      start = std::chrono::steady_clock::now();
      for (int i = 0; i < round_trips; ++i) {
        Check(direct_function->LaunchAsync(config, *direct_buffer, n), "launch (direct)");
        Check(direct_session->Synchronize(), "sync (direct)");
      }
      const double direct = Seconds(start) * 1e6 / round_trips;
      direct_samples.push_back(direct);
      direct_ratios.push_back(direct / ping);
    }
    ping_samples.push_back(ping);
    stream_samples.push_back(stream);
    unary_samples.push_back(unary);
    stream_ratios.push_back(stream / ping);
    unary_ratios.push_back(unary / ping);
  }
  const double ping_us = Median(ping_samples);
  const double daemon_round_trip_us = Median(stream_samples);
  const double daemon_unary_round_trip_us = Median(unary_samples);

  // What each path costs each process (CPU and wake-ups per operation).
  auto costs_of = [&](int ops, const std::function<void()>& op) {
    const ProcessCosts before = TakeCosts(daemon);
    for (int i = 0; i < ops; ++i) op();
    return CostPerOp(before, TakeCosts(daemon), ops);
  };
  const ProcessCosts ping_cost =
      costs_of(pings, [&] { Check(session->KeepAlive().status(), "ping"); });
  const ProcessCosts stream_cost = costs_of(round_trips, [&] {
    Check(function->LaunchAsync(config, *buffer, n), "launch");
    Check(session->Synchronize(), "sync");
  });
  const ProcessCosts unary_cost = costs_of(unary_round_trips, [&] {
    Check(function->Launch(config, *buffer, n), "unary launch");
    Check(session->Synchronize(), "sync");
  });
  const ProcessCosts fused_cost = costs_of(unary_round_trips, [&] {
    Check(function->LaunchAndSynchronize(config, *buffer, n), "launch and synchronize");
  });

  // Asynchronous launches per second through the command stream.
  const int launches = daemon.fake() ? 100000 : 300000;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i) Check(function->LaunchAsync(config, *buffer, n), "launch");
  Check(session->Synchronize(), "sync");
  const double daemon_launch_rate = launches / Seconds(start);

  // Every device at once: one session per device, each driven by its own thread over its own
  // connection, against the same setup on one device alone (same run).
  auto inventory = client->ListDevices();
  Check(inventory.status(), "list devices");
  const int device_count = inventory->devices_size();
  double one_device_rate = 0, all_devices_rate = 0;
  if (device_count > 1) {
    struct Driver {
      std::optional<Client> client;
      std::optional<Session> session;
      std::optional<Function> function;
      std::optional<Buffer> buffer;
      double seconds = 0;
    };
    std::vector<std::unique_ptr<Driver>> drivers;
    for (int d = 0; d < device_count; ++d) {
      auto driver = std::make_unique<Driver>();
      auto own = Client::Connect(address);
      Check(own.status(), "connect (per device)");
      driver->client.emplace(*std::move(own));
      auto opened = driver->client->OpenSession(inventory->devices(d).ordinal(), "bench devices");
      Check(opened.status(), "open a session per device");
      driver->session.emplace(*std::move(opened));
      auto compiled = driver->session->Compile(compile_options);
      Check(compiled.status(), "compile (per device)");
      auto got = compiled->module.GetFunction(kKernelName);
      Check(got.status(), "get function (per device)");
      driver->function.emplace(*std::move(got));
      auto allocated = driver->session->Allocate(1024);
      Check(allocated.status(), "allocate (per device)");
      driver->buffer.emplace(*std::move(allocated));
      for (int i = 0; i < 1000; ++i) {
        Check(driver->function->LaunchAsync(config, *driver->buffer, n), "warm up (per device)");
      }
      Check(driver->session->Synchronize(), "sync (per device)");
      drivers.push_back(std::move(driver));
    }
    auto run = [&](Driver& driver) {
      const auto begin = std::chrono::steady_clock::now();
      for (int i = 0; i < launches; ++i) {
        Check(driver.function->LaunchAsync(config, *driver.buffer, n), "launch (per device)");
      }
      Check(driver.session->Synchronize(), "sync (per device)");
      driver.seconds = Seconds(begin);
    };
    run(*drivers[0]);
    one_device_rate = launches / drivers[0]->seconds;
    std::vector<std::thread> threads;
    const auto begin = std::chrono::steady_clock::now();
    for (auto& driver : drivers) threads.emplace_back(run, std::ref(*driver));
    for (std::thread& thread : threads) thread.join();
    all_devices_rate = static_cast<double>(launches) * device_count / Seconds(begin);
  }

  // CUDA graphs: kGraphKernels launches captured once and replayed with one command, against
  // the same launches sent one by one through the command stream. Each iteration ends with a
  // synchronize, so both are round trips of the same work; rounds interleave the two.
  constexpr int kGraphKernels = 100;
  const int graph_iterations = daemon.fake() ? 100 : 300;
  auto graph_stream = session->CreateStream();
  Check(graph_stream.status(), "create stream");
  LaunchConfig graph_config = config;
  graph_config.stream = &*graph_stream;
  Check(graph_stream->BeginCapture(), "begin capture");
  for (int i = 0; i < kGraphKernels; ++i) {
    Check(function->LaunchAsync(graph_config, *buffer, n), "capture a launch");
  }
  auto graph = graph_stream->EndCapture();
  Check(graph.status(), "end capture");
  auto graph_exec = graph->Instantiate();
  Check(graph_exec.status(), "instantiate");
  for (int i = 0; i < 20; ++i) Check(graph_exec->Launch(&*graph_stream), "warm up");
  Check(graph_stream->Synchronize(), "sync");
  std::vector<double> graph_samples, separate_samples, graph_ratios;
  for (int round = 0; round < kRounds; ++round) {
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < graph_iterations; ++i) {
      Check(graph_exec->Launch(&*graph_stream), "graph launch");
      Check(graph_stream->Synchronize(), "sync");
    }
    const double replay = Seconds(start) * 1e6 / graph_iterations;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < graph_iterations; ++i) {
      for (int k = 0; k < kGraphKernels; ++k) {
        Check(function->LaunchAsync(graph_config, *buffer, n), "launch");
      }
      Check(graph_stream->Synchronize(), "sync");
    }
    const double separate = Seconds(start) * 1e6 / graph_iterations;
    graph_samples.push_back(replay);
    separate_samples.push_back(separate);
    graph_ratios.push_back(replay / separate);
  }
  const double graph_replay_us = Median(graph_samples);
  const double graph_separate_us = Median(separate_samples);

  // The same work locally (not on the fake backend): kGraphKernels cuLaunchKernel on a
  // stream, and one cuGraphLaunch of them captured, each followed by cuStreamSynchronize.
  double local_launches_us = 0;
  double local_graph_us = 0;
  if (!daemon.fake()) {
    const backend::cuda::DriverApi* api = DriverWithContext();
    CUmodule module;
    BENCH_CHECK_CU(
        api, api->cuModuleLoadDataEx(&module, cold->response.image().data(), 0, nullptr, nullptr));
    CUfunction kernel;
    BENCH_CHECK_CU(api, api->cuModuleGetFunction(&kernel, module, kKernelName));
    CUdeviceptr x;
    BENCH_CHECK_CU(api, api->cuMemAlloc(&x, 1024));
    unsigned long long count = 0;  // NOLINT(runtime/int): the kernel's parameter type
    void* params[] = {&x, &count};
    CUstream stream;
    BENCH_CHECK_CU(api, api->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    BENCH_CHECK_CU(api, api->cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_RELAXED));
    for (int k = 0; k < kGraphKernels; ++k) {
      BENCH_CHECK_CU(api,
                     api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr));
    }
    CUgraph local_graph;
    BENCH_CHECK_CU(api, api->cuStreamEndCapture(stream, &local_graph));
    CUgraphExec local_exec;
    BENCH_CHECK_CU(api, api->cuGraphInstantiateWithFlags(&local_exec, local_graph, 0));
    for (int i = 0; i < 20; ++i) BENCH_CHECK_CU(api, api->cuGraphLaunch(local_exec, stream));
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(stream));
    std::vector<double> launches_samples, local_graph_samples;
    for (int round = 0; round < kRounds; ++round) {
      start = std::chrono::steady_clock::now();
      for (int i = 0; i < graph_iterations; ++i) {
        for (int k = 0; k < kGraphKernels; ++k) {
          BENCH_CHECK_CU(
              api, api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr));
        }
        BENCH_CHECK_CU(api, api->cuStreamSynchronize(stream));
      }
      launches_samples.push_back(Seconds(start) * 1e6 / graph_iterations);
      start = std::chrono::steady_clock::now();
      for (int i = 0; i < graph_iterations; ++i) {
        BENCH_CHECK_CU(api, api->cuGraphLaunch(local_exec, stream));
        BENCH_CHECK_CU(api, api->cuStreamSynchronize(stream));
      }
      local_graph_samples.push_back(Seconds(start) * 1e6 / graph_iterations);
    }
    local_launches_us = Median(launches_samples);
    local_graph_us = Median(local_graph_samples);
    api->cuGraphExecDestroy(local_exec);
    api->cuGraphDestroy(local_graph);
    api->cuStreamDestroy(stream);
    api->cuMemFree(x);
    api->cuModuleUnload(module);
  }

  // Direct driver calls on the same GPU, same cubin (not on the fake backend).
  double direct_round_trip_us = 0;
  double direct_launch_rate = 0;
  if (!daemon.fake()) {
    const backend::cuda::DriverApi* api = DriverWithContext();
    CUmodule module;
    BENCH_CHECK_CU(
        api, api->cuModuleLoadDataEx(&module, cold->response.image().data(), 0, nullptr, nullptr));
    CUfunction kernel;
    BENCH_CHECK_CU(api, api->cuModuleGetFunction(&kernel, module, kKernelName));
    CUdeviceptr x;
    BENCH_CHECK_CU(api, api->cuMemAlloc(&x, 1024));
    unsigned long long count = 0;  // NOLINT(runtime/int): the kernel's parameter type
    void* params[] = {&x, &count};
    for (int i = 0; i < 100; ++i) {
      BENCH_CHECK_CU(api,
                     api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
    }
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < round_trips; ++i) {
      BENCH_CHECK_CU(api,
                     api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
      BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
    }
    direct_round_trip_us = Seconds(start) * 1e6 / round_trips;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < launches; ++i) {
      BENCH_CHECK_CU(api,
                     api->cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
    }
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
    direct_launch_rate = launches / Seconds(start);
    api->cuMemFree(x);
    api->cuModuleUnload(module);
  }

  std::printf(
      "\nCompute path, one run (%s, %s backend; round trips: medians of %d interleaved "
      "rounds)\n",
      address.c_str(), daemon.backend.c_str(), kRounds);
  std::printf("%-55s %14s %14s %10s %8s\n", "measure", "gpurpcd", "baseline", "ratio", "target");
  std::printf("%-55s %11.1f us %14s %10s %8s\n", "bare ping (KeepAlive, front end only)", ping_us,
              "-", "-", "-");
  std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
              "launch+sync round trip (command stream) vs bare ping", daemon_round_trip_us, ping_us,
              Median(stream_ratios), "<=1.5x");
  std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
              "launch+sync round trip (unary RPCs) vs bare ping", daemon_unary_round_trip_us,
              ping_us, Median(unary_ratios), "<=2x");
  std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
              "launch+sync in one unary RPC (synchronize) vs ping", Median(fused_samples), ping_us,
              Median(fused_ratios), "<=2x");
  std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n", "unary launch alone (one RPC) vs bare ping",
              Median(unary_launch_samples), ping_us, Median(unary_launch_samples) / ping_us, "-");
  if (direct_session) {
    std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
                "launch+sync round trip (direct channel) vs bare ping", Median(direct_samples),
                ping_us, Median(direct_ratios), "<=1.1x");
  } else {
    std::printf("%-55s %14s %14s %10s %8s   (%s)\n",
                "launch+sync round trip (direct channel) vs bare ping", "n/a", "-", "-", "<=1.1x",
                direct_note.c_str());
  }
  if (daemon.fake()) {
    std::printf("%-55s %11.1f us %14s %10s %8s\n",
                "launch+sync round trip (command stream) vs direct", daemon_round_trip_us,
                "n/a (fake)", "-", "-");
    std::printf("%-55s %12.0f/s %14s %10s %8s\n", "async launches per second vs cuLaunchKernel",
                daemon_launch_rate, "n/a (fake)", "-", ">=150k/s");
  } else {
    std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
                "launch+sync round trip (command stream) vs direct", daemon_round_trip_us,
                direct_round_trip_us, daemon_round_trip_us / direct_round_trip_us, "-");
    std::printf("%-55s %12.0f/s %12.0f/s %9.2fx %8s\n",
                "async launches per second vs cuLaunchKernel", daemon_launch_rate,
                direct_launch_rate, daemon_launch_rate / direct_launch_rate, ">=150k/s");
  }
  if (device_count > 1) {
    char label[96];
    std::snprintf(label, sizeof(label), "async launches/s, %d devices at once vs one device",
                  device_count);
    std::printf("%-55s %12.0f/s %12.0f/s %9.2fx %8s\n", label, all_devices_rate, one_device_rate,
                all_devices_rate / one_device_rate, "-");
  } else {
    std::printf("%-55s %14s %14s %10s %8s   (the daemon serves one device)\n",
                "async launches/s, every device at once vs one device", "n/a", "-", "-", "-");
  }
  std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
              "100 kernels+sync: graph vs 100 launches (stream)", graph_replay_us,
              graph_separate_us, Median(graph_ratios), "<1x");
  if (daemon.fake()) {
    std::printf("%-55s %11.1f us %14s %10s %8s\n", "100 kernels+sync: graph vs local cuGraphLaunch",
                graph_replay_us, "n/a (fake)", "-", "-");
    std::printf("%-55s %11.1f us %14s %10s %8s\n",
                "100 kernels+sync: graph vs local 100x cuLaunchKernel", graph_replay_us,
                "n/a (fake)", "-", "-");
  } else {
    std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
                "100 kernels+sync: graph vs local cuGraphLaunch", graph_replay_us, local_graph_us,
                graph_replay_us / local_graph_us, "-");
    std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
                "100 kernels+sync: graph vs local 100x cuLaunchKernel", graph_replay_us,
                local_launches_us, graph_replay_us / local_launches_us, "-");
    std::printf("%-55s %11.1f us %11.1f us %9.2fx %8s\n",
                "100 kernels+sync: local graph vs local 100x launch", local_graph_us,
                local_launches_us, local_graph_us / local_launches_us, "-");
  }
  std::printf("%-55s %11.3f ms %14s %10s %8s\n", "NVRTC compile, cold (miss)", cold_ms, "-", "-",
              "-");
  std::printf("%-55s %11.3f ms %11.1f us %9.2fx %8s\n",
              all_hits ? "NVRTC compile, cached (hit) vs bare ping"
                       : "NVRTC compile, repeated (NOT ALL HITS) vs bare ping",
              cached_ms, ping_us, cached_ms * 1e3 / ping_us, "<=1ms");
  if (daemon.daemon != nullptr) {
    std::printf("\nCost per operation by process (CPU us / scheduler time slices, ~wake-ups)\n");
    std::printf("%-40s %20s %20s %20s\n", "operation", "client", "front end", "worker");
    auto row = [](const char* what, const ProcessCosts& c) {
      auto cell = [](const ProcessCosts::Cost& cost) {
        char text[32];
        std::snprintf(text, sizeof(text), "%.1f us / %.1f", cost.cpu_ns / 1e3, cost.slices);
        return std::string(text);
      };
      std::printf("%-40s %20s %20s %20s\n", what, cell(c.client).c_str(), cell(c.frontend).c_str(),
                  cell(c.workers).c_str());
    };
    row("bare ping", ping_cost);
    row("launch+sync (command stream)", stream_cost);
    row("launch+sync (unary launch, then sync)", unary_cost);
    row("launch+sync (one unary, synchronize)", fused_cost);
  }
  // One line for scripts (bench_python.py --cpp-bench compares Python with this client).
  std::printf(
      "machine: ping_us=%.2f stream_round_trip_us=%.2f unary_round_trip_us=%.2f "
      "direct_channel_round_trip_us=%.2f\n",
      ping_us, daemon_round_trip_us, daemon_unary_round_trip_us,
      direct_session ? Median(direct_samples) : 0.0);
  return 0;
}

}  // namespace
}  // namespace gpurpc::bench

int main(int argc, char** argv) { return gpurpc::bench::Main(argc, argv); }
