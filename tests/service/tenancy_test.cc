// Tenancy and quotas, the way a tenant of a shared daemon meets them: through the C++
// client against a real gpurpcd with real worker processes on the fake backend. Two
// tenants reach the daemon: the test's own user over the Unix socket (the kernel says who
// it is) and bearer-token tenants ("alice", "bob") over loopback TCP. Every claim of
// isolation here is an attempt to break it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::RawCall;
using ::gpurpc::testing::RawCallResult;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMiB = 1ull << 20;

int FreePort() {
  absl::StatusOr<int> port = ::gpurpc::testing::FreeLoopbackPort();
  EXPECT_TRUE(port.ok()) << port.status();
  return port.value_or(0);
}

std::string CurrentUser() {
  struct passwd* pw = getpwuid(geteuid());
  return pw != nullptr ? pw->pw_name : absl::StrCat("uid-", geteuid());
}

// `gpurpcd --new-token=TENANT`: {token, tokens-file line}.
std::pair<std::string, std::string> NewToken(const std::string& tenant) {
  absl::StatusOr<::gpurpc::testing::TestToken> token = ::gpurpc::testing::MakeToken(tenant);
  EXPECT_TRUE(token.ok()) << token.status();
  if (!token.ok()) return {};
  return {token->token, token->line};
}

// A scratch folder for tokens and config files.
class Scratch {
 public:
  Scratch() {
    char dir[] = "/tmp/gpurpc-tenancy-XXXXXX";
    path_ = mkdtemp(dir);
  }
  ~Scratch() { std::system(absl::StrCat("rm -rf '", path_, "'").c_str()); }
  std::string Write(const std::string& name, const std::string& text, mode_t mode = 0600) {
    const std::string file = absl::StrCat(path_, "/", name);
    std::ofstream(file) << text;
    chmod(file.c_str(), mode);
    return file;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One daemon with a Unix socket and a token-authenticated loopback TCP listener.
class TenancyTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags, const std::string& config = "") {
    auto [alice_token, alice_line] = NewToken("alice");
    auto [bob_token, bob_line] = NewToken("bob");
    alice_token_ = alice_token;
    bob_token_ = bob_token;
    tokens_file_ = scratch_.Write(
        "tokens", absl::StrCat("# test tenants\n", alice_line, "\n", bob_line, "\n"));
    port_ = FreePort();
    TestDaemon::Options options;
    options.extra_flags = {absl::StrCat("--listen=127.0.0.1:", port_),
                           absl::StrCat("--tokens-file=", tokens_file_)};
    if (!config.empty()) {
      options.extra_flags.push_back(
          absl::StrCat("--config=", scratch_.Write("gpurpcd.conf", config)));
    }
    options.extra_flags.insert(options.extra_flags.end(), flags.begin(), flags.end());
    auto daemon = TestDaemon::Start(options);
    ASSERT_THAT(daemon.status(), IsOk());
    daemon_ = *std::move(daemon);
  }

  std::string tcp() const { return absl::StrCat("127.0.0.1:", port_); }

  absl::StatusOr<Client> ConnectTcp(const std::string& token) const {
    ConnectOptions options;
    options.address = tcp();
    options.token = token;
    options.use_environment = false;
    return Client::Connect(options);
  }
  absl::StatusOr<Client> ConnectUnix() const {
    ConnectOptions options;
    options.address = daemon_->address();
    options.use_environment = false;
    return Client::Connect(options);
  }

  // A raw channel over TCP with no credentials of its own, for calls a client library
  // would never make.
  std::shared_ptr<grpc::Channel> RawTcpChannel() const {
    return grpc::CreateChannel(tcp(), grpc::InsecureChannelCredentials());
  }

  // Allocate on `session_id` with `token` (empty: none), as an attacker would try it.
  grpc::Status RawAllocate(uint64_t session_id, const std::string& token,
                           uint64_t bytes = kMiB) const {
    auto stub = v1::MemoryService::NewStub(RawTcpChannel());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.AddMetadata(kSessionMetadataKey, std::to_string(session_id));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::AllocateRequest request;
    request.set_size_bytes(bytes);
    v1::AllocateResponse response;
    return stub->Allocate(&context, request, &response);
  }

