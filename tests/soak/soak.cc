// gpurpc-soak: the soak and leak check of a gpurpcd. A program, not a test: it runs for
// minutes and prints one table. `gpurpc-soak --help` says everything; in short:
//
//   0. Starts its own gpurpcd (or attaches to a running one by address and pid), warms it up
//      (one session of every kind of iteration, then bursts of as many concurrent sessions
//      and cycles as the phases will run until its threads stop growing, so that pools grown
//      on demand and kept have their size) and, once it has settled, takes the baseline.
//   1. --clients threads (or, with --client-processes, processes: this program re-executed
//      with --child-client), each with its own Client and session, for --seconds: allocate,
//      upload, launch add_one_f32 (compiled with NVRTC through the daemon; the fake backend
//      runs its built-in host kernel of that name), synchronise, download and verify every
//      value, free; every 8th iteration through a freshly loaded module.
//   2. --cycles open/close cycles (connect, open, allocate, upload, close with the buffer
//      still allocated) on --cycle-concurrency threads.
//   3. --killed child processes (this program re-executed with --child-upload) that each
//      open a session, allocate --kill-bytes and upload it in a loop; each is SIGKILLed
//      mid-upload, and the daemon must reclaim their sessions within --reclaim-timeout.
//
// After every phase it waits, bounded by --settle-timeout, for the front end's threads, open
// fds and children, the tool's tenant's sessions and device memory (the daemon's view) and
// the device's used memory (cuMemGetInfo in a context of its own) to return to the baseline,
// and prints them beside each phase's peak. Exit status 0 with "soak: PASS" when everything
// returned and no operation failed, 1 with "soak: FAIL: <what>" otherwise, 2 for bad usage.

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gpurpc/client.h"
#include "grpc/grpc.h"
#include "server/worker/backend/cuda/driver_api.h"
#include "tests/testing/daemon.h"

extern char** environ;

namespace gpurpc::soak {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

// The kernel every client runs: real CUDA for a GPU, and on the fake backend the name and
// signature of its built-in host kernel (server/worker/backend/fake/fake_kernels.h).
constexpr char kKernelSource[] = R"cuda(
extern "C" __global__ void add_one_f32(float* data, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}
)cuda";
constexpr char kKernelName[] = "add_one_f32";

// Bytes of each open/close cycle's buffer and upload.
constexpr uint64_t kCycleBytes = 64 * kKiB;
// How often the peak of a phase is sampled.
constexpr absl::Duration kSampleInterval = absl::Milliseconds(500);
// How often the settle and reclaim waits poll.
constexpr absl::Duration kPollInterval = absl::Milliseconds(250);
// The baseline is taken once this many polls in a row saw the same threads, fds, children
// and sessions.
constexpr int kStablePolls = 8;
// Error messages kept per phase (the count is always exact).
constexpr size_t kKeptErrors = 6;

std::atomic<bool> g_interrupted{false};
void OnSignal(int) { g_interrupted = true; }
bool Interrupted() { return g_interrupted.load(); }

// Sleeps up to `d`, waking early when interrupted.
void Nap(absl::Duration d) {
  const absl::Time end = absl::Now() + d;
  while (!Interrupted() && absl::Now() < end) {
    absl::SleepFor(std::min(end - absl::Now(), absl::Milliseconds(50)));
  }
}

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.1f", bytes / double(kMiB)); }

std::string Secs(absl::Duration d) { return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d)); }

// ---------------------------------------------------------------------------------------
// Options.

struct Options {
  std::string daemon;  // binary to start, or an address to attach to
  std::vector<std::string> daemon_args;
  pid_t daemon_pid = 0;    // with an address
  std::string daemon_log;  // copy of a started daemon's log
  int clients = 64;
  bool client_processes = false;
  absl::Duration seconds = absl::Seconds(30);
  int cycles = 1000;
  int cycle_concurrency = 8;
  int killed = 8;
  uint64_t kill_bytes = 256 * kMiB;
  uint64_t client_bytes = 4 * kMiB;
  int device = 0;
  absl::Duration reclaim_timeout = absl::Seconds(120);
  absl::Duration settle_timeout = absl::Seconds(60);
  int thread_tolerance = 4;
  int fd_tolerance = 2;
  uint64_t device_memory_tolerance = 32 * kMiB;
  uint64_t rss_tolerance = 512 * kMiB;
};

constexpr char kUsage[] = R"usage(usage: gpurpc-soak [options]

Soak and leak check of a gpurpcd: N concurrent clients for T seconds, then K session
open/close cycles, then M clients killed mid-transfer. Before and after every phase it
measures the front end's threads, open fds, child processes (live and zombie) and RSS, the
sessions and device memory the daemon accounts to this tool's tenant, and the device memory
in use (cuMemGetInfo on the device, through this tool's own context, so the device must allow
several processes: the default compute mode; "n/a (no driver)" where there is no CUDA
driver). Prints a table of phase x metric, each phase's operations and errors, and a last
line "soak: PASS (...)" (exit 0) or "soak: FAIL: <what>" (exit 1).

The daemon:
  --daemon=PATH         start this gpurpcd binary (default: $GPURPCD_BIN, which the installed
                        bin/gpurpc-soak launcher sets, else the daemon of this build) on a
                        private Unix socket in a fresh temporary folder, with
                        --session-idle-timeout=60s (the daemon's default: reclaim is measured,
                        never shortened), --max-sessions and --tenant-max-sessions large
                        enough for the run, --admin-tenants=<your user> and
                        --log-level=info; --daemon-arg flags come after these and win
  --daemon-arg=ARG      one more daemon flag (repeat it), e.g. --daemon-arg=--backend=fake or
                        --daemon-arg=--backend=cuda; without --backend the daemon's default
                        (auto: the GPU when there is one, else it refuses to start)
  --daemon=ADDRESS      attach to a running daemon instead: unix:PATH, an absolute socket
                        path, or HOST:PORT (credentials from GPURPC_TOKEN etc., as for every
                        client); needs --daemon-pid. Its own limits then apply: it must allow
                        this tool's tenant --clients + --cycle-concurrency + --killed + 1
                        sessions at once.
  --daemon-pid=PID      the front end's pid (the gpurpcd process whose children the workers
                        are), read through /proc; same user or root
  --daemon-log=PATH     keep a copy of the started daemon's log here (it is printed in part
                        on FAIL anyway)

The phases (0 skips one):
  --clients=N           concurrent clients of phase 1 (default 64), each with its own Client
                        and session; threads of this process, which gRPC serves over one
                        shared connection (one channel per target and arguments)
  --client-processes    each phase-1 client in a process of its own instead (this program
                        re-executed), so that the daemon sees N connections and N peers
  --seconds=T           how long phase 1 runs, seconds (default 30)
  --client-bytes=SIZE   largest transfer of a phase-1 iteration (default 4MiB); iterations
                        cycle through 4KiB, 64KiB, 1MiB+4KiB and this
  --cycles=K            session open/close cycles of phase 2 (default 1000)
  --cycle-concurrency=C threads running the cycles (default 8)
  --killed=M            clients killed mid-transfer in phase 3 (default 8)
  --kill-bytes=SIZE     buffer each of them allocates and uploads in a loop (default 256MiB)
  --device=ORDINAL      device of every session, and of the cuMemGetInfo context (default 0)
  --reclaim-timeout=D   how long the daemon may take to reclaim the killed clients' sessions
                        (default 120s; a number is seconds)

Settling and tolerances. After every phase the tool polls until every metric is back within
tolerance of the baseline, for at most --settle-timeout, and then reports what it saw:
  --settle-timeout=D    default 60s
  --thread-tolerance=N  front-end threads may exceed the baseline by N (default 4): gRPC's
                        server keeps a few threads it started under load for a while
  --fd-tolerance=N      open fds may exceed the baseline by N (default 2)
  (children)            must equal the baseline (the warm pool, refilled), no zombies
  (sessions, tenant memory)
                        the daemon's view must equal the baseline exactly
  --memory-tolerance=SIZE
                        device memory in use may exceed the baseline by SIZE (default 32MiB;
                        a leaked worker context is hundreds of MiB)
  --rss-tolerance=SIZE  front-end RSS growth is reported, and fails only beyond SIZE
                        (default 512MiB): the allocator keeps freed memory for reuse, so RSS
                        is no leak signal unless it grows without bound

SIZE takes a suffix K, M, G (KiB, MiB, GiB); D a suffix ms, s, m or h.
The baseline is taken after a warm-up, once the front end's threads, fds, children and
sessions stayed the same for 2 s (at most --settle-timeout). The warm-up is one session
through every kind of iteration plus one open/close cycle (state the daemon creates once, on
first use), then rounds of max(--clients, --killed) concurrent sessions that each run one
iteration and --cycle-concurrency threads of open/close cycles, until a round leaves the
front end with no more threads than the one before (at most 6 rounds): pools that grow on
demand and are kept (the front end's bounded pool of threads for blocking work, gRPC's
threads) reach their size before the baseline, so that only growth that goes on counts.
)usage";

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  struct Suffix {
    absl::string_view name;
    uint64_t factor;
  };
  static constexpr Suffix kSuffixes[] = {{"KiB", kKiB}, {"MiB", kMiB}, {"GiB", kGiB}, {"K", kKiB},
                                         {"M", kMiB},   {"G", kGiB},   {"B", 1}};
  uint64_t factor = 1;
  absl::string_view number = text;
  for (const Suffix& suffix : kSuffixes) {
    if (absl::EndsWith(text, suffix.name)) {
      number = text.substr(0, text.size() - suffix.name.size());
      factor = suffix.factor;
      break;
    }
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(number, &value) || value > UINT64_MAX / factor) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a size: give bytes, or a number with K, M or G (e.g. 256MiB)"));
  }
  return value * factor;
}

