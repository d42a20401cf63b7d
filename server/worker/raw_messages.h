// The worker's streamed data path on raw gRPC messages (the bytes of a message as they came
// off the wire, grpc::ByteBuffer), for the streaming methods whose messages carry bulk bytes or
// must be refused one by one:
// - UploadStream's chunks are parsed without copying their `data` field: the other fields are
//   parsed as protobuf, the data is handed on as the pieces of the received slices (one copy
//   to the device, none into a message).
// - DownloadStream's chunks are written as raw messages whose data the device copied into a
//   pooled buffer: no copy into a message, none at serialization.
// - The client-streaming methods' messages are parsed here rather than by gRPC's reader, which
//   cannot tell a message that does not parse from the end of the stream (the rest of the
//   stream would be taken as never sent): such a message is refused, naming its index.
#ifndef GPURPC_SERVER_WORKER_RAW_MESSAGES_H_
#define GPURPC_SERVER_WORKER_RAW_MESSAGES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"

namespace gpurpc::worker {

// A message whose length-delimited field `field_number` was split off: `rest` holds every
// other field (parsed as protobuf), `pieces` the field's bytes (empty when it is absent; the
// last occurrence, as protobuf takes it), pointing into `slices`, which keep them alive.
struct SplitMessage {
  std::vector<grpc::Slice> slices;
  std::vector<absl::Span<const uint8_t>> pieces;
  size_t size = 0;  // of the field
};

// Splits `message` (consumed) as above. False when it does not parse as `rest`'s type
// (protobuf's rules: malformed wire format, a bad nested message or string of another field).
// Fields whose numbers `rest`'s type does not have are skipped (protobuf would keep them as
// unknown fields); those of nested messages are kept.
bool SplitBytesField(grpc::ByteBuffer* message, int field_number, google::protobuf::Message* rest,
                     SplitMessage* out);

// Parses `message` as `out`'s type; false when it does not parse.
bool ParseRaw(const grpc::ByteBuffer& message, google::protobuf::Message* out);

// `message` serialized as a raw message.
grpc::ByteBuffer SerializeRaw(const google::protobuf::Message& message);

// What a client-streaming method answers (INVALID_ARGUMENT) when message `index` (from 1) of
// its stream does not parse as `type`: "METHOD: message N of the stream is not a valid TYPE
// ...". Shared by the gRPC handlers and the framed channels the front end relays.
std::string NotParsedMessage(const char* method, uint64_t index, const char* type);

// A raw message of `header` (the serialized other fields) followed by `size` bytes as the
// length-delimited field `field_number`, in a pooled buffer that gRPC gives back once the
// transport has written it. `fill` writes the field's bytes (to `size` bytes at its argument);
// its error is returned as is.
template <typename Fill>
absl::Status ChunkMessage(const std::string& header, int field_number, size_t size, Fill fill,
                          grpc::ByteBuffer* out);

// The pooled buffer behind ChunkMessage (taken, then given to a slice).
struct PooledBlock {
  size_t capacity;
  uint8_t* bytes;
};
PooledBlock* TakeBlock(size_t size);
void GiveBlock(void* block);  // a grpc slice's destroy callback
// Writes the field's key and length after `header` in `block`; returns where the bytes go.
uint8_t* BeginChunk(PooledBlock* block, const std::string& header, int field_number, size_t size);
size_t ChunkSize(const std::string& header, int field_number, size_t size);

template <typename Fill>
absl::Status ChunkMessage(const std::string& header, int field_number, size_t size, Fill fill,
                          grpc::ByteBuffer* out) {
  const size_t total = ChunkSize(header, field_number, size);
  PooledBlock* block = TakeBlock(total);
  uint8_t* data = BeginChunk(block, header, field_number, size);
  if (absl::Status status = fill(data); !status.ok()) {
    GiveBlock(block);
    return status;
  }
  grpc::Slice slice(block->bytes, total, &GiveBlock, block);
  *out = grpc::ByteBuffer(&slice, 1);
  return absl::OkStatus();
}

}  // namespace gpurpc::worker

#endif  // GPURPC_SERVER_WORKER_RAW_MESSAGES_H_
