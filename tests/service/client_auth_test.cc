// Authentication and tenancy through the C++ client, against real daemons on the fake
// backend, one per configuration (started on first use, shared by the suite):
//   default: gpurpcd with its default socket (XDG_RUNTIME_DIR = a test directory);
//   token:   TCP with a tokens file (alice, bob; alice is an admin), plain text;
//   tls:     TCP with TLS and the same tokens;
//   mtls:    TCP with TLS and client certificates (the certificate's CN is the tenant).
// Tokens come from `gpurpcd --new-token`; certificates are made with the openssl command
// (the TLS tests skip when it is missing).
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::MakeToken;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::gpurpc::testing::TestToken;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Sets (or, with nullptr, unsets) an environment variable until the end of the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ScopedEnv(const char* name, const std::string& value) : ScopedEnv(name, value.c_str()) {}
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

constexpr const char* kClientEnv[] = {
    "GPURPC_ADDRESS", "GPURPC_TOKEN",    "GPURPC_TOKEN_FILE", "GPURPC_TLS",
    "GPURPC_TLS_CA",  "GPURPC_TLS_CERT", "GPURPC_TLS_KEY",    "GPURPC_TLS_SERVER_NAME"};

std::string UserName() {
  const passwd* pw = getpwuid(getuid());
  return pw == nullptr ? std::to_string(getuid()) : pw->pw_name;
}

// Runs a shell command; its stdout, or an error with the exit status.
absl::StatusOr<std::string> RunCommand(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("popen failed: ", command));
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::InternalError(absl::StrCat("`", command, "` failed (", status, "): ", out));
  }
  return out;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

constexpr char kOpensslConfig[] = R"([req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
)";