absl::StatusOr<absl::Duration> ParseSeconds(absl::string_view text) {
  absl::Duration d;
  int64_t seconds = 0;
  if (absl::SimpleAtoi(text, &seconds) && seconds >= 0) return absl::Seconds(seconds);
  if (absl::ParseDuration(text, &d) && d >= absl::ZeroDuration()) return d;
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not a duration: give seconds, or e.g. 90s, 2m, 500ms"));
}

absl::StatusOr<int> ParseCount(absl::string_view name, absl::string_view text, int max) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s=%s: give a whole number from 0 to %d", name, std::string(text), max));
  }
  return value;
}

absl::StatusOr<Options> ParseOptions(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--client-processes") {
      options.client_processes = true;
      continue;
    }
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown argument '", arg, "': flags are --name=value; see --help"));
    }
    const std::string name = arg.substr(2, eq - 2);
    const std::string value = arg.substr(eq + 1);
    auto set_count = [&](int* out, int max) -> absl::Status {
      absl::StatusOr<int> parsed = ParseCount(name, value, max);
      if (!parsed.ok()) return parsed.status();
      *out = *parsed;
      return absl::OkStatus();
    };
    auto set_size = [&](uint64_t* out) -> absl::Status {
      absl::StatusOr<uint64_t> parsed = ParseSize(value);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": ", parsed.status().message()));
      }
      *out = *parsed;
      return absl::OkStatus();
    };
    auto set_duration = [&](absl::Duration* out) -> absl::Status {
      absl::StatusOr<absl::Duration> parsed = ParseSeconds(value);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": ", parsed.status().message()));
      }
      *out = *parsed;
      return absl::OkStatus();
    };
    absl::Status status;
    if (name == "daemon") {
      options.daemon = value;
    } else if (name == "daemon-arg") {
      options.daemon_args.push_back(value);
    } else if (name == "daemon-pid") {
      int pid = 0;
      if (!absl::SimpleAtoi(value, &pid) || pid <= 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("--daemon-pid=", value, ": give the front end's process id"));
      }
      options.daemon_pid = pid;
    } else if (name == "daemon-log") {
      options.daemon_log = value;
    } else if (name == "clients") {
      status = set_count(&options.clients, 4096);
    } else if (name == "seconds") {
      status = set_duration(&options.seconds);
    } else if (name == "cycles") {
      status = set_count(&options.cycles, 10'000'000);
    } else if (name == "cycle-concurrency") {
      status = set_count(&options.cycle_concurrency, 1024);
    } else if (name == "killed") {
      status = set_count(&options.killed, 1024);
    } else if (name == "kill-bytes") {
      status = set_size(&options.kill_bytes);
    } else if (name == "client-bytes") {
      status = set_size(&options.client_bytes);
    } else if (name == "device") {
      status = set_count(&options.device, 1024);
    } else if (name == "reclaim-timeout") {
      status = set_duration(&options.reclaim_timeout);
    } else if (name == "settle-timeout") {
      status = set_duration(&options.settle_timeout);
    } else if (name == "thread-tolerance") {
      status = set_count(&options.thread_tolerance, 1 << 20);
    } else if (name == "fd-tolerance") {
      status = set_count(&options.fd_tolerance, 1 << 20);
    } else if (name == "memory-tolerance") {
      status = set_size(&options.device_memory_tolerance);
    } else if (name == "rss-tolerance") {
      status = set_size(&options.rss_tolerance);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; see --help"));
    }
    if (!status.ok()) return status;
  }
  if (options.cycles > 0 && options.cycle_concurrency == 0) {
    return absl::InvalidArgumentError("--cycle-concurrency must be at least 1 when --cycles > 0");
  }
  if (options.killed > 0 && options.kill_bytes < 4 * kMiB) {
    return absl::InvalidArgumentError(
        "--kill-bytes must be at least 4MiB: the killed clients must be in a streamed "
        "(chunked) upload when they die");
  }
  if (options.client_bytes < 4 * kKiB || options.client_bytes > 1 * kGiB) {
    return absl::InvalidArgumentError("--client-bytes must be from 4KiB to 1GiB");
  }
  return options;
}

// ---------------------------------------------------------------------------------------
// Measurements.

// Device memory in use (total - free, over every process), through a primary context of
// this process on the device: the context costs memory too, equally before and after.
class DeviceMemoryProbe {
 public:
  explicit DeviceMemoryProbe(int ordinal) {
    absl::StatusOr<const backend::cuda::DriverApi*> api = backend::cuda::LoadDriverApi();
    if (!api.ok()) {
      why_not_ = std::string(api.status().message());
      no_driver_ = true;
      return;
    }
    CUdevice device = 0;
    CUcontext context = nullptr;
    if (CUresult rc = (*api)->cuDeviceGet(&device, ordinal); rc != CUDA_SUCCESS) {
      why_not_ = absl::StrCat("cuDeviceGet(", ordinal, ") failed: ", Name(*api, rc));
      return;
    }
    if (CUresult rc = (*api)->cuDevicePrimaryCtxRetain(&context, device); rc != CUDA_SUCCESS) {
      why_not_ = absl::StrCat("cuDevicePrimaryCtxRetain failed: ", Name(*api, rc));
      return;
    }
    api_ = *api;
    device_ = device;
    context_ = context;
  }
  ~DeviceMemoryProbe() {
    if (context_ != nullptr) api_->cuDevicePrimaryCtxRelease(device_);
  }
  DeviceMemoryProbe(const DeviceMemoryProbe&) = delete;
  DeviceMemoryProbe& operator=(const DeviceMemoryProbe&) = delete;

  bool available() const { return context_ != nullptr; }
  // Why not available: no driver at all (the fake's machines), or the driver's error.
  bool no_driver() const { return no_driver_; }
  const std::string& why_not() const { return why_not_; }

  // Any thread: the context is made current on the calling thread first.
  absl::StatusOr<uint64_t> UsedBytes() const {
    if (context_ == nullptr) return absl::UnavailableError(why_not_);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    CUresult rc = api_->cuCtxSetCurrent(context_);
    if (rc == CUDA_SUCCESS) rc = api_->cuMemGetInfo(&free_bytes, &total_bytes);
    if (rc != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuMemGetInfo failed: ", Name(api_, rc)));
    }
    return static_cast<uint64_t>(total_bytes - free_bytes);
  }

 private:
  static std::string Name(const backend::cuda::DriverApi* api, CUresult rc) {
    const char* name = nullptr;
    if (api->cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == nullptr) {
      return absl::StrCat("CUresult ", static_cast<int>(rc));
    }
    return name;
  }

  const backend::cuda::DriverApi* api_ = nullptr;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  bool no_driver_ = false;
  std::string why_not_;
};

struct Sample {
  // The front end, from /proc.
  bool process_ok = false;
  std::string process_error;
  int64_t threads = 0;
  int64_t fds = 0;
  int64_t children = 0;  // live processes whose parent is the front end
  int64_t zombies = 0;   // exited children not yet reaped
  uint64_t rss_bytes = 0;
  // The device.
  bool device_ok = false;
  uint64_t device_used_bytes = 0;
  // The daemon's view of this tool's tenant (GetServerInfo).
  bool daemon_ok = false;
  std::string daemon_error;
  int64_t sessions = 0;
  uint64_t tenant_memory_bytes = 0;
};

void KeepMax(const Sample& s, Sample* peak) {
  peak->process_ok |= s.process_ok;
  peak->device_ok |= s.device_ok;
  peak->daemon_ok |= s.daemon_ok;
  peak->threads = std::max(peak->threads, s.threads);
  peak->fds = std::max(peak->fds, s.fds);
  peak->children = std::max(peak->children, s.children);
  peak->zombies = std::max(peak->zombies, s.zombies);
  peak->rss_bytes = std::max(peak->rss_bytes, s.rss_bytes);
  peak->device_used_bytes = std::max(peak->device_used_bytes, s.device_used_bytes);
  peak->sessions = std::max(peak->sessions, s.sessions);
  peak->tenant_memory_bytes = std::max(peak->tenant_memory_bytes, s.tenant_memory_bytes);
}

// Reads one process's /proc entries. State 'Z' (or no entry) means it is gone.
void ReadProcess(pid_t pid, Sample* s) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  if (!status) {
    s->process_error = absl::StrCat("the front end (pid ", pid, ") is gone");
    return;
  }
  bool zombie = false;
  for (std::string line; std::getline(status, line);) {
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() < 2) continue;
    if (fields[0] == "State:") zombie = fields[1] == "Z" || fields[1] == "X";
    if (fields[0] == "Threads:") absl::SimpleAtoi(fields[1], &s->threads);
    if (fields[0] == "VmRSS:") {
      uint64_t kib = 0;
      absl::SimpleAtoi(fields[1], &kib);
      s->rss_bytes = kib * kKiB;
    }
  }
  if (zombie) {
    s->process_error = absl::StrCat("the front end (pid ", pid, ") has exited");
    return;
  }
  DIR* fd_dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (fd_dir == nullptr) {
    s->process_error = absl::StrCat("cannot read /proc/", pid, "/fd (", std::strerror(errno),
                                    "): run as the daemon's user or as root");
    return;
  }
  while (dirent* entry = readdir(fd_dir)) {
    if (entry->d_name[0] != '.') ++s->fds;
  }
  closedir(fd_dir);
  DIR* proc = opendir("/proc");
  if (proc == nullptr) {
    s->process_error = "cannot read /proc";
    return;
  }
  while (dirent* entry = readdir(proc)) {
    int child = 0;
    if (!absl::SimpleAtoi(entry->d_name, &child) || child <= 0) continue;
    std::ifstream stat(absl::StrCat("/proc/", child, "/stat"));
    std::string line;
    if (!std::getline(stat, line)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'.
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(absl::string_view(line).substr(paren + 2), ' ');
    int parent = 0;
    if (fields.size() < 2 || !absl::SimpleAtoi(fields[1], &parent) || parent != pid) continue;
    if (fields[0] == "Z" || fields[0] == "X") {
      ++s->zombies;
    } else {
      ++s->children;
    }
  }
  closedir(proc);
  s->process_ok = true;
}