  Scratch scratch_;
  std::unique_ptr<TestDaemon> daemon_;
  std::string alice_token_, bob_token_, tokens_file_;
  int port_ = 0;
};

TEST_F(TenancyTest, TcpWithoutValidCredentialsIsUnauthenticated) {
  StartDaemon({});
  EXPECT_THAT(ConnectTcp("").status(), StatusIs(absl::StatusCode::kUnauthenticated));
  const std::string wrong = "gpurpc_" + std::string(64, 'a');
  absl::Status bad = ConnectTcp(wrong).status();
  EXPECT_THAT(bad, StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(std::string(bad.message()), Not(HasSubstr(wrong)));
  // A real token of the daemon does not make a forged one pass.
  EXPECT_THAT(ConnectTcp(alice_token_ + "x").status(),
              StatusIs(absl::StatusCode::kUnauthenticated));

  // Every service refuses before it looks at anything else, even a real session id.
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_EQ(RawAllocate(session->id(), "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(RawAllocate(session->id(), "not-a-token").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  auto sessions = v1::SessionService::NewStub(RawTcpChannel());
  grpc::ClientContext context;
  v1::OpenSessionRequest open;
  v1::OpenSessionResponse opened;
  EXPECT_EQ(sessions->OpenSession(&context, open, &opened).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // No token in the daemon's log.
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr(alice_token_)));
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr(wrong)));
}

TEST_F(TenancyTest, ServerInfoNamesTheTenant) {
  StartDaemon({"--tenant-max-sessions=3"});
  auto unix_client = ConnectUnix();
  ASSERT_THAT(unix_client.status(), IsOk());
  auto info = unix_client->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->tenant(), CurrentUser());
  EXPECT_EQ(info->auth_method(), "unix-peer");
  EXPECT_EQ(info->quota().max_sessions(), 3u);
  EXPECT_FALSE(info->admin());

  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->tenant(), "alice");
  EXPECT_EQ(info->auth_method(), "token");
  EXPECT_EQ(info->sessions_open(), 1u);
  EXPECT_FALSE(info->compile_sandbox().empty());
}

