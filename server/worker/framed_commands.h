// The framed command protocol: a same-host client's command stream on a direct socket
// without gRPC (host_region_service.proto, OpenDirectChannel). Each message is a 4-byte
// little-endian length and that many bytes: a CommandBatch from the client, a CommandReply
// from the worker, one reply per batch, in order.
//
// Every byte on the socket comes from the tenant. A length above kMaxMessageBytes, bytes
// that are not a CommandBatch and sequence numbers that do not increase are answered by one
// last reply whose `error` names what was wrong (INVALID_ARGUMENT), and the channel ends; a
// message is read in pieces of at most 1 MiB, so a length that announces more than arrives
// holds no more memory than what arrived.
//
// Memory: gRPC's resource quota does not see these sockets, so the worker's framed channels
// share a FramedMemory. A message's announced length is taken twice from it (the bytes, then
// the parsed batch) before its bytes are read, and given back once its reply is sent; a
// channel whose message does not fit waits until others give back. This bounds the wire
// bytes a worker's framed channels hold at once (kFramedMemoryBytes), plus one reply per
// channel (a batch's downloads are at most 64 MiB, Session::RunBatch). It does not bound
// what parsing makes of them: a batch of many tiny commands parses to many times its wire
// size (also on CommandStream); a cap on commands per batch would (not done yet). Every channel of
// a worker is its session's, so a channel that holds the memory (a message announced and never
// sent) stalls only its own session's other channels.
#ifndef GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
#define GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_

#include <cstddef>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

// Bytes of a frame's length prefix.
inline constexpr size_t kFrameHeaderBytes = 4;

// What a worker's framed channels may hold of messages at once (FramedMemory): room for
// one message of the largest size (twice kMaxMessageBytes) and then some.
inline constexpr size_t kFramedMemoryBytes = size_t{256} << 20;

// A budget of bytes shared by a worker's framed channels. Thread-safe.
class FramedMemory {
 public:
  explicit FramedMemory(size_t capacity) : free_(capacity), capacity_(capacity) {}
  FramedMemory(const FramedMemory&) = delete;
  FramedMemory& operator=(const FramedMemory&) = delete;

  // Waits until `bytes` are free and takes them; `bytes` above the capacity is taken as
  // the whole capacity (so it waits until every other taker gave back).
  void Take(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back what Take took (the same `bytes`).
  void Give(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  size_t free() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  size_t Clamp(size_t bytes) const { return bytes < capacity_ ? bytes : capacity_; }

  mutable absl::Mutex mu_;
  size_t free_ ABSL_GUARDED_BY(mu_);
  const size_t capacity_;
};

// Runs one command-stream batch (Session::RunBatch, whose status this returns) and, when the
// batch synchronises, puts the device printf output captured by then into the reply. Shared
// by ExecutionService.CommandStream and the framed protocol.
absl::Status AnswerBatch(Session* session, const v1::CommandBatch& batch, uint64_t* last_sequence,
                         v1::CommandReply* reply);

// Serves the framed protocol on the connected stream socket `fd` (blocking; not closed here)
// until the client closes its end or shuts it down, the client breaks the protocol, or a
// sticky fault ends the stream; then shuts `fd` down, so that the client sees the end.
// `memory` (shared by the worker's framed channels) must outlive the call.
void ServeFramedCommands(Session* session, int fd, FramedMemory* memory);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
