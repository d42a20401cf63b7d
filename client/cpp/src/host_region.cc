// Same-host regions of the C++ client (HostRegion in client.h; the protocol is in
// proto/gpurpc/v1/host_region_service.proto).
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cpp/src/session_core.h"
#include "client/cpp/src/session_object.h"
#include "common/fd_passing.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/host_region_service.grpc.pb.h"
#include "grpcpp/create_channel_posix.h"

namespace gpurpc {
namespace {

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// A unary HostRegionService call of the session (internal::SessionCall).
#define GPURPC_REGION_CALL(core, Method, request, response, timeout)                    \
  [&]() -> absl::Status {                                                               \
    auto stub = v1::HostRegionService::NewStub((core).channel());                       \
    return internal::SessionCall((core), GPURPC_RPC(*stub, Method), #Method, (request), \
                                 (response), (timeout));                                \
  }()

// One RegionCopyCommand on the command stream: region bytes [region_offset_bytes,
// + size_bytes) to `device`, or back.
absl::Status QueueRegionCopy(internal::SessionCore* core, uint64_t region_id,
                             const DeviceRef& device, uint64_t region_offset_bytes,
                             uint64_t size_bytes, bool to_device, const Stream* stream) {
  if (core == nullptr || region_id == 0) {
    return absl::FailedPreconditionError("the region is not registered");
  }
  v1::Command command;
  v1::RegionCopyCommand* copy = command.mutable_region_copy();
  copy->set_region_id(region_id);
  copy->set_region_offset_bytes(region_offset_bytes);
  if (device.buffer_id != 0) {
    copy->mutable_device()->mutable_buffer()->set_buffer_id(device.buffer_id);
    copy->mutable_device()->mutable_buffer()->set_offset_bytes(device.offset_bytes);
  } else {
    copy->mutable_device()->set_device_address(device.device_address);
  }
  copy->set_size_bytes(size_bytes);
  copy->set_to_device(to_device);
  copy->set_stream_id(stream == nullptr ? 0 : stream->id());
  return core->Enqueue(std::move(command));
}

// Sends the memfd on the region socket and returns the daemon's verdict.
absl::Status Attach(const std::string& socket_path, const v1::AttachHostRegionRequest& request,
                    int memfd, absl::Duration timeout) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return absl::UnavailableError(
        absl::StrFormat("the daemon's region socket path '%s' is unusable here", socket_path));
  }
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(Errno("socket(AF_UNIX, SOCK_SEQPACKET)"));
  absl::Status status;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    status = absl::UnavailableError(absl::StrFormat(
        "cannot reach the daemon's region socket %s (is this client on the daemon's host?): %s",
        socket_path, std::strerror(errno)));
  }
  if (status.ok()) status = SendDatagram(fd, request.SerializeAsString(), {memfd});
  if (status.ok()) {
    pollfd pfd{fd, POLLIN, 0};
    int ready = -1;
    do {
      ready = poll(&pfd, 1,
                   static_cast<int>(
                       std::min<int64_t>(absl::ToInt64Milliseconds(timeout), 24 * 3600 * 1000)));
    } while (ready < 0 && errno == EINTR);
    if (ready == 0) {
      status = absl::DeadlineExceededError(absl::StrFormat(
          "the daemon did not answer the region attach within %s", absl::FormatDuration(timeout)));
    }
  }
  ReceivedDatagram answer;
  if (status.ok()) status = ReceiveDatagram(fd, &answer);
  close(fd);
  if (!status.ok()) return status;
  v1::AttachHostRegionReply reply;
  if (!reply.ParseFromString(answer.bytes)) {
    return absl::UnavailableError("the daemon's region socket sent a malformed answer");
  }
  return absl::Status(static_cast<absl::StatusCode>(reply.code()),
                      absl::StrCat("attaching the region: ", reply.message()));
}

}  // namespace