// The front end's threads by name (/proc/PID/task/*/comm) and open fds by kind (socket, pipe,
// anon_inode:[eventfd], /dev/..., file), for the report when a count did not return.
using Breakdown = std::map<std::string, int>;

Breakdown ThreadNames(pid_t pid) {
  Breakdown out;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* tasks = opendir(dir.c_str());
  if (tasks == nullptr) return out;
  while (dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat(dir, "/", entry->d_name, "/comm"));
    std::string name;
    if (std::getline(comm, name)) ++out[name];
  }
  closedir(tasks);
  return out;
}

Breakdown FdKinds(pid_t pid) {
  Breakdown out;
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* fds = opendir(dir.c_str());
  if (fds == nullptr) return out;
  while (dirent* entry = readdir(fds)) {
    if (entry->d_name[0] == '.') continue;
    char target[512];
    const ssize_t n =
        readlink(absl::StrCat(dir, "/", entry->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string link(target, n);
    std::string kind = "file";
    if (absl::StartsWith(link, "socket:")) {
      kind = "socket";
    } else if (absl::StartsWith(link, "pipe:")) {
      kind = "pipe";
    } else if (absl::StartsWith(link, "anon_inode:")) {
      kind = link;
    } else if (absl::StartsWith(link, "/dev/")) {
      kind = link;
    }
    ++out[kind];
  }
  closedir(fds);
  return out;
}

std::string Describe(const Breakdown& breakdown) {
  return absl::StrJoin(breakdown, ", ", [](std::string* out, const auto& entry) {
    absl::StrAppend(out, entry.first, " ", entry.second);
  });
}

class Monitor {
 public:
  Monitor(pid_t pid, Client client, const DeviceMemoryProbe* device)
      : pid_(pid), client_(std::move(client)), device_(device) {}

  pid_t pid() const { return pid_; }
  const Client& client() const { return client_; }

  Sample Measure() const {
    Sample s;
    ReadProcess(pid_, &s);
    if (device_->available()) {
      absl::StatusOr<uint64_t> used = device_->UsedBytes();
      s.device_ok = used.ok();
      if (used.ok()) s.device_used_bytes = *used;
    }
    absl::StatusOr<v1::GetServerInfoResponse> info = client_.GetServerInfo();
    s.daemon_ok = info.ok();
    if (info.ok()) {
      s.sessions = info->sessions_open();
      s.tenant_memory_bytes = info->device_memory_bytes();
    } else {
      s.daemon_error = info.status().ToString();
    }
    return s;
  }

 private:
  const pid_t pid_;
  const Client client_;
  const DeviceMemoryProbe* device_;
};

struct Tolerance {
  int64_t threads = 0;
  int64_t fds = 0;
  uint64_t device_bytes = 0;
  uint64_t rss_bytes = 0;
};

// What in `s` is not back at `base` within `tol`; empty when everything is.
std::vector<std::string> Differences(const Sample& s, const Sample& base, const Tolerance& tol) {
  std::vector<std::string> out;
  if (!s.process_ok) out.push_back(s.process_error);
  if (!s.daemon_ok) out.push_back(absl::StrCat("GetServerInfo failed: ", s.daemon_error));
  if (!out.empty()) return out;
  if (s.threads > base.threads + tol.threads) {
    out.push_back(
        absl::StrFormat("threads %d > baseline %d + %d", s.threads, base.threads, tol.threads));
  }
  if (s.fds > base.fds + tol.fds) {
    out.push_back(absl::StrFormat("fds %d > baseline %d + %d", s.fds, base.fds, tol.fds));
  }
  if (s.children != base.children) {
    out.push_back(absl::StrFormat("children %d != baseline %d", s.children, base.children));
  }
  if (s.zombies > 0) out.push_back(absl::StrFormat("%d zombie children", s.zombies));
  if (s.sessions != base.sessions) {
    out.push_back(absl::StrFormat("sessions open %d != baseline %d", s.sessions, base.sessions));
  }
  if (s.tenant_memory_bytes != base.tenant_memory_bytes) {
    out.push_back(absl::StrFormat("tenant device memory %d bytes != baseline %d",
                                  s.tenant_memory_bytes, base.tenant_memory_bytes));
  }
  if (base.device_ok && !s.device_ok) out.push_back("cuMemGetInfo failed");
  if (base.device_ok && s.device_ok &&
      s.device_used_bytes > base.device_used_bytes + tol.device_bytes) {
    out.push_back(absl::StrFormat("device memory used %s MiB > baseline %s MiB + %s MiB",
                                  Mib(s.device_used_bytes), Mib(base.device_used_bytes),
                                  Mib(tol.device_bytes)));
  }
  if (s.rss_bytes > base.rss_bytes + tol.rss_bytes) {
    out.push_back(absl::StrFormat("RSS %s MiB > baseline %s MiB + %s MiB", Mib(s.rss_bytes),
                                  Mib(base.rss_bytes), Mib(tol.rss_bytes)));
  }
  return out;
}

// One row of the table.
struct Row {
  std::string phase;
  Sample sample;
  std::string waited;  // how long the settle wait took, "-" for peaks
  std::vector<std::string> problems;
};

// Polls until `monitor` shows no differences from `base`, for at most `timeout`.
Row WaitForBaseline(const std::string& phase, const Monitor& monitor, const Sample& base,
                    const Tolerance& tol, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  Row row;
  row.phase = phase;
  while (true) {
    row.sample = monitor.Measure();
    row.problems = Differences(row.sample, base, tol);
    if (row.problems.empty() || absl::Now() - start >= timeout || Interrupted()) break;
    absl::SleepFor(kPollInterval);
  }
  row.waited = Secs(absl::Now() - start);
  if (!row.problems.empty()) row.waited += " (gave up)";
  return row;
}

// Samples `monitor` every kSampleInterval until stopped, keeping the maximum of each metric.
class PeakSampler {
 public:
  explicit PeakSampler(const Monitor& monitor) : monitor_(monitor) {
    peak_ = monitor_.Measure();
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        lock.unlock();
        const Sample s = monitor_.Measure();
        lock.lock();
        KeepMax(s, &peak_);
        cv_.wait_for(lock, absl::ToChronoNanoseconds(kSampleInterval), [this] { return stop_; });
      }
    });
  }
  ~PeakSampler() { Stop(); }
  Sample Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    return peak_;
  }

 private:
  const Monitor& monitor_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  Sample peak_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------
// Phase bookkeeping.

