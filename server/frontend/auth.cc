#include "server/frontend/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <pwd.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "spdlog/spdlog.h"

namespace gpurpc::frontend {
namespace {

constexpr char kBearerPrefix[] = "Bearer ";
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kSaltBytes = 16;
constexpr char kUnixPeerPrefix[] = "fd:";

std::string Sha256(absl::string_view a, absl::string_view b = {}) {
  const std::string input = absl::StrCat(a, b);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(input.data()), input.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      std::abort();  // no kernel randomness: never make a guessable token
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

bool IsHex(absl::string_view text) {
  return !text.empty() && text.size() % 2 == 0 &&
         text.find_first_not_of("0123456789abcdefABCDEF") == absl::string_view::npos;
}

std::string UserName(uid_t uid) {
  std::vector<char> buffer(16384);
  struct passwd pwd;
  struct passwd* result = nullptr;
  if (getpwuid_r(uid, &pwd, buffer.data(), buffer.size(), &result) == 0 && result != nullptr &&
      result->pw_name != nullptr && IsTenantName(result->pw_name)) {
    return result->pw_name;
  }
  // No name, or one a tenant may not have (a directory's name with quotes, newlines or
  // bytes that are not UTF-8 would break logs and metrics labels): the uid stands for it.
  return absl::StrCat("uid-", uid);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TokenTable>> TokenTable::Load(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrFormat("--tokens-file %s: %s", path, std::strerror(errno)));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH | S_IROTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--tokens-file %s: others may read or write it (mode %04o); chmod o-rw,g-w it", path,
        st.st_mode & 07777));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrFormat("--tokens-file %s: cannot read", path));
  auto table = std::make_shared<TokenTable>();
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text.front() == '#') continue;
    std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--tokens-file %s line %d: %s (expected tenant:salt_hex:sha256_hex, as "
                          "gpurpcd --new-token=TENANT prints)",
                          path, number, why));
    };
    if (parts.size() != 3) return bad("not three ':'-separated fields");
    Entry entry;
    entry.tenant = std::string(parts[0]);
    if (!IsTenantName(entry.tenant)) {
      return bad(
          "the tenant name is empty, too long or has characters other than "
          "A-Z a-z 0-9 . _ @ + - = ,");
    }
    if (!IsHex(parts[1])) return bad("the salt is not hex");
    if (!IsHex(parts[2]) || parts[2].size() != 2 * SHA256_DIGEST_LENGTH) {
      return bad("the hash is not 64 hex digits");
    }
    entry.salt = absl::HexStringToBytes(absl::AsciiStrToLower(parts[1]));
    entry.digest = absl::HexStringToBytes(absl::AsciiStrToLower(parts[2]));
    table->entries_.push_back(std::move(entry));
  }
  return std::shared_ptr<const TokenTable>(std::move(table));
}

std::string TokenTable::Find(absl::string_view token) const {
  // Every entry is checked, so the time does not tell which one matched.
  std::string found;
  for (const Entry& entry : entries_) {
    const std::string digest = Sha256(entry.salt, token);
    if (CRYPTO_memcmp(digest.data(), entry.digest.data(), digest.size()) == 0) {
      found = entry.tenant;
    }
  }
  return found;
}

NewToken MakeToken(const std::string& tenant) {
  NewToken out;
  out.token = absl::StrCat("gpurpc_", absl::BytesToHexString(RandomBytes(32)));
  const std::string salt = RandomBytes(kSaltBytes);
  out.line = absl::StrCat(tenant, ":", absl::BytesToHexString(salt), ":",
                          absl::BytesToHexString(Sha256(salt, out.token)));
  return out;
}

Authenticator::Authenticator(const DaemonOptions& options)
    : options_(options), admins_(options.admin_tenants.begin(), options.admin_tenants.end()) {}

absl::Status Authenticator::Start() {
  if (options_.tokens_file.empty()) return absl::OkStatus();
  auto table = TokenTable::Load(options_.tokens_file);
  if (!table.ok()) return table.status();
  spdlog::info("{} bearer token(s) from {}", (*table)->size(), options_.tokens_file);
  absl::MutexLock lock(&mu_);
  tokens_ = *std::move(table);
  return absl::OkStatus();
}

absl::Status Authenticator::ReloadTokens() {
  if (options_.tokens_file.empty()) return absl::OkStatus();
  auto table = TokenTable::Load(options_.tokens_file);
  if (!table.ok()) return table.status();
  spdlog::info("reloaded {} bearer token(s) from {}", (*table)->size(), options_.tokens_file);
  absl::MutexLock lock(&mu_);
  tokens_ = *std::move(table);
  token_cache_.clear();
  return absl::OkStatus();
}

