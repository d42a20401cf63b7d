// Small Status helpers that Debian's Abseil (20220623) does not ship.
#ifndef GPURPC_COMMON_STATUS_MACROS_H_
#define GPURPC_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GPURPC_STATUS_CONCAT_INNER_(a, b) a##b
#define GPURPC_STATUS_CONCAT_(a, b) GPURPC_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define GPURPC_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status gpurpc_status_ = (expr);          \
    if (!gpurpc_status_.ok()) return gpurpc_status_; \
  } while (false)

// `GPURPC_ASSIGN_OR_RETURN(auto x, MakeX());` assigns the value of an OK StatusOr, or
// returns its status from the enclosing function.
#define GPURPC_ASSIGN_OR_RETURN(lhs, expr) \
  GPURPC_ASSIGN_OR_RETURN_IMPL_(GPURPC_STATUS_CONCAT_(gpurpc_statusor_, __LINE__), lhs, expr)
#define GPURPC_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // GPURPC_COMMON_STATUS_MACROS_H_
