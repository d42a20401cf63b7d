#include "gpurpc/client.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cpp/src/daemons.h"
#include "client/cpp/src/session_core.h"
#include "client/cpp/src/session_object.h"
#include "common/array_shape.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "gpurpc/v1/admin_service.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc {
namespace {

using internal::CleanupTimeout;
using internal::NoSession;
using internal::ReportCleanup;
using internal::SessionCall;
using internal::SessionCore;

void SetPointer(const DeviceRef& ref, v1::DevicePointer* out) {
  if (ref.buffer_id != 0) {
    out->mutable_buffer()->set_buffer_id(ref.buffer_id);
    out->mutable_buffer()->set_offset_bytes(ref.offset_bytes);
  } else {
    out->set_device_address(ref.device_address);
  }
}

uint64_t StreamId(const Stream* stream) { return stream == nullptr ? 0 : stream->id(); }

constexpr char kUploadStreamMethod[] = "/gpurpc.v1.MemoryService/UploadStream";
constexpr char kDownloadStreamMethod[] = "/gpurpc.v1.MemoryService/DownloadStream";

// MemoryService.Free of a buffer or an array (they share the id space), after the commands
// queued before it, which may still use it.
absl::Status FreeAllocation(SessionCore& core, uint64_t id, absl::Duration timeout) {
  if (absl::Status status = core.Barrier(timeout); !status.ok()) return status;
  v1::FreeRequest request;
  request.set_buffer_id(id);
  v1::FreeResponse response;
  return SessionCall(core, GPURPC_RPC(core.memory(), Free), "Free", request, &response, timeout);
}

// A call of the Client (not session-scoped) with a deadline `timeout` from now. When the
// channel could not reach the daemon (UNAVAILABLE while not connected, e.g. the daemon just
// restarted and gRPC is waiting before it reconnects), it reconnects at once and tries once
// more, waiting for the connection at most kReconnectTimeout: then the request was never
// sent, so even OpenSession is safe to repeat.
template <typename Request, typename Response, typename Start>
absl::Status ClientCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& target,
                        Start&& start, absl::string_view name, const Request& request,
                        Response* response, absl::Duration timeout) {
  absl::Status status = internal::RunUnary(name, start, request, response, timeout, nullptr);
  if (!absl::IsUnavailable(status) ||
      channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY) {
    return status;
  }
  grpc::experimental::ChannelResetConnectionBackoff(channel.get());
  const absl::Duration wait = std::min(timeout, internal::kReconnectTimeout);
  absl::Status retried = internal::RunUnary(name, start, request, response, wait, nullptr,
                                            /*wait_for_ready=*/true);
  if (absl::IsDeadlineExceeded(retried) &&
      channel->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) {
    return absl::UnavailableError(
        absl::StrFormat("%s: cannot reach gpurpcd at %s (waited %s for the connection): %s", name,
                        target, absl::FormatDuration(wait), status.message()));
  }
  return retried;
}

void SetDim(const Dim3& in, v1::Dim3* out) {
  out->set_x(in.x);
  out->set_y(in.y);
  out->set_z(in.z);
}

// A streamed transfer has no deadline as a whole (its size has no bound); each of its steps
// (opening it, every 1 MiB chunk, the final answer) must finish within the call timeout.
absl::Status StreamStepTimeout(absl::string_view call, absl::Duration timeout, uint64_t done,
                               uint64_t total) {
  return internal::TimeoutError(
      call, timeout,
      absl::StrFormat("no progress after %d of %d bytes, so the transfer was cancelled", done,
                      total));
}

// One UploadStream of `data` (bytes [offset, offset + data.size()) of a transfer of `total`)
// to `dst` on `channel`. Streamed: raw messages (transport.h), each chunk copied once, into a
// pooled buffer.
absl::Status UploadPart(SessionCore& core, const std::shared_ptr<grpc::Channel>& channel,
                        const DeviceRef& dst, absl::Span<const uint8_t> data, uint64_t stream_id,
                        uint64_t offset, uint64_t total) {
  const absl::Duration timeout = core.call_timeout();
  internal::Background::Busy busy;
  auto call = std::make_shared<internal::RawStreamCall>(
      channel, kUploadStreamMethod,
      [&core](grpc::ClientContext* context) { core.AddMetadata(context); });
  v1::UploadStreamRequest first;  // the first message names the destination and the size
  SetPointer(dst, first.mutable_destination());
  first.set_total_size_bytes(data.size());
  first.set_stream_id(stream_id);
  std::string header = first.SerializeAsString();
  size_t done = 0;
  bool written = true;
  while (done < data.size() && written) {
    const size_t n = std::min<size_t>(kTransferChunkBytes, data.size() - done);
    call->Write(internal::ChunkMessage(header, v1::UploadStreamRequest::kDataFieldNumber,
                                       data.data() + done, n));
    header.clear();
    if (!call->Await(internal::RawStreamCall::kWrite, internal::DeadlineAfter(timeout), &written)) {
      internal::RawStreamCall::End(std::move(call));
      return StreamStepTimeout("UploadStream", timeout, offset + done, total);
    }
    if (written) done += n;  // else the daemon ended the call: its status says why
  }
  bool ok = false;
  if (written) call->WritesDone();
  call->Read();  // the answer (UploadStreamResponse has nothing the client uses)
  call->Finish();
  if (!call->Await(internal::RawStreamCall::kFinish, internal::DeadlineAfter(timeout), &ok)) {
    internal::RawStreamCall::End(std::move(call));
    return StreamStepTimeout("UploadStream", timeout, offset + done, total);
  }
  const grpc::Status status = call->status();
  internal::RawStreamCall::End(std::move(call));
  return FromGrpcStatus(status);
}