void Authenticator::RegisterUnixPeer(int fd, uid_t uid, pid_t pid) {
  std::string name;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = user_names_.find(uid); it != user_names_.end()) name = it->second;
  }
  if (name.empty()) {
    // Asked once per uid: the name service may be slow, and this runs on the accept thread.
    name = UserName(uid);
    absl::MutexLock lock(&mu_);
    user_names_[uid] = name;
  }
  UnixPeer peer{uid, pid, std::move(name)};
  absl::MutexLock lock(&mu_);
  // A reused fd number replaces the entry of a connection gRPC has already closed: a call
  // keeps its connection (and so its fd) open while it is being served.
  unix_peers_[fd] = std::move(peer);
}

std::string Authenticator::TenantForToken(absl::string_view token) const {
  const std::string key = Sha256(token);
  std::shared_ptr<const TokenTable> table;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = token_cache_.find(key); it != token_cache_.end()) return it->second;
    table = tokens_;
  }
  if (table == nullptr) return "";
  std::string tenant = table->Find(token);
  if (!tenant.empty()) {
    absl::MutexLock lock(&mu_);
    if (tokens_ == table) token_cache_[key] = tenant;  // not across a reload
  }
  return tenant;
}

absl::StatusOr<Identity> Authenticator::Authenticate(const grpc::ServerContextBase& context) const {
  Identity identity;
  identity.peer = context.peer();
  // Connections accepted by our Unix listener are handed to gRPC as "fd:N".
  if (absl::StartsWith(identity.peer, kUnixPeerPrefix)) {
    int fd = -1;
    if (absl::SimpleAtoi(absl::string_view(identity.peer).substr(strlen(kUnixPeerPrefix)), &fd)) {
      absl::MutexLock lock(&mu_);
      if (auto it = unix_peers_.find(fd); it != unix_peers_.end()) {
        identity.tenant = it->second.tenant;
        identity.method = "unix-peer";
        identity.peer = absl::StrFormat("unix uid %d pid %d", it->second.uid, it->second.pid);
        return identity;
      }
    }
    return absl::UnauthenticatedError("unknown local connection");
  }

  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  auto tcp = AuthenticateTcp(auth.get(), context.client_metadata());
  if (!tcp.ok()) return tcp.status();
  tcp->peer = identity.peer;
  return tcp;
}

absl::StatusOr<Identity> Authenticator::AuthenticateTcp(
    const grpc::AuthContext* auth,
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  Identity identity;
  std::string cert_tenant;
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& cn : auth->FindPropertyValues("x509_common_name")) {
      cert_tenant.assign(cn.data(), cn.size());
    }
    if (!cert_tenant.empty() && !IsTenantName(cert_tenant)) {
      return absl::UnauthenticatedError(
          "the client certificate's common name is not a tenant name (1 to 128 of A-Z a-z "
          "0-9 . _ @ + - = ,)");
    }
  }
  std::string token_tenant;
  if (metadata.count("authorization") > 1) {
    return absl::UnauthenticatedError(
        "the call carries more than one authorization header; send exactly one");
  }
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    const absl::string_view value(it->second.data(), it->second.size());
    if (!absl::StartsWith(value, kBearerPrefix)) {
      return absl::UnauthenticatedError("the authorization header is not 'Bearer <token>'");
    }
    const absl::string_view token = value.substr(strlen(kBearerPrefix));
    if (token.empty() || token.size() > kMaxTokenBytes) {
      return absl::UnauthenticatedError("the bearer token is empty or too long");
    }
    token_tenant = TenantForToken(token);
    if (token_tenant.empty()) {
      return absl::UnauthenticatedError("the bearer token is not valid on this daemon");
    }
  }
  if (!cert_tenant.empty() && !token_tenant.empty() && cert_tenant != token_tenant) {
    return absl::UnauthenticatedError(
        "the client certificate and the bearer token name different tenants");
  }
  if (!cert_tenant.empty()) {
    identity.tenant = cert_tenant;
    identity.method = "mtls";
  } else if (!token_tenant.empty()) {
    identity.tenant = token_tenant;
    identity.method = "token";
  } else if (options_.insecure) {
    identity.tenant = "anonymous";
    identity.method = "insecure";
  } else {
    return absl::UnauthenticatedError(
        "no credentials: send 'authorization: Bearer <token>' metadata (GPURPC_TOKEN) or "
        "connect with a client certificate, or use the daemon's Unix socket");
  }
  return identity;
}

namespace {

class EarlyCheckProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit EarlyCheckProcessor(const Authenticator* auth) : auth_(auth) {}
  bool IsBlocking() const override { return false; }  // a table lookup, no I/O
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context, OutputMetadata*,
                       OutputMetadata*) override {
    return ToGrpcStatus(auth_->EarlyCheckStatus(context, metadata));
  }

 private:
  const Authenticator* auth_;
};

}  // namespace

absl::Status Authenticator::EarlyCheckStatus(
    const grpc::AuthContext* auth,
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  return AuthenticateTcp(auth, metadata).status();
}

std::shared_ptr<grpc::AuthMetadataProcessor> Authenticator::EarlyCheck() const {
  return std::make_shared<EarlyCheckProcessor>(this);
}

}  // namespace gpurpc::frontend
