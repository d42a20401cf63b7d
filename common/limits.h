// Limits shared by the daemon and the C++ client.
#ifndef GPURPC_COMMON_LIMITS_H_
#define GPURPC_COMMON_LIMITS_H_

#include <cstddef>
#include <cstdint>

namespace gpurpc {

// Largest gRPC message either side accepts: a command batch with 64 MiB of inline
// downloads plus headroom.
inline constexpr int kMaxMessageBytes = 80 << 20;
// The framed command protocol (server/worker/framed_commands.h), spoken by the worker, the
// front end's command relay and same-host clients: a little-endian length prefix of this many
// bytes, then the message; kEndFrameBit set in the length marks a relayed channel's end frame.
inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr uint32_t kEndFrameBit = 0x80000000u;
static_assert(static_cast<uint64_t>(kMaxMessageBytes) < kEndFrameBit);
// The largest end frame (a status) the front end accepts from a worker.
inline constexpr size_t kMaxEndFrameBytes = 64 << 10;
// The largest request the front end relays on a framed unary channel
// (server/frontend/unary_channels.h); a larger one goes by gRPC. Small enough that a frame of it
// fits an idle socket's buffer at once. The worker refuses a RelayedCall frame over this plus
// kMaxRelayedMethodBytes.
inline constexpr size_t kMaxRelayedRequestBytes = 64 << 10;
inline constexpr size_t kMaxRelayedMethodBytes = 256;
// Chunk size of streamed uploads and downloads.
inline constexpr uint64_t kTransferChunkBytes = 1ull << 20;
// Largest chunk a streamed download may ask for.
inline constexpr uint64_t kMaxTransferChunkBytes = 4ull << 20;
// The HTTP/2 frame size every gpurpc party accepts (SETTINGS_MAX_FRAME_SIZE, set with
// GRPC_ARG_HTTP2_MAX_FRAME_SIZE on the front end's server, its channel to each worker, the
// worker's server and the C++ client): a 1 MiB chunk crosses a hop as one DATA frame instead
// of 64 of gRPC's default 16 KiB. On the H200, 1 GiB downloads over TCP loopback measured
// 2.2-4.0 GB/s over six runs with it, 2.3-3.5 over six without (DESIGN.md §7.3).
inline constexpr int kHttp2MaxFrameBytes = 4 << 20;
// Metadata key carrying the session id (decimal) on session-scoped calls.
inline constexpr char kSessionMetadataKey[] = "gpurpc-session";
// The most threads (so calls running at once) a worker's gRPC server has.
inline constexpr int kWorkerMaxThreads = 64;
// Metadata key carrying the daemon instance from OpenSession beside the session id.
inline constexpr char kInstanceMetadataKey[] = "gpurpc-instance";
// Trailing metadata a worker adds to every status it sends, so that the front end tells a
// worker's own answer from one gRPC made up for a broken call (server/status_interceptor.h).
inline constexpr char kWorkerAnswerMetadataKey[] = "gpurpc-worker-answer";

// Bounds of ModuleService.SetContextLimit's device-memory limits (module_service.proto): the
// worker refuses values beyond them, and the front end charges values within them to the
// tenant's device-memory ledger before the call reaches the worker.
inline constexpr uint64_t kMaxStackBytesPerThread = uint64_t{64} << 10;
inline constexpr uint64_t kMaxStackReservationBytes = uint64_t{4} << 30;
inline constexpr uint64_t kMaxPrintfFifoBytes = uint64_t{64} << 20;
inline constexpr uint64_t kMaxMallocHeapBytes = uint64_t{1} << 30;

// Bounds of ModuleService.LinkModule (module_service.proto): inputs of one link, how many
// of them are sources (each may be an NVRTC compile), and the length of a data input's name.
inline constexpr int kMaxLinkInputs = 64;
inline constexpr int kMaxLinkSources = 16;
inline constexpr int kMaxLinkInputNameBytes = 256;

// Events one session may export over its life (SessionService.ExportEvent). An exported event
// outlives its DestroyEvent until the session ends, so this bounds what a session that
// exports and destroys in a loop holds, also when the tenant's event quota is 0 (none).
inline constexpr size_t kMaxExportedEventsPerSession = 4096;

}  // namespace gpurpc

#endif  // GPURPC_COMMON_LIMITS_H_
