#include "client/cpp/src/daemons.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "gpurpc/v1/device_service.grpc.pb.h"

namespace gpurpc::internal {

bool Accepting(const DaemonStatus& daemon) {
  // A daemon from before load reporting names no instance: it may well accept.
  return daemon.devices.accepting_sessions() || daemon.devices.daemon_instance().empty();
}

absl::StatusOr<std::vector<TargetSpec>> ParseTargets(const std::string& list) {
  std::vector<TargetSpec> specs;
  int index = 0;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    ++index;
    std::string target(absl::StripAsciiWhitespace(entry));
    if (target.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the address list '%s' has an empty entry (entry %d): separate targets with one "
          "comma, e.g. gpu1:50051,gpu2:50051",
          absl::CHexEscape(list.substr(0, 256)), index));
    }
    if (absl::StartsWith(target, "/")) target = "unix:" + target;
    TargetSpec spec;
    spec.target = target;
    if (absl::StartsWith(target, "dns:///")) {
      const std::string rest = target.substr(7);
      size_t colon = rest.rfind(':');
      const size_t bracket = rest.rfind(']');
      if (colon == std::string::npos || (bracket != std::string::npos && colon < bracket) ||
          colon == 0 || colon + 1 == rest.size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("address '%s' (entry %d) needs a host and a port: dns:///HOST:PORT",
                            absl::CHexEscape(target.substr(0, 256)), index));
      }
      spec.resolve = true;
      spec.host = rest.substr(0, colon);
      if (absl::StartsWith(spec.host, "[") && absl::EndsWith(spec.host, "]")) {
        spec.host = spec.host.substr(1, spec.host.size() - 2);
      }
      spec.port = rest.substr(colon + 1);
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host,
                                                    const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrFormat("cannot resolve %s:%s: %s", host, port, gai_strerror(rc)));
  }
  std::set<std::string> targets;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (ai->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
      if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) {
        targets.insert(absl::StrCat("ipv4:", text, ":", ntohs(in->sin_port)));
      }
    } else if (ai->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
      if (inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text) != nullptr) {
        targets.insert(absl::StrCat("ipv6:[", text, "]:", ntohs(in6->sin6_port)));
      }
    }
  }
  freeaddrinfo(found);
  if (targets.empty()) {
    return absl::UnavailableError(absl::StrFormat("%s:%s resolves to no address", host, port));
  }
  return std::vector<std::string>(targets.begin(), targets.end());
}

std::vector<PlacementCandidate> RankDevices(const std::vector<DaemonStatus>& daemons) {
  std::vector<PlacementCandidate> candidates;
  for (size_t i = 0; i < daemons.size(); ++i) {
    if (!daemons[i].status.ok() || !Accepting(daemons[i])) continue;
    for (const v1::DeviceInfo& device : daemons[i].devices.devices()) {
      candidates.push_back(PlacementCandidate{
          i, device.ordinal(), device.load().free_memory_bytes(), device.load().sessions()});
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const PlacementCandidate& a, const PlacementCandidate& b) {
                     const uint64_t a_free = a.free_memory_bytes >> kPlacementMemoryStepShift;
                     const uint64_t b_free = b.free_memory_bytes >> kPlacementMemoryStepShift;
                     return std::make_tuple(b_free, a.sessions, a.daemon, a.ordinal) <
                            std::make_tuple(a_free, b.sessions, b.daemon, b.ordinal);
                   });
  return candidates;
}

std::string DescribeUnavailable(const std::vector<DaemonStatus>& daemons) {
  std::vector<std::string> parts;
  for (const DaemonStatus& daemon : daemons) {
    if (!daemon.status.ok()) {
      parts.push_back(absl::StrCat(daemon.target, ": ", daemon.status.message()));
    } else if (!Accepting(daemon)) {
      parts.push_back(absl::StrCat(daemon.target, ": draining (accepts no new session)"));
    } else if (daemon.devices.devices_size() == 0) {
      parts.push_back(absl::StrCat(daemon.target, ": serves no device"));
    }
  }
  return absl::StrJoin(parts, "; ");
}

Daemons::Daemons(std::vector<TargetSpec> specs, ChannelFactory factory)
    : specs_(std::move(specs)), factory_(std::move(factory)) {}

std::vector<Daemons::Address> Daemons::Addresses() const {
  std::vector<Address> addresses;
  std::set<std::string> seen;
  for (const TargetSpec& spec : specs_) {
    if (!spec.resolve) {
      if (seen.insert(spec.target).second) addresses.push_back(Address{spec.target, "", {}});
      continue;
    }
    absl::StatusOr<std::vector<std::string>> resolved = ResolveAll(spec.host, spec.port);
    if (!resolved.ok()) {
      addresses.push_back(Address{spec.target, "", resolved.status()});
      continue;
    }
    for (std::string& target : *resolved) {
      if (seen.insert(target).second) addresses.push_back(Address{target, spec.host, {}});
    }
  }
  return addresses;
}

std::shared_ptr<grpc::Channel> Daemons::ChannelLocked(const std::string& target,
                                                      const std::string& tls_name) const {
  auto& channel = channels_[target];
  if (channel == nullptr) channel = factory_.Make(target, tls_name);
  return channel;
}

std::shared_ptr<grpc::Channel> Daemons::ChannelFor(const std::string& target) const {
  absl::MutexLock lock(&mu_);
  return ChannelLocked(target, "");
}

std::vector<DaemonStatus> Daemons::Probe(absl::Duration timeout) const {
  const std::vector<Address> addresses = Addresses();
  struct Pending {
    grpc::ClientContext context;
    v1::ListDevicesRequest request;
    v1::ListDevicesResponse response;
    grpc::Status status;
    absl::Notification done;
    std::unique_ptr<v1::DeviceService::Stub> stub;
  };
  std::vector<std::unique_ptr<Pending>> pending(addresses.size());
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (!addresses[i].resolve_error.ok()) continue;
    std::shared_ptr<grpc::Channel> channel;
    {
      absl::MutexLock lock(&mu_);
      channel = ChannelLocked(addresses[i].target, addresses[i].tls_name);
    }
    auto call = std::make_unique<Pending>();
    call->stub = v1::DeviceService::NewStub(channel);
    // Not wait_for_ready: a daemon that refuses connections (down) answers at once.
    call->context.set_deadline(deadline);
    Pending* raw = call.get();
    call->stub->async()->ListDevices(&raw->context, &raw->request, &raw->response,
                                     [raw](grpc::Status status) {
                                       raw->status = std::move(status);
                                       raw->done.Notify();
                                     });
    pending[i] = std::move(call);
  }
  std::vector<DaemonStatus> daemons;
  std::set<std::string> instances;
  for (size_t i = 0; i < addresses.size(); ++i) {
    DaemonStatus daemon;
    daemon.target = addresses[i].target;
    if (!addresses[i].resolve_error.ok()) {
      daemon.status = addresses[i].resolve_error;
      daemons.push_back(std::move(daemon));
      continue;
    }
    Pending& call = *pending[i];
    call.done.WaitForNotification();
    if (call.status.ok()) {
      const std::string& instance = call.response.daemon_instance();
      if (!instance.empty() && !instances.insert(instance).second) continue;  // seen already
      daemon.devices = std::move(call.response);
    } else if (call.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      daemon.status =
          absl::UnavailableError(absl::StrCat("no answer within ", absl::FormatDuration(timeout)));
    } else {
      daemon.status = FromGrpcStatus(call.status);
    }
    daemons.push_back(std::move(daemon));
  }
  return daemons;
}

}  // namespace gpurpc::internal