// One DownloadStream of bytes [offset, offset + out.size()) of a transfer of `total` from
// `src` on `channel`. Streamed: raw messages (transport.h), each chunk's bytes copied once,
// straight into `out`; the next chunk is read while one is copied.
absl::Status DownloadPart(SessionCore& core, const std::shared_ptr<grpc::Channel>& channel,
                          const DeviceRef& src, absl::Span<uint8_t> out, uint64_t stream_id,
                          uint64_t offset, uint64_t total) {
  v1::DownloadRequest request;
  SetPointer(src, request.mutable_source());
  request.set_size_bytes(out.size());
  request.set_stream_id(stream_id);
  const absl::Duration timeout = core.call_timeout();
  internal::Background::Busy busy;
  auto call = std::make_shared<internal::RawStreamCall>(
      channel, kDownloadStreamMethod,
      [&core](grpc::ClientContext* context) { core.AddMetadata(context); });
  std::string serialized = request.SerializeAsString();
  grpc::Slice request_slice(serialized);
  call->WriteLast(grpc::ByteBuffer(&request_slice, 1));
  size_t done = 0;
  // The next chunk is read into the call's other buffer while one is copied.
  grpc::ByteBuffer* arriving = call->Read();
  for (;;) {
    bool read = false;
    if (!call->Await(internal::RawStreamCall::kRead, internal::DeadlineAfter(timeout), &read)) {
      internal::RawStreamCall::End(std::move(call));
      return StreamStepTimeout("DownloadStream", timeout, offset + done, total);
    }
    if (!read) break;
    grpc::ByteBuffer* chunk = std::exchange(arriving, call->Read());
    absl::Status copied = internal::CopyChunkField(chunk, v1::DownloadResponse::kDataFieldNumber,
                                                   out, &done, "DownloadStream");
    chunk->Clear();
    if (!copied.ok()) {
      internal::RawStreamCall::End(std::move(call));  // cancels it
      return copied;
    }
  }
  call->Finish();
  bool ok = false;
  if (!call->Await(internal::RawStreamCall::kFinish, internal::DeadlineAfter(timeout), &ok)) {
    internal::RawStreamCall::End(std::move(call));
    return StreamStepTimeout("DownloadStream", timeout, offset + done, total);
  }
  const grpc::Status status = call->status();
  internal::RawStreamCall::End(std::move(call));
  if (!status.ok()) return FromGrpcStatus(status);
  if (done != out.size()) {
    return absl::InternalError(
        absl::StrFormat("DownloadStream: %d of %d bytes arrived", done, out.size()));
  }
  return absl::OkStatus();
}

// `ref` moved `bytes` further into device memory.
DeviceRef Offset(DeviceRef ref, uint64_t bytes) {
  if (ref.buffer_id != 0) ref.offset_bytes += bytes;
  if (ref.buffer_id == 0 || ref.device_address != 0) ref.device_address += bytes;
  return ref;
}

// A streamed transfer of `total` bytes at `ref` as parts on the session's transfer connections
// (SessionCore::transfer_channel): `part(connection, offset, size)` moves bytes
// [offset, offset + size). At least kMinPartBytes per part, whole chunks but the last; one
// part (on the session's own connection) below twice that. Parts after the first run on
// threads of their own, the first on the caller's; the result is the first part's error in
// offset order, OK when every part went through. A part that fails does not stop the others
// (each ends on its own, within the call timeout per step).
// Split only where the whole range is known good: `ref` names a buffer (not a raw address)
// that GetAllocation says holds [offset, offset + total). Anything else goes as one stream,
// so that a bad range is refused whole, with the daemon's own error, before a byte is written
// (a part past the end would fail only after the parts before it wrote theirs).
constexpr uint64_t kMinPartBytes = uint64_t{8} << 20;
absl::Status InParts(SessionCore& core, const DeviceRef& ref, uint64_t total,
                     const std::function<absl::Status(size_t, uint64_t, uint64_t)>& part) {
  const uint64_t by_size = std::max<uint64_t>(1, total / kMinPartBytes);
  const size_t parts =
      static_cast<size_t>(std::min<uint64_t>(core.transfer_connections(), by_size));
  if (parts <= 1 || ref.buffer_id == 0) return part(0, 0, total);
  v1::GetAllocationRequest request;
  request.set_buffer_id(ref.buffer_id);
  v1::GetAllocationResponse response;
  if (!SessionCall(core, GPURPC_RPC(core.memory(), GetAllocation), "GetAllocation", request,
                   &response)
           .ok() ||
      ref.offset_bytes > response.buffer().size_bytes() ||
      total > response.buffer().size_bytes() - ref.offset_bytes) {
    return part(0, 0, total);
  }
  // Whole chunks per part; the last takes the rest.
  const uint64_t chunks = (total + kTransferChunkBytes - 1) / kTransferChunkBytes;
  const uint64_t per_part = (chunks / parts) * kTransferChunkBytes;
  std::vector<absl::Status> results(parts);
  std::vector<std::thread> threads;
  threads.reserve(parts - 1);
  const auto range = [&](size_t index) {
    const uint64_t offset = per_part * index;
    return std::make_pair(offset, index + 1 == parts ? total - offset : per_part);
  };
  for (size_t index = 1; index < parts; ++index) {
    try {
      threads.emplace_back([&, index] {
        const auto [offset, size] = range(index);
        results[index] = part(index, offset, size);
      });
    } catch (const std::system_error&) {
      // No thread: this part goes on the caller's thread, after the first.
      threads.emplace_back();
    }
  }
  {
    // The threads use this frame: were the first part to throw, they are joined first.
    absl::Cleanup join_on_throw = [&threads] {
      for (std::thread& thread : threads) {
        if (thread.joinable()) thread.join();
      }
    };
    const auto [offset, size] = range(0);
    results[0] = part(0, offset, size);
    std::move(join_on_throw).Cancel();
  }
  for (size_t index = 1; index < parts; ++index) {
    if (threads[index - 1].joinable()) {
      threads[index - 1].join();
    } else {
      const auto [offset, size] = range(index);
      results[index] = part(index, offset, size);
    }
  }
  for (absl::Status& result : results) {
    if (!result.ok()) return result;
  }
  return absl::OkStatus();
}

