// Starts a real gpurpcd (front end + worker processes) for a test, on a unix socket in a
// fresh temporary directory (and, when asked, on a loopback TCP port), and ends it
// afterwards.
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
    // Also serve TCP on a free loopback port (tcp_address()); the credentials it needs come
    // from extra_flags (--tokens-file, --tls-*).
    bool listen_tcp = false;
    // Pass no --unix-socket: the daemon picks its default socket, with XDG_RUNTIME_DIR set
    // to the test's directory (so the socket is <dir>/gpurpc/gpurpcd.sock; see
    // runtime_dir()).
    bool default_unix_socket = false;
    // Serve on this Unix socket instead of <dir>/gpurpcd.sock (its folder must exist and be
    // private): daemons started one after the other with the same path take over the
    // socket, as a restarted daemon does. Ignored with default_unix_socket.
    std::string unix_socket_path;
    // Added to (or replacing in) the daemon's environment, "NAME=VALUE".
    std::vector<std::string> env;
  };

  // The binary is $GPURPCD_BIN, else the one this build made. Waits until it answers
  // ListDevices; on failure returns its log in the message.
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(Options options);
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start() { return Start(Options()); }
  // The gpurpcd binary Start runs: $GPURPCD_BIN, else the one this build made.
  static std::string Binary();
  // SIGTERM, then SIGKILL after 10 s; removes the temporary directory.
  ~TestDaemon();

  // The Unix socket, "unix:PATH" (the readiness check uses it: no credentials needed).
  const std::string& address() const { return address_; }
  // "127.0.0.1:PORT" with listen_tcp, else "".
  const std::string& tcp_address() const { return tcp_address_; }
  // The daemon's XDG_RUNTIME_DIR with default_unix_socket, else "".
  const std::string& runtime_dir() const { return runtime_dir_; }
  // The temporary directory of this daemon (removed at the end).
  const std::string& dir() const { return dir_; }
  const std::string& cache_dir() const { return cache_dir_; }
  pid_t pid() const { return pid_; }
  // OK while the daemon runs; once it has exited, UNAVAILABLE saying how (exit status or
  // signal) with its log. Reaps an exited daemon, so pid() is -1 afterwards.
  absl::Status CheckRunning();
  // Its stderr so far.
  std::string Log() const;
  // Child processes (the workers), by pid.
  std::vector<pid_t> WorkerPids() const;

 private:
  TestDaemon() = default;
  pid_t pid_ = -1;
  std::string dir_;
  std::string address_;
  std::string tcp_address_;
  std::string runtime_dir_;
  std::string cache_dir_;
  std::string log_path_;
  bool own_cache_dir_ = false;
};

// SIGKILLs the daemon's device workers: every worker but the inventory worker (which has no
// device, --device=-1), so the sessions' workers and any warm spare. How many were killed;
// with `pids`, each killed worker's pid is appended to it.
int KillDeviceWorkers(TestDaemon& daemon, std::vector<pid_t>* pids = nullptr);

// True when the named backend cannot run here (prints why via the status).
absl::Status CudaAvailable();

// A loopback TCP port that was free a moment ago.
absl::StatusOr<int> FreeLoopbackPort();

// GET /metrics from a daemon's --metrics-listen port on loopback: the body of a whole 200
// answer, read within 20 s.
absl::StatusOr<std::string> ScrapeMetrics(int port);

// A bearer token for `tenant` from `gpurpcd --new-token` (TestDaemon::Binary()): the token,
// and its line for a --tokens-file.
struct TestToken {
  std::string token;
  std::string line;
};
absl::StatusOr<TestToken> MakeToken(const std::string& tenant);

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_DAEMON_H_
