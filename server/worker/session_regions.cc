// Session's same-host regions (session.h, proto/gpurpc/v1/host_region_service.proto).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_count.h"
#include "common/status_macros.h"
#include "server/worker/host_region.h"
#include "server/worker/session.h"

namespace gpurpc::worker {

// Fields are guarded by the session's mu_, except `mapping` and `registration`, which are set
// once (under mu_, before `state` becomes kAttached) and then only read.
struct Session::RegionEntry {
  enum class State { kPending, kAttaching, kAttached };
  RegionEntry(backend::Context* context, uint64_t size_bytes, std::string ticket)
      : context(context), size_bytes(size_bytes), ticket(std::move(ticket)) {}
  // Queued copies may still read or write the region: wait for them, then unpin and unmap.
  ~RegionEntry() {
    if (registration != nullptr) {
      context->Synchronize().IgnoreError();  // a fault has stopped the copies anyway
      registration.reset();
    }
    mapping.reset();
  }

  backend::Context* const context;
  const uint64_t size_bytes;
  const std::string ticket;
  State state = State::kPending;
  std::unique_ptr<MappedRegion> mapping;
  std::unique_ptr<backend::HostRegistration> registration;
};

namespace {

// Constant time in the ticket's bytes: the ticket is a secret.
bool SameTicket(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return difference == 0;
}

}  // namespace

absl::StatusOr<v1::RegisterHostRegionResponse> Session::RegisterHostRegion(uint64_t size_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (region_socket_.empty()) {
    return absl::FailedPreconditionError(
        "RegisterHostRegion: this gpurpcd serves no region socket (it has no Unix socket, or "
        "--region-socket is empty); transfer through MemoryService instead");
  }
  if (size_bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostRegion: size_bytes must be > 0");
  }
  GPURPC_ASSIGN_OR_RETURN(std::string ticket, NewAttachTicket());
  absl::MutexLock lock(&mu_);
  if (regions_.size() >= kMaxHostRegionsPerSession) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RegisterHostRegion: this session holds %d regions, the most a session may; "
        "unregister some first",
        regions_.size()));
  }
  const uint64_t limit = limits_.max_host_region_bytes;
  if (limit != 0 && (size_bytes > limit || region_bytes_ > limit - size_bytes)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RegisterHostRegion: %s more would pass the session's limit of %s of host regions "
        "(--max-host-region-bytes); the session holds %s",
        FormatBytes(size_bytes), FormatBytes(limit), FormatBytes(region_bytes_)));
  }
  const uint64_t id = NewIdLocked();
  regions_.Insert(id, std::make_shared<RegionEntry>(context_.get(), size_bytes, ticket));
  region_bytes_ += size_bytes;
  v1::RegisterHostRegionResponse response;
  response.set_region_id(id);
  response.set_attach_ticket(std::move(ticket));
  response.set_region_socket(region_socket_);
  return response;
}

absl::Status Session::AttachHostRegion(uint64_t region_id, const std::string& ticket, int fd) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<RegionEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<RegionEntry>* found = regions_.Lookup(region_id);
    // One answer for every way of not holding the right ticket.
    if (found == nullptr || (*found)->state != RegionEntry::State::kPending ||
        !SameTicket((*found)->ticket, ticket)) {
      return absl::NotFoundError(absl::StrFormat(
          "no region %d of this session waits for its memfd with that ticket", region_id));
    }
    entry = *found;
    entry->state = RegionEntry::State::kAttaching;
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> mapping = MappedRegion::Map(fd, entry->size_bytes);
  absl::StatusOr<std::unique_ptr<backend::HostRegistration>> registration;
  if (mapping.ok()) {
    registration = RecordFault(context_->RegisterHostMemory((*mapping)->data(), entry->size_bytes));
  }
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<RegionEntry>* current = regions_.Lookup(region_id);
  const bool still_ours = current != nullptr && *current == entry;
  if (!mapping.ok() || !registration.ok()) {
    if (still_ours) entry->state = RegionEntry::State::kPending;  // the client may retry
    return !mapping.ok() ? mapping.status() : registration.status();
  }
  entry->mapping = *std::move(mapping);
  entry->registration = *std::move(registration);
  if (!still_ours) {
    // Unregistered while it was being attached: `entry`'s last owner undoes it all.
    return absl::NotFoundError(
        absl::StrFormat("region %d was unregistered while it was being attached", region_id));
  }
  entry->state = RegionEntry::State::kAttached;
  return absl::OkStatus();
}