absl::Status UploadImpl(SessionCore& core, const DeviceRef& dst, absl::Span<const uint8_t> data,
                        uint64_t stream_id) {
  if (absl::Status usable = core.CheckUsable(); !usable.ok()) return usable;
  if (absl::Status status = core.Barrier(); !status.ok()) return status;
  if (data.size() <= kTransferChunkBytes) {
    v1::UploadRequest request;
    SetPointer(dst, request.mutable_destination());
    request.set_data(data.data(), data.size());
    request.set_stream_id(stream_id);
    v1::UploadResponse response;
    return SessionCall(core, GPURPC_RPC(core.memory(), Upload), "Upload", std::move(request),
                       &response);
  }
  return InParts(core, dst, data.size(), [&](size_t connection, uint64_t offset, uint64_t size) {
    return UploadPart(core, core.transfer_channel(connection), Offset(dst, offset),
                      data.subspan(offset, size), stream_id, offset, data.size());
  });
}

absl::Status DownloadImpl(SessionCore& core, const DeviceRef& src, absl::Span<uint8_t> out,
                          uint64_t stream_id) {
  if (absl::Status usable = core.CheckUsable(); !usable.ok()) return usable;
  if (absl::Status status = core.Barrier(); !status.ok()) return status;
  v1::DownloadRequest request;
  SetPointer(src, request.mutable_source());
  request.set_size_bytes(out.size());
  request.set_stream_id(stream_id);
  if (out.size() <= kTransferChunkBytes) {
    v1::DownloadResponse response;
    absl::Status status =
        SessionCall(core, GPURPC_RPC(core.memory(), Download), "Download", request, &response);
    if (!status.ok()) return status;
    if (response.data().size() != out.size()) {
      return absl::InternalError("Download: the daemon returned a short answer");
    }
    std::copy(response.data().begin(), response.data().end(), out.begin());
    return absl::OkStatus();
  }
  return InParts(core, src, out.size(), [&](size_t connection, uint64_t offset, uint64_t size) {
    return DownloadPart(core, core.transfer_channel(connection), Offset(src, offset),
                        out.subspan(offset, size), stream_id, offset, out.size());
  });
}

}  // namespace

internal::ModuleHandle::~ModuleHandle() {
  if (core == nullptr || !core->CheckUsable().ok()) return;
  v1::UnloadModuleRequest request;
  request.set_module_id(id);
  v1::UnloadModuleResponse response;
  ReportCleanup("module", SessionCall(*core, GPURPC_RPC(core->modules(), UnloadModule),
                                      "UnloadModule", request, &response, CleanupTimeout(*core)));
}

// ---------------------------------------------------------------------------- Client

// Client::Connect is in connect.cc.

absl::StatusOr<v1::ListDevicesResponse> Client::ListDevices() const {
  auto stub = v1::DeviceService::NewStub(channel_);
  v1::ListDevicesResponse response;
  absl::Status status = ClientCall(channel_, target_, GPURPC_RPC(*stub, ListDevices), "ListDevices",
                                   v1::ListDevicesRequest(), &response, call_timeout_);
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<Session> Client::OpenSessionOn(const std::shared_ptr<grpc::Channel>& channel,
                                              const std::string& target, int device_ordinal,
                                              const std::string& client_label) const {
  auto stub = v1::SessionService::NewStub(channel);
  v1::OpenSessionRequest request;
  request.set_device_ordinal(device_ordinal);
  request.set_client_label(client_label.empty() ? "gpurpc C++ client" : client_label);
  v1::OpenSessionResponse response;
  absl::Status status = ClientCall(channel, target, GPURPC_RPC(*stub, OpenSession), "OpenSession",
                                   request, &response, call_timeout_);
  if (!status.ok()) return status;
  Session session;
  session.core_ = std::make_shared<SessionCore>(channel, response, call_timeout_);
  session.core_->set_target(target);
  if (transfer_factory_ != nullptr && target == target_) {
    // Made now, connected when a large transfer first uses them.
    std::vector<std::shared_ptr<grpc::Channel>> extra;
    for (int i = 1; i < transfer_connections_; ++i)
      extra.push_back(transfer_factory_->Make(target));
    session.core_->set_transfer_channels(std::move(extra));
  }
  // The direct path when asked for; best effort (the relay serves everything anyway).
  if (const char* direct = std::getenv("GPURPC_DIRECT");
      direct != nullptr && std::string(direct) == "1" && absl::StartsWith(target, "unix:")) {
    if (absl::Status used = session.UseDirectChannel();
        !used.ok() && std::getenv("GPURPC_CLIENT_DEBUG")) {
      std::fprintf(stderr, "gpurpc: no direct channel for session %llu: %s\n",
                   static_cast<unsigned long long>(response.session_id()), used.ToString().c_str());
    }
  }
  return session;
}

std::vector<DaemonStatus> Client::Daemons() const {
  if (daemons_ != nullptr) {
    return daemons_->Probe(std::min(call_timeout_, internal::kPlacementProbeTimeout));
  }
  DaemonStatus daemon;
  daemon.target = target_;
  absl::StatusOr<v1::ListDevicesResponse> devices = ListDevices();
  if (devices.ok()) {
    daemon.devices = *std::move(devices);
  } else {
    daemon.status = devices.status();
  }
  return {std::move(daemon)};
}

absl::StatusOr<Session> Client::OpenSession(int device_ordinal,
                                            const std::string& client_label) const {
  if (device_ordinal < 0 && device_ordinal != kAnyDevice) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device ordinal %d: give a device's ordinal (0 or more) or kAnyDevice (-1)",
                        device_ordinal));
  }
  // One daemon and a device named: straight there, no round trip first.
  if (daemons_ == nullptr && device_ordinal >= 0) {
    return OpenSessionOn(channel_, target_, device_ordinal, client_label);
  }
  const std::vector<DaemonStatus> daemons = Daemons();
  auto channel_of = [this](const DaemonStatus& daemon) {
    return daemons_ != nullptr ? daemons_->ChannelFor(daemon.target) : channel_;
  };
  if (device_ordinal >= 0) {
    // One list over the answering daemons, in order.
    int first = 0;
    for (const DaemonStatus& daemon : daemons) {
      if (!daemon.status.ok()) continue;
      const int count = daemon.devices.devices_size();
      if (device_ordinal < first + count) {
        return OpenSessionOn(channel_of(daemon), daemon.target,
                             daemon.devices.devices(device_ordinal - first).ordinal(),
                             client_label);
      }
      first += count;
    }
    std::string why = internal::DescribeUnavailable(daemons);
    return absl::NotFoundError(absl::StrFormat(
        "no device %d: the %d answering daemons serve %d devices%s%s", device_ordinal,
        std::count_if(daemons.begin(), daemons.end(),
                      [](const DaemonStatus& daemon) { return daemon.status.ok(); }),
        first, why.empty() ? "" : "; ", why));
  }
  const std::vector<internal::PlacementCandidate> candidates = internal::RankDevices(daemons);
  if (candidates.empty()) {
    std::string why = internal::DescribeUnavailable(daemons);
    return absl::UnavailableError(
        absl::StrFormat("no daemon can take a new session%s%s", why.empty() ? "" : ": ", why));
  }
  absl::Status last;
  std::vector<std::string> tried;
  for (const internal::PlacementCandidate& candidate : candidates) {
    const DaemonStatus& daemon = daemons[candidate.daemon];
    absl::StatusOr<Session> session =
        OpenSessionOn(channel_of(daemon), daemon.target, candidate.ordinal, client_label);
    if (session.ok()) return session;
    last = session.status();
    if (!absl::IsUnavailable(last) && !absl::IsResourceExhausted(last) &&
        !absl::IsDeadlineExceeded(last)) {
      return last;
    }
    tried.push_back(
        absl::StrFormat("%s device %d: %s", daemon.target, candidate.ordinal, last.message()));
  }
  return absl::Status(last.code(), absl::StrCat("no device took the session (tried ",
                                                absl::StrJoin(tried, "; "), ")"));
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo() const {
  auto stub = v1::DeviceService::NewStub(channel_);
  v1::GetServerInfoResponse response;
  absl::Status status =
      ClientCall(channel_, target_, GPURPC_RPC(*stub, GetServerInfo), "GetServerInfo",
                 v1::GetServerInfoRequest(), &response, call_timeout_);
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::ListSessionsResponse> Client::AdminListSessions(
    const std::string& tenant) const {
  auto stub = v1::AdminService::NewStub(channel_);
  v1::ListSessionsRequest request;
  request.set_tenant(tenant);
  v1::ListSessionsResponse response;
  absl::Status status = ClientCall(channel_, target_, GPURPC_RPC(*stub, ListSessions),
                                   "AdminService.ListSessions", request, &response, call_timeout_);
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::AdminCloseSessionResponse> Client::AdminCloseSession(uint64_t session_id) const {
  auto stub = v1::AdminService::NewStub(channel_);
  v1::AdminCloseSessionRequest request;
  request.set_session_id(session_id);
  v1::AdminCloseSessionResponse response;
  absl::Status status = ClientCall(channel_, target_, GPURPC_RPC(*stub, CloseSession),
                                   "AdminService.CloseSession", request, &response, call_timeout_);
  if (!status.ok()) return status;
  return response;
}

// ---------------------------------------------------------------------------- Session

Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    if (core_ != nullptr) ReportCleanup("session", core_->Close());
    core_ = std::move(other.core_);
  }
  return *this;
}
Session::~Session() {
  if (core_ != nullptr) ReportCleanup("session", core_->Close());
}

