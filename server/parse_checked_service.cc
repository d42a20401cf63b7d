#include "server/parse_checked_service.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/parse_limit.h"

namespace gpurpc {
namespace {

using grpc::internal::MethodHandler;
using grpc::internal::RpcMethod;
using grpc::internal::RpcServiceMethod;

// The slices of `buffer` as a grpc::ByteBuffer that shares them (decompressed, when the
// message came compressed). Invalid when the buffer cannot be read.
grpc::ByteBuffer View(grpc_byte_buffer* buffer) {
  grpc_byte_buffer_reader reader;
  if (grpc_byte_buffer_reader_init(&reader, buffer) == 0) return grpc::ByteBuffer();
  std::vector<grpc::Slice> slices;
  grpc_slice slice;
  while (grpc_byte_buffer_reader_next(&reader, &slice) != 0) {
    slices.emplace_back(slice, grpc::Slice::STEAL_REF);
  }
  grpc_byte_buffer_reader_destroy(&reader);
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

class CheckedHandler final : public MethodHandler {
 public:
  CheckedHandler(MethodHandler* inner, const google::protobuf::Descriptor* request,
                 std::string method, std::optional<size_t> limit)
      : inner_(inner), request_(request), method_(std::move(method)), limit_(limit) {}

  void RunHandler(const HandlerParameter& param) override { inner_->RunHandler(param); }

  // Owns `req` (as every handler's Deserialize does).
  void* Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status,
                    void** handler_data) override {
    if (req != nullptr && !SmallEnough(req)) {
      const absl::Status size = CheckParsedBytes(
          *request_, View(req), [this] { return absl::StrCat(method_, ": the request"); }, limit_);
      if (!size.ok()) {
        grpc_byte_buffer_destroy(req);
        // impl's handler still sets up its per-call state (a callback handler keeps it in
        // handler_data, and its RunHandler needs it even for a request that failed), from
        // an empty request; the request is then dropped as one that did not parse.
        grpc::Status ignored;
        (void)inner_->Deserialize(call, grpc_raw_byte_buffer_create(nullptr, 0), &ignored,
                                  handler_data);
        *status = ToGrpcStatus(size);
        return nullptr;
      }
    }
    return inner_->Deserialize(call, req, status, handler_data);
  }

 private:
  // Whether `req`'s size alone bounds its parse within the limit: the common case, decided
  // without building a view of its slices (a compressed request is always viewed, since its
  // size is not the size it parses from).
  bool SmallEnough(grpc_byte_buffer* req) const {
    if (req->type != GRPC_BB_RAW || req->data.raw.compression != GRPC_COMPRESS_NONE) {
      return false;
    }
    const size_t length = grpc_byte_buffer_length(req);
    return ParsedBytesBoundFromSize(*request_, length) <= limit_.value_or(ParsedBytesLimit(length));
  }

  MethodHandler* const inner_;  // impl's, owned by impl
  const google::protobuf::Descriptor* const request_;
  const std::string method_;
  const std::optional<size_t> limit_;
};

RpcMethod::RpcType TypeOf(const google::protobuf::MethodDescriptor& method) {
  if (method.client_streaming()) {
    return method.server_streaming() ? RpcMethod::BIDI_STREAMING : RpcMethod::CLIENT_STREAMING;
  }
  return method.server_streaming() ? RpcMethod::SERVER_STREAMING : RpcMethod::NORMAL_RPC;
}

// Passes every call to impl's handler (a method whose client streams).
class PassedHandler final : public MethodHandler {
 public:
  explicit PassedHandler(MethodHandler* inner) : inner_(inner) {}
  void RunHandler(const HandlerParameter& param) override { inner_->RunHandler(param); }
  void* Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status,
                    void** handler_data) override {
    return inner_->Deserialize(call, req, status, handler_data);
  }

 private:
  MethodHandler* const inner_;
};

}  // namespace

void ParseCheckedService::AddChecked(const google::protobuf::MethodDescriptor& method,
                                     MethodHandler* inner, bool callback) {
  if (inner == nullptr) return;  // not served by impl
  names_.push_back(absl::StrCat("/", method.service()->full_name(), "/", method.name()));
  MethodHandler* handler =
      method.client_streaming()
          ? static_cast<MethodHandler*>(new PassedHandler(inner))
          : new CheckedHandler(inner, method.input_type(), names_.back(), limit_);
  auto* served = new RpcServiceMethod(names_.back().c_str(), TypeOf(method), handler);
  if (callback) served->SetServerApiType(RpcServiceMethod::ApiType::CALL_BACK);
  AddMethod(served);
}

}  // namespace gpurpc
