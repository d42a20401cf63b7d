// The daemons of a Client that was given several (ConnectOptions::address): parsing the
// address list, resolving dns:/// names to every address, one channel per daemon, asking all
// of them for their devices' load at once, and ranking devices for a new session.
// Internal to the client library; the contract users see is at Client in gpurpc/client.h.
#ifndef GPURPC_CLIENT_CPP_SRC_DAEMONS_H_
#define GPURPC_CLIENT_CPP_SRC_DAEMONS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpurpc/client.h"
#include "grpcpp/grpcpp.h"

namespace gpurpc::internal {

// Free memory counts in steps of this size when devices are ranked, so that a few bytes
// more do not outweigh a session fewer (the Python client uses the same step).
inline constexpr int kPlacementMemoryStepShift = 28;  // 256 MiB
// The longest a placement waits for the daemons' answers.
inline constexpr absl::Duration kPlacementProbeTimeout = absl::Seconds(5);

// One entry of the address list.
struct TargetSpec {
  std::string target;      // normalized gRPC target, as given
  bool resolve = false;    // "dns:///HOST:PORT": every address HOST resolves to
  std::string host, port;  // of a dns:/// target
};

// Splits "a,b,c" into targets. INVALID_ARGUMENT for an empty entry or a dns:/// target
// without a host or a port, naming the entry.
absl::StatusOr<std::vector<TargetSpec>> ParseTargets(const std::string& list);

// The addresses HOST:PORT resolves to, as gRPC targets ("ipv4:1.2.3.4:50051",
// "ipv6:[::1]:50051"), deduplicated and sorted. UNAVAILABLE when it does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host,
                                                    const std::string& port);

// Makes every channel of one Client the same way: credentials, arguments, bearer token.
struct ChannelFactory {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments args;
  std::string token;  // "" for none
  bool tls = false;
  bool name_overridden = false;  // args carry a server-name override the user gave
  // `tls_name`: the name the daemon's certificate must carry when the target is an address a
  // dns:/// name resolved to ("" for none).
  std::shared_ptr<grpc::Channel> Make(const std::string& target,
                                      const std::string& tls_name = "") const;
};

// A candidate device for a new session, from RankDevices.
struct PlacementCandidate {
  size_t daemon = 0;  // index into the DaemonStatus list
  int ordinal = 0;
  uint64_t free_memory_bytes = 0;
  uint32_t sessions = 0;
};

// Whether the daemon accepts new sessions (not draining). A daemon from before the load
// fields (no daemon_instance) counts as accepting; its devices then rank as all free.
bool Accepting(const DaemonStatus& daemon);

// The devices of the daemons that answered and accept sessions, best first: most free
// memory (in kPlacementMemoryStepShift steps), then fewest sessions, then daemon order,
// then ordinal.
std::vector<PlacementCandidate> RankDevices(const std::vector<DaemonStatus>& daemons);

// "A: why; B: why" for the daemons that did not answer (or do not accept sessions).
std::string DescribeUnavailable(const std::vector<DaemonStatus>& daemons);

class Daemons {
 public:
  Daemons(std::vector<TargetSpec> specs, ChannelFactory factory);

  // Resolves the dns:/// names and asks every daemon ListDevices at once, each within
  // `timeout`; in list order, a daemon reached again (same daemon_instance) left out.
  std::vector<DaemonStatus> Probe(absl::Duration timeout) const;
  // The channel to `target` (one of Probe's), made once and kept.
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& target) const;

 private:
  struct Address {
    std::string target;
    std::string tls_name;
    absl::Status resolve_error;  // a dns:/// name that did not resolve
  };
  std::vector<Address> Addresses() const;
  std::shared_ptr<grpc::Channel> ChannelLocked(const std::string& target,
                                               const std::string& tls_name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<TargetSpec> specs_;
  const ChannelFactory factory_;
  mutable absl::Mutex mu_;
  mutable std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpurpc::internal

#endif  // GPURPC_CLIENT_CPP_SRC_DAEMONS_H_
