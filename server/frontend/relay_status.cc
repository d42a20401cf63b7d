#include "server/frontend/relay_status.h"

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"

namespace gpurpc::frontend {

grpc::Status TranslateWorkerStatus(SessionRecord& session, const std::string& method,
                                   const grpc::Status& status, bool answered_by_worker) {
  if (IsStickyFault(status)) {
    // The worker reported a sticky CUDA fault: its context is lost for good.
    session.MarkFaultAnswered(status.error_message());
    return grpc::Status(status.error_code(), absl::StrFormat("%s; session %d is now FAULTED",
                                                             status.error_message(), session.id()));
  }
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::CANCELLED: {
      // An answer of the worker itself (an event not ready yet, NVRTC missing, ...) goes
      // to the client as it is, at once.
      if (answered_by_worker) return status;
      // The call broke. A dead worker breaks the channel, and its reaper sees the exit
      // within milliseconds; wait that long (only for a worker that is ending: a live one
      // answers for itself), never for a cancelled call.
      WorkerProcess& worker = session.worker();
      const absl::Duration wait = status.error_code() == grpc::StatusCode::CANCELLED
                                      ? absl::ZeroDuration()
                                      : absl::Milliseconds(250);
      if (worker.WaitExited(wait)) {
        if (session.closing()) {
          return grpc::Status(
              grpc::StatusCode::CANCELLED,
              absl::StrFormat("session %d was closed during %s", session.id(), method));
        }
        // Recorded here or already by the worker's exit callback: either way this call was
        // in flight on the worker that ended.
        session.MarkFaultedByExit();
        if (session.fault_answered()) {
          // Another call was answered with the fault and the worker was ended before it
          // answered this one: to this call, as to every later one, the session FAULTED
          // earlier (what the worker itself answers after a fault).
          return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                              absl::StrFormat("session %d FAULTED earlier (during %s): %s",
                                              session.id(), method, session.fault_cause()));
        }
        const absl::StatusCode code = session.fault_code();
        return grpc::Status(code == absl::StatusCode::kFailedPrecondition
                                ? grpc::StatusCode::ABORTED
                                : static_cast<grpc::StatusCode>(code),
                            absl::StrFormat("session %d FAULTED during %s: %s", session.id(),
                                            method, session.fault_cause()));
      }
      return status;
    }
    default:
      return status;
  }
}

grpc::Status StatusFromWorker(int32_t code, const std::string& message) {
  const grpc::StatusCode known = code >= 0 && code <= grpc::StatusCode::UNAUTHENTICATED
                                     ? static_cast<grpc::StatusCode>(code)
                                     : grpc::StatusCode::UNKNOWN;
  if (known == grpc::StatusCode::OK) return grpc::Status::OK;
  return ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(known), message));
}

}  // namespace gpurpc::frontend
