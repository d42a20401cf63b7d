#include "server/worker/device_output.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gpurpc::worker {
namespace {

constexpr int kPipeBytes = 1 << 20;

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat("device output: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceOutput>> DeviceOutput::Start(uint64_t max_buffered_bytes) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Errno("pipe2");
  // Best effort: the default 64 KiB works too, the reader just has to keep up sooner.
  (void)fcntl(fds[1], F_SETPIPE_SZ, kPipeBytes);
  if (fcntl(fds[0], F_SETFL, O_NONBLOCK) != 0) {
    const absl::Status error = Errno("fcntl O_NONBLOCK");
    close(fds[0]);
    close(fds[1]);
    return error;
  }
  const int stop_fd = eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) {
    const absl::Status error = Errno("eventfd");
    close(fds[0]);
    close(fds[1]);
    return error;
  }
  std::fflush(stdout);
  if (dup2(fds[1], STDOUT_FILENO) < 0) {
    const absl::Status error = Errno("dup2 onto fd 1");
    close(fds[0]);
    close(fds[1]);
    close(stop_fd);
    return error;
  }
  close(fds[1]);
  std::unique_ptr<DeviceOutput> output(new DeviceOutput(fds[0], stop_fd, max_buffered_bytes));
  try {
    output->reader_ = std::thread([raw = output.get()] { raw->ReadLoop(); });
  } catch (const std::system_error& e) {
    // Nothing would read the pipe, and a full pipe would block the driver: send fd 1 nowhere.
    const int null_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null_fd >= 0) {
      dup2(null_fd, STDOUT_FILENO);
      close(null_fd);
    }
    return absl::InternalError(absl::StrCat("device output: no reader thread: ", e.what()));
  }
  return output;
}

DeviceOutput::DeviceOutput(int read_fd, int stop_fd, uint64_t max_buffered_bytes)
    : read_fd_(read_fd), stop_fd_(stop_fd), max_buffered_bytes_(max_buffered_bytes) {}

DeviceOutput::~DeviceOutput() {
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  if (reader_.joinable()) reader_.join();
  close(read_fd_);
  close(stop_fd_);
}

void DeviceOutput::ReadLoop() {
  while (true) {
    pollfd fds[2] = {{read_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      // EINTR, or ENOMEM for a moment: the reader must not end while fd 1 is the pipe (a
      // full pipe would block the driver's printf flush), so it waits and polls again.
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents != 0) {
      absl::MutexLock lock(&mu_);
      DrainLocked();
    }
  }
}

void DeviceOutput::DrainLocked() {
  char chunk[64 << 10];
  // At most about the buffer's bound per pass: a writer that never pauses must not keep the
  // lock (and so Take) forever.
  for (uint64_t read_bytes = 0; read_bytes <= max_buffered_bytes_;) {
    const ssize_t n = read(read_fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // EAGAIN: nothing more now (0: no writer, cannot happen while fd 1 is)
    read_bytes += static_cast<uint64_t>(n);
    const uint64_t room =
        buffer_.size() < max_buffered_bytes_ ? max_buffered_bytes_ - buffer_.size() : 0;
    const uint64_t keep = std::min<uint64_t>(room, static_cast<uint64_t>(n));
    buffer_.append(chunk, keep);
    dropped_bytes_ += static_cast<uint64_t>(n) - keep;
  }
}

std::string DeviceOutput::Take() {
  // Outside the lock: a flush into a full pipe waits for the reader, which needs the lock.
  std::fflush(stdout);
  absl::MutexLock lock(&mu_);
  DrainLocked();
  std::string out;
  out.swap(buffer_);
  if (dropped_bytes_ != 0) {
    absl::StrAppendFormat(&out,
                          "\n[gpurpc: %d bytes of device printf output were dropped: more than "
                          "%d bytes between two synchronisations]\n",
                          dropped_bytes_, max_buffered_bytes_);
    dropped_bytes_ = 0;
  }
  return out;
}

}  // namespace gpurpc::worker