uint64_t Session::id() const { return core_ == nullptr ? 0 : core_->id(); }
const std::string& Session::daemon_target() const {
  static const std::string kNone;
  return core_ == nullptr ? kNone : core_->target();
}
const v1::DeviceInfo& Session::device() const {
  static const v1::DeviceInfo kNone;
  return core_ == nullptr ? kNone : core_->device();
}

absl::Status Session::Close() {
  if (core_ == nullptr) return NoSession();
  return core_->Close();
}

absl::StatusOr<v1::KeepAliveResponse> Session::KeepAlive() const {
  if (core_ == nullptr) return NoSession();
  // Always a round trip (it asks the daemon), also when the watch already knows better.
  const absl::Duration timeout = std::min(core_->call_timeout(), internal::kKeepAliveTimeout);
  v1::KeepAliveResponse response;
  SessionCore& core = *core_;
  absl::Status status = internal::RunUnary(
      "KeepAlive", GPURPC_RPC(core.sessions(), KeepAlive), v1::KeepAliveRequest(), &response,
      timeout, [&core](grpc::ClientContext* context) { core.AddMetadata(context); });
  if (!status.ok()) return status;
  return response;
}

v1::SessionState Session::state() const {
  return core_ == nullptr ? v1::SESSION_STATE_UNSPECIFIED : core_->state();
}

absl::Status Session::fault() const {
  if (core_ == nullptr) return NoSession();
  return core_->CheckUsable();
}

absl::Duration Session::call_timeout() const {
  return core_ == nullptr ? absl::ZeroDuration() : core_->call_timeout();
}

void Session::set_call_timeout(absl::Duration timeout) {
  if (core_ != nullptr) core_->set_call_timeout(timeout);
}

void Session::SetDeviceOutputHandler(std::function<void(absl::string_view)> handler) {
  if (core_ != nullptr) core_->SetDeviceOutputHandler(std::move(handler));
}

absl::StatusOr<Buffer> internal::AllocateBuffer(const std::shared_ptr<SessionCore>& core,
                                                uint64_t size_bytes) {
  v1::AllocateRequest request;
  request.set_size_bytes(size_bytes);
  v1::AllocateResponse response;
  absl::Status status =
      SessionCall(*core, GPURPC_RPC(core->memory(), Allocate), "Allocate", request, &response);
  if (!status.ok()) return status;
  Buffer buffer;
  buffer.core_ = core;
  buffer.id_ = response.buffer().buffer_id();
  buffer.device_address_ = response.buffer().device_address();
  buffer.size_bytes_ = response.buffer().size_bytes();
  return buffer;
}

