// Shared pieces of the benchmark programs: a daemon to measure (started here with the CUDA
// backend, or an existing one from --address), a timer, and table printing. Benchmarks
// print ratios measured in one run; they never assert on time.
#ifndef GPURPC_TESTS_BENCHMARKS_BENCH_COMMON_H_
#define GPURPC_TESTS_BENCHMARKS_BENCH_COMMON_H_

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gpurpc/client.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "tests/testing/daemon.h"

namespace gpurpc::bench {

inline double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Exits with a message when `status` is not OK.
inline void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

#define BENCH_CHECK_CU(api, call)                                  \
  do {                                                             \
    CUresult bench_rc_ = (call);                                   \
    if (bench_rc_ != CUDA_SUCCESS) {                               \
      const char* bench_name_ = "?";                               \
      (api)->cuGetErrorName(bench_rc_, &bench_name_);              \
      std::fprintf(stderr, "%s failed: %s\n", #call, bench_name_); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

// The daemon under test: --address=ADDR uses a running one; otherwise one is started with
// the CUDA backend (TCP on 127.0.0.1 and a unix socket), or the backend that
// --daemon-arg=--backend=NAME names (the last one wins, as in gpurpcd). On the fake backend
// there is no driver to compare with: the direct-driver baselines are left out, and only the
// ratios between daemon paths (and the client and relay costs) mean anything.
struct DaemonUnderTest {
  std::unique_ptr<testing::TestDaemon> daemon;
  std::string unix_address;
  std::string tcp_address;
  std::string backend = "cuda";
  bool fake() const { return backend == "fake"; }
};

inline DaemonUnderTest StartDaemon(int argc, char** argv) {
  DaemonUnderTest out;
  std::vector<std::string> daemon_args;  // --daemon-arg=FLAG, repeatable: passed to gpurpcd
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--address=", 0) == 0) {
      // A unix: address is the same host (the direct channel is measured there too).
      (arg.rfind("--address=unix:", 0) == 0 ? out.unix_address : out.tcp_address) = arg.substr(10);
      // A running daemon: its backend decides whether there is a driver to compare with.
      auto client = Client::Connect(arg.substr(10));
      Check(client.status(), "connect to --address");
      auto devices = client->ListDevices();
      Check(devices.status(), "ListDevices of --address");
      out.backend = devices->backend();
      return out;
    }
    if (arg.rfind("--daemon-arg=", 0) == 0) {
      daemon_args.push_back(arg.substr(13));
      if (daemon_args.back().rfind("--backend=", 0) == 0) {
        out.backend = daemon_args.back().substr(10);
      }
    }
  }
  // The TCP listener authenticates with a bearer token, as a remote client's would: made by
  // `gpurpcd --new-token`, and handed to the client through GPURPC_TOKEN.
  char dir[] = "/tmp/gpurpc-bench-XXXXXX";
  Check(mkdtemp(dir) != nullptr ? absl::OkStatus() : absl::InternalError("mkdtemp"), "mkdtemp");
  absl::StatusOr<testing::TestToken> token = testing::MakeToken("bench");
  Check(token.status(), "make a token");
  const std::string tokens_file = std::string(dir) + "/tokens";
  if (FILE* out = fopen(tokens_file.c_str(), "w")) {
    fchmod(fileno(out), 0600);
    fputs((token->line + "\n").c_str(), out);
    fclose(out);
  }
  setenv("GPURPC_TOKEN", token->token.c_str(), 1);
  testing::TestDaemon::Options options;
  options.backend = out.backend;
  // A free port, so that runs side by side (an A/B of two builds) do not collide.
  absl::StatusOr<int> port = testing::FreeLoopbackPort();
  Check(port.status(), "find a free loopback port");
  const std::string tcp_address = "127.0.0.1:" + std::to_string(*port);
  options.extra_flags = {"--listen=" + tcp_address, "--tokens-file=" + tokens_file};
  options.extra_flags.insert(options.extra_flags.end(), daemon_args.begin(), daemon_args.end());
  auto daemon = testing::TestDaemon::Start(options);
  Check(daemon.status(), "start gpurpcd");
  out.daemon = *std::move(daemon);
  out.unix_address = out.daemon->address();
  out.tcp_address = tcp_address;
  return out;
}

// CPU time and scheduler time slices (each a wake-up, roughly) of the client (this process),
// the front end and its workers, from /proc/PID/task/*/schedstat: what a round trip costs in
// each process, and how many thread hand-overs it takes. Deterministic enough to compare on a
// shared machine where wall times are noisy; the lead's many-core GPU host pays the hand-overs
// in latency.
struct ProcessCosts {
  struct Cost {
    double cpu_ns = 0;
    double slices = 0;
  };
  Cost client, frontend, workers;
};

inline ProcessCosts::Cost TaskCost(pid_t pid) {
  ProcessCosts::Cost cost;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* tasks = opendir(dir.c_str());
  if (tasks == nullptr) return cost;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    FILE* f = std::fopen((dir + "/" + entry->d_name + "/schedstat").c_str(), "r");
    if (f == nullptr) continue;
    double run_ns = 0, wait_ns = 0, slices = 0;
    if (std::fscanf(f, "%lf %lf %lf", &run_ns, &wait_ns, &slices) == 3) {
      cost.cpu_ns += run_ns;
      cost.slices += slices;
    }
    std::fclose(f);
  }
  closedir(tasks);
  return cost;
}

// Empty (all zero) when the daemon is not ours (--address).
inline ProcessCosts TakeCosts(const DaemonUnderTest& daemon) {
  ProcessCosts costs;
  costs.client = TaskCost(getpid());
  if (daemon.daemon == nullptr) return costs;
  costs.frontend = TaskCost(daemon.daemon->pid());
  for (pid_t worker : daemon.daemon->WorkerPids()) {
    const ProcessCosts::Cost cost = TaskCost(worker);
    costs.workers.cpu_ns += cost.cpu_ns;
    costs.workers.slices += cost.slices;
  }
  return costs;
}

// (after - before) per operation.
inline ProcessCosts CostPerOp(const ProcessCosts& before, const ProcessCosts& after, int ops) {
  auto per = [ops](const ProcessCosts::Cost& a, const ProcessCosts::Cost& b) {
    return ProcessCosts::Cost{(b.cpu_ns - a.cpu_ns) / ops, (b.slices - a.slices) / ops};
  };
  return ProcessCosts{per(before.client, after.client), per(before.frontend, after.frontend),
                      per(before.workers, after.workers)};
}

// The driver, with device 0's primary context current on this thread: the baseline that
// the daemon is measured against, in the same process.
inline const backend::cuda::DriverApi* DriverWithContext() {
  auto loaded = backend::cuda::LoadDriverApi();
  Check(loaded.status(), "load the CUDA driver");
  const backend::cuda::DriverApi* api = *loaded;
  CUdevice device;
  CUcontext context;
  BENCH_CHECK_CU(api, api->cuDeviceGet(&device, 0));
  BENCH_CHECK_CU(api, api->cuDevicePrimaryCtxRetain(&context, device));
  BENCH_CHECK_CU(api, api->cuCtxSetCurrent(context));
  return api;
}

}  // namespace gpurpc::bench

#endif  // GPURPC_TESTS_BENCHMARKS_BENCH_COMMON_H_
