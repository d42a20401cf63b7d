#include "common/grpc_status.h"

#include <algorithm>
#include <string>

namespace gpurpc {
namespace {
// Of the message as it goes on the wire: gRPC percent-encodes every byte outside printable
// ASCII, so a message is escaped here first (control and non-ASCII bytes as \xNN) and then
// bounded, and its trailer stays far below the peers' metadata limits (8 KiB by default).
constexpr size_t kMaxStatusMessageBytes = 4096;
constexpr char kTruncated[] = "... (truncated)";
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message;
  message.reserve(std::min<size_t>(status.message().size(), kMaxStatusMessageBytes) + 16);
  size_t encoded = 0;  // the size on the wire
  for (const char c : status.message()) {
    const auto byte = static_cast<unsigned char>(c);
    // Newlines and tabs stay (compiler output and multi-line reasons are read by people);
    // they and '%' take three bytes on the wire.
    const bool kept = (byte >= 0x20 && byte < 0x7f) || byte == '\n' || byte == '\t';
    const size_t cost = !kept ? 4 : (byte == '\n' || byte == '\t' || byte == '%') ? 3 : 1;
    if (encoded + cost > kMaxStatusMessageBytes) {
      message += kTruncated;
      break;
    }
    encoded += cost;
    if (kept) {
      message += c;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      message += "\\x";
      message += kHex[byte >> 4];
      message += kHex[byte & 15];
    }
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), message);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace gpurpc
