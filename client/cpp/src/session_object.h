// What the C++ client's handle classes share (client.h): the session-scoped unary call, the
// bounded, quiet cleanup of destructors, and the members of internal::SessionObject (moves
// and remote release), written once for Buffer, Array, Stream, Event, HostRegion, Graph and
// GraphExec. Included only by the client's own sources.
#ifndef GPURPC_CLIENT_CPP_SRC_SESSION_OBJECT_H_
#define GPURPC_CLIENT_CPP_SRC_SESSION_OBJECT_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/cpp/src/session_core.h"
#include "client/cpp/src/transport.h"
#include "gpurpc/client.h"

namespace gpurpc::internal {

// The answer of a handle used without a session (default-constructed or moved from).
inline absl::Status NoSession() {
  return absl::FailedPreconditionError("no session (moved from?)");
}

// Cleanup in destructors never throws and never stalls the caller for long; it says what
// failed only when $GPURPC_CLIENT_DEBUG is set.
inline void ReportCleanup(const char* what, const absl::Status& status) {
  if (status.ok() || std::getenv("GPURPC_CLIENT_DEBUG") == nullptr) return;
  std::fprintf(stderr, "gpurpc: cleanup of %s failed: %s\n", what, status.ToString().c_str());
}

inline absl::Duration CleanupTimeout(const SessionCore& core) {
  return std::min(core.call_timeout(), kCleanupTimeout);
}

// `stub.PrepareAsyncMethod(...)`, the start of a call for RunUnary and SessionCall.
#define GPURPC_RPC(stub, Method)                                                  \
  [&rpc_stub = (stub)](grpc::ClientContext* rpc_context, const auto& rpc_request, \
                       grpc::CompletionQueue* rpc_queue) {                        \
    return rpc_stub.PrepareAsync##Method(rpc_context, rpc_request, rpc_queue);    \
  }

// A session-scoped unary call: the session's health first (a FAULTED or lost session answers
// at once, without a round trip), then the call with the session metadata and a deadline
// `timeout` from now (the session's call timeout when not given).
template <typename Request, typename Response, typename Start>
absl::Status SessionCall(SessionCore& core, Start&& start, absl::string_view name,
                         const Request& request, Response* response, absl::Duration timeout) {
  if (absl::Status usable = core.CheckUsable(); !usable.ok()) return usable;
  return RunUnary(name, std::forward<Start>(start), request, response, timeout,
                  [&core](grpc::ClientContext* context) { core.AddMetadata(context); });
}

template <typename Request, typename Response, typename Start>
absl::Status SessionCall(SessionCore& core, Start&& start, absl::string_view name,
                         const Request& request, Response* response) {
  return SessionCall(core, std::forward<Start>(start), name, request, response,
                     core.call_timeout());
}

template <typename Derived>
SessionObject<Derived>::SessionObject(SessionObject&& other) noexcept
    : core_(std::move(other.core_)), id_(std::exchange(other.id_, 0)) {}

template <typename Derived>
SessionObject<Derived>& SessionObject<Derived>::operator=(SessionObject&& other) noexcept {
  if (this != &other) {
    ReleaseQuietly();
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

template <typename Derived>
SessionObject<Derived>::~SessionObject() {
  ReleaseQuietly();
}

template <typename Derived>
void SessionObject<Derived>::ReleaseQuietly() {
  const uint64_t id = std::exchange(id_, 0);
  if (id == 0 || core_ == nullptr || !core_->CheckUsable().ok()) return;
  ReportCleanup(Derived::kKind, Derived::Release(*core_, id, CleanupTimeout(*core_)));
}

template <typename Derived>
absl::Status SessionObject<Derived>::ReleaseNow(const char* none_message) {
  if (core_ == nullptr || id_ == 0) return absl::NotFoundError(none_message);
  absl::Status status = Derived::Release(*core_, id_, core_->call_timeout());
  // NOT_FOUND: the daemon holds no such object any more; the handle lets go of it too.
  if (status.ok() || absl::IsNotFound(status)) id_ = 0;
  return status;
}

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_SESSION_OBJECT_H_
