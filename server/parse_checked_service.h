// A generated gRPC service whose one-request methods' requests are checked against the parse
// bound (server/parse_limit.h) before gRPC parses them: for the typed services a client
// reaches without the front end's relay in between, which checks every relayed message
// itself (server/frontend/proxy.h): the front end's own services (reached before a caller
// is authenticated) and the worker's direct channel (host_region_service.proto).
//
// gRPC parses a typed method's request in its MethodHandler::Deserialize, before any code of
// ours runs. ParseCheckedService serves the methods of an implementation `impl`, which is
// not registered itself, through handlers that walk the request's wire bytes first and hand
// them on to impl's own handler when they are within the bound. A refused request reaches
// no handler of impl:
//   - a synchronous method answers INVALID_ARGUMENT with parse_limit's message (naming the
//     method, the request type and its size);
//   - a callback method answers as gRPC answers any request that does not parse, which
//     the status interceptor (server/status_interceptor.h) turns into INVALID_ARGUMENT
//     naming the method and both causes.
// Methods whose client streams are passed through as they are (their messages are read by
// impl itself, as raw messages where they matter: server/worker/raw_messages.h).
#ifndef GPURPC_SERVER_PARSE_CHECKED_SERVICE_H_
#define GPURPC_SERVER_PARSE_CHECKED_SERVICE_H_

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/impl/service_type.h"

namespace gpurpc {

class ParseCheckedService final : public grpc::Service {
 public:
  // `Impl` derives from a generated service (synchronous or callback, not both) and makes
  // grpc::Service::GetHandler public (`using grpc::Service::GetHandler;`); methods it marked
  // streamed must be bidirectional in the proto. `service_name` is the generated service's
  // (v1::ExecutionService::service_full_name()). A request may take `limit` bytes once
  // parsed (by default ParsedBytesLimit of its size). `impl` must outlive this service.
  template <typename Impl>
  ParseCheckedService(Impl* impl, const char* service_name,
                      std::optional<size_t> limit = std::nullopt)
      : limit_(limit) {
    Add(impl, service_name, [impl](int index) { return impl->GetHandler(index); });
  }
  // The same, owning `impl`.
  template <typename Impl>
  ParseCheckedService(std::unique_ptr<Impl> impl, const char* service_name)
      : ParseCheckedService(impl.get(), service_name) {
    owned_ = std::move(impl);
  }

 private:
  template <typename HandlerOf>
  void Add(grpc::Service* impl, const char* service_name, HandlerOf handler_of) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service_name);
    for (int i = 0; i < (service != nullptr ? service->method_count() : 0); ++i) {
      AddChecked(*service->method(i), handler_of(i), impl->has_callback_methods());
    }
  }

  void AddChecked(const google::protobuf::MethodDescriptor& method,
                  grpc::internal::MethodHandler* inner, bool callback);

  std::deque<std::string> names_;  // the methods' paths, which RpcServiceMethod only points to
  const std::optional<size_t> limit_;
  std::unique_ptr<grpc::Service> owned_;
};

}  // namespace gpurpc

#endif  // GPURPC_SERVER_PARSE_CHECKED_SERVICE_H_