namespace {

void SetCopy3DEnd(const Copy3DEnd& end, v1::Copy3DEndpoint* out) {
  if (end.array_id != 0) {
    out->set_array_id(end.array_id);
  } else {
    SetPointer(end.device, out->mutable_device());
  }
  out->set_pitch_bytes(end.pitch_bytes);
  out->set_height(end.height);
  out->set_x_bytes(end.x_bytes);
  out->set_y(end.y);
  out->set_z(end.z);
}

absl::Status Copy3DOn(internal::SessionCore& core, const Copy3DEnd& dst, const Copy3DEnd& src,
                      uint64_t width_bytes, uint64_t height, uint64_t depth, uint64_t stream_id,
                      bool wait) {
  v1::Command command;
  v1::Copy3DCommand* copy = command.mutable_copy_3d();
  SetCopy3DEnd(dst, copy->mutable_destination());
  SetCopy3DEnd(src, copy->mutable_source());
  copy->set_width_bytes(width_bytes);
  copy->set_height(height);
  copy->set_depth(depth);
  copy->set_stream_id(stream_id);
  if (absl::Status status = core.Enqueue(std::move(command)); !status.ok() || !wait) {
    return status;
  }
  return core.Sync(stream_id, /*whole_session=*/false, core.call_timeout(), "Session::Copy3D");
}

}  // namespace

absl::StatusOr<Buffer> Session::Allocate(uint64_t size_bytes) const {
  if (core_ == nullptr) return NoSession();
  return internal::AllocateBuffer(core_, size_bytes);
}

absl::StatusOr<std::string> Session::ExportMemory(const Buffer& buffer) const {
  if (core_ == nullptr) return NoSession();
  v1::ExportMemoryRequest request;
  request.set_buffer_id(buffer.id());
  v1::ExportMemoryResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->sessions(), ExportMemory),
                                    "ExportMemory", request, &response);
  if (!status.ok()) return status;
  return std::move(*response.mutable_handle());
}

absl::StatusOr<Buffer> Session::OpenMemoryHandle(const std::string& handle) const {
  if (core_ == nullptr) return NoSession();
  v1::OpenMemoryHandleRequest request;
  request.set_handle(handle);
  v1::OpenMemoryHandleResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->sessions(), OpenMemoryHandle),
                                    "OpenMemoryHandle", request, &response);
  if (!status.ok()) return status;
  Buffer buffer;
  buffer.core_ = core_;
  buffer.id_ = response.buffer().buffer_id();
  buffer.device_address_ = response.buffer().device_address();
  buffer.size_bytes_ = response.buffer().size_bytes();
  return buffer;
}

absl::StatusOr<Array> Session::AllocateArray(const v1::ArrayDescriptor& descriptor) const {
  if (core_ == nullptr) return NoSession();
  absl::StatusOr<uint32_t> element =
      ArrayElementBytes(descriptor.format(), descriptor.num_channels());
  if (!element.ok())
    return absl::InvalidArgumentError(absl::StrCat("AllocateArray: ", element.status().message()));
  v1::AllocateRequest request;
  *request.mutable_array() = descriptor;
  v1::AllocateResponse response;
  absl::Status status =
      SessionCall(*core_, GPURPC_RPC(core_->memory(), Allocate), "Allocate", request, &response);
  if (!status.ok()) return status;
  Array array;
  array.core_ = core_;
  array.id_ = response.buffer().buffer_id();
  array.descriptor_ = descriptor;
  array.charged_bytes_ = response.buffer().size_bytes();
  array.row_bytes_ = descriptor.width() * *element;
  return array;
}

absl::Status Session::Copy3DAsync(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                                  uint64_t height, uint64_t depth, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return Copy3DOn(*core_, dst, src, width_bytes, height, depth, StreamId(stream), false);
}

absl::Status Session::Copy3D(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                             uint64_t height, uint64_t depth, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return Copy3DOn(*core_, dst, src, width_bytes, height, depth, StreamId(stream), true);
}

absl::StatusOr<uint64_t> Session::SetLimit(v1::ContextLimit limit, uint64_t value) const {
  if (core_ == nullptr) return NoSession();
  v1::SetContextLimitRequest request;
  request.set_limit(limit);
  request.set_value(value);
  v1::SetContextLimitResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), SetContextLimit),
                                    "SetContextLimit", request, &response);
  if (!status.ok()) return status;
  return response.value();
}

absl::StatusOr<uint64_t> Session::GetLimit(v1::ContextLimit limit) const {
  if (core_ == nullptr) return NoSession();
  v1::GetContextLimitRequest request;
  request.set_limit(limit);
  v1::GetContextLimitResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), GetContextLimit),
                                    "GetContextLimit", request, &response);
  if (!status.ok()) return status;
  return response.value();
}

absl::StatusOr<bool> Session::SetProfiling(bool enabled) const {
  if (core_ == nullptr) return NoSession();
  v1::SetProfilingRequest request;
  request.set_enabled(enabled);
  v1::SetProfilingResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), SetProfiling),
                                    "SetProfiling", request, &response);
  if (!status.ok()) return status;
  return response.was_enabled();
}

absl::Status Session::SetCacheConfig(v1::CacheConfig config) const {
  if (core_ == nullptr) return NoSession();
  v1::SetCacheConfigRequest request;
  request.set_config(config);
  v1::SetCacheConfigResponse response;
  return SessionCall(*core_, GPURPC_RPC(core_->modules(), SetCacheConfig), "SetCacheConfig",
                     request, &response);
}

absl::StatusOr<v1::CacheConfig> Session::GetCacheConfig() const {
  if (core_ == nullptr) return NoSession();
  v1::GetCacheConfigResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), GetCacheConfig),
                                    "GetCacheConfig", v1::GetCacheConfigRequest(), &response);
  if (!status.ok()) return status;
  return response.config();
}

absl::StatusOr<MemInfo> Session::GetMemInfo() const {
  if (core_ == nullptr) return NoSession();
  v1::GetMemInfoResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->memory(), GetMemInfo), "GetMemInfo",
                                    v1::GetMemInfoRequest(), &response);
  if (!status.ok()) return status;
  return MemInfo{response.free_bytes(), response.total_bytes()};
}

absl::Status Session::Upload(const DeviceRef& dst, absl::Span<const uint8_t> data,
                             const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return UploadImpl(*core_, dst, data, StreamId(stream));
}

absl::StatusOr<std::vector<uint8_t>> Session::Download(const DeviceRef& src, uint64_t size_bytes,
                                                       const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  std::vector<uint8_t> out(size_bytes);
  absl::Status status = DownloadImpl(*core_, src, absl::MakeSpan(out), StreamId(stream));
  if (!status.ok()) return status;
  return out;
}