struct PhaseStats {
  std::atomic<uint64_t> iterations{0};
  std::atomic<uint64_t> operations{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> quota_retries{0};
  std::atomic<uint64_t> sessions_opened{0};
  absl::Duration elapsed;
  std::mutex mu;
  std::vector<std::string> kept_errors;
  std::vector<std::string> notes;  // phase-specific findings that fail the run

  void Error(const std::string& what) {
    ++errors;
    std::lock_guard<std::mutex> lock(mu);
    if (kept_errors.size() < kKeptErrors) kept_errors.push_back(what);
  }
  // The outcome of a client process: `count` errors, of which `messages` were kept.
  void MergeErrors(uint64_t count, const std::vector<std::string>& messages) {
    errors += count;
    std::lock_guard<std::mutex> lock(mu);
    for (const std::string& m : messages) {
      if (kept_errors.size() < kKeptErrors) kept_errors.push_back(m);
    }
  }
  void Note(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    notes.push_back(what);
  }
};

struct Target {
  std::string address;
  int device = 0;
};

ConnectOptions ConnectTo(const Target& target) {
  ConnectOptions connect;
  connect.address = target.address;
  connect.timeout = absl::Seconds(30);  // a daemon busy with many clients answers slowly
  return connect;
}

LaunchConfig Linear(uint64_t n) {
  LaunchConfig config;
  config.block.x = 256;
  config.grid.x = static_cast<uint32_t>((n + 255) / 256);
  return config;
}

// Compiles the soak kernel in `session`, retrying while the tenant's concurrent-compile
// quota is taken (RESOURCE_EXHAUSTED naming max_concurrent_compiles) until `deadline`.
absl::StatusOr<CompileResult> CompileKernel(const Session& session, absl::Time deadline,
                                            std::mt19937& rng, PhaseStats* stats) {
  CompileOptions options;
  options.source = kKernelSource;
  options.program_name = "gpurpc_soak.cu";
  while (true) {
    absl::StatusOr<CompileResult> result = session.Compile(options);
    if (result.ok()) {
      if (!result->success()) {
        return absl::InternalError(
            absl::StrCat("the soak kernel did not compile; NVRTC's log: ", result->log()));
      }
      return result;
    }
    const bool quota = result.status().code() == absl::StatusCode::kResourceExhausted &&
                       absl::StrContains(result.status().message(), "max_concurrent_compiles");
    if (!quota || absl::Now() >= deadline || Interrupted()) return result.status();
    if (stats != nullptr) ++stats->quota_retries;
    Nap(absl::Milliseconds(std::uniform_int_distribution<int>(20, 200)(rng)));
  }
}

// One phase-1 iteration: allocate, upload, launch add_one_f32, synchronise, download, verify,
// free. Every 8th iteration loads the compiled image again and launches through that module.
absl::Status Iteration(const Session& session, const Function& kernel, const std::string& image,
                       uint64_t max_bytes, uint64_t index, std::mt19937& rng, PhaseStats* stats) {
  const uint64_t sizes[] = {4 * kKiB, 64 * kKiB, 1 * kMiB + 4 * kKiB, max_bytes};
  const uint64_t bytes = std::min(sizes[index % 4], max_bytes) / 4 * 4;
  const uint64_t n = bytes / 4;
  // Whole numbers below 2^24: adding 1.0f is exact on any device.
  const uint32_t seed = std::uniform_int_distribution<uint32_t>(0, 1 << 22)(rng);
  std::vector<float> data(n);
  for (uint64_t k = 0; k < n; ++k) data[k] = static_cast<float>((seed + k) % (1u << 23));

  absl::StatusOr<Buffer> buffer = session.Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  ++stats->operations;
  if (absl::Status s =
          buffer->Upload(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.data()), bytes));
      !s.ok()) {
    return s;
  }
  ++stats->operations;
  std::optional<Module> module;
  Function function = kernel;
  if (index % 8 == 7) {
    absl::StatusOr<Module> loaded = session.LoadModule(image);
    if (!loaded.ok()) return loaded.status();
    absl::StatusOr<Function> from_module = loaded->GetFunction(kKernelName);
    if (!from_module.ok()) return from_module.status();
    module = *std::move(loaded);
    function = *std::move(from_module);
    stats->operations += 2;
  }
  if (absl::Status s = function.LaunchAsync(Linear(n), *buffer, static_cast<uint64_t>(n));
      !s.ok()) {
    return s;
  }
  ++stats->operations;
  if (absl::Status s = session.Synchronize(); !s.ok()) return s;
  ++stats->operations;
  std::vector<float> out(n);
  if (absl::Status s = session.DownloadInto(
          buffer->at(0), absl::MakeSpan(reinterpret_cast<uint8_t*>(out.data()), bytes));
      !s.ok()) {
    return s;
  }
  ++stats->operations;
  for (uint64_t k = 0; k < n; ++k) {
    if (out[k] != data[k] + 1.0f) {
      return absl::DataLossError(absl::StrFormat(
          "session %d: a %d-byte buffer read back %g at element %d after add_one_f32 on %g",
          session.id(), bytes, out[k], k, data[k]));
    }
  }
  if (absl::Status s = buffer->Free(); !s.ok()) return s;
  ++stats->operations;
  ++stats->iterations;
  stats->bytes += 2 * bytes;
  return absl::OkStatus();
}

// One phase-1 client: its own Client; a session for the whole phase (a new one after an
// error), running iterations until `deadline`.
void RunClient(int index, const Target& target, uint64_t max_bytes, absl::Time deadline,
               PhaseStats* stats) {
  std::mt19937 rng(std::random_device{}() ^ static_cast<uint32_t>(index));
  const std::string who = absl::StrCat("client ", index);
  absl::StatusOr<Client> client = Client::Connect(ConnectTo(target));
  while (!client.ok()) {
    stats->Error(absl::StrCat(who, ": connect: ", client.status().ToString()));
    if (absl::Now() >= deadline || Interrupted()) return;
    Nap(absl::Seconds(1));
    client = Client::Connect(ConnectTo(target));
  }
  uint64_t iteration = 0;
  uint64_t done = 0;
  while (absl::Now() < deadline && !Interrupted()) {
    absl::StatusOr<Session> session =
        client->OpenSession(target.device, absl::StrCat("gpurpc-soak ", who));
    if (!session.ok()) {
      stats->Error(absl::StrCat(who, ": OpenSession: ", session.status().ToString()));
      Nap(absl::Milliseconds(500));
      continue;
    }
    ++stats->sessions_opened;
    absl::StatusOr<CompileResult> compiled = CompileKernel(*session, deadline, rng, stats);
    absl::StatusOr<Function> kernel =
        compiled.ok() ? compiled->module.GetFunction(kKernelName) : compiled.status();
    if (!kernel.ok()) {
      stats->Error(absl::StrCat(who, ": compile: ", kernel.status().ToString()));
      Nap(absl::Milliseconds(500));
      continue;
    }
    stats->operations += 2;
    const std::string image = compiled->response.image();
    while (absl::Now() < deadline && !Interrupted()) {
      absl::Status s = Iteration(*session, *kernel, image, max_bytes, iteration++, rng, stats);
      if (!s.ok()) {
        stats->Error(absl::StrCat(who, ": iteration ", iteration - 1, ": ", s.ToString()));
        break;
      }
      ++done;
    }
    // Kernel and image first: the session's handles go before the session.
    kernel = absl::CancelledError();
    compiled = absl::CancelledError();
    if (absl::Status s = session->Close(); !s.ok()) {
      stats->Error(absl::StrCat(who, ": CloseSession: ", s.ToString()));
    }
  }
  if (done == 0 && !Interrupted()) {
    stats->Note(absl::StrCat(who, " completed no iteration"));
  }
}

// One phase-2 cycle: a fresh connection, open, allocate, upload, close with the buffer still
// allocated (the daemon frees it with the session).
absl::Status Cycle(int index, const Target& target, PhaseStats* stats) {
  absl::StatusOr<Client> client = Client::Connect(ConnectTo(target));
  if (!client.ok()) return client.status();
  absl::StatusOr<Session> session =
      client->OpenSession(target.device, absl::StrCat("gpurpc-soak cycle ", index));
  if (!session.ok()) return session.status();
  ++stats->sessions_opened;
  absl::StatusOr<Buffer> buffer = session->Allocate(kCycleBytes);
  if (!buffer.ok()) return buffer.status();
  std::vector<uint8_t> bytes(kCycleBytes, static_cast<uint8_t>(index));
  if (absl::Status s = buffer->Upload(bytes); !s.ok()) return s;
  stats->operations += 4;
  stats->bytes += kCycleBytes;
  return session->Close();
}

// ---------------------------------------------------------------------------------------
// Phase 3: clients killed mid-transfer. Each is this program re-executed in child mode:
//
//   gpurpc-soak --child-upload=ADDRESS --device=D --kill-bytes=N --child-parent=PID
//
// It opens a session, allocates N bytes and uploads them in a loop, printing "uploading K"
// before and "uploaded K" after each upload on stdout, until it is killed.

constexpr char kChildUploadFlag[] = "--child-upload=";
constexpr char kChildClientFlag[] = "--child-client=";

// This program, for re-executing it in a child mode.
absl::StatusOr<std::string> SelfExe() {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len <= 0) {
    return absl::InternalError(
        absl::StrCat("cannot find this program (/proc/self/exe): ", std::strerror(errno)));
  }
  return std::string(exe, len);
}

// The common flags of both child modes; false (with a message) when the process is not the
// soak's child.
bool ParseChildFlags(int argc, char** argv, const char* mode_flag, Target* target, uint64_t* bytes,
                     int* index, int64_t* milliseconds) {
  int parent = 0;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (absl::StartsWith(arg, mode_flag)) {
      target->address = std::string(arg.substr(std::strlen(mode_flag)));
    } else if (absl::StartsWith(arg, "--device=")) {
      absl::SimpleAtoi(arg.substr(9), &target->device);
    } else if (absl::StartsWith(arg, "--kill-bytes=")) {
      absl::SimpleAtoi(arg.substr(13), bytes);
    } else if (absl::StartsWith(arg, "--client-bytes=")) {
      absl::SimpleAtoi(arg.substr(15), bytes);
    } else if (absl::StartsWith(arg, "--child-index=")) {
      absl::SimpleAtoi(arg.substr(14), index);
    } else if (absl::StartsWith(arg, "--child-ms=")) {
      absl::SimpleAtoi(arg.substr(11), milliseconds);
    } else if (absl::StartsWith(arg, "--child-parent=")) {
      absl::SimpleAtoi(arg.substr(15), &parent);
    }
  }
  // Never outlive the soak that started us.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (parent <= 1 || getppid() != parent || *bytes == 0 || target->address.empty()) {
    std::fprintf(stderr,
                 "gpurpc-soak: %s is gpurpc-soak's own child mode, not for direct use; see "
                 "--help\n",
                 mode_flag);
    return false;
  }
  return true;
}

// One line of child output: newlines in messages (an NVRTC log) would split it.
std::string OneLine(absl::string_view text) {
  std::string out(text);
  std::replace(out.begin(), out.end(), '\n', ' ');
  return out;
}

// --client-processes: one phase-1 client in a process of its own. Prints, once done,
// "stats ITERATIONS OPERATIONS BYTES ERRORS QUOTA_RETRIES SESSIONS", then "error MESSAGE" and
// "note MESSAGE" lines.
int ChildClient(int argc, char** argv) {
  Target target;
  uint64_t bytes = 0;
  int index = 0;
  int64_t milliseconds = 0;
  if (!ParseChildFlags(argc, argv, kChildClientFlag, &target, &bytes, &index, &milliseconds)) {
    return 2;
  }
  // gRPC 1.51 shuts itself down when its last channel goes, joining executor threads that
  // may sit in a 10 s poll: hold it up, and leave with _Exit once the report is out.
  grpc_init();
  PhaseStats stats;
  RunClient(index, target, bytes, absl::Now() + absl::Milliseconds(milliseconds), &stats);
  absl::PrintF("stats %d %d %d %d %d %d\n", stats.iterations.load(), stats.operations.load(),
               stats.bytes.load(), stats.errors.load(), stats.quota_retries.load(),
               stats.sessions_opened.load());
  std::lock_guard<std::mutex> lock(stats.mu);
  for (const std::string& e : stats.kept_errors) absl::PrintF("error %s\n", OneLine(e));
  for (const std::string& n : stats.notes) absl::PrintF("note %s\n", OneLine(n));
  std::fflush(stdout);
  std::_Exit(0);
}

