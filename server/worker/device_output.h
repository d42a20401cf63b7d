// Device printf output of the session's kernels, captured for its client.
//
// The CUDA driver writes what kernels printf to the process's stdout when the work that
// printed is synchronised (a stream, event or context synchronisation, a blocking copy, a
// module load). A worker serves exactly one session, so everything on its stdout is that
// session's: DeviceOutput points the worker's fd 1 at a pipe, a reader thread keeps the
// pipe drained into a bounded buffer, and every synchronising answer the worker gives
// (SynchronizeStream/Session/Event and a Launch with `synchronize` when they succeed, and a
// CommandReply of a batch with a SyncCommand, with its error if any) carries what has been
// captured by then in its `device_output` field; a unary answer that fails leaves it for
// the next. The clients print it (Python to sys.stdout, C++ through
// Session::SetDeviceOutputHandler, stdout by default).
// Nothing of one session's output can reach another session: they are other processes with
// other pipes.
//
// Bounds: at most `max_buffered_bytes` wait between two takes; beyond, output is dropped and
// the next Take says how many bytes were lost. The pipe is enlarged to 1 MiB where the
// kernel allows, so a burst does not block the driver while the reader catches up.
//
// Thread-safe. Start once per process, before the CUDA backend is opened.
#ifndef GPURPC_SERVER_WORKER_DEVICE_OUTPUT_H_
#define GPURPC_SERVER_WORKER_DEVICE_OUTPUT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gpurpc::worker {

class DeviceOutput {
 public:
  static constexpr uint64_t kDefaultMaxBufferedBytes = 4ull << 20;

  // Replaces fd 1 with the write end of a new pipe and starts the reader. INTERNAL (with
  // errno's text) when the pipe or the thread cannot be made; fd 1 is unchanged then.
  static absl::StatusOr<std::unique_ptr<DeviceOutput>> Start(
      uint64_t max_buffered_bytes = kDefaultMaxBufferedBytes);

  // Stops the reader. fd 1 stays the pipe (nothing reads it any more).
  ~DeviceOutput();
  DeviceOutput(const DeviceOutput&) = delete;
  DeviceOutput& operator=(const DeviceOutput&) = delete;

  // Flushes C stdio's stdout, then returns everything written to fd 1 since the last Take
  // (with a note of dropped bytes, if any) and empties the buffer.
  std::string Take();

 private:
  DeviceOutput(int read_fd, int stop_fd, uint64_t max_buffered_bytes);
  void ReadLoop();
  // Reads what the pipe holds now without blocking. Caller holds mu_.
  void DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int read_fd_;
  const int stop_fd_;  // an eventfd: written to stop the reader
  const uint64_t max_buffered_bytes_;
  absl::Mutex mu_;
  std::string buffer_ ABSL_GUARDED_BY(mu_);
  uint64_t dropped_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread reader_;
};

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_DEVICE_OUTPUT_H_