absl::Status Session::DownloadInto(const DeviceRef& src, absl::Span<uint8_t> out,
                                   const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  return DownloadImpl(*core_, src, out, StreamId(stream));
}

absl::Status Session::Memset(const DeviceRef& dst, uint32_t value, uint32_t element_size_bytes,
                             uint64_t count, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::MemsetRequest request;
  SetPointer(dst, request.mutable_destination());
  request.set_value(value);
  request.set_element_size_bytes(element_size_bytes);
  request.set_count(count);
  request.set_stream_id(StreamId(stream));
  v1::MemsetResponse response;
  return SessionCall(*core_, GPURPC_RPC(core_->memory(), Memset), "Memset", request, &response);
}

absl::Status Session::CopyDeviceToDevice(const DeviceRef& dst, const DeviceRef& src,
                                         uint64_t size_bytes, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::CopyDeviceToDeviceRequest request;
  SetPointer(dst, request.mutable_destination());
  SetPointer(src, request.mutable_source());
  request.set_size_bytes(size_bytes);
  request.set_stream_id(StreamId(stream));
  v1::CopyDeviceToDeviceResponse response;
  return SessionCall(*core_, GPURPC_RPC(core_->memory(), CopyDeviceToDevice), "CopyDeviceToDevice",
                     request, &response);
}

absl::Status Session::MemsetAsync(const DeviceRef& dst, uint32_t value, uint32_t element_size_bytes,
                                  uint64_t count, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  v1::MemsetCommand* memset = command.mutable_memset();
  SetPointer(dst, memset->mutable_destination());
  memset->set_value(value);
  memset->set_element_size_bytes(element_size_bytes);
  memset->set_count(count);
  memset->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Session::CopyDeviceToDeviceAsync(const DeviceRef& dst, const DeviceRef& src,
                                              uint64_t size_bytes, const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  v1::CopyCommand* copy = command.mutable_copy();
  SetPointer(dst, copy->mutable_destination());
  SetPointer(src, copy->mutable_source());
  copy->set_size_bytes(size_bytes);
  copy->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Session::UploadAsync(const DeviceRef& dst, absl::Span<const uint8_t> data,
                                  const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  if (data.size() > kTransferChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("UploadAsync: %d bytes exceed the inline limit of %d; use Upload",
                        data.size(), kTransferChunkBytes));
  }
  v1::Command command;
  v1::UploadCommand* upload = command.mutable_upload();
  SetPointer(dst, upload->mutable_destination());
  upload->set_data(data.data(), data.size());
  upload->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::StatusOr<CompileResult> Session::Compile(const CompileOptions& options) const {
  if (core_ == nullptr) return NoSession();
  v1::CompileRequest request;
  request.set_source(options.source);
  request.set_program_name(options.program_name);
  for (const std::string& option : options.options) request.add_options(option);
  for (const auto& [name, content] : options.headers) {
    v1::Header* header = request.add_headers();
    header->set_name(name);
    header->set_content(content);
  }
  for (const std::string& expression : options.name_expressions) {
    request.add_name_expressions(expression);
  }
  CompileResult result;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), Compile), "Compile",
                                    std::move(request), &result.response);
  if (!status.ok()) return status;
  if (result.response.success() && result.response.module_id() != 0) {
    result.module.core_ = core_;
    result.module.handle_ = std::make_shared<internal::ModuleHandle>();
    result.module.handle_->core = core_;
    result.module.handle_->id = result.response.module_id();
  }
  return result;
}

std::string CompileResult::LoweredName(const std::string& name_expression) const {
  for (const v1::LoweredName& name : response.lowered_names()) {
    if (name.name_expression() == name_expression) return name.lowered_name();
  }
  return "";
}

absl::StatusOr<Module> Session::LoadModule(const std::string& image) const {
  if (core_ == nullptr) return NoSession();
  v1::LoadModuleRequest request;
  request.set_image(image);
  v1::LoadModuleResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), LoadModule), "LoadModule",
                                    std::move(request), &response);
  if (!status.ok()) return status;
  Module module;
  module.core_ = core_;
  module.handle_ = std::make_shared<internal::ModuleHandle>();
  module.handle_->core = core_;
  module.handle_->id = response.module_id();
  return module;
}

absl::StatusOr<Stream> Session::CreateStream(bool non_blocking) const {
  if (core_ == nullptr) return NoSession();
  v1::CreateStreamRequest request;
  request.set_non_blocking(non_blocking);
  v1::CreateStreamResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->execution(), CreateStream),
                                    "CreateStream", request, &response);
  if (!status.ok()) return status;
  Stream stream;
  stream.core_ = core_;
  stream.id_ = response.stream_id();
  return stream;
}

namespace {

absl::StatusOr<uint64_t> NewEvent(SessionCore& core, bool disable_timing, bool interprocess) {
  v1::CreateEventRequest request;
  request.set_disable_timing(disable_timing);
  request.set_interprocess(interprocess);
  v1::CreateEventResponse response;
  absl::Status status = SessionCall(core, GPURPC_RPC(core.execution(), CreateEvent), "CreateEvent",
                                    request, &response);
  if (!status.ok()) return status;
  return response.event_id();
}

}  // namespace

absl::StatusOr<Event> Session::CreateEvent(bool disable_timing) const {
  if (core_ == nullptr) return NoSession();
  absl::StatusOr<uint64_t> id = NewEvent(*core_, disable_timing, /*interprocess=*/false);
  if (!id.ok()) return id.status();
  Event event;
  event.core_ = core_;
  event.id_ = *id;
  return event;
}

absl::StatusOr<Event> Session::CreateInterprocessEvent() const {
  if (core_ == nullptr) return NoSession();
  absl::StatusOr<uint64_t> id = NewEvent(*core_, /*disable_timing=*/true, /*interprocess=*/true);
  if (!id.ok()) return id.status();
  Event event;
  event.core_ = core_;
  event.id_ = *id;
  return event;
}

absl::StatusOr<std::string> Session::ExportEvent(const Event& event) const {
  if (core_ == nullptr) return NoSession();
  v1::ExportEventRequest request;
  request.set_event_id(event.id());
  v1::ExportEventResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->sessions(), ExportEvent),
                                    "ExportEvent", request, &response);
  if (!status.ok()) return status;
  return std::move(*response.mutable_handle());
}