// A CA, a server certificate for localhost/127.0.0.1, client certificates CN=alice and
// CN=bob, and a CN=alice certificate from an untrusted CA, as dir/NAME.pem and dir/NAME.key.
absl::Status MakeCertificates(const std::string& dir) {
  WriteFile(dir + "/openssl.cnf", kOpensslConfig);
  const std::string cd = absl::StrCat("cd '", dir, "' && ");
  auto key = [&](const std::string& name) {
    return RunCommand(
               absl::StrCat(cd, "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 ",
                            "-out ", name, ".key 2>&1"))
        .status();
  };
  auto ca = [&](const std::string& name, const std::string& cn) {
    if (absl::Status s = key(name); !s.ok()) return s;
    return RunCommand(absl::StrCat(cd, "openssl req -x509 -new -key ", name, ".key -subj '/CN=", cn,
                                   "' -days 2 -config openssl.cnf -extensions ca -out ", name,
                                   ".pem 2>&1"))
        .status();
  };
  auto leaf = [&](const std::string& name, const std::string& cn, const std::string& issuer,
                  const std::string& kind, int serial) {
    if (absl::Status s = key(name); !s.ok()) return s;
    if (absl::Status s =
            RunCommand(absl::StrCat(cd, "openssl req -new -key ", name, ".key -subj '/CN=", cn,
                                    "' -config openssl.cnf -out ", name, ".csr 2>&1"))
                .status();
        !s.ok()) {
      return s;
    }
    return RunCommand(absl::StrCat(cd, "openssl x509 -req -in ", name, ".csr -CA ", issuer,
                                   ".pem -CAkey ", issuer, ".key -set_serial ", serial,
                                   " -days 2 -extfile openssl.cnf -extensions ", kind, " -out ",
                                   name, ".pem 2>&1"))
        .status();
  };
  for (absl::Status s :
       {ca("ca", "gpurpc test CA"), ca("rogue-ca", "gpurpc untrusted CA"),
        leaf("server", "localhost", "ca", "server", 2), leaf("alice", "alice", "ca", "client", 3),
        leaf("bob", "bob", "ca", "client", 4), leaf("rogue", "alice", "rogue-ca", "client", 5)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

struct Suite {
  std::string dir;
  std::map<std::string, std::string> tokens;  // tenant -> token
  std::string tokens_file;
  absl::Status tokens_status = absl::UnknownError("not made");
  bool have_openssl = false;
  absl::Status certs_status = absl::UnknownError("not made");
  std::map<std::string, absl::StatusOr<std::unique_ptr<TestDaemon>>> daemons;
};

Suite* suite = nullptr;

class ClientAuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    suite = new Suite();
    char tmpl[] = "/tmp/gpurpc-auth-test-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return;
    suite->dir = tmpl;
    // Tokens from the daemon itself: line 1 the token, line 2 its tokens-file line.
    std::string lines = "# test tokens\n";
    suite->tokens_status = absl::OkStatus();
    for (const char* tenant : {"alice", "bob"}) {
      absl::StatusOr<TestToken> token = MakeToken(tenant);
      if (!token.ok()) {
        suite->tokens_status = token.status();
        break;
      }
      suite->tokens[tenant] = token->token;
      absl::StrAppend(&lines, token->line, "\n");
    }
    suite->tokens_file = suite->dir + "/tokens";
    WriteFile(suite->tokens_file, lines);
    chmod(suite->tokens_file.c_str(), 0600);
    suite->have_openssl = std::system("openssl version >/dev/null 2>&1") == 0;
    if (suite->have_openssl) suite->certs_status = MakeCertificates(suite->dir);
  }

  static void TearDownTestSuite() {
    if (suite == nullptr) return;
    suite->daemons.clear();
    if (!suite->dir.empty()) {
      if (std::system(absl::StrCat("rm -rf '", suite->dir, "'").c_str()) != 0) {
        // A leftover temporary directory is harmless.
      }
    }
    delete suite;
    suite = nullptr;
  }

  void SetUp() override {
    ASSERT_FALSE(suite->dir.empty()) << "mkdtemp failed";
    for (const char* name : kClientEnv) env_.push_back(std::make_unique<ScopedEnv>(name, nullptr));
  }

  static std::string Cert(const std::string& name) { return suite->dir + "/" + name; }
  static const std::string& Token(const std::string& tenant) { return suite->tokens[tenant]; }

  // The daemon of one configuration, started on first use.
  TestDaemon* Daemon(const std::string& config) {
    auto it = suite->daemons.find(config);
    if (it == suite->daemons.end()) {
      TestDaemon::Options options;
      options.idle_timeout = "10s";
      if (config == "default") {
        options.default_unix_socket = true;
      } else {
        options.listen_tcp = true;
      }
      if (config == "token") {
        options.extra_flags = {"--tokens-file=" + suite->tokens_file, "--admin-tenants=alice"};
      } else if (config == "tls") {
        options.extra_flags = {"--tokens-file=" + suite->tokens_file,
                               "--tls-cert=" + Cert("server.pem"),
                               "--tls-key=" + Cert("server.key")};
      } else if (config == "mtls") {
        options.extra_flags = {"--tls-cert=" + Cert("server.pem"),
                               "--tls-key=" + Cert("server.key"),
                               "--tls-client-ca=" + Cert("ca.pem")};
      }
      it = suite->daemons.emplace(config, TestDaemon::Start(options)).first;
    }
    EXPECT_THAT(it->second, IsOk()) << "the " << config << " daemon did not start";
    return it->second.ok() ? it->second->get() : nullptr;
  }

  // Tokens are needed: they come from gpurpcd --new-token.
  bool NeedTokens() {
    EXPECT_THAT(suite->tokens_status, IsOk()) << "gpurpcd --new-token";
    return suite->tokens_status.ok();
  }
  bool NeedCerts() {
    EXPECT_THAT(suite->certs_status, IsOk()) << "making test certificates";
    return suite->certs_status.ok();
  }

  // Options with nothing from the environment and a short timeout.
  static ConnectOptions Options(const std::string& address) {
    ConnectOptions options;
    options.address = address;
    options.use_environment = false;
    options.timeout = absl::Seconds(5);
    return options;
  }

  static std::string Localhost(const TestDaemon& daemon) {
    return absl::StrReplaceAll(daemon.tcp_address(), {{"127.0.0.1", "localhost"}});
  }

 private:
  std::vector<std::unique_ptr<ScopedEnv>> env_;
};

#define SKIP_WITHOUT_OPENSSL()                                  \
  do {                                                          \
    if (!suite->have_openssl)                                   \
      GTEST_SKIP() << "needs the openssl command to make test " \
                      "certificates";                           \
  } while (0)

grpc::Status RawKeepAlive(const Client& client, uint64_t session_id, std::string* message) {
  auto stub = v1::SessionService::NewStub(client.channel());
  grpc::ClientContext context;
  context.AddMetadata(kSessionMetadataKey, std::to_string(session_id));
  v1::KeepAliveResponse response;
  grpc::Status status = stub->KeepAlive(&context, v1::KeepAliveRequest(), &response);
  if (message != nullptr) *message = status.error_message();
  return status;
}

// ------------------------------------------------------------------------ addresses

TEST_F(ClientAuthTest, DefaultSocketPathsFollowTheDaemon) {
  ScopedEnv xdg("XDG_RUNTIME_DIR", "/run/user/4242");
  EXPECT_THAT(
      DefaultSocketPaths(),
      ::testing::ElementsAre("/run/user/4242/gpurpc/gpurpcd.sock", "/run/gpurpc/gpurpcd.sock",
                             absl::StrCat("/tmp/gpurpc-", getuid(), "/gpurpcd.sock")));
  EXPECT_THAT(ResolveAddress("/some/where.sock"),
              ::gpurpc::testing::IsOkAndHolds(std::string("unix:/some/where.sock")));
  ScopedEnv address("GPURPC_ADDRESS", "gpubox:7000");
  EXPECT_THAT(ResolveAddress(), ::gpurpc::testing::IsOkAndHolds(std::string("gpubox:7000")));
  EXPECT_THAT(ResolveAddress("other:1"), ::gpurpc::testing::IsOkAndHolds(std::string("other:1")));
}

TEST_F(ClientAuthTest, NoAddressAndNoSocketNamesEveryPlace) {
  ScopedEnv xdg("XDG_RUNTIME_DIR", suite->dir + "/nothing-here");
  const std::vector<std::string> paths = DefaultSocketPaths();
  for (size_t i = 1; i < paths.size(); ++i) {
    if (access(paths[i].c_str(), F_OK) == 0) {
      GTEST_SKIP() << paths[i] << " exists here: cannot test its absence";
    }
  }
  absl::StatusOr<Client> client = Client::Connect(ConnectOptions());
  ASSERT_THAT(client, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("GPURPC_ADDRESS")));
  for (const std::string& path : paths) {
    EXPECT_THAT(client.status().message(), HasSubstr(path));
  }
}

