// A client's ExecutionService.CommandStream relayed to its session's worker on a framed
// command channel (server/worker/framed_commands.h) rather than on a gRPC call: the worker
// serves it on a thread of its own that reads a batch, runs it and writes the reply, with none
// of the hand-offs between gRPC's threads that a relayed gRPC stream costs on both sides.
//
// The channel is one end of a socketpair whose other end went to the worker on its relay
// channel (WorkerProcess::OpenCommandChannel). The relay reads one client message at a time
// and writes it to the channel without waiting (what the socket does not take at once is
// sent by the relay's thread, and the next message is read once it is out); the thread reads
// the worker's replies and writes them to the client, one at a time, reading no further reply
// while one waits for the client. So the front end holds at most one batch and two replies
// per stream, as its gRPC relay does.
//
// The client sees what it would see through the gRPC relay: the worker checks each batch
// itself and names errors as CommandStream's handler does (FramedPeer::kFrontEndRelay); its
// end frame becomes the stream's status, a sticky fault or a worker that ended marks the
// session FAULTED (relay_status.h), the session is touched by the stream's traffic, and the
// relay's bytes are counted in the metrics as the gRPC relay's are.
//
// At most SessionRecord::kMaxRelayedCommandStreams streams per session are relayed so (each
// has a thread in the front end and one in the worker); more go by gRPC. A client that leaves
// frees its place at once, while the worker may still run the batch it was given (it then
// ends that channel without running more): the worker bounds those threads itself
// (kMaxRelayedChannelsPerSession), answering a channel over its bound with an end frame
// RESOURCE_EXHAUSTED, which the client gets as the stream's status.
//
// The same relay carries a client's streamed transfers (MemoryService.UploadStream and
// DownloadStream), one call per framed transfer channel (WorkerProcess::OpenTransferChannel),
// served by the worker with the gRPC server's own handlers (ServeRelayedTransfer,
// server/worker/framed_commands.h): the upload's chunks go out as frames without waiting for
// the worker to take each (the socket's buffer holds what it can), the download's come back
// as fast as the worker fills them, with one gRPC hop instead of two. The worker checks every
// message itself (the parse bound the gRPC relay checks here, the one request of a download)
// and ends the channel with the call's status as an end frame. A transfer is a call in flight
// for the session's idle reclaim (SessionRecord::BeginCall) until the worker's side ends. At
// most kMaxRelayedCommandStreams transfers per session go so at once, beside as many command
// streams; more go by gRPC. Unlike a command stream's, a transfer's relay ends as soon as its
// client leaves; the worker bounds the transfers whose threads still run
// (kMaxRelayedTransfersPerSession, server/worker/host_region.h). A worker's frame on a
// transfer channel may be at most a 4 MiB chunk and a little; a larger one ends the call as
// a broken worker.
#ifndef GPURPC_SERVER_FRONTEND_COMMAND_RELAY_H_
#define GPURPC_SERVER_FRONTEND_COMMAND_RELAY_H_

#include <memory>

#include "grpcpp/generic/async_generic_service.h"
#include "server/frontend/metrics.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

// The reactor relaying a CommandStream call (the proxy's CreateReactor returns it) on a
// framed channel to `session`'s worker, or null when it cannot (the session relays
// kMaxRelayedCommandStreams already, or no channel could be made): the caller then relays the
// stream by gRPC. `metrics` may be null.
grpc::ServerGenericBidiReactor* StartFramedCommandRelay(
    const std::shared_ptr<SessionRecord>& session, FrontendMetrics* metrics);

// The same for an UploadStream (`upload`) or DownloadStream call, on a framed transfer
// channel; null when the session relays kMaxRelayedCommandStreams transfers already or no
// channel could be made.
grpc::ServerGenericBidiReactor* StartFramedTransferRelay(
    const std::shared_ptr<SessionRecord>& session, bool upload, FrontendMetrics* metrics);

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_COMMAND_RELAY_H_
