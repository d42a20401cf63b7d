// Who is calling: every call on the main listener is authenticated to a tenant before it
// touches a session, a device or the admin service.
//
//  * Unix socket: the kernel-verified peer uid (SO_PEERCRED, taken when the connection is
//    accepted, see unix_listener.h) is the tenant, named by its user name ("uid-N" when the
//    uid has no name). Tokens are not looked at.
//  * TCP: a client certificate verified against --tls-client-ca names the tenant by its
//    common name (mTLS), and/or an `authorization: Bearer <token>` header matches a line of
//    the --tokens-file. When both are present they must name the same tenant. With
//    --insecure, a TCP call with neither is the tenant "anonymous".
//
// The tokens file holds `tenant:salt_hex:sha256_hex` lines, sha256 over the salt's bytes
// followed by the token's, never the token itself; `#` starts a comment. Tokens are never
// logged. ReloadTokens() (SIGHUP) swaps in a new table atomically, keeping the old one
// when the new file is bad.
//
// Thread safety: all methods are thread-safe.
#ifndef GPURPC_SERVER_FRONTEND_AUTH_H_
#define GPURPC_SERVER_FRONTEND_AUTH_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/server_context.h"
#include "server/options.h"

namespace gpurpc::frontend {

struct Identity {
  std::string tenant;
  std::string method;  // "unix-peer", "token", "mtls" or "insecure"
  std::string peer;    // for logs and the admin API: "unix uid 1000 pid 42", "ipv4:..."
};

// A parsed tokens file.
class TokenTable {
 public:
  // INVALID_ARGUMENT naming the line for a malformed file; NOT_FOUND when unreadable;
  // FAILED_PRECONDITION when others may read or write it.
  static absl::StatusOr<std::shared_ptr<const TokenTable>> Load(const std::string& path);

  // The tenant `token` belongs to, or "" (constant time in the token's content).
  std::string Find(absl::string_view token) const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string tenant;
    std::string salt;    // raw bytes
    std::string digest;  // raw SHA-256(salt || token)
  };
  std::vector<Entry> entries_;
};

// A new random token for `tenant` and its tokens-file line.
struct NewToken {
  std::string token;
  std::string line;
};
NewToken MakeToken(const std::string& tenant);

class Authenticator {
 public:
  explicit Authenticator(const DaemonOptions& options);

  // Loads the tokens file, if any. The daemon does not start when this fails.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Re-reads the tokens file; on error the previous table stays in force.
  absl::Status ReloadTokens() ABSL_LOCKS_EXCLUDED(mu_);

  // Called by the Unix listener for each accepted connection before gRPC sees it.
  void RegisterUnixPeer(int fd, uid_t uid, pid_t pid) ABSL_LOCKS_EXCLUDED(mu_);

  // The caller's identity, or UNAUTHENTICATED saying what is missing or wrong (never
  // quoting a token).
  absl::StatusOr<Identity> Authenticate(const grpc::ServerContextBase& context) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // For TLS listeners: a check gRPC runs on each call's metadata before it reads the
  // request, so that a caller without valid credentials cannot make the daemon buffer a
  // large message first. The handlers still call Authenticate. Must not outlive this.
  std::shared_ptr<grpc::AuthMetadataProcessor> EarlyCheck() const;
  absl::Status EarlyCheckStatus(const grpc::AuthContext* auth,
                                const std::multimap<grpc::string_ref, grpc::string_ref>& metadata)
      const ABSL_LOCKS_EXCLUDED(mu_);

  bool IsAdmin(const std::string& tenant) const ABSL_LOCKS_EXCLUDED(admins_mu_) {
    absl::MutexLock lock(&admins_mu_);
    return admins_.count(tenant) > 0;
  }
  // SIGHUP: the admin tenants from the reloaded configuration, from the next call on.
  void SetAdmins(const std::vector<std::string>& tenants) ABSL_LOCKS_EXCLUDED(admins_mu_) {
    absl::MutexLock lock(&admins_mu_);
    admins_ = std::set<std::string>(tenants.begin(), tenants.end());
  }

 private:
  struct UnixPeer {
    uid_t uid;
    pid_t pid;
    std::string tenant;
  };
  std::string TenantForToken(absl::string_view token) const ABSL_LOCKS_EXCLUDED(mu_);
  // The TCP rules of Authenticate, from the parts of a call.
  absl::StatusOr<Identity> AuthenticateTcp(
      const grpc::AuthContext* auth,
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const
      ABSL_LOCKS_EXCLUDED(mu_);

  const DaemonOptions options_;
  mutable absl::Mutex admins_mu_;
  std::set<std::string> admins_ ABSL_GUARDED_BY(admins_mu_);

  // Guards the token table, the Unix peers, the user-name cache and the token cache.
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> tokens_ ABSL_GUARDED_BY(mu_);
  // By fd. gRPC 1.51 keeps a connection's fd open while any call on it is being served
  // (checked by an attacker's review: a call outliving its client kept the fd until it
  // ended), so the fd of a call names its connection. Newer gRPC releases close the fd when
  // the connection drops; building against one needs another way to tie calls to peers.
  std::unordered_map<int, UnixPeer> unix_peers_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uid_t, std::string> user_names_ ABSL_GUARDED_BY(mu_);
  // Verified tokens by their SHA-256, so that a call costs one hash, not one per entry.
  mutable std::unordered_map<std::string, std::string> token_cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_AUTH_H_
