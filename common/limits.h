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

}  // namespace gpurpc

#endif  // GPURPC_COMMON_LIMITS_H_