int ChildUpload(int argc, char** argv) {
  Target target;
  uint64_t bytes = 0;
  int index = 0;
  int64_t milliseconds = 0;
  if (!ParseChildFlags(argc, argv, kChildUploadFlag, &target, &bytes, &index, &milliseconds)) {
    return 2;
  }
  const std::string who = absl::StrCat("gpurpc-soak killed client (pid ", getpid(), ")");
  auto fail = [&](absl::string_view what, const absl::Status& status) {
    std::fprintf(stderr, "%s: %s: %s\n", who.c_str(), std::string(what).c_str(),
                 status.ToString().c_str());
    return 2;
  };
  absl::StatusOr<Client> client = Client::Connect(ConnectTo(target));
  if (!client.ok()) return fail("connect", client.status());
  absl::StatusOr<Session> session = client->OpenSession(target.device, who);
  if (!session.ok()) return fail("OpenSession", session.status());
  absl::StatusOr<Buffer> buffer = session->Allocate(bytes);
  if (!buffer.ok()) return fail(absl::StrCat("Allocate(", bytes, ")"), buffer.status());
  std::vector<uint8_t> data(bytes);
  for (uint64_t k = 0; k < bytes; ++k) data[k] = static_cast<uint8_t>(k * 7 + 1);
  std::printf("session %llu\n", static_cast<unsigned long long>(session->id()));
  std::fflush(stdout);
  const absl::Time give_up = absl::Now() + absl::Minutes(10);
  for (uint64_t k = 1; absl::Now() < give_up; ++k) {
    std::printf("uploading %llu\n", static_cast<unsigned long long>(k));
    std::fflush(stdout);
    if (absl::Status s = buffer->Upload(data); !s.ok()) return fail("Upload", s);
    std::printf("uploaded %llu\n", static_cast<unsigned long long>(k));
    std::fflush(stdout);
  }
  std::fprintf(stderr, "%s: nobody killed it within 10 minutes; exiting\n", who.c_str());
  return 4;
}

