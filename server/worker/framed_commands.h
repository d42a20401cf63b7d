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
#ifndef GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
#define GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

// Bytes of a frame's length prefix.
inline constexpr size_t kFrameHeaderBytes = 4;

// Runs one command-stream batch (Session::RunBatch, whose status this returns) and, when the
// batch synchronises, puts the device printf output captured by then into the reply. Shared
// by ExecutionService.CommandStream and the framed protocol.
absl::Status AnswerBatch(Session* session, const v1::CommandBatch& batch, uint64_t* last_sequence,
                         v1::CommandReply* reply);

// Serves the framed protocol on the connected stream socket `fd` (blocking; not closed here)
// until the client closes its end or shuts it down, the client breaks the protocol, or a
// sticky fault ends the stream; then shuts `fd` down, so that the client sees the end.
void ServeFramedCommands(Session* session, int fd);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
