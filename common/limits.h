// Limits shared by the daemon and the C++ client.
#ifndef GPURPC_COMMON_LIMITS_H_
#define GPURPC_COMMON_LIMITS_H_

#include <cstdint>

namespace gpurpc {

// Largest gRPC message either side accepts: a command batch with 64 MiB of inline
// downloads plus headroom.
inline constexpr int kMaxMessageBytes = 80 << 20;
// Chunk size of streamed uploads and downloads.
inline constexpr uint64_t kTransferChunkBytes = 1ull << 20;
// Largest chunk a streamed download may ask for.
inline constexpr uint64_t kMaxTransferChunkBytes = 4ull << 20;
// Metadata key carrying the session id (decimal) on session-scoped calls.
inline constexpr char kSessionMetadataKey[] = "gpurpc-session";
// The most threads (so calls running at once) a worker's gRPC server has.
inline constexpr int kWorkerMaxThreads = 64;
// Metadata key carrying the daemon instance from OpenSession beside the session id.
inline constexpr char kInstanceMetadataKey[] = "gpurpc-instance";
// Trailing metadata a worker adds to every status it sends, so that the front end tells a
// worker's own answer from one gRPC made up for a broken call (server/status_interceptor.h).
inline constexpr char kWorkerAnswerMetadataKey[] = "gpurpc-worker-answer";

}  // namespace gpurpc

#endif  // GPURPC_COMMON_LIMITS_H_
