// What parsing a client's message will allocate, bounded from its wire bytes before it is
// parsed, for both halves of the daemon.
//
// gRPC bounds a message's wire size (kMaxMessageBytes) and the bytes of messages in flight
// (the resource quotas), but not what protobuf makes of them: an empty element of a repeated
// message field is 2 bytes on the wire and a heap object of tens of bytes once parsed, an
// unknown varint field 2 bytes and a 16-byte entry of the unknown field set. An 80 MiB batch
// of empty commands parses to some 2.3 GB. So every message a client sends is walked on its
// wire bytes first (no allocation), with its type's descriptor, adding up an upper bound of
// the heap bytes the parse will take:
//   - a nested message: its object (sizeof, as SpaceUsedLong of the default instance, in
//     malloc's block), plus a slot of the repeated field (pointers: the array doubles, and
//     the old one lives on while the new is filled) when repeated, plus a map node when a
//     map entry;
//   - a string or bytes field: a std::string of its own (protobuf allocates one even for a
//     singular field) and its contents (twice over above 50 MB, which protobuf reads in
//     doubling pieces), plus a slot when repeated;
//   - a repeated scalar: three elements' size per element, a packed run as many elements as
//     it has bytes;
//   - a repeated field's first array, once per message object;
//   - an unknown field (or a known one of the wrong wire type, which protobuf keeps as
//     unknown): an entry of the unknown field set (and the set itself, once per message
//     object), plus a string and its bytes when length-delimited; an unknown group is walked
//     as a message of unknown fields.
// A message small enough is not walked: every field occurrence takes at least 2 bytes on the
// wire and adds at most the largest of the above for its type, so its size alone gives a
// bound (ParsedBytesBoundFromSize); up to 16 MiB that bound is taken as it is, so a typical
// command batch costs nothing to check.
// A message whose bound is above its limit is refused (INVALID_ARGUMENT, naming what was
// sent and the limit) before it is parsed. Bytes that are not valid wire format end the walk
// where they start, with the bound of what came before: parsing them fails as it did before
// (with the caller's usual error), having allocated at most that much.
//
// The limit (ParsedBytesLimit) is 16 MiB plus the message's size and a quarter: room for
// every message a client of ours builds (an upload parses to its bytes and a few objects;
// 4096 launch commands to a few MiB), while the bytes of messages in flight, which gRPC's
// quotas bound, bound their parses (plus 16 MiB per message being parsed). The front end's
// own services, whose requests are a few bytes, take a limit of their own
// (parse_checked_service.h).
#ifndef GPURPC_SERVER_PARSE_LIMIT_H_
#define GPURPC_SERVER_PARSE_LIMIT_H_

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "common/limits.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/byte_buffer.h"

namespace gpurpc {

// What any message may parse to beyond its own size and a quarter.
inline constexpr size_t kParsedAllowanceBytes = size_t{16} << 20;
// The largest limit of ParsedBytesLimit, that of a message of kMaxMessageBytes.
inline constexpr size_t kMaxParsedMessageBytes = kParsedAllowanceBytes +
                                                 static_cast<size_t>(kMaxMessageBytes) +
                                                 static_cast<size_t>(kMaxMessageBytes) / 4;

// The most a message of `wire_bytes` bytes may take once parsed.
size_t ParsedBytesLimit(size_t wire_bytes);

// An upper bound of the heap bytes parsing `bytes` as `type` allocates (see above), counted
// until it passes `stop_above` (then a value above it is returned at once).
size_t ParsedBytesBound(const google::protobuf::Descriptor& type, std::string_view bytes,
                        size_t stop_above = kMaxParsedMessageBytes);
size_t ParsedBytesBound(const google::protobuf::Descriptor& type, const grpc::ByteBuffer& message,
                        size_t stop_above = kMaxParsedMessageBytes);

// An upper bound of what parsing any message of `wire_bytes` bytes as `type` allocates, from
// the size alone (every field occurrence takes at least 2 bytes on the wire); at least
// ParsedBytesBound of any such message. Up to 16 MiB ParsedBytesBound is this, without a walk.
size_t ParsedBytesBoundFromSize(const google::protobuf::Descriptor& type, size_t wire_bytes);

// OK when the bound is at most `limit` (by default ParsedBytesLimit of the message's size);
// otherwise INVALID_ARGUMENT naming what was sent (`what()`, say "CommandStream message 3",
// called only then), the message's type, its wire size and the limit.
absl::Status CheckParsedBytes(const google::protobuf::Descriptor& type, std::string_view bytes,
                              absl::FunctionRef<std::string()> what,
                              std::optional<size_t> limit = std::nullopt);
absl::Status CheckParsedBytes(const google::protobuf::Descriptor& type,
                              const grpc::ByteBuffer& message,
                              absl::FunctionRef<std::string()> what,
                              std::optional<size_t> limit = std::nullopt);

}  // namespace gpurpc

#endif  // GPURPC_SERVER_PARSE_LIMIT_H_