TEST_F(ClientAuthTest, DefaultSocketWithNothingSetAndTenantIsTheUser) {
  TestDaemon* daemon = Daemon("default");
  ASSERT_NE(daemon, nullptr);
  ScopedEnv xdg("XDG_RUNTIME_DIR", daemon->runtime_dir());
  EXPECT_THAT(ResolveAddress(), ::gpurpc::testing::IsOkAndHolds(daemon->address()));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(ConnectOptions()));
  EXPECT_EQ(client.target(), daemon->address());
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
  EXPECT_EQ(info.tenant(), UserName());
  EXPECT_EQ(info.auth_method(), "unix-peer");
  EXPECT_FALSE(info.version().empty());
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession(0, "default socket"));
  EXPECT_OK(session.Synchronize());
}

// ------------------------------------------------------------------------ tokens

TEST_F(ClientAuthTest, UnixSocketNeedsNoToken) {
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(Options(daemon->address())));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
  EXPECT_EQ(info.tenant(), UserName());
  EXPECT_EQ(info.auth_method(), "unix-peer");
}

TEST_F(ClientAuthTest, TokenGivesItsTenant) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  for (const std::string tenant : {"alice", "bob"}) {
    ConnectOptions options = Options(daemon->tcp_address());
    options.token = Token(tenant);
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
    EXPECT_EQ(info.tenant(), tenant);
    EXPECT_EQ(info.auth_method(), "token");
    EXPECT_EQ(info.admin(), tenant == "alice");
  }
}

TEST_F(ClientAuthTest, NoTokenIsUnauthenticated) {
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  EXPECT_THAT(Client::Connect(Options(daemon->tcp_address())),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("GPURPC_TOKEN")));
  // The old entry point, credentials from the (empty) environment.
  EXPECT_THAT(Client::Connect(daemon->tcp_address(), absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST_F(ClientAuthTest, WrongTokenIsUnauthenticatedAndNeverShown) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = "not-" + Token("alice");
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       AllOf(Not(HasSubstr(options.token)), Not(HasSubstr(Token("alice"))))));
}