absl::StatusOr<HostRegion> Session::CreateHostRegion(uint64_t size_bytes) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("no session (moved from?)");
  if (size_bytes == 0)
    return absl::InvalidArgumentError("CreateHostRegion: size_bytes must be > 0");
  const int memfd = memfd_create("gpurpc-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) return absl::UnavailableError(Errno("memfd_create"));
  HostRegion region;
  absl::Status status;
  if (ftruncate(memfd, static_cast<off_t>(size_bytes)) != 0) {
    status = absl::ResourceExhaustedError(Errno("ftruncate of the region's memfd"));
  } else if (fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    status = absl::UnavailableError(Errno("sealing the region's memfd"));
  } else {
    void* data = mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (data == MAP_FAILED) {
      status = absl::ResourceExhaustedError(Errno("mmap of the region"));
    } else {
      region.data_ = static_cast<uint8_t*>(data);
      region.size_bytes_ = size_bytes;
    }
  }
  if (status.ok()) {
    v1::RegisterHostRegionRequest request;
    request.set_size_bytes(size_bytes);
    v1::RegisterHostRegionResponse response;
    status =
        GPURPC_REGION_CALL(*core_, RegisterHostRegion, request, &response, core_->call_timeout());
    if (status.ok()) {
      region.core_ = core_;
      region.id_ = response.region_id();
      std::string path = response.region_socket();
      if (const char* override_path = std::getenv("GPURPC_REGION_SOCKET");
          override_path != nullptr && *override_path != '\0') {
        path = override_path;
      }
      v1::AttachHostRegionRequest attach;
      attach.set_session_id(core_->id());
      attach.set_region_id(response.region_id());
      attach.set_ticket(response.attach_ticket());
      status = Attach(path, attach, memfd, core_->call_timeout());
    }
  }
  close(memfd);                     // the mappings, here and in the worker, keep the memory
  if (!status.ok()) return status;  // `region`'s destructor unregisters and unmaps
  return region;
}

absl::Status Session::UseDirectChannel() const {
  if (core_ == nullptr) return absl::FailedPreconditionError("no session (moved from?)");
  if (core_->direct()) return absl::OkStatus();
  v1::OpenDirectChannelRequest request;
  v1::OpenDirectChannelResponse response;
  absl::Status status =
      GPURPC_REGION_CALL(*core_, OpenDirectChannel, request, &response, core_->call_timeout());
  if (!status.ok()) return status;
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return absl::UnavailableError(Errno("socketpair"));
  }
  std::string path = response.region_socket();
  if (const char* override_path = std::getenv("GPURPC_REGION_SOCKET");
      override_path != nullptr && *override_path != '\0') {
    path = override_path;
  }
  v1::AttachHostRegionRequest attach;
  attach.set_session_id(core_->id());
  attach.set_ticket(response.attach_ticket());
  attach.set_direct_channel(true);
  status = Attach(path, attach, pair[1], core_->call_timeout());
  close(pair[1]);  // the worker holds its own copy
  if (!status.ok()) {
    close(pair[0]);
    return status;
  }
  // gRPC 1.51 hangs on a blocking fd.
  fcntl(pair[0], F_SETFL, fcntl(pair[0], F_GETFL) | O_NONBLOCK);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomInsecureChannelFromFd(
      absl::StrCat("gpurpc-direct-", core_->id()), pair[0], args);  // owns pair[0]
  return core_->UseExecutionChannel(std::move(channel));
}

bool Session::direct() const { return core_ != nullptr && core_->direct(); }

// The base takes `other`'s session and id last: only its own part of `other` is moved.
HostRegion::HostRegion(HostRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_bytes_(std::exchange(other.size_bytes_, 0)) {
  SessionObject::operator=(std::move(other));
}

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    HostRegion doomed(std::move(*this));  // unregistered and unmapped on leaving
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    SessionObject::operator=(std::move(other));
  }
  return *this;
}

// The local mapping goes first; the daemon's side goes in ~SessionObject (Release): the
// worker holds its own mapping until then, so queued copies still find their bytes.
HostRegion::~HostRegion() { Unmap(); }

void HostRegion::Unmap() {
  if (data_ != nullptr) munmap(data_, size_bytes_);
  data_ = nullptr;
}

absl::Status HostRegion::Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout) {
  // Commands queued before may still name the region: they go first.
  if (absl::Status status = core.Barrier(timeout); !status.ok()) return status;
  v1::UnregisterHostRegionRequest request;
  request.set_region_id(id);
  v1::UnregisterHostRegionResponse response;
  return GPURPC_REGION_CALL(core, UnregisterHostRegion, request, &response, timeout);
}

absl::Status HostRegion::Unregister() { return ReleaseNow("the region is not registered"); }

absl::Status HostRegion::CopyToDevice(const DeviceRef& dst, uint64_t region_offset_bytes,
                                      uint64_t size_bytes, const Stream* stream) const {
  return QueueRegionCopy(core_.get(), id_, dst, region_offset_bytes, size_bytes,
                         /*to_device=*/true, stream);
}

absl::Status HostRegion::CopyFromDevice(const DeviceRef& src, uint64_t region_offset_bytes,
                                        uint64_t size_bytes, const Stream* stream) const {
  return QueueRegionCopy(core_.get(), id_, src, region_offset_bytes, size_bytes,
                         /*to_device=*/false, stream);
}

}  // namespace gpurpc