// A child process of the soak (this program in a child mode), its stdout read line by line on
// a thread: the progress lines of an upload child are counted, every other line is kept.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::string& exe,
                                                      std::vector<std::string> flags) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
    std::vector<std::string> args = {exe};
    args.insert(args.end(), flags.begin(), flags.end());
    args.push_back(absl::StrCat("--child-parent=", getpid()));
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    if (rc != 0) {
      close(fds[0]);
      return absl::InternalError(absl::StrCat("cannot start ", exe, ": ", std::strerror(rc)));
    }
    auto child = std::unique_ptr<Child>(new Child(pid, fds[0]));
    child->reader_ = std::thread([c = child.get()] { c->Read(); });
    return child;
  }

  ~Child() {
    if (!reaped_) {
      kill(pid_, SIGKILL);
      Reap();
    }
    if (reader_.joinable()) reader_.join();
    close(fd_);
  }

  pid_t pid() const { return pid_; }

  // Waits until the first upload started; false when the child ended first or `deadline`
  // passed.
  bool WaitUploading(absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, absl::ToChronoTime(deadline), [this] {
      return uploading_ || eof_ || Interrupted();
    }) && uploading_;
  }

  // SIGKILL, then reaps it and reads its last words. Its exit is the description of how it
  // ended ("killed by SIGKILL" when as intended).
  void Kill() {
    if (!reaped_) {  // never signal a pid that may belong to someone else by now
      kill(pid_, SIGKILL);
      Reap();
    }
    if (reader_.joinable()) reader_.join();
  }

  bool killed_by_us() const {
    return WIFSIGNALED(wait_status_) && WTERMSIG(wait_status_) == SIGKILL;
  }
  std::string how_it_ended() const {
    if (WIFSIGNALED(wait_status_)) {
      return absl::StrCat("was killed by signal ", WTERMSIG(wait_status_));
    }
    return absl::StrCat("exited with status ", WEXITSTATUS(wait_status_));
  }
  // After Kill: whether its last line said an upload had started and not finished.
  bool died_mid_upload() const { return absl::StartsWith(last_line_, "uploading "); }
  uint64_t uploads_completed() const { return completed_; }

  // Waits for the child to end by itself until `deadline`, then kills it. True when it ended
  // by itself with status 0. Its lines are complete afterwards.
  bool WaitExit(absl::Time deadline) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!eof_ && absl::Now() < deadline && !Interrupted()) {
        cv_.wait_for(lock, std::chrono::milliseconds(200));
      }
    }
    Kill();  // reaps it; a SIGKILL only when it is still running
    return WIFEXITED(wait_status_) && WEXITSTATUS(wait_status_) == 0;
  }
  // Every line that is not upload progress, once it ended.
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  Child(pid_t pid, int fd) : pid_(pid), fd_(fd) {}

  void Reap() {
    while (waitpid(pid_, &wait_status_, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }

  void Read() {
    std::string pending;
    char buffer[256];
    while (true) {
      const ssize_t n = read(fd_, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      pending.append(buffer, n);
      for (size_t end; (end = pending.find('\n')) != std::string::npos;) {
        std::string line = pending.substr(0, end);
        pending.erase(0, end + 1);
        std::lock_guard<std::mutex> lock(mu_);
        if (absl::StartsWith(line, "uploading ")) {
          uploading_ = true;
        } else if (absl::StartsWith(line, "uploaded ")) {
          ++completed_;
        } else {
          lines_.push_back(line);
        }
        last_line_ = std::move(line);
        cv_.notify_all();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    eof_ = true;
    cv_.notify_all();
  }

  const pid_t pid_;
  const int fd_;
  std::thread reader_;
  bool reaped_ = false;
  int wait_status_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool uploading_ = false;
  bool eof_ = false;
  uint64_t completed_ = 0;
  std::string last_line_;
  std::vector<std::string> lines_;
};

// Phase 1 with --client-processes: every client is a Child running ChildClient until the
// phase's end; their stats lines are summed into `stats`.
void RunClientProcesses(const Options& options, const Target& target, PhaseStats* stats) {
  const absl::StatusOr<std::string> exe = SelfExe();
  if (!exe.ok()) {
    stats->Note(std::string(exe.status().message()));
    return;
  }
  const int64_t ms = absl::ToInt64Milliseconds(options.seconds);
  std::vector<std::unique_ptr<Child>> children;
  for (int i = 0; i < options.clients && !Interrupted(); ++i) {
    absl::StatusOr<std::unique_ptr<Child>> child =
        Child::Spawn(*exe, {absl::StrCat(kChildClientFlag, target.address),
                            absl::StrCat("--device=", target.device),
                            absl::StrCat("--client-bytes=", options.client_bytes),
                            absl::StrCat("--child-index=", i), absl::StrCat("--child-ms=", ms)});
    if (!child.ok()) {
      stats->Error(absl::StrCat("client process ", i, ": ", child.status().message()));
      continue;
    }
    children.push_back(*std::move(child));
  }
  // A client ends at the phase's end plus its last iteration and close.
  const absl::Time deadline = absl::Now() + options.seconds + absl::Seconds(120);
  for (auto& child : children) {
    const bool ok = child->WaitExit(deadline);
    bool reported = false;
    std::vector<std::string> messages;
    uint64_t errors = 0;
    for (const std::string& line : child->lines()) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      uint64_t v[6] = {};
      if (f.size() == 7 && f[0] == "stats" && absl::SimpleAtoi(f[1], &v[0]) &&
          absl::SimpleAtoi(f[2], &v[1]) && absl::SimpleAtoi(f[3], &v[2]) &&
          absl::SimpleAtoi(f[4], &v[3]) && absl::SimpleAtoi(f[5], &v[4]) &&
          absl::SimpleAtoi(f[6], &v[5])) {
        stats->iterations += v[0];
        stats->operations += v[1];
        stats->bytes += v[2];
        errors = v[3];
        stats->quota_retries += v[4];
        stats->sessions_opened += v[5];
        reported = true;
      } else if (absl::StartsWith(line, "error ")) {
        messages.push_back(absl::StrCat("(pid ", child->pid(), ") ", line.substr(6)));
      } else if (absl::StartsWith(line, "note ")) {
        stats->Note(line.substr(5));
      }
    }
    stats->MergeErrors(errors, messages);
    if (!ok || !reported) {
      stats->Error(absl::StrCat("client process pid ", child->pid(), " ", child->how_it_ended(),
                                reported ? "" : " without its stats line",
                                "; its errors are above, on stderr"));
    }
  }
}

struct KillResult {
  int spawned = 0;
  int killed = 0;
  int mid_upload = 0;
  uint64_t uploads_completed = 0;
  absl::Duration reclaim;
  bool reclaimed = false;
  int64_t sessions_left = 0;
};

// Spawns the children, kills each 0.2-1.2 s after all of them are uploading, then waits for
// the daemon to reclaim their sessions (its sessions_open for this tenant back at the
// baseline's).
KillResult RunKills(const Options& options, const Target& target, const Monitor& monitor,
                    const Sample& base, PhaseStats* stats) {
  KillResult result;
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::string> exe = SelfExe();
  if (!exe.ok()) {
    stats->Note(std::string(exe.status().message()));
    return result;
  }
  std::vector<std::unique_ptr<Child>> children;
  for (int i = 0; i < options.killed && !Interrupted(); ++i) {
    absl::StatusOr<std::unique_ptr<Child>> child =
        Child::Spawn(*exe, {absl::StrCat(kChildUploadFlag, target.address),
                            absl::StrCat("--device=", target.device),
                            absl::StrCat("--kill-bytes=", options.kill_bytes)});
    if (!child.ok()) {
      stats->Note(std::string(child.status().message()));
      break;
    }
    children.push_back(*std::move(child));
  }
  result.spawned = static_cast<int>(children.size());
  const absl::Time ready_deadline = absl::Now() + absl::Seconds(120);
  for (auto& child : children) {
    if (!child->WaitUploading(ready_deadline) && !Interrupted()) {
      child->Kill();
      stats->Note(absl::StrCat("killed client pid ", child->pid(), " never started its upload (it ",
                               child->how_it_ended(), "; its errors are above, on stderr)"));
    }
  }
  // Kill times, each uniform in 0.2-1.2 s from now, in order.
  std::mt19937 rng(std::random_device{}());
  std::vector<std::pair<absl::Time, Child*>> schedule;
  const absl::Time now = absl::Now();
  for (auto& child : children) {
    schedule.emplace_back(
        now + absl::Milliseconds(std::uniform_int_distribution<int>(200, 1200)(rng)), child.get());
  }
  std::sort(schedule.begin(), schedule.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  absl::Time last_kill = now;
  for (auto& [when, child] : schedule) {
    Nap(when - absl::Now());
    child->Kill();
    last_kill = absl::Now();
    if (!child->killed_by_us()) {
      // Already reported above when it never started; otherwise it died of an error.
      if (child->uploads_completed() > 0 || child->died_mid_upload()) {
        stats->Note(absl::StrCat("killed client pid ", child->pid(), " ", child->how_it_ended(),
                                 " before it was killed; its errors are above, on stderr"));
      }
      continue;
    }
    ++result.killed;
    result.mid_upload += child->died_mid_upload() ? 1 : 0;
    result.uploads_completed += child->uploads_completed();
  }
  children.clear();
  // The daemon's view: the killed clients' sessions are reclaimed.
  std::fprintf(stderr,
               "soak: %d clients killed; waiting up to %s for the daemon to reclaim "
               "their sessions\n",
               result.killed, Secs(options.reclaim_timeout).c_str());
  while (!Interrupted()) {
    absl::StatusOr<v1::GetServerInfoResponse> info = monitor.client().GetServerInfo();
    if (info.ok()) {
      result.sessions_left = static_cast<int64_t>(info->sessions_open()) - base.sessions;
      if (result.sessions_left <= 0) {
        result.reclaimed = true;
        break;
      }
    }
    if (absl::Now() - last_kill >= options.reclaim_timeout) break;
    absl::SleepFor(kPollInterval);
  }
  result.reclaim = absl::Now() - last_kill;
  stats->elapsed = absl::Now() - start;
  return result;
}

// ---------------------------------------------------------------------------------------
// The run.

// The most warm-up rounds (see WarmUp).
constexpr int kMaxWarmUpRounds = 6;

// `burst` concurrent clients that each open a session, compile, run one iteration and close,
// then `cycles` threads that each run 4 open/close cycles.
absl::Status WarmUpBurst(const Target& target, uint64_t client_bytes, int burst, int cycles) {
  PhaseStats warm;
  std::vector<std::thread> threads;
  for (int i = 0; i < burst; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(std::random_device{}() ^ static_cast<uint32_t>(i));
      absl::Status status = [&]() -> absl::Status {
        absl::StatusOr<Client> own = Client::Connect(ConnectTo(target));
        if (!own.ok()) return own.status();
        absl::StatusOr<Session> session =
            own->OpenSession(target.device, absl::StrCat("gpurpc-soak warm-up ", i));
        if (!session.ok()) return session.status();
        absl::StatusOr<CompileResult> compiled =
            CompileKernel(*session, absl::Now() + absl::Seconds(120), rng, nullptr);
        if (!compiled.ok()) return compiled.status();
        absl::StatusOr<Function> kernel = compiled->module.GetFunction(kKernelName);
        if (!kernel.ok()) return kernel.status();
        absl::Status s = Iteration(*session, *kernel, compiled->response.image(), client_bytes,
                                   static_cast<uint64_t>(i), rng, &warm);
        if (!s.ok()) return s;
        kernel = absl::CancelledError();
        compiled = absl::CancelledError();
        return session->Close();
      }();
      if (!status.ok()) warm.Error(absl::StrCat("warm-up client ", i, ": ", status.ToString()));
    });
  }
  for (std::thread& t : threads) t.join();
  threads.clear();
  for (int w = 0; w < cycles; ++w) {
    threads.emplace_back([&, w] {
      for (int c = 0; c < 4; ++c) {
        if (absl::Status s = Cycle(-1, target, &warm); !s.ok()) {
          warm.Error(absl::StrCat("warm-up cycle ", w, ".", c, ": ", s.ToString()));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::lock_guard<std::mutex> lock(warm.mu);
  if (warm.errors > 0) {
    return absl::InternalError(absl::StrCat(
        warm.errors.load(), " warm-up operations failed; the first: ", warm.kept_errors.front()));
  }
  return absl::OkStatus();
}

// One session through every kind of iteration and an open/close cycle (state the daemon
// creates on first use); then rounds of WarmUpBurst with as many concurrent clients and
// cycles as the phases will run, until a round leaves the front end with no more threads
// than the round before (at most kMaxWarmUpRounds). Pools that grow on demand and are kept
// (the front end's bounded pool of threads for blocking work, gRPC's threads) so reach the
// size the phases give them before the baseline, and only growth that goes on counts.
// Returns the number of rounds.
absl::StatusOr<int> WarmUp(const Monitor& monitor, const Target& target, const Options& options) {
  PhaseStats warm;
  std::mt19937 rng(std::random_device{}());
  absl::StatusOr<Session> session =
      monitor.client().OpenSession(target.device, "gpurpc-soak warm-up");
  if (!session.ok()) return session.status();
  {
    absl::StatusOr<CompileResult> compiled =
        CompileKernel(*session, absl::Now() + absl::Seconds(120), rng, nullptr);
    if (!compiled.ok()) return compiled.status();
    absl::StatusOr<Function> kernel = compiled->module.GetFunction(kKernelName);
    if (!kernel.ok()) return kernel.status();
    for (uint64_t i = 0; i < 8; ++i) {
      absl::Status s = Iteration(*session, *kernel, compiled->response.image(),
                                 options.client_bytes, i, rng, &warm);
      if (!s.ok()) return s;
    }
  }
  if (absl::Status s = session->Close(); !s.ok()) return s;
  if (absl::Status s = Cycle(-1, target, &warm); !s.ok()) return s;
  const int burst = std::max({1, options.clients, options.killed});
  int64_t threads = -1;
  for (int round = 1;; ++round) {
    if (absl::Status s = WarmUpBurst(target, options.client_bytes, burst,
                                     std::max(1, options.cycle_concurrency));
        !s.ok()) {
      return s;
    }
    // Its sessions closed, and a moment for threads that end by themselves.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    Sample sample = monitor.Measure();
    while (sample.sessions > 0 && absl::Now() < deadline && !Interrupted()) {
      absl::SleepFor(kPollInterval);
      sample = monitor.Measure();
    }
    absl::SleepFor(absl::Seconds(1));
    sample = monitor.Measure();
    if (!sample.process_ok) return absl::UnavailableError(sample.process_error);
    if ((threads >= 0 && sample.threads <= threads) || round == kMaxWarmUpRounds || Interrupted()) {
      return round;
    }
    threads = sample.threads;
  }
}

std::string Cell(bool ok, int64_t value) { return ok ? absl::StrCat(value) : "?"; }

void PrintTable(const std::vector<Row>& rows, const DeviceMemoryProbe& device) {
  std::printf("%-15s %7s %6s %8s %7s %8s %15s %8s %10s  %s\n", "phase", "threads", "fds",
              "children", "zombies", "RSS MiB", "device used MiB", "sessions", "tenant MiB",
              "waited");
  for (const Row& row : rows) {
    const Sample& s = row.sample;
    std::string device_cell = device.no_driver() ? "n/a (no driver)" : "n/a";
    if (device.available()) device_cell = s.device_ok ? Mib(s.device_used_bytes) : "?";
    std::printf("%-15s %7s %6s %8s %7s %8s %15s %8s %10s  %s\n", row.phase.c_str(),
                Cell(s.process_ok, s.threads).c_str(), Cell(s.process_ok, s.fds).c_str(),
                Cell(s.process_ok, s.children).c_str(), Cell(s.process_ok, s.zombies).c_str(),
                s.process_ok ? Mib(s.rss_bytes).c_str() : "?", device_cell.c_str(),
                Cell(s.daemon_ok, s.sessions).c_str(),
                s.daemon_ok ? Mib(s.tenant_memory_bytes).c_str() : "?", row.waited.c_str());
  }
}

std::string Rate(uint64_t count, absl::Duration d) {
  const double seconds = absl::ToDoubleSeconds(d);
  return seconds > 0 ? absl::StrFormat("%.1f/s", count / seconds) : "-";
}

// Adds a phase's error count and kept messages to `failures`, and prints them.
void ReportErrors(const std::string& phase, PhaseStats& stats, std::vector<std::string>* failures) {
  std::lock_guard<std::mutex> lock(stats.mu);
  if (stats.errors > 0) {
    failures->push_back(absl::StrCat(phase, ": ", stats.errors.load(), " operations failed"));
    for (const std::string& e : stats.kept_errors) std::printf("    error: %s\n", e.c_str());
    if (stats.errors > stats.kept_errors.size()) {
      absl::PrintF("    (%d more errors)\n", stats.errors.load() - stats.kept_errors.size());
    }
  }
  for (const std::string& note : stats.notes) {
    failures->push_back(absl::StrCat(phase, ": ", note));
    std::printf("    %s\n", note.c_str());
  }
}

std::string UserName() {
  if (const passwd* pw = getpwuid(geteuid()); pw != nullptr) return pw->pw_name;
  return absl::StrCat(geteuid());
}

bool LooksLikeAddress(const std::string& text) {
  return absl::StartsWith(text, "unix:") || absl::StartsWith(text, "dns:") ||
         absl::StartsWith(text, "ipv4:") || absl::StartsWith(text, "ipv6:") ||
         (text.find(':') != std::string::npos && text.find('/') == std::string::npos);
}

// The daemon under soak: one this tool started (`daemon` set), or one it attached to.
struct DaemonUnderSoak {
  std::unique_ptr<testing::TestDaemon> daemon;
  Target target;
  pid_t pid = 0;  // the front end
};

// --daemon names a binary to start, or a socket or address to attach to (with --daemon-pid).
// INVALID_ARGUMENT for flags that do not fit together, UNAVAILABLE when the daemon does not
// start.
absl::StatusOr<DaemonUnderSoak> StartOrAttach(const Options& options) {
  DaemonUnderSoak out;
  out.target.device = options.device;
  out.pid = options.daemon_pid;
  const std::string binary =
      options.daemon.empty() ? testing::TestDaemon::Binary() : options.daemon;
  struct stat st = {};
  const bool exists = stat(binary.c_str(), &st) == 0;
  if (exists && S_ISREG(st.st_mode)) {
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--daemon=", binary, " is not executable"));
    }
    if (options.daemon_pid != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--daemon-pid is for attaching to a running daemon (--daemon=ADDRESS); "
                       "this run starts ",
                       binary, " itself"));
    }
    testing::TestDaemon::Options start;
    start.backend = "auto";
    start.idle_timeout = "60s";
    start.warm_workers = 1;
    const int sessions = options.clients + options.cycle_concurrency + options.killed + 8;
    start.extra_flags = {absl::StrCat("--max-sessions=", sessions),
                         absl::StrCat("--tenant-max-sessions=", sessions), "--log-level=info",
                         absl::StrCat("--admin-tenants=", UserName())};
    start.extra_flags.insert(start.extra_flags.end(), options.daemon_args.begin(),
                             options.daemon_args.end());
    // TestDaemon starts $GPURPCD_BIN.
    setenv("GPURPCD_BIN", binary.c_str(), 1);
    std::fprintf(stderr, "soak: starting %s %s\n", binary.c_str(),
                 absl::StrJoin(start.extra_flags, " ").c_str());
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> started =
        testing::TestDaemon::Start(start);
    if (!started.ok()) {
      return absl::UnavailableError(
          absl::StrCat("cannot start the daemon: ", started.status().ToString()));
    }
    out.daemon = *std::move(started);
    out.target.address = out.daemon->address();
    out.pid = out.daemon->pid();
    return out;
  }
  if ((exists && S_ISSOCK(st.st_mode)) || LooksLikeAddress(binary)) {
    out.target.address = exists && S_ISSOCK(st.st_mode) ? absl::StrCat("unix:", binary) : binary;
    if (out.pid == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attaching to ", out.target.address,
          " needs --daemon-pid=PID, the pid of its front end (the gpurpcd process its workers "
          "are children of)"));
    }
    if (!options.daemon_args.empty()) {
      return absl::InvalidArgumentError(
          "--daemon-arg applies only to a daemon this tool starts (--daemon=PATH), not to one "
          "at an address");
    }
    return out;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--daemon=", binary,
                   " is neither a gpurpcd binary, a Unix socket nor an address (unix:PATH or "
                   "HOST:PORT)"));
}

// Polls until the front end's threads, fds, children and the sessions stay the same for
// kStablePolls polls in a row, at most `timeout`.
Row TakeBaseline(const Monitor& monitor, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  Row baseline;
  baseline.phase = "baseline";
  baseline.sample = monitor.Measure();
  int same = 1;
  while (same < kStablePolls && absl::Now() - start < timeout && !Interrupted()) {
    absl::SleepFor(kPollInterval);
    const Sample s = monitor.Measure();
    const Sample& p = baseline.sample;
    const bool stable = s.process_ok && s.daemon_ok && s.zombies == 0 && s.threads == p.threads &&
                        s.fds == p.fds && s.children == p.children && s.sessions == p.sessions;
    same = stable ? same + 1 : 1;
    baseline.sample = s;
  }
  baseline.waited = Secs(absl::Now() - start);
  if (!baseline.sample.process_ok) baseline.problems.push_back(baseline.sample.process_error);
  if (!baseline.sample.daemon_ok) baseline.problems.push_back(baseline.sample.daemon_error);
  if (same < kStablePolls) baseline.waited += " (never steady)";
  return baseline;
}

// Phase 2: `options.cycles` Cycles on `options.cycle_concurrency` threads.
void RunCycles(const Options& options, const Target& target, PhaseStats* stats,
               absl::Duration* slowest) {
  std::atomic<int> next{0};
  std::mutex slowest_mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < options.cycle_concurrency; ++w) {
    threads.emplace_back([&] {
      for (int c; (c = next++) < options.cycles && !Interrupted();) {
        const absl::Time t0 = absl::Now();
        if (absl::Status s = Cycle(c, target, stats); !s.ok()) {
          stats->Error(absl::StrCat("cycle ", c, ": ", s.ToString()));
          continue;
        }
        ++stats->iterations;
        std::lock_guard<std::mutex> lock(slowest_mu);
        *slowest = std::max(*slowest, absl::Now() - t0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

int Run(const Options& options) {
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  // The tool's own context first, so that the baseline includes it.
  DeviceMemoryProbe device(options.device);

  // The daemon: started here, or attached to.
  absl::StatusOr<DaemonUnderSoak> under_soak = StartOrAttach(options);
  if (!under_soak.ok()) {
    std::fprintf(stderr, "gpurpc-soak: %s\n", std::string(under_soak.status().message()).c_str());
    return under_soak.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::unique_ptr<testing::TestDaemon> daemon = std::move(under_soak->daemon);
  const Target target = under_soak->target;
  const pid_t pid = under_soak->pid;

  std::vector<std::string> failures;
  auto print_log_tail = [&] {
    if (daemon == nullptr) return;
    const std::string log = daemon->Log();
    if (!options.daemon_log.empty()) {
      std::ofstream(options.daemon_log) << log;
      std::fprintf(stderr, "soak: the daemon's log is in %s\n", options.daemon_log.c_str());
    }
    if (failures.empty()) return;
    std::vector<absl::string_view> lines = absl::StrSplit(log, '\n', absl::SkipEmpty());
    const size_t first = lines.size() > 40 ? lines.size() - 40 : 0;
    std::fprintf(stderr, "soak: the daemon's log, last %zu lines:\n", lines.size() - first);
    for (size_t i = first; i < lines.size(); ++i) {
      std::fprintf(stderr, "  %s\n", std::string(lines[i]).c_str());
    }
  };

  absl::StatusOr<Client> client = Client::Connect(ConnectTo(target));
  absl::StatusOr<v1::ListDevicesResponse> devices =
      client.ok() ? client->ListDevices() : client.status();
  absl::StatusOr<v1::GetServerInfoResponse> info =
      devices.ok() ? client->GetServerInfo() : devices.status();
  if (!info.ok()) {
    failures.push_back(absl::StrCat("cannot talk to the daemon at ", target.address, ": ",
                                    info.status().ToString()));
    std::printf("soak: FAIL: %s\n", failures.back().c_str());
    print_log_tail();
    return 1;
  }
  if (options.device >= devices->devices_size()) {
    std::fprintf(stderr, "gpurpc-soak: --device=%d, but the daemon serves %d device(s)\n",
                 options.device, devices->devices_size());
    return 2;
  }
  const v1::DeviceInfo& device_info = devices->devices(options.device);
  Monitor monitor(pid, *client, &device);

  std::printf("gpurpc-soak: gpurpcd pid %d at %s (%s), backend %s, device %d: %s\n", pid,
              target.address.c_str(), daemon ? "started by this tool" : "attached",
              devices->backend().c_str(), options.device, device_info.name().c_str());
  std::printf("tenant %s (%s%s); device memory: %s\n", info->tenant().c_str(),
              info->auth_method().c_str(), info->admin() ? ", admin" : "",
              device.available() ? "cuMemGetInfo through this tool's own context"
                                 : absl::StrCat(device.no_driver() ? "n/a (no driver: " : "n/a (",
                                                device.why_not(), ")")
                                       .c_str());
  std::fflush(stdout);

  const Tolerance tolerance{options.thread_tolerance, options.fd_tolerance,
                            options.device_memory_tolerance, options.rss_tolerance};
  std::vector<Row> rows;

  // 0. Warm-up and baseline.
  {
    std::fprintf(stderr,
                 "soak: warm-up: one session of every kind of iteration, then rounds of %d "
                 "concurrent sessions and %d concurrent open/close cycles until the front end's "
                 "threads stop growing\n",
                 std::max({1, options.clients, options.killed}),
                 std::max(1, options.cycle_concurrency));
    absl::StatusOr<int> rounds = WarmUp(monitor, target, options);
    if (!rounds.ok()) {
      failures.push_back(absl::StrCat("the warm-up failed: ", rounds.status().ToString()));
      std::printf("soak: FAIL: %s\n", failures.back().c_str());
      print_log_tail();
      return 1;
    }
    std::fprintf(stderr, "soak: warm-up took %d round(s)\n", *rounds);
  }
  std::fprintf(stderr, "soak: waiting for the front end to settle (baseline)\n");
  const Row baseline = TakeBaseline(monitor, options.settle_timeout);
  if (!baseline.problems.empty()) {
    failures.push_back(absl::StrCat("no baseline: ", absl::StrJoin(baseline.problems, ", ")));
    std::printf("soak: FAIL: %s\n", failures.back().c_str());
    print_log_tail();
    return 1;
  }
  rows.push_back(baseline);
  const Sample base = rows.front().sample;
  const Breakdown base_threads = ThreadNames(pid);
  const Breakdown base_fds = FdKinds(pid);

  // 1. Concurrent clients.
  PhaseStats clients;
  if (options.clients > 0 && options.seconds > absl::ZeroDuration() && !Interrupted()) {
    std::fprintf(stderr, "soak: phase 1: %d clients (%s) for %s\n", options.clients,
                 options.client_processes ? "processes" : "threads", Secs(options.seconds).c_str());
    PeakSampler sampler(monitor);
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + options.seconds;
    if (options.client_processes) {
      RunClientProcesses(options, target, &clients);
    } else {
      std::vector<std::thread> threads;
      for (int i = 0; i < options.clients; ++i) {
        threads.emplace_back(RunClient, i, std::cref(target), options.client_bytes, deadline,
                             &clients);
      }
      for (std::thread& t : threads) t.join();
    }
    clients.elapsed = absl::Now() - start;
    rows.push_back(Row{"clients (peak)", sampler.Stop(), "-", {}});
    rows.push_back(
        WaitForBaseline("after clients", monitor, base, tolerance, options.settle_timeout));
  }

  // 2. Open/close cycles.
  PhaseStats cycles;
  absl::Duration slowest_cycle;
  if (options.cycles > 0 && !Interrupted()) {
    std::fprintf(stderr, "soak: phase 2: %d open/close cycles, %d at a time\n", options.cycles,
                 options.cycle_concurrency);
    PeakSampler sampler(monitor);
    const absl::Time start = absl::Now();
    RunCycles(options, target, &cycles, &slowest_cycle);
    cycles.elapsed = absl::Now() - start;
    rows.push_back(Row{"cycles (peak)", sampler.Stop(), "-", {}});
    rows.push_back(
        WaitForBaseline("after cycles", monitor, base, tolerance, options.settle_timeout));
  }

  // 3. Clients killed mid-transfer.
  PhaseStats kills;
  KillResult killed;
  if (options.killed > 0 && !Interrupted()) {
    std::fprintf(stderr, "soak: phase 3: %d clients killed while uploading %s MiB each\n",
                 options.killed, Mib(options.kill_bytes).c_str());
    PeakSampler sampler(monitor);
    killed = RunKills(options, target, monitor, base, &kills);
    rows.push_back(Row{"kills (peak)", sampler.Stop(), "-", {}});
    Row after = WaitForBaseline("after kills", monitor, base, tolerance, options.settle_timeout);
    after.waited = absl::StrCat(Secs(killed.reclaim), " reclaim + ", after.waited);
    rows.push_back(after);
  }

  // The final state.
  rows.push_back(WaitForBaseline("final", monitor, base, tolerance, options.settle_timeout));

  // Report.
  std::printf("\n");
  PrintTable(rows, device);
  std::printf("\n");
  const Sample& last = rows.back().sample;
  if (last.process_ok) {
    absl::PrintF(
        "front-end RSS: %s MiB at the baseline, %s MiB at the end (%+.1f MiB; it fails "
        "only beyond +%s MiB: the allocator keeps freed memory for reuse)\n",
        Mib(base.rss_bytes), Mib(last.rss_bytes),
        (static_cast<double>(last.rss_bytes) - static_cast<double>(base.rss_bytes)) / kMiB,
        Mib(options.rss_tolerance));
  }
  if (last.process_ok && last.threads != base.threads) {
    absl::PrintF("front-end threads by name: baseline %s; final %s\n", Describe(base_threads),
                 Describe(ThreadNames(pid)));
  }
  if (last.process_ok && last.fds != base.fds) {
    absl::PrintF("front-end fds by kind: baseline %s; final %s\n", Describe(base_fds),
                 Describe(FdKinds(pid)));
  }
  for (const Row& row : rows) {
    if (row.phase == "baseline" || absl::EndsWith(row.phase, "(peak)")) continue;
    if (!row.problems.empty()) {
      failures.push_back(absl::StrCat(row.phase, ": ", absl::StrJoin(row.problems, ", ")));
    }
  }
  if (options.clients > 0 && options.seconds > absl::ZeroDuration()) {
    absl::PrintF(
        "clients: %d clients (%s) x %s: %d iterations, %d operations (%s), %s MiB moved and "
        "verified, %d sessions, %d errors, %d compile retries (quota max_concurrent_compiles)\n",
        options.clients, options.client_processes ? "processes" : "threads", Secs(clients.elapsed),
        clients.iterations.load(), clients.operations.load(),
        Rate(clients.operations, clients.elapsed), Mib(clients.bytes),
        clients.sessions_opened.load(), clients.errors.load(), clients.quota_retries.load());
    ReportErrors("clients", clients, &failures);
  }
  if (options.cycles > 0) {
    absl::PrintF(
        "cycles: %d of %d open/allocate/upload/close cycles at concurrency %d in %s "
        "(%s), slowest %s, %d errors\n",
        cycles.iterations.load(), options.cycles, options.cycle_concurrency, Secs(cycles.elapsed),
        Rate(cycles.iterations, cycles.elapsed), Secs(slowest_cycle), cycles.errors.load());
    if (cycles.iterations < static_cast<uint64_t>(options.cycles) && cycles.errors == 0 &&
        !Interrupted()) {
      cycles.Note(
          absl::StrCat("only ", cycles.iterations.load(), " of ", options.cycles, " cycles ran"));
    }
    ReportErrors("cycles", cycles, &failures);
  }
  if (options.killed > 0) {
    absl::PrintF(
        "kills: %d of %d clients killed by SIGKILL while uploading %s MiB (%d of them "
        "mid-upload; %d whole uploads had completed before the kills); %s\n",
        killed.killed, options.killed, Mib(options.kill_bytes), killed.mid_upload,
        killed.uploads_completed,
        killed.reclaimed ? absl::StrCat("their sessions were reclaimed ", Secs(killed.reclaim),
                                        " after the last kill")
                         : absl::StrCat(killed.sessions_left, " of their sessions were still open ",
                                        Secs(killed.reclaim), " after the last kill"));
    if (killed.killed < options.killed && !Interrupted()) {
      kills.Note(absl::StrCat("only ", killed.killed, " of ", options.killed,
                              " clients could be killed mid-transfer"));
    }
    if (!killed.reclaimed && !Interrupted()) {
      kills.Note(
          absl::StrCat("the daemon did not reclaim the killed clients' sessions within "
                       "--reclaim-timeout=",
                       Secs(options.reclaim_timeout), " (", killed.sessions_left, " still open)"));
      if (info->admin()) {
        absl::StatusOr<v1::ListSessionsResponse> open =
            monitor.client().AdminListSessions(info->tenant());
        if (open.ok()) {
          for (const v1::SessionSummary& s : open->sessions()) {
            std::printf("    still open: session %llu '%s', idle %.1f s, peer %s\n",
                        static_cast<unsigned long long>(s.session_id()), s.client_label().c_str(),
                        s.idle_ms() / 1000.0, s.peer().c_str());
          }
        }
      }
    }
    ReportErrors("kills", kills, &failures);
  }
  if (Interrupted()) failures.push_back("interrupted (SIGINT/SIGTERM) before the end");

  if (failures.empty()) {
    std::printf(
        "soak: PASS (threads, fds, children, device memory back to baseline within "
        "tolerance%s)\n",
        device.available() ? ""
                           : absl::StrCat("; device memory not measured: ",
                                          device.no_driver() ? "no driver" : device.why_not())
                                 .c_str());
  } else {
    std::printf("soak: FAIL: %s\n", absl::StrJoin(failures, "; ").c_str());
  }
  std::fflush(stdout);
  print_log_tail();
  return failures.empty() ? 0 : 1;
}

}  // namespace
}  // namespace gpurpc::soak

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind(gpurpc::soak::kChildUploadFlag, 0) == 0) {
      return gpurpc::soak::ChildUpload(argc, argv);
    }
    if (arg.rfind(gpurpc::soak::kChildClientFlag, 0) == 0) {
      return gpurpc::soak::ChildClient(argc, argv);
    }
    if (arg == "--help" || arg == "-h") {
      std::fputs(gpurpc::soak::kUsage, stdout);
      return 0;
    }
  }
  absl::StatusOr<gpurpc::soak::Options> options = gpurpc::soak::ParseOptions(argc, argv);
  if (!options.ok()) {
    std::fprintf(stderr, "gpurpc-soak: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  return gpurpc::soak::Run(*options);
}