TEST_F(TenancyTest, AnotherTenantsSessionIsNotFoundExactlyLikeAnUnknownOne) {
  StartDaemon({});
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  auto buffer = session->Allocate(4096);
  ASSERT_THAT(buffer.status(), IsOk());
  const std::vector<uint8_t> secret(4096, 0x5a);
  ASSERT_THAT(buffer->Upload(secret), IsOk());

  const uint64_t id = session->id();
  const uint64_t unknown = id ^ 0x1234567;
  const grpc::Status bob_on_alice = RawAllocate(id, bob_token_);
  const grpc::Status bob_on_unknown = RawAllocate(unknown, bob_token_);
  EXPECT_EQ(bob_on_alice.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(bob_on_unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  // Word for word, but for the id itself.
  EXPECT_EQ(absl::StrReplaceAll(bob_on_alice.error_message(), {{std::to_string(id), "N"}}),
            absl::StrReplaceAll(bob_on_unknown.error_message(), {{std::to_string(unknown), "N"}}));

  // Bob cannot download alice's bytes, keep her session alive, or close it.
  {
    auto memory = v1::MemoryService::NewStub(RawTcpChannel());
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(id));
    context.AddMetadata("authorization", "Bearer " + bob_token_);
    v1::DownloadRequest request;
    request.mutable_source()->mutable_buffer()->set_buffer_id(buffer->id());
    request.set_size_bytes(4096);
    v1::DownloadResponse response;
    const grpc::Status status = memory->Download(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_TRUE(response.data().empty());
  }
  for (const char* method : {"KeepAlive", "CloseSession"}) {
    auto sessions = v1::SessionService::NewStub(RawTcpChannel());
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(id));
    context.AddMetadata("authorization", "Bearer " + bob_token_);
    grpc::Status status;
    if (std::string(method) == "KeepAlive") {
      v1::KeepAliveResponse response;
      status = sessions->KeepAlive(&context, v1::KeepAliveRequest(), &response);
    } else {
      v1::CloseSessionResponse response;
      status = sessions->CloseSession(&context, v1::CloseSessionRequest(), &response);
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << method;
  }
  // Nor can the Unix-socket tenant, whose identity comes from the kernel.
  auto local = ConnectUnix();
  ASSERT_THAT(local.status(), IsOk());
  {
    auto memory = v1::MemoryService::NewStub(local->channel());
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(id));
    context.AddMetadata("authorization", "Bearer " + alice_token_);  // ignored on the socket
    v1::AllocateRequest request;
    request.set_size_bytes(4096);
    v1::AllocateResponse response;
    EXPECT_EQ(memory->Allocate(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // Alice's session is untouched.
  auto bytes = buffer->Download();
  ASSERT_THAT(bytes.status(), IsOk());
  EXPECT_EQ(*bytes, secret);
  EXPECT_THAT(session->KeepAlive().status(), IsOk());
}

TEST_F(TenancyTest, SessionIdsAreUnrelated) {
  StartDaemon({});
  auto local = ConnectUnix();
  ASSERT_THAT(local.status(), IsOk());
  std::vector<uint64_t> ids;
  for (int i = 0; i < 8; ++i) {
    auto session = local->OpenSession(0);
    ASSERT_THAT(session.status(), IsOk());
    ids.push_back(session->id());
    ASSERT_THAT(session->Close(), IsOk());
  }
  // 64 random bits each: no two share their high or low 32 bits.
  std::set<uint64_t> high, low;
  for (uint64_t id : ids) {
    high.insert(id >> 32);
    low.insert(id & 0xffffffffu);
  }
  EXPECT_EQ(high.size(), ids.size());
  EXPECT_EQ(low.size(), ids.size());
}

TEST_F(TenancyTest, DeviceMemoryQuotaIsSummedOverTheTenantsSessions) {
  StartDaemon({}, R"(
default_quota { max_device_memory_bytes: 17179869184 }
tenant_quotas { key: "alice" value { max_device_memory_bytes: 67108864 } }
)");
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto first = alice->OpenSession(0);
  auto second = alice->OpenSession(0);
  ASSERT_THAT(first.status(), IsOk());
  ASSERT_THAT(second.status(), IsOk());
  auto big = first->Allocate(40 * kMiB);
  ASSERT_THAT(big.status(), IsOk());
  // 40 + 30 MiB > 64 MiB, though in another session of hers.
  auto refused = second->Allocate(30 * kMiB);
  ASSERT_THAT(refused.status(), StatusIs(absl::StatusCode::kResourceExhausted));
  const std::string message(refused.status().message());
  EXPECT_THAT(message, HasSubstr("max_device_memory_bytes"));
  EXPECT_THAT(message, HasSubstr("alice"));
  EXPECT_THAT(message, HasSubstr(std::to_string(40 * kMiB)));  // her use
  EXPECT_THAT(message, HasSubstr(std::to_string(30 * kMiB)));  // the request
  // Nothing was lost: the session works, and 24 MiB still fit.
  auto small = second->Allocate(24 * kMiB);
  ASSERT_THAT(small.status(), IsOk());
  EXPECT_THAT(second->Allocate(1 * kMiB).status(), StatusIs(absl::StatusCode::kResourceExhausted));
  auto info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 64 * kMiB);

  // Free gives the bytes back; so does closing a session.
  ASSERT_THAT(big->Free(), IsOk());
  auto again = second->Allocate(30 * kMiB);
  ASSERT_THAT(again.status(), IsOk());
  ASSERT_THAT(second->Close(), IsOk());
  info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 0u);
  EXPECT_THAT(first->Allocate(64 * kMiB).status(), IsOk());

  // Bob has the default quota, untouched by alice's use.
  auto bob = ConnectTcp(bob_token_);
  ASSERT_THAT(bob.status(), IsOk());
  auto bob_session = bob->OpenSession(0);
  ASSERT_THAT(bob_session.status(), IsOk());
  auto bobs = bob_session->Allocate(512 * kMiB);
  EXPECT_THAT(bobs.status(), IsOk());
  // An allocation within the quota that the device refuses (the fake has 8 GiB) leaves no
  // reservation behind.
  EXPECT_THAT(bob_session->Allocate(12ull << 30).status(),
              StatusIs(absl::StatusCode::kResourceExhausted));
  info = bob->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 512 * kMiB);
}

// A module's __device__ globals are device memory too: charged, refused over quota (the
// module is unloaded), released on unload.
TEST_F(TenancyTest, ModuleGlobalsCountAgainstTheMemoryQuota) {
  StartDaemon({}, R"(
tenant_quotas { key: "alice" value { max_device_memory_bytes: 67108864 } }
)");
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  // 16 MiB of globals fit.
  const std::string small_ptx =
      ".version 8.0\n.target sm_90\n.address_size 64\n"
      ".visible .global .align 4 .b8 small_buffer[16777216];\n";
  auto small = session->LoadModule(small_ptx);
  ASSERT_THAT(small.status(), IsOk());
  auto info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 16 * kMiB);
  // 256 MiB do not, loaded or compiled (on a GPU, 16 GiB would go the same way).
  const std::string big_ptx =
      ".version 8.0\n.target sm_90\n.address_size 64\n"
      ".visible .global .align 4 .b8 big_buffer[268435456];\n";
  EXPECT_THAT(session->LoadModule(big_ptx).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
  CompileOptions compile;
  compile.source =
      "__device__ char big_global[1ull << 28];\n"
      "extern \"C\" __global__ void touch(int i) { big_global[i] = 1; }\n";
  EXPECT_THAT(session->Compile(compile).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_device_memory_bytes")));
  info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->device_memory_bytes(), 16 * kMiB);
  // The session carries on; unloading gives the bytes back.
  *small = Module();
  ASSERT_THAT(session->Synchronize(), IsOk());
  for (int attempt = 0; attempt < 50; ++attempt) {
    info = alice->GetServerInfo();
    ASSERT_THAT(info.status(), IsOk());
    if (info->device_memory_bytes() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(info->device_memory_bytes(), 0u);
  EXPECT_THAT(session->Allocate(60 * kMiB).status(), IsOk());
}

TEST_F(TenancyTest, PerSessionCountsAreCapped) {
  StartDaemon({"--tenant-max-streams-per-session=2", "--tenant-max-events-per-session=3"});
  auto local = ConnectUnix();
  ASSERT_THAT(local.status(), IsOk());
  auto session = local->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  std::vector<Stream> streams;
  for (int i = 0; i < 2; ++i) {
    auto stream = session->CreateStream();
    ASSERT_THAT(stream.status(), IsOk());
    streams.push_back(*std::move(stream));
  }
  auto refused = session->CreateStream();
  ASSERT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_streams_per_session")));
  streams.pop_back();  // destroys it
  ASSERT_THAT(session->Synchronize(), IsOk());
  EXPECT_THAT(session->CreateStream().status(), IsOk());

  std::vector<Event> events;
  for (int i = 0; i < 3; ++i) {
    auto event = session->CreateEvent();
    ASSERT_THAT(event.status(), IsOk());
    events.push_back(*std::move(event));
  }
  EXPECT_THAT(session->CreateEvent().status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_events_per_session")));
  // Another session has its own count.
  auto other = local->OpenSession(0);
  ASSERT_THAT(other.status(), IsOk());
  EXPECT_THAT(other->CreateEvent().status(), IsOk());
}

TEST_F(TenancyTest, ModulesPerSessionAreCapped) {
  StartDaemon({"--tenant-max-modules-per-session=2"});
  auto local = ConnectUnix();
  ASSERT_THAT(local.status(), IsOk());
  auto session = local->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  std::vector<Module> modules;
  for (int i = 0; i < 3; ++i) {
    CompileOptions compile;
    compile.source = absl::StrFormat(
        "extern \"C\" __global__ void k%d(float* x) { x[threadIdx.x] += %d; }", i, i);
    auto compiled = session->Compile(compile);
    if (i < 2) {
      ASSERT_THAT(compiled.status(), IsOk());
      ASSERT_TRUE(compiled->success()) << compiled->log();
      modules.push_back(std::move(compiled->module));
    } else {
      EXPECT_THAT(compiled.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                              HasSubstr("max_modules_per_session")));
    }
  }
}

// The session caps hold under a storm of concurrent opens from two tenants, and every
// refused open is RESOURCE_EXHAUSTED naming the cap.
TEST_F(TenancyTest, TwoHundredConcurrentOpensNeverExceedTheCaps) {
  StartDaemon({"--max-sessions=15", "--tenant-max-sessions=10", "--warm-workers=2"});
  auto alice = ConnectTcp(alice_token_);
  auto local = ConnectUnix();
  ASSERT_THAT(alice.status(), IsOk());
  ASSERT_THAT(local.status(), IsOk());

  std::mutex mu;
  std::vector<Session> opened_alice, opened_local;
  std::map<absl::StatusCode, int> refusals;
  std::vector<std::string> unexpected;
  std::vector<std::thread> threads;
  std::atomic<bool> go{false};
  for (int i = 0; i < 200; ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      const bool is_alice = i % 2 == 0;
      auto session = (is_alice ? *alice : *local).OpenSession(0);
      std::lock_guard<std::mutex> lock(mu);
      if (session.ok()) {
        (is_alice ? opened_alice : opened_local).push_back(*std::move(session));
        return;
      }
      ++refusals[session.status().code()];
      const std::string message(session.status().message());
      if (session.status().code() != absl::StatusCode::kResourceExhausted ||
          (message.find("--max-sessions") == std::string::npos &&
           message.find("max_sessions") == std::string::npos)) {
        unexpected.push_back(session.status().ToString());
      }
    });
  }
  go = true;
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(unexpected, ::testing::IsEmpty());
  EXPECT_LE(opened_alice.size(), 10u);
  EXPECT_LE(opened_local.size(), 10u);
  EXPECT_EQ(opened_alice.size() + opened_local.size(), 15u);
  EXPECT_EQ(refusals[absl::StatusCode::kResourceExhausted], 200 - 15);

  // Closing gives the slots back.
  for (Session& session : opened_alice) ASSERT_THAT(session.Close(), IsOk());
  auto info = alice->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ(info->sessions_open(), 0u);
  EXPECT_THAT(alice->OpenSession(0).status(), IsOk());
}

TEST_F(TenancyTest, ConcurrentCompilesPerTenantAreCapped) {
  StartDaemon({"--tenant-max-concurrent-compiles=1", "--tenant-max-sessions=8"});
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  std::vector<Session> sessions;
  for (int i = 0; i < 6; ++i) {
    auto session = alice->OpenSession(0);
    ASSERT_THAT(session.status(), IsOk());
    sessions.push_back(*std::move(session));
  }
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      CompileOptions compile;
      // Distinct, slow-ish sources: no cache hit, and they overlap in time.
      compile.source = absl::StrFormat(
          "#include <curand_kernel.h>\nextern \"C\" __global__ void k(float* x) {\n"
          "  curandState s; curand_init(%d, threadIdx.x, 0, &s); x[threadIdx.x] = "
          "curand_uniform(&s);\n}\n",
          i + 1000);
      auto compiled = sessions[i].Compile(compile);
      if (compiled.ok()) {
        ++ok;
      } else if (compiled.status().code() == absl::StatusCode::kResourceExhausted &&
                 compiled.status().message().find("max_concurrent_compiles") !=
                     absl::string_view::npos) {
        ++exhausted;
      } else {
        ++other;
        ADD_FAILURE() << compiled.status();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_GE(ok.load(), 1);
  EXPECT_GE(exhausted.load(), 1);
  EXPECT_EQ(other.load(), 0);
  // Another tenant is not held up by alice's compiles.
  auto bob = ConnectTcp(bob_token_);
  ASSERT_THAT(bob.status(), IsOk());
  auto bob_session = bob->OpenSession(0);
  ASSERT_THAT(bob_session.status(), IsOk());
  CompileOptions compile;
  compile.source = "extern \"C\" __global__ void b(float* x) { x[0] = 1; }";
  EXPECT_THAT(bob_session->Compile(compile).status(), IsOk());
}

TEST_F(TenancyTest, CacheHitsAreNotSharedAcrossTenants) {
  StartDaemon({});
  auto alice = ConnectTcp(alice_token_);
  auto bob = ConnectTcp(bob_token_);
  ASSERT_THAT(alice.status(), IsOk());
  ASSERT_THAT(bob.status(), IsOk());
  CompileOptions compile;
  compile.source = "extern \"C\" __global__ void secret_kernel_name(int* x) { x[0] = 42; }";
  auto alice_session = alice->OpenSession(0);
  ASSERT_THAT(alice_session.status(), IsOk());
  auto first = alice_session->Compile(compile);
  ASSERT_THAT(first.status(), IsOk());
  auto second = alice_session->Compile(compile);
  ASSERT_THAT(second.status(), IsOk());
  EXPECT_FALSE(first->response.cache_hit());
  EXPECT_TRUE(second->response.cache_hit());

  auto bob_session = bob->OpenSession(0);
  ASSERT_THAT(bob_session.status(), IsOk());
  auto bobs = bob_session->Compile(compile);
  ASSERT_THAT(bobs.status(), IsOk());
  EXPECT_FALSE(bobs->response.cache_hit());
  EXPECT_NE(bobs->response.cache_key(), first->response.cache_key());
}

TEST_F(TenancyTest, AdminsListAndCloseAnySessionOthersMayNot) {
  StartDaemon({absl::StrCat("--admin-tenants=", CurrentUser())});
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0, "alice's job");
  ASSERT_THAT(session.status(), IsOk());
  auto buffer = session->Allocate(3 * kMiB);
  ASSERT_THAT(buffer.status(), IsOk());

  EXPECT_THAT(alice->AdminListSessions().status(), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(alice->AdminCloseSession(session->id()).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));

  auto admin = ConnectUnix();
  ASSERT_THAT(admin.status(), IsOk());
  auto info = admin->GetServerInfo();
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_TRUE(info->admin());
  auto listed = admin->AdminListSessions("alice");
  ASSERT_THAT(listed.status(), IsOk());
  ASSERT_EQ(listed->sessions_size(), 1);
  const v1::SessionSummary& summary = listed->sessions(0);
  EXPECT_EQ(summary.session_id(), session->id());
  EXPECT_EQ(summary.tenant(), "alice");
  EXPECT_EQ(summary.device_memory_bytes(), 3 * kMiB);
  EXPECT_EQ(summary.client_label(), "alice's job");
  EXPECT_EQ(summary.state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_THAT(summary.peer(), HasSubstr("127.0.0.1"));
  EXPECT_GT(summary.worker_pid(), 0);

  // Workers are not dumpable: /proc/PID of a worker belongs to root, so the daemon's user
  // (and so a compromised worker of another tenant) cannot ptrace it or read its memory.
  if (geteuid() != 0) {
    struct stat st;
    ASSERT_EQ(stat(absl::StrCat("/proc/", summary.worker_pid()).c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, 0u) << "worker " << summary.worker_pid() << " is dumpable";
  }

  auto closed = admin->AdminCloseSession(session->id());
  ASSERT_THAT(closed.status(), IsOk());
  EXPECT_EQ(closed->tenant(), "alice");
  EXPECT_THAT(session->KeepAlive().status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(admin->AdminCloseSession(session->id()).status(),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(TenancyTest, TokensAreReloadedOnSighup) {
  StartDaemon({});
  ASSERT_THAT(ConnectTcp(bob_token_).status(), IsOk());
  auto [carol_token, carol_line] = NewToken("carol");
  EXPECT_THAT(ConnectTcp(carol_token).status(), StatusIs(absl::StatusCode::kUnauthenticated));
  // Carol in, bob out.
  std::string alice_line;
  {
    std::ifstream in(tokens_file_);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("alice:", 0) == 0) alice_line = line;
    }
  }
  scratch_.Write("tokens", absl::StrCat(alice_line, "\n", carol_line, "\n"));
  ASSERT_EQ(kill(daemon_->pid(), SIGHUP), 0);
  absl::Status carol = absl::UnknownError("not tried");
  for (int i = 0; i < 50 && !carol.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    carol = ConnectTcp(carol_token).status();
  }
  EXPECT_THAT(carol, IsOk());
  EXPECT_THAT(ConnectTcp(bob_token_).status(), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(ConnectTcp(alice_token_).status(), IsOk());
  // A broken file keeps the tokens in force.
  scratch_.Write("tokens", "this is not a tokens file\n");
  ASSERT_EQ(kill(daemon_->pid(), SIGHUP), 0);
  // Once the daemon has read the broken file (and said it keeps the tokens in force).
  EXPECT_TRUE(Eventually([&] {
    return absl::StrContains(daemon_->Log(), "SIGHUP: keeping the tokens in force");
  })) << "the daemon did not reload on the second SIGHUP";
  EXPECT_THAT(ConnectTcp(carol_token).status(), IsOk());
  EXPECT_THAT(daemon_->Log(), Not(HasSubstr(carol_token)));
}

TEST_F(TenancyTest, HealthListenerServesHealthOnlyAndTheMainListenerNoHealth) {
  const int health_port = FreePort();
  StartDaemon({absl::StrCat("--health-listen=127.0.0.1:", health_port)});
  auto health_channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", health_port),
                                            grpc::InsecureChannelCredentials());
  // One request of `bytes` to `method`, then the half-close (a unary call's shape): the status,
  // with exactly one answer when the call went well.
  const auto call = [](const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                       const std::string& bytes) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const RawCallResult result = RawCall(channel, &context, method, {bytes});
    if (result.status.ok()) {
      EXPECT_EQ(result.responses.size(), 1u) << method;
    }
    return result.status;
  };
  // grpc.health.v1.Health/Check with an empty request (service ""), as a kubelet sends it.
  const auto check = [&](const std::shared_ptr<grpc::Channel>& channel, const std::string& method) {
    return call(channel, method, "");
  };
  EXPECT_TRUE(check(health_channel, "/grpc.health.v1.Health/Check").ok());
  EXPECT_EQ(check(health_channel, "/gpurpc.v1.DeviceService/ListDevices").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(check(health_channel, "/gpurpc.v1.SessionService/OpenSession").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(check(health_channel, "/gpurpc.v1.MemoryService/Allocate").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // The main listener has no unauthenticated health service, nor reflection.
  const grpc::Status main_health = check(RawTcpChannel(), "/grpc.health.v1.Health/Check");
  EXPECT_FALSE(main_health.ok());
  for (const char* reflection : {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                 "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"}) {
    EXPECT_EQ(check(RawTcpChannel(), reflection).error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << reflection;
  }
  // Reflection answers on the health listener (a list_services request, field 7 = "").
  const auto reflect = [&](const std::string& bytes) {
    return call(health_channel, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                bytes);
  };
  const grpc::Status listed = reflect(std::string("\x3a\x00", 2));
  EXPECT_TRUE(listed.ok()) << listed.error_message();
  // Anyone can reach this listener: a request of 1 MB of empty unknown fields (which would
  // parse to some 45 MB) is refused by its size.
  std::string junk;
  for (int i = 0; i < 333'333; ++i) junk.append("\xa2\x06\x00", 3);
  EXPECT_EQ(reflect(junk).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Reflection streams held open take at most their threads; health checks still answer.
  std::vector<std::shared_ptr<grpc::Channel>> connections;
  std::vector<std::unique_ptr<grpc::ClientContext>> held_contexts;
  std::vector<std::unique_ptr<grpc::GenericClientAsyncReaderWriter>> held;
  grpc::CompletionQueue cq;
  for (int c = 0; c < 6; ++c) {
    // A connection of its own (a connection takes at most 8 streams).
    grpc::ChannelArguments args;
    args.SetInt("gpurpc.test.connection", c);
    connections.push_back(grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", health_port),
                                                    grpc::InsecureChannelCredentials(), args));
    grpc::GenericStub stub(connections.back());
    for (int i = 0; i < 8; ++i) {
      held_contexts.push_back(std::make_unique<grpc::ClientContext>());
      held.push_back(
          stub.PrepareCall(held_contexts.back().get(),
                           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq));
      held.back()->StartCall(reinterpret_cast<void*>(1));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_TRUE(check(health_channel, "/grpc.health.v1.Health/Check").ok());
  // Cancel them, let each finish, and drain the queue before the calls go.
  for (auto& context : held_contexts) context->TryCancel();
  std::vector<grpc::Status> statuses(held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    held[i]->Finish(&statuses[i], reinterpret_cast<void*>(2));
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  held.clear();
}

// A client that gives up on an Allocate (deadline, cancel) must not leave memory the ledger
// does not see: the worker still allocates, and the ledger must count it.
TEST_F(TenancyTest, AbandonedAllocationsStayCounted) {
  StartDaemon({});
  auto alice = ConnectTcp(alice_token_);
  ASSERT_THAT(alice.status(), IsOk());
  auto session = alice->OpenSession(0);
  ASSERT_THAT(session.status(), IsOk());
  auto stub = v1::MemoryService::NewStub(RawTcpChannel());
  for (int i = 0; i < 40; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(i * 50));
    context.AddMetadata(kSessionMetadataKey, std::to_string(session->id()));
    context.AddMetadata("authorization", "Bearer " + alice_token_);
    v1::AllocateRequest request;
    request.set_size_bytes(4 * kMiB);
    v1::AllocateResponse response;
    stub->Allocate(&context, request, &response).IgnoreError();
  }
  // Whatever the worker allocated, the ledger counts: it equals the session's used memory.
  absl::StatusOr<v1::GetServerInfoResponse> info;
  absl::StatusOr<MemInfo> memory;
  for (int attempt = 0; attempt < 50; ++attempt) {  // the last answers may still be in flight
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    info = alice->GetServerInfo();
    memory = session->GetMemInfo();
    ASSERT_THAT(info.status(), IsOk());
    ASSERT_THAT(memory.status(), IsOk());
    if (info->device_memory_bytes() == memory->total_bytes - memory->free_bytes) break;
  }
  EXPECT_EQ(info->device_memory_bytes(), memory->total_bytes - memory->free_bytes);
}

// One user cannot take the daemon's file descriptors through the Unix socket.
TEST_F(TenancyTest, UnixConnectionsPerUserAreBounded) {
  StartDaemon({});
  std::string path = daemon_->address();
  if (path.rfind("unix:", 0) == 0) path = path.substr(5);
  auto connect_raw = [&]() {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", path.c_str());
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  };
  std::vector<int> held;
  for (size_t i = 0; i < 300; ++i) held.push_back(connect_raw());
  // Connections past the bound are closed by the daemon: reading them ends at once.
  constexpr int kPastTheBound = 300 - 256 - 8;  // the test's own channels may hold a few
  int closed_by_daemon = 0;
  Eventually([&] {
    closed_by_daemon = 0;
    for (int fd : held) {
      if (fd < 0) continue;
      pollfd p{fd, POLLIN, 0};
      char byte;
      if (poll(&p, 1, 0) == 1 && (p.revents & POLLHUP || recv(fd, &byte, 1, MSG_PEEK) == 0)) {
        ++closed_by_daemon;
      }
    }
    return closed_by_daemon >= kPastTheBound;
  });
  EXPECT_GE(closed_by_daemon, kPastTheBound);
  EXPECT_THAT(daemon_->Log(), HasSubstr("refused a connection"));
  for (int fd : held) {
    if (fd >= 0) close(fd);
  }
  // Once they are gone, the user connects again.
  absl::Status again = absl::UnknownError("not tried");
  for (int attempt = 0; attempt < 50 && !again.ok(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    again = ConnectUnix().status();
  }
  EXPECT_THAT(again, IsOk());
}

// Secure by default: what the daemon refuses to start with.
TEST(TenancyStartupTest, RefusesUnsafeListeners) {
  const int port = FreePort();
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  } cases[] = {
      {{absl::StrCat("--listen=127.0.0.1:", port)}, "needs a way to authenticate"},
      {{absl::StrCat("--listen=0.0.0.0:", port), "--tokens-file=/nonexistent"},
       "not a loopback address"},
      {{"--tls-cert=/nonexistent"}, "--tls-cert and --tls-key go together"},
      // A folder others may write (even sticky, like /tmp): another user could squat the name.
      {{absl::StrCat("--unix-socket=/tmp/gpurpc-tenancy-", getpid(), ".sock")},
       "writable by others"},
  };
  for (const Case& c : cases) {
    TestDaemon::Options options;
    options.extra_flags = c.flags;
    auto daemon = TestDaemon::Start(options);
    EXPECT_THAT(daemon.status(), Not(IsOk()));
    EXPECT_THAT(std::string(daemon.status().message()), HasSubstr(c.message));
  }
  Scratch scratch;
  const std::string tokens =
      scratch.Write("tokens", "alice:00:" + std::string(64, '0') + "\n", 0644);
  TestDaemon::Options options;
  options.extra_flags = {absl::StrCat("--listen=127.0.0.1:", port),
                         absl::StrCat("--tokens-file=", tokens)};
  auto daemon = TestDaemon::Start(options);
  EXPECT_THAT(daemon.status(), Not(IsOk()));
  EXPECT_THAT(std::string(daemon.status().message()), HasSubstr("others may read"));
}

}  // namespace
}  // namespace gpurpc
