// The framed command protocol: a same-host client's command stream on a direct socket
// without gRPC (host_region_service.proto, OpenDirectChannel), and the front end's relay of a
// client's CommandStream to the worker (FramedPeer::kFrontEndRelay). Each message is a 4-byte
// little-endian length and that many bytes: a CommandBatch from the client, a CommandReply
// from the worker, one reply per batch, in order.
//
// On a relayed channel the worker ends the stream as CommandStream's gRPC handler would,
// with an end frame: its length has kEndFrameBit set and its bytes are a CommandError whose
// code and message are the stream's status (as ToGrpcStatus makes it). A protocol error or a
// sticky fault ends so (a sticky fault's reply comes before it, as on CommandStream), and so
// does the clean end, with OK, once the front end shut its side down after the client
// half-closed. A channel that closes without an end frame broke (the worker died). A direct
// client's channel has no end frames: an error is one last reply whose `error` says what was
// wrong.
//
// Every byte on the socket comes from the tenant. A length above kMaxMessageBytes, bytes
// that are not a CommandBatch and sequence numbers that do not increase are answered by one
// last reply whose `error` names what was wrong (INVALID_ARGUMENT), and the channel ends; a
// message is read in pieces of at most 1 MiB, so a length that announces more than arrives
// holds no more memory than what arrived.
//
// Memory: gRPC's resource quota does not see these sockets, so the worker's framed channels
// share a FramedMemory. Before a message's bytes are read, its announced length is taken
// from it, with what parsing that many bytes may take as far as their number tells
// (ParsedBytesBoundFromSize, server/parse_limit.h; at most the message's ParsedBytesLimit);
// once they are read, the walk's closer bound is kept and the rest given back at once, and
// a message whose bound is above its limit (a batch of very many small commands) is answered
// as a protocol error without being parsed. The rest is given back once the reply is sent.
// One take per message, before anything is held: a channel whose message does not fit waits
// until others give back, and no channel waits for memory while holding some, so channels
// cannot wait on each other in a circle (a channel whose peer does not read its reply waits
// in send with its message's memory held: that stalls only the session's own channels). This bounds
// what a worker's framed channels hold at once (kFramedMemoryBytes), plus one reply per channel (a
// batch's downloads are at most 64 MiB, Session::RunBatch). Every channel of a worker is its
// session's, so a channel that holds the memory (a message announced and never sent) stalls only
// its own session's other channels.
#ifndef GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
#define GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_

#include <cstddef>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/limits.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "server/parse_limit.h"
#include "server/worker/service.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

// kFrameHeaderBytes and kEndFrameBit, the framing, are in common/limits.h.

// What a worker's framed channels may hold of messages at once (FramedMemory): room for
// one message of the largest size and its largest parse (kMaxMessageBytes plus
// kMaxParsedMessageBytes) and then some.
inline constexpr size_t kFramedMemoryBytes = size_t{256} << 20;
static_assert(kFramedMemoryBytes >= static_cast<size_t>(kMaxMessageBytes) + kMaxParsedMessageBytes);

// A budget of bytes shared by a worker's framed channels. Thread-safe.
class FramedMemory {
 public:
  explicit FramedMemory(size_t capacity) : free_(capacity), capacity_(capacity) {}
  FramedMemory(const FramedMemory&) = delete;
  FramedMemory& operator=(const FramedMemory&) = delete;

  // Waits until `bytes` are free and takes them; `bytes` above the capacity is taken as
  // the whole capacity (so it waits until every other taker gave back). Returns what it
  // took.
  size_t Take(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back `bytes` of what Take took (all of it, or some first and the rest later).
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

// Who is at the other end of a framed channel, which decides how errors name what was wrong:
// a same-host client's direct channel ("framed command channel: message N"), or the front
// end relaying a client's ExecutionService.CommandStream (host_region.h, RelayChannel): its
// errors read as CommandStream's own on the worker's gRPC server, since the client made a
// CommandStream call.
// kFrontEndUnary: the front end's framed unary channel, served by ServeRelayedUnaryCalls
// rather than as a command stream; kFrontEndUpload and kFrontEndDownload: a client's
// MemoryService.UploadStream or DownloadStream call relayed on a framed transfer channel,
// served by ServeRelayedTransfer.
enum class FramedPeer {
  kDirectClient,
  kFrontEndRelay,
  kFrontEndUnary,
  kFrontEndUpload,
  kFrontEndDownload
};

// Serves the framed protocol on the connected stream socket `fd` (blocking; not closed here)
// until the client closes its end or shuts it down, the client breaks the protocol, or a
// sticky fault ends the stream; then shuts `fd` down, so that the client sees the end.
// `memory` (shared by the worker's framed channels) must outlive the call.
void ServeFramedCommands(Session* session, int fd, FramedMemory* memory,
                         FramedPeer peer = FramedPeer::kDirectClient);

// Serves the front end's framed unary channel `fd` (blocking; not closed here;
// server/frontend/unary_channels.h): reads a RelayedCall frame (internal.v1), runs the method's
// handler (`calls`) and answers a RelayedAnswer frame, one call at a time, until the front end
// closes its end; then shuts `fd` down. The bytes are the tenant's, passed on: a frame over
// kMaxRelayedRequestBytes plus kMaxRelayedMethodBytes, or one that is not a RelayedCall, ends
// the channel with an end frame INVALID_ARGUMENT; an unknown method is answered UNIMPLEMENTED
// and a request whose parse would take more than its ParsedBytesLimit INVALID_ARGUMENT
// (parse_limit.h), each before anything parses it, and the channel goes on. The requests are
// small, so these channels take nothing from FramedMemory; an answer (at most a message's
// size: a Download's bytes) is held until it is sent, as the gRPC server holds it.
void ServeRelayedUnaryCalls(const RelayedUnaryCalls& calls, int fd);

// Serves one relayed MemoryService.UploadStream (`peer` kFrontEndUpload) or DownloadStream
// (kFrontEndDownload) call on the front end's framed transfer channel `fd` (blocking; not
// closed here; server/frontend/command_relay.h): each frame from the front end is one of the
// client's messages, each message the handler sends goes back as one frame, and the call's
// status ends the channel as an end frame; then shuts `fd` down. The handlers are the gRPC
// server's own (ServeUploadStream, ServeDownloadStream, service.h), so the checks and errors
// are theirs. The bytes are the tenant's: a frame over kMaxMessageBytes, or one whose parse
// would take more than its ParsedBytesLimit, ends the call INVALID_ARGUMENT before anything
// parses it, and nothing but the end frame follows (no UploadResponse for bytes that had all
// arrived), as on the gRPC relay; a DownloadStream with other than one request message ends
// UNIMPLEMENTED, checked before its request's parse bound, in the gRPC relay's order. A
// message's bytes, and what parsing them may take, are taken from `memory` before they are
// read and held until the handler asks for the next message, which frees them first (one
// message per channel, taken while none is held). A front end that stops reading a download
// holds the handler in its send.
void ServeRelayedTransfer(Session* session, int fd, FramedMemory* memory, FramedPeer peer);

// Ends a relayed channel that is not served (a refusal): sends its end frame with `status`
// (not OK; a few KiB at most, which a fresh socket takes at once), and leaves `fd` open.
void RefuseRelayedChannel(int fd, const absl::Status& status);

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_FRAMED_COMMANDS_H_
