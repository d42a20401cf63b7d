// Starts a real gpurpcd (front end + worker processes) for a test, on a unix socket in a
// fresh temporary directory, and ends it afterwards.
#ifndef GPURPC_TESTS_TESTING_DAEMON_H_
#define GPURPC_TESTS_TESTING_DAEMON_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace gpurpc::testing {

class TestDaemon {
 public:
  struct Options {
    std::string backend = "fake";
    std::string idle_timeout = "30s";
    int warm_workers = 1;
    // Shared between daemons to test a cache that survives restarts; "" = a fresh one.
    std::string cache_dir;
    std::vector<std::string> extra_flags;
  };

  // The binary is $GPURPCD_BIN, else the one this build made. Waits until it answers
  // ListDevices; on failure returns its log in the message.
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(Options options);
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start() { return Start(Options()); }
  // SIGTERM, then SIGKILL after 10 s; removes the temporary directory.
  ~TestDaemon();

  const std::string& address() const { return address_; }
  const std::string& cache_dir() const { return cache_dir_; }
  pid_t pid() const { return pid_; }
  // Its stderr so far.
  std::string Log() const;
  // Child processes (the workers), by pid.
  std::vector<pid_t> WorkerPids() const;

 private:
  TestDaemon() = default;
  pid_t pid_ = -1;
  std::string dir_;
  std::string address_;
  std::string cache_dir_;
  std::string log_path_;
  bool own_cache_dir_ = false;
};

// True when the named backend cannot run here (prints why via the status).
absl::Status CudaAvailable();

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_DAEMON_H_