absl::Status Session::UnregisterHostRegion(uint64_t region_id) {
  std::shared_ptr<RegionEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(entry, regions_.Take(region_id));
    region_bytes_ -= std::min(region_bytes_, entry->size_bytes);
  }
  entry.reset();  // waits for queued work unless a copy still holds it (it then does)
  return absl::OkStatus();
}

absl::Status Session::CopyHostRegion(const v1::RegionCopyCommand& command) {
  GPURPC_RETURN_IF_ERROR(fault());
  const char* what =
      command.to_device() ? "region copy to the device" : "region copy from the device";
  if (command.size_bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": size_bytes must be > 0"));
  }
  std::shared_ptr<RegionEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(entry, regions_.Find(command.region_id(), what));
    if (entry->state != RegionEntry::State::kAttached) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: region %d has no memfd attached yet (send it on the region socket first)", what,
          command.region_id()));
    }
  }
  const uint64_t offset = command.region_offset_bytes();
  if (offset > entry->size_bytes || command.size_bytes() > entry->size_bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bytes [%d, %d + %d) are outside region %d of %d bytes", what, offset,
                        offset, command.size_bytes(), command.region_id(), entry->size_bytes));
  }
  GPURPC_ASSIGN_OR_RETURN(
      backend::DevicePtr device,
      Resolve(command.device(), command.size_bytes(),
              command.to_device() ? "region copy destination" : "region copy source"));
  GPURPC_ASSIGN_OR_RETURN(auto stream, FindStream(command.stream_id()));
  // Host memory copies cannot be captured into a CUDA graph (session_graphs.cc).
  GPURPC_RETURN_IF_ERROR(RefuseWhileCapturing(command.stream_id(), what));
  uint8_t* const host = entry->mapping->data() + offset;
  if (command.to_device()) {
    return RecordFault(
        context_->CopyHostToDeviceAsync(device, host, command.size_bytes(), stream.get()));
  }
  return RecordFault(
      context_->CopyDeviceToHostAsync(host, device, command.size_bytes(), stream.get()));
}

absl::StatusOr<v1::OpenDirectChannelResponse> Session::OpenDirectChannel() {
  GPURPC_RETURN_IF_ERROR(fault());
  if (region_socket_.empty()) {
    return absl::FailedPreconditionError(
        "OpenDirectChannel: this gpurpcd serves no region socket (it has no Unix socket, or "
        "--region-socket is empty)");
  }
  GPURPC_ASSIGN_OR_RETURN(std::string ticket, NewAttachTicket());
  absl::MutexLock lock(&mu_);
  if (direct_tickets_.size() >= kMaxDirectChannelsPerSession) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "OpenDirectChannel: this session holds %d unused direct-channel tickets, the most it "
        "may; use them first",
        direct_tickets_.size()));
  }
  direct_tickets_.push_back(ticket);
  v1::OpenDirectChannelResponse response;
  response.set_attach_ticket(std::move(ticket));
  response.set_region_socket(region_socket_);
  return response;
}

absl::Status Session::TakeDirectTicket(const std::string& ticket) {
  GPURPC_RETURN_IF_ERROR(fault());
  absl::MutexLock lock(&mu_);
  for (auto it = direct_tickets_.begin(); it != direct_tickets_.end(); ++it) {
    if (SameTicket(*it, ticket)) {
      direct_tickets_.erase(it);
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError("no direct channel of this session waits for that ticket");
}

}  // namespace gpurpc::worker
