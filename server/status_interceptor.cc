#include "server/status_interceptor.h"

#include <chrono>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"
#include "common/limits.h"

namespace gpurpc {
namespace {

class StatusInterceptor final : public grpc::experimental::Interceptor {
 public:
  StatusInterceptor(const char* method, bool mark_worker_answers, int max_threads,
                    CallObserver* observer)
      // gRPC's sync server names the handler of methods it does not serve "unknown".
      : known_method_(method != nullptr && std::string_view(method) != "unknown"),
        method_(method != nullptr ? method : "this method"),
        mark_worker_answers_(mark_worker_answers),
        max_threads_(max_threads),
        observer_(observer) {
    if (observer_ != nullptr) start_ = std::chrono::steady_clock::now();
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!known_method_ && status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
        // gRPC's answer to a method this server does not serve (the direct channel serves
        // only ExecutionService): it stays UNIMPLEMENTED, with words.
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::UNIMPLEMENTED,
            "this method is not served on this channel (a session's direct channel carries "
            "ExecutionService only; use the daemon's address for the rest)"));
      } else if ((status.error_code() == grpc::StatusCode::INTERNAL ||
                  status.error_code() == grpc::StatusCode::UNIMPLEMENTED) &&
                 status.error_message().empty()) {
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, NotParsedRequestMessage(method_)));
      } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
                 status.error_message() == "Server Threadpool Exhausted") {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrFormat("%s was not started: %s already runs as many calls at once as it "
                            "may (%d, each holding one of its threads); retry when some have "
                            "finished",
                            method_, mark_worker_answers_ ? "this session's worker" : "gpurpcd",
                            max_threads_)));
      }
      if (mark_worker_answers_) {
        methods->GetSendTrailingMetadata()->emplace(kWorkerAnswerMetadataKey, "1");
      }
      if (observer_ != nullptr) {
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start_;
        observer_->OnCallEnd(known_method_ ? std::string_view(method_) : std::string_view(),
                             methods->GetSendStatus().error_code(), took.count());
      }
    }
    methods->Proceed();
  }

 private:
  const bool known_method_;
  const std::string method_;
  const bool mark_worker_answers_;
  const int max_threads_;
  CallObserver* const observer_;
  std::chrono::steady_clock::time_point start_;
};

class StatusInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  StatusInterceptorFactory(bool mark_worker_answers, int max_threads, CallObserver* observer)
      : mark_worker_answers_(mark_worker_answers), max_threads_(max_threads), observer_(observer) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new StatusInterceptor(info->method(), mark_worker_answers_, max_threads_, observer_);
  }

 private:
  const bool mark_worker_answers_;
  const int max_threads_;
  CallObserver* const observer_;
};

}  // namespace

std::string NotParsedRequestMessage(std::string_view method) {
  return absl::StrFormat(
      "%s: the request is not a valid message of the method's request type (it does not parse "
      "as protobuf, or it would take too much memory once parsed), or none was sent",
      method);
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
StatusInterceptors(bool mark_worker_answers, int max_threads, CallObserver* observer) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(
      std::make_unique<StatusInterceptorFactory>(mark_worker_answers, max_threads, observer));
  return out;
}

}  // namespace gpurpc