TEST_F(ClientAuthTest, TokenFromFileAndEnvironment) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  const std::string file = suite->dir + "/bob.token";
  WriteFile(file, "  " + Token("bob") + "\n\n");
  auto tenant_of = [](const ConnectOptions& options) -> std::string {
    absl::StatusOr<Client> client = Client::Connect(options);
    if (!client.ok()) return client.status().ToString();
    absl::StatusOr<v1::GetServerInfoResponse> info = client->GetServerInfo();
    return info.ok() ? info->tenant() : info.status().ToString();
  };
  ConnectOptions options = Options(daemon->tcp_address());
  options.token_file = file;
  EXPECT_EQ(tenant_of(options), "bob");

  ConnectOptions from_env = Options(daemon->tcp_address());
  from_env.use_environment = true;
  {
    ScopedEnv token("GPURPC_TOKEN", Token("alice"));
    EXPECT_EQ(tenant_of(from_env), "alice");
    ConnectOptions explicit_token = from_env;
    explicit_token.token = Token("bob");  // wins over the environment
    EXPECT_EQ(tenant_of(explicit_token), "bob");
  }
  {
    ScopedEnv token_file("GPURPC_TOKEN_FILE", file);
    EXPECT_EQ(tenant_of(from_env), "bob");
    ScopedEnv address("GPURPC_ADDRESS", daemon->tcp_address());
    ConnectOptions all_from_env;
    all_from_env.timeout = absl::Seconds(5);
    EXPECT_EQ(tenant_of(all_from_env), "bob");
  }
}

TEST_F(ClientAuthTest, UnusableTokenIsAClearError) {
  const std::string missing = suite->dir + "/no-such-token";
  ConnectOptions options = Options("127.0.0.1:1");
  options.token_file = missing;
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(missing)));
  {
    ScopedEnv token_file("GPURPC_TOKEN_FILE", missing);
    ConnectOptions from_env = Options("127.0.0.1:1");
    from_env.use_environment = true;
    EXPECT_THAT(Client::Connect(from_env),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(missing), HasSubstr("GPURPC_TOKEN_FILE"))));
  }
  const std::string empty = suite->dir + "/empty-token";
  WriteFile(empty, "\n");
  options.token_file = empty;
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  options.token_file.clear();
  options.token = "secret part\nother";
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kInvalidArgument, Not(HasSubstr("secret"))));
}

TEST_F(ClientAuthTest, TokenReachesEveryCall) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession(0, "token test"));
  const uint64_t size = 3 * kTransferChunkBytes + 5;  // streamed both ways
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(size));
  std::vector<uint8_t> data(size);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  ASSERT_OK(buffer.Upload(data));
  // Through the command stream.
  ASSERT_OK(session.MemsetAsync(buffer.at(0), 0xAB, 1, 16));
  ASSERT_OK(session.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> back, buffer.Download());
  for (size_t i = 0; i < 16; ++i) data[i] = 0xAB;
  EXPECT_TRUE(back == data);
  EXPECT_OK(session.KeepAlive().status());
  // Calls made directly on the channel carry the token too.
  auto stub = v1::DeviceService::NewStub(client.channel());
  grpc::ClientContext context;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.tenant(), "alice");
  EXPECT_OK(session.Close());
}

