// Shared pieces of the benchmark programs: a daemon to measure (started here with the CUDA
// backend, or an existing one from --address), a timer, and table printing. Benchmarks
// print ratios measured in one run; they never assert on time.
#ifndef GPURPC_TESTS_BENCHMARKS_BENCH_COMMON_H_
#define GPURPC_TESTS_BENCHMARKS_BENCH_COMMON_H_

#include <sys/stat.h>

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
// the CUDA backend (TCP on 127.0.0.1 and a unix socket).
struct DaemonUnderTest {
  std::unique_ptr<testing::TestDaemon> daemon;
  std::string unix_address;
  std::string tcp_address;
};

inline DaemonUnderTest StartDaemon(int argc, char** argv) {
  DaemonUnderTest out;
  std::vector<std::string> daemon_args;  // --daemon-arg=FLAG, repeatable: passed to gpurpcd
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--address=", 0) == 0) {
      out.tcp_address = arg.substr(10);
      return out;
    }
    if (arg.rfind("--daemon-arg=", 0) == 0) daemon_args.push_back(arg.substr(13));
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
  options.backend = "cuda";
  options.extra_flags = {"--listen=127.0.0.1:50777", "--tokens-file=" + tokens_file};
  options.extra_flags.insert(options.extra_flags.end(), daemon_args.begin(), daemon_args.end());
  auto daemon = testing::TestDaemon::Start(options);
  Check(daemon.status(), "start gpurpcd");
  out.daemon = *std::move(daemon);
  out.unix_address = out.daemon->address();
  out.tcp_address = "127.0.0.1:50777";
  return out;
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
