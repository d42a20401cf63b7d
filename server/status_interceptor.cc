#include "server/worker/status_marker.h"

#include "common/limits.h"

namespace gpurpc::worker {
namespace {

class StatusMarker final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->GetSendTrailingMetadata()->emplace(kWorkerAnswerMetadataKey, "1");
    }
    methods->Proceed();
  }
};

class StatusMarkerFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new StatusMarker();
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStatusMarker() {
  return std::make_unique<StatusMarkerFactory>();
}

}  // namespace gpurpc::worker
