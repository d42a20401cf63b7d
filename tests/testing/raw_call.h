// A call of any method with messages of any bytes (grpc::GenericStub), for tests that send
// what a generated stub cannot: garbage, several requests to a unary method, none at all.
#ifndef GPURPC_TESTS_TESTING_RAW_CALL_H_
#define GPURPC_TESTS_TESTING_RAW_CALL_H_

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"

namespace gpurpc::testing {

// What a RawCall saw: every message the server sent (its bytes), in order, and the status.
struct RawCallResult {
  std::vector<std::string> responses;
  grpc::Status status;
};

// `requests` (any bytes) to `method` (a full name, "/package.Service/Method") on `channel`,
// one after the other, then a half-close; then every answer until the server ends the call,
// and its status. Writing stops at the first write that fails (the call has ended), and the
// half-close is sent only while the call is open. `context` is the caller's, with its metadata
// and deadline: nothing here ends a call that hangs, so give it a deadline.
RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                      const std::string& method, const std::vector<std::string>& requests);

// The bytes of `buffer`, its slices joined; "" when it cannot be read (an empty buffer too).
std::string ByteBufferToString(const grpc::ByteBuffer& buffer);

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_RAW_CALL_H_