TEST_F(ClientAuthTest, TenantsCannotUseEachOthersSessions) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  ASSERT_OK_AND_ASSIGN(Client alice, Client::Connect(options));
  options.token = Token("bob");
  ASSERT_OK_AND_ASSIGN(Client bob, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Session session, alice.OpenSession(0, "alice's session"));
  const uint64_t unknown = session.id() + 1000003;

  std::string theirs, nobodys;
  EXPECT_EQ(RawKeepAlive(bob, session.id(), &theirs).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(RawKeepAlive(bob, unknown, &nobodys).error_code(), grpc::StatusCode::NOT_FOUND);
  // No oracle: someone else's session reads exactly like one that does not exist.
  EXPECT_EQ(absl::StrReplaceAll(theirs, {{std::to_string(session.id()), "ID"}}),
            absl::StrReplaceAll(nobodys, {{std::to_string(unknown), "ID"}}));
  EXPECT_THAT(theirs, Not(HasSubstr(Token("bob"))));

  auto memory = v1::MemoryService::NewStub(bob.channel());
  grpc::ClientContext context;
  context.AddMetadata(kSessionMetadataKey, std::to_string(session.id()));
  v1::AllocateRequest request;
  request.set_size_bytes(64);
  v1::AllocateResponse response;
  EXPECT_EQ(memory->Allocate(&context, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(RawKeepAlive(alice, session.id(), nullptr).ok());
}

TEST_F(ClientAuthTest, AdminListsAndClosesSessions) {
  if (!NeedTokens()) return;
  TestDaemon* daemon = Daemon("token");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  ASSERT_OK_AND_ASSIGN(Client alice, Client::Connect(options));
  options.token = Token("bob");
  ASSERT_OK_AND_ASSIGN(Client bob, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(Session session, bob.OpenSession(0, "bob's session"));

  ASSERT_OK_AND_ASSIGN(v1::ListSessionsResponse all, alice.AdminListSessions());
  int found = 0;
  for (const v1::SessionSummary& s : all.sessions()) {
    if (s.session_id() != session.id()) continue;
    ++found;
    EXPECT_EQ(s.tenant(), "bob");
    EXPECT_EQ(s.client_label(), "bob's session");
  }
  EXPECT_EQ(found, 1);
  ASSERT_OK_AND_ASSIGN(v1::ListSessionsResponse bobs, alice.AdminListSessions("bob"));
  for (const v1::SessionSummary& s : bobs.sessions()) EXPECT_EQ(s.tenant(), "bob");
  ASSERT_OK_AND_ASSIGN(v1::ListSessionsResponse alices, alice.AdminListSessions("alice"));
  for (const v1::SessionSummary& s : alices.sessions()) EXPECT_NE(s.session_id(), session.id());

  EXPECT_THAT(bob.AdminListSessions(), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(bob.AdminCloseSession(session.id()), StatusIs(absl::StatusCode::kPermissionDenied));

  ASSERT_OK_AND_ASSIGN(v1::AdminCloseSessionResponse closed, alice.AdminCloseSession(session.id()));
  EXPECT_EQ(closed.tenant(), "bob");
  EXPECT_THAT(session.KeepAlive(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(alice.AdminCloseSession(session.id()), StatusIs(absl::StatusCode::kNotFound));
}

// ------------------------------------------------------------------------ TLS

TEST_F(ClientAuthTest, TlsWithToken) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedTokens() || !NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  for (const std::string& address : {Localhost(*daemon), daemon->tcp_address()}) {
    ConnectOptions options = Options(address);
    options.token = Token("alice");
    options.root_certs_file = Cert("ca.pem");
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
    EXPECT_EQ(info.tenant(), "alice");
    EXPECT_EQ(info.auth_method(), "token");
    ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession(0, "tls"));
    ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(64));
    EXPECT_OK(session.MemsetAsync(buffer.at(0), 1, 4, 16));
    EXPECT_OK(session.Synchronize());
  }
  // Roots given as PEM text.
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("bob");
  options.root_certs_pem = ReadFile(Cert("ca.pem"));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
  EXPECT_THAT(client.GetServerInfo(), IsOk());
}

TEST_F(ClientAuthTest, TlsFromEnvironment) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedTokens() || !NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ScopedEnv address("GPURPC_ADDRESS", daemon->tcp_address());
  ScopedEnv ca("GPURPC_TLS_CA", Cert("ca.pem"));
  ScopedEnv token("GPURPC_TOKEN", Token("bob"));
  ScopedEnv name("GPURPC_TLS_SERVER_NAME", "localhost");
  ConnectOptions options;
  options.timeout = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
  EXPECT_EQ(info.tenant(), "bob");
}

TEST_F(ClientAuthTest, TlsNeedsTheTokenToo) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.root_certs_file = Cert("ca.pem");
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST_F(ClientAuthTest, TlsWithTheWrongCaFailsClearly) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedTokens() || !NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  options.root_certs_file = Cert("rogue-ca.pem");
  options.timeout = absl::Seconds(2);
  absl::StatusOr<Client> client = Client::Connect(options);
  EXPECT_THAT(client, StatusIs(absl::StatusCode::kUnavailable,
                               AllOf(HasSubstr(daemon->tcp_address()), HasSubstr("TLS"),
                                     Not(HasSubstr(Token("alice"))))));
  std::cout << "wrong CA: " << client.status() << "\n";
}

TEST_F(ClientAuthTest, TlsServerNameOverrideIsApplied) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedTokens() || !NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  options.root_certs_file = Cert("ca.pem");
  options.server_name_override = "localhost";
  EXPECT_THAT(Client::Connect(options), IsOk());
  options.server_name_override = "not-this.example";
  options.timeout = absl::Seconds(2);
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(ClientAuthTest, PlainTextClientAgainstTlsDaemonFails) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedTokens() || !NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.token = Token("alice");
  options.timeout = absl::Seconds(2);
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kUnavailable, Not(HasSubstr(Token("alice")))));
}