absl::StatusOr<Event> Session::OpenEventHandle(const std::string& handle) const {
  if (core_ == nullptr) return NoSession();
  v1::OpenEventHandleRequest request;
  request.set_handle(handle);
  v1::OpenEventHandleResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->sessions(), OpenEventHandle),
                                    "OpenEventHandle", request, &response);
  if (!status.ok()) return status;
  Event event;
  event.core_ = core_;
  event.id_ = response.event_id();
  return event;
}

absl::Status Session::Flush() const {
  if (core_ == nullptr) return NoSession();
  return core_->Flush();
}

absl::Status Session::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  return Synchronize(core_->call_timeout());
}

absl::Status Session::Synchronize(absl::Duration timeout) const {
  if (core_ == nullptr) return NoSession();
  return core_->Sync(0, /*whole_session=*/true, timeout, "Session::Synchronize");
}

// ---------------------------------------------------------------------------- Array

Array::Array(Array&&) noexcept = default;
Array& Array::operator=(Array&&) noexcept = default;
Array::~Array() = default;

absl::Status Array::Free() { return ReleaseNow("Free: array already freed"); }

absl::Status Array::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  return FreeAllocation(core, id, timeout);
}

absl::Status Array::Upload(absl::Span<const uint8_t> data) const {
  if (core_ == nullptr || id_ == 0) return absl::FailedPreconditionError("Array::Upload: no array");
  const uint64_t packed = row_bytes_ * rows() * slices();
  if (data.size() != packed) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Array::Upload: the array holds %d bytes (%d x %d x %d), got %d", packed,
                        row_bytes_, rows(), slices(), data.size()));
  }
  GPURPC_ASSIGN_OR_RETURN(Buffer staging, internal::AllocateBuffer(core_, packed));
  GPURPC_RETURN_IF_ERROR(staging.Upload(data));
  return Copy3DOn(*core_, at(), Copy3DEnd::Linear(staging.at()), row_bytes_, rows(), slices(), 0,
                  true);
}

absl::StatusOr<std::vector<uint8_t>> Array::Download() const {
  if (core_ == nullptr || id_ == 0) {
    return absl::FailedPreconditionError("Array::Download: no array");
  }
  const uint64_t packed = row_bytes_ * rows() * slices();
  GPURPC_ASSIGN_OR_RETURN(Buffer staging, internal::AllocateBuffer(core_, packed));
  GPURPC_RETURN_IF_ERROR(Copy3DOn(*core_, Copy3DEnd::Linear(staging.at()), at(), row_bytes_, rows(),
                                  slices(), 0, true));
  return staging.Download();
}

// ---------------------------------------------------------------------------- Buffer

Buffer::Buffer(Buffer&&) noexcept = default;
Buffer& Buffer::operator=(Buffer&&) noexcept = default;
Buffer::~Buffer() = default;

absl::Status Buffer::Free() { return ReleaseNow("Free: buffer already freed"); }

absl::Status Buffer::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  return FreeAllocation(core, id, timeout);
}

absl::Status Buffer::Upload(absl::Span<const uint8_t> data, uint64_t offset_bytes) const {
  if (core_ == nullptr) return NoSession();
  return UploadImpl(*core_, at(offset_bytes), data, 0);
}

absl::StatusOr<std::vector<uint8_t>> Buffer::Download(uint64_t offset_bytes,
                                                      uint64_t size_bytes) const {
  if (core_ == nullptr) return NoSession();
  std::vector<uint8_t> out(size_bytes);
  absl::Status status = DownloadImpl(*core_, at(offset_bytes), absl::MakeSpan(out), 0);
  if (!status.ok()) return status;
  return out;
}

// ---------------------------------------------------------------------------- Stream, Event

Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;
Stream::~Stream() = default;

absl::Status Stream::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  if (absl::Status status = core.Barrier(timeout); !status.ok()) return status;
  v1::DestroyStreamRequest request;
  request.set_stream_id(id);
  v1::DestroyStreamResponse response;
  return SessionCall(core, GPURPC_RPC(core.execution(), DestroyStream), "DestroyStream", request,
                     &response, timeout);
}

absl::Status Stream::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  return Synchronize(core_->call_timeout());
}

absl::Status Stream::Synchronize(absl::Duration timeout) const {
  if (core_ == nullptr) return NoSession();
  return core_->Sync(id_, /*whole_session=*/false, timeout, "Stream::Synchronize");
}

absl::StatusOr<bool> Stream::Query() const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::QueryStreamRequest request;
  request.set_stream_id(id_);
  v1::QueryStreamResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->execution(), QueryStream),
                                    "QueryStream", request, &response);
  if (!status.ok()) return status;
  return response.done();
}

absl::Status Stream::WaitEvent(const Event& event) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  command.mutable_wait_event()->set_event_id(event.id());
  command.mutable_wait_event()->set_stream_id(id_);
  return core_->Enqueue(std::move(command));
}

Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;
Event::~Event() = default;

absl::Status Event::Release(SessionCore& core, uint64_t id, absl::Duration timeout) {
  if (absl::Status status = core.Barrier(timeout); !status.ok()) return status;
  v1::DestroyEventRequest request;
  request.set_event_id(id);
  v1::DestroyEventResponse response;
  // Through the front end, which keeps the record of exported and opened events
  // (execution_service.proto); the barrier above ordered it after the queued commands.
  return SessionCall(core, GPURPC_RPC(core.relay_execution(), DestroyEvent), "DestroyEvent",
                     request, &response, timeout);
}

absl::Status Event::Record(const Stream* stream) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  command.mutable_record_event()->set_event_id(id_);
  command.mutable_record_event()->set_stream_id(StreamId(stream));
  return core_->Enqueue(std::move(command));
}

absl::Status Event::Synchronize() const {
  if (core_ == nullptr) return NoSession();
  return Synchronize(core_->call_timeout());
}

