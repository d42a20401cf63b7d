// Shared state behind a Session and every handle made from it: the stubs, the session id
// metadata, the keepalive thread and the command stream.
#ifndef GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
#define GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc::internal {

class SessionCore {
 public:
  SessionCore(std::shared_ptr<grpc::Channel> channel, uint64_t id, v1::DeviceInfo device,
              uint64_t idle_timeout_ms);
  ~SessionCore();

  uint64_t id() const { return id_; }
  const v1::DeviceInfo& device() const { return device_; }
  bool closed() const { return closed_.load(); }

  // Adds the session metadata to a call.
  void Prepare(grpc::ClientContext* context) const;

  v1::MemoryService::Stub& memory() { return *memory_; }
  v1::ModuleService::Stub& modules() { return *modules_; }
  v1::ExecutionService::Stub& execution() { return *execution_; }
  v1::SessionService::Stub& sessions() { return *sessions_; }

  // Command stream. Enqueue assigns the sequence number and sends a batch when it is full.
  absl::Status Enqueue(v1::Command command);
  // Sends the queued batch.
  absl::Status Flush();
  // Makes sure every command enqueued so far has been processed by the worker (so that a
  // unary call sent next is ordered after them). Free when nothing was enqueued since.
  absl::Status Barrier();
  // Enqueues a sync marker and waits for it; returns the first asynchronous error since the
  // last synchronising call, or the stream's final error.
  absl::Status Sync(uint64_t stream_id, bool whole_session);

  // Ends the keepalive thread and the command stream, then closes the session remotely.
  absl::Status Close();

 private:
  absl::Status EnsureStreamLocked();
  absl::Status FlushLocked();
  void ReadReplies();
  absl::Status WaitProcessed(uint64_t sequence);
  void KeepAliveLoop(std::chrono::milliseconds interval);

  std::shared_ptr<grpc::Channel> channel_;
  const uint64_t id_;
  const std::string id_string_;
  const v1::DeviceInfo device_;
  std::unique_ptr<v1::SessionService::Stub> sessions_;
  std::unique_ptr<v1::MemoryService::Stub> memory_;
  std::unique_ptr<v1::ModuleService::Stub> modules_;
  std::unique_ptr<v1::ExecutionService::Stub> execution_;
  std::atomic<bool> closed_{false};

  std::mutex keepalive_mu_;
  std::condition_variable keepalive_cv_;
  bool stop_keepalive_ = false;
  std::thread keepalive_;

  // Command stream. send_mu_ orders enqueue/flush; state_mu_ guards what the reader thread
  // updates. Never take send_mu_ while holding state_mu_.
  std::mutex send_mu_;
  std::unique_ptr<grpc::ClientContext> stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::CommandBatch, v1::CommandReply>> stream_;
  v1::CommandBatch batch_;
  size_t batch_bytes_ = 0;
  uint64_t next_sequence_ = 0;
  uint64_t sent_through_ = 0;
  std::thread reader_;

  std::mutex state_mu_;
  std::condition_variable state_cv_;
  // The last sequence of each batch sent and not yet answered: the worker answers every
  // batch with exactly one reply, in order, also when an error skipped its tail.
  std::deque<uint64_t> unanswered_batches_;
  uint64_t processed_through_ = 0;
  absl::Status first_error_;   // first failed command since the last sync
  absl::Status stream_error_;  // the stream ended with this
  bool stream_ended_ = false;
  bool stream_error_reported_ = false;  // then the next command opens a new stream
};

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_SESSION_CORE_H_