TEST_F(ClientAuthTest, EnvironmentTlsIsNotAppliedToUnixSockets) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedCerts()) return;
  TestDaemon* daemon = Daemon("tls");
  ASSERT_NE(daemon, nullptr);
  ScopedEnv tls("GPURPC_TLS", "1");
  ScopedEnv ca("GPURPC_TLS_CA", Cert("ca.pem"));
  ConnectOptions options;
  options.address = daemon->address();
  options.timeout = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
  EXPECT_EQ(info.tenant(), UserName());
}

// ------------------------------------------------------------------------ mutual TLS

TEST_F(ClientAuthTest, MtlsCertificateNamesTheTenant) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedCerts()) return;
  TestDaemon* daemon = Daemon("mtls");
  ASSERT_NE(daemon, nullptr);
  for (const std::string tenant : {"alice", "bob"}) {
    ConnectOptions options = Options(daemon->tcp_address());
    options.root_certs_file = Cert("ca.pem");
    options.client_cert_file = Cert(tenant + ".pem");
    options.client_key_pem = ReadFile(Cert(tenant + ".key"));
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(options));
    ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
    EXPECT_EQ(info.tenant(), tenant);
    EXPECT_EQ(info.auth_method(), "mtls");
  }
  // From the environment, with a session.
  ScopedEnv address("GPURPC_ADDRESS", daemon->tcp_address());
  ScopedEnv ca("GPURPC_TLS_CA", Cert("ca.pem"));
  ScopedEnv cert("GPURPC_TLS_CERT", Cert("bob.pem"));
  ScopedEnv key("GPURPC_TLS_KEY", Cert("bob.key"));
  ASSERT_OK_AND_ASSIGN(Client client, Client::Connect("", absl::Seconds(5)));
  ASSERT_OK_AND_ASSIGN(v1::GetServerInfoResponse info, client.GetServerInfo());
  EXPECT_EQ(info.tenant(), "bob");
  ASSERT_OK_AND_ASSIGN(Session session, client.OpenSession(0, "mtls"));
  EXPECT_OK(session.Synchronize());
}

TEST_F(ClientAuthTest, MtlsUntrustedOrMissingClientCertificateIsRefused) {
  SKIP_WITHOUT_OPENSSL();
  if (!NeedCerts()) return;
  TestDaemon* daemon = Daemon("mtls");
  ASSERT_NE(daemon, nullptr);
  ConnectOptions options = Options(daemon->tcp_address());
  options.root_certs_file = Cert("ca.pem");
  options.timeout = absl::Seconds(2);
  // Refused at the handshake (UNAVAILABLE) or at the call (UNAUTHENTICATED); never alice.
  EXPECT_THAT(Client::Connect(options), AnyOf(StatusIs(absl::StatusCode::kUnavailable),
                                              StatusIs(absl::StatusCode::kUnauthenticated)));
  options.client_cert_file = Cert("rogue.pem");
  options.client_key_file = Cert("rogue.key");
  EXPECT_THAT(Client::Connect(options), AnyOf(StatusIs(absl::StatusCode::kUnavailable),
                                              StatusIs(absl::StatusCode::kUnauthenticated)));
}

TEST_F(ClientAuthTest, ClientCertificateNeedsItsKey) {
  ConnectOptions options = Options("127.0.0.1:1");
  options.client_cert_pem = "-----BEGIN CERTIFICATE-----\n";
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("private key")));
  options.client_cert_pem.clear();
  options.root_certs_file = suite->dir + "/no-such-ca.pem";
  EXPECT_THAT(Client::Connect(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no-such-ca.pem")));
}

}  // namespace
}  // namespace gpurpc