absl::Status Event::Synchronize(absl::Duration timeout) const {
  if (core_ == nullptr) return NoSession();
  // One sync marker on the command stream, after the queued commands (SyncCommand.event_id;
  // the event's id as the stream too, see there).
  return core_->Sync(id_, /*whole_session=*/false, timeout, "Event::Synchronize", id_);
}

absl::StatusOr<bool> Event::Query() const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::QueryEventRequest request;
  request.set_event_id(id_);
  v1::QueryEventResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->execution(), QueryEvent),
                                    "QueryEvent", request, &response);
  if (!status.ok()) return status;
  return response.done();
}

absl::StatusOr<float> Event::ElapsedSince(const Event& start) const {
  if (core_ == nullptr) return NoSession();
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::EventElapsedTimeRequest request;
  request.set_start_event_id(start.id());
  request.set_end_event_id(id_);
  v1::EventElapsedTimeResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->execution(), EventElapsedTime),
                                    "EventElapsedTime", request, &response);
  if (!status.ok()) return status;
  return response.elapsed_ms();
}

// ---------------------------------------------------------------------------- modules

uint64_t Module::id() const { return handle_ == nullptr ? 0 : handle_->id; }

absl::StatusOr<Function> Module::GetFunction(const std::string& name) const {
  if (core_ == nullptr) return NoSession();
  v1::GetFunctionRequest request;
  request.set_module_id(id());
  request.set_name(name);
  v1::GetFunctionResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), GetFunction),
                                    "GetFunction", request, &response);
  if (!status.ok()) return status;
  Function function;
  function.core_ = core_;
  function.module_ = handle_;
  function.id_ = response.function_id();
  function.name_ = name;
  function.params_.assign(response.params().begin(), response.params().end());
  function.attributes_ = response.attributes();
  return function;
}

absl::StatusOr<Module::Global> Module::GetGlobal(const std::string& name) const {
  if (core_ == nullptr) return NoSession();
  v1::GetGlobalRequest request;
  request.set_module_id(id());
  request.set_name(name);
  v1::GetGlobalResponse response;
  absl::Status status =
      SessionCall(*core_, GPURPC_RPC(core_->modules(), GetGlobal), "GetGlobal", request, &response);
  if (!status.ok()) return status;
  return Global{response.device_address(), response.size_bytes()};
}

absl::StatusOr<std::string> Function::Pack(absl::Span<const KernelArg> args) const {
  if (args.size() != params_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kernel '%s' takes %d parameters; %d arguments were given", name_,
                        params_.size(), args.size()));
  }
  const size_t total =
      params_.empty() ? 0 : params_.back().offset_bytes() + params_.back().size_bytes();
  std::string packed(total, '\0');
  for (size_t i = 0; i < args.size(); ++i) {
    const std::vector<uint8_t>& bytes = args[i].bytes();
    if (bytes.size() != params_[i].size_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("kernel '%s' parameter #%d: expected %d bytes, given %d bytes", name_, i,
                          params_[i].size_bytes(), bytes.size()));
    }
    std::copy(bytes.begin(), bytes.end(), packed.begin() + params_[i].offset_bytes());
  }
  return packed;
}

namespace {

void FillLaunch(uint64_t function_id, const LaunchConfig& config, std::string packed,
                v1::LaunchCommand* launch) {
  launch->set_function_id(function_id);
  SetDim(config.grid, launch->mutable_grid());
  SetDim(config.block, launch->mutable_block());
  launch->set_shared_memory_bytes(config.shared_memory_bytes);
  launch->set_stream_id(StreamId(config.stream));
  launch->set_packed_args(std::move(packed));
}

}  // namespace

absl::Status Function::LaunchPacked(const LaunchConfig& config, absl::Span<const KernelArg> args,
                                    LaunchMode mode) const {
  if (core_ == nullptr) return NoSession();
  auto packed = Pack(args);
  if (!packed.ok()) return packed.status();
  if (mode == LaunchMode::kAsync) return LaunchBlobAsync(config, *std::move(packed));
  if (absl::Status status = core_->Barrier(); !status.ok()) return status;
  v1::LaunchRequest request;
  FillLaunch(id_, config, *std::move(packed), request.mutable_launch());
  request.set_synchronize(mode == LaunchMode::kSynchronize);
  v1::LaunchResponse response;
  absl::Status status =
      SessionCall(*core_, GPURPC_RPC(core_->execution(), Launch), "Launch", request, &response);
  if (mode != LaunchMode::kSynchronize || !status.ok()) return status;
  core_->DeliverDeviceOutput(response.device_output());
  if (!response.synchronized()) {
    // A daemon older than LaunchRequest.synchronize only enqueued the launch.
    return core_->Sync(StreamId(config.stream), /*whole_session=*/false, core_->call_timeout(),
                       "Function::LaunchAndSynchronize");
  }
  // As Stream::Synchronize would: the first asynchronous error since the last sync.
  return core_->TakeCommandError();
}

absl::Status Function::SetAttribute(v1::FunctionAttribute attribute, int64_t value) {
  if (core_ == nullptr) return NoSession();
  v1::SetFunctionAttributeRequest request;
  request.set_function_id(id_);
  request.set_attribute(attribute);
  request.set_value(value);
  v1::SetFunctionAttributeResponse response;
  absl::Status status = SessionCall(*core_, GPURPC_RPC(core_->modules(), SetFunctionAttribute),
                                    "SetFunctionAttribute", request, &response);
  if (!status.ok()) return status;
  attributes_ = response.attributes();
  return absl::OkStatus();
}

absl::Status Function::SetCacheConfig(v1::CacheConfig config) const {
  if (core_ == nullptr) return NoSession();
  v1::SetFunctionCacheConfigRequest request;
  request.set_function_id(id_);
  request.set_config(config);
  v1::SetFunctionCacheConfigResponse response;
  return SessionCall(*core_, GPURPC_RPC(core_->modules(), SetFunctionCacheConfig),
                     "SetFunctionCacheConfig", request, &response);
}

absl::Status Function::LaunchBlobAsync(const LaunchConfig& config, std::string packed_args) const {
  if (core_ == nullptr) return NoSession();
  v1::Command command;
  FillLaunch(id_, config, std::move(packed_args), command.mutable_launch());
  return core_->Enqueue(std::move(command));
}

}  // namespace gpurpc
