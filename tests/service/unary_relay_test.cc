// The front end's relay of the session services' unary calls (server/frontend/unary_proxy.h)
// on framed unary channels to the workers (server/frontend/unary_channels.h), against real
// daemons with real worker processes: a client must get exactly what the gRPC relay
// (--command-relay=grpc) gives it, answers and statuses alike; gpurpc_unary_calls_relayed_total
// must show which way each call went (framed for small requests on a free channel, gRPC above
// 64 KiB, when the session's channels are all busy, or with --command-relay=grpc); a worker
// that dies under a framed call must fault the session as it does under a gRPC call; the
// tenant's ledger must hold on both; hostile raw requests must be answered and leave the
// session usable. Compiled twice: label `service` with the fake backend, label `gpu` with the
// CUDA backend (GPURPC_TEST_BACKEND; it skips without a driver).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::KillDeviceWorkers;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kFramedLimit = 64 << 10;  // kMaxRelayedRequestBytes (common/limits.h)
constexpr char kBackend[] = GPURPC_TEST_BACKEND;

using MemoryStub = v1::MemoryService::Stub;
using ExecutionStub = v1::ExecutionService::Stub;
using SessionStub = v1::SessionService::Stub;

constexpr char kLaunch[] = "/gpurpc.v1.ExecutionService/Launch";
constexpr char kAllocate[] = "/gpurpc.v1.MemoryService/Allocate";
constexpr char kGetMemInfo[] = "/gpurpc.v1.MemoryService/GetMemInfo";

std::string RandomBytes(size_t n, uint32_t seed) {
  std::string out(n, '\0');
  std::mt19937 rng(seed);
  for (char& byte : out) byte = static_cast<char>(rng());
  return out;
}

v1::DevicePointer At(uint64_t buffer_id, uint64_t offset) {
  v1::DevicePointer pointer;
  pointer.mutable_buffer()->set_buffer_id(buffer_id);
  pointer.mutable_buffer()->set_offset_bytes(offset);
  return pointer;
}

// An Upload request of `data` to `buffer` at `offset`.
v1::UploadRequest UploadOf(uint64_t buffer, uint64_t offset, std::string data) {
  v1::UploadRequest request;
  *request.mutable_destination() = At(buffer, offset);
  request.set_data(std::move(data));
  return request;
}

// An Upload request to `buffer` at 0 whose serialized size is exactly `total` bytes.
v1::UploadRequest UploadOfSize(uint64_t buffer, size_t total, uint32_t seed) {
  v1::UploadRequest request = UploadOf(buffer, 0, "");
  size_t data = total;
  for (int i = 0; i < 8; ++i) {
    request.set_data(RandomBytes(data, seed));
    const size_t size = request.ByteSizeLong();
    if (size == total) break;
    data = size > total ? data - (size - total) : data + (total - size);
  }
  return request;
}

v1::LaunchRequest LaunchOf(uint64_t function, std::string packed_args) {
  v1::LaunchRequest request;
  v1::LaunchCommand* launch = request.mutable_launch();
  launch->set_function_id(function);
  for (v1::Dim3* dim : {launch->mutable_grid(), launch->mutable_block()}) {
    dim->set_x(1);
    dim->set_y(1);
    dim->set_z(1);
  }
  launch->set_packed_args(std::move(packed_args));
  return request;
}

// spin_us(us): a kernel that runs `micros` microseconds.
v1::LaunchRequest SpinOf(uint64_t function, uint64_t micros) {
  std::string packed(8, '\0');
  for (int i = 0; i < 8; ++i) packed[i] = static_cast<char>((micros >> (8 * i)) & 0xff);
  return LaunchOf(function, std::move(packed));
}

// `text` with every id of `ids` of 4 digits or more made "<id>", so that two daemons' answers
// compare (shorter ids are left: they would match digits of sizes, and are equal anyway).
std::string Scrub(std::string text, const std::vector<uint64_t>& ids) {
  std::vector<std::string> sorted;
  for (const uint64_t id : ids) {
    if (id >= 1000) sorted.push_back(std::to_string(id));
  }
  // Longer first, so that no id is replaced inside a longer one.
  std::sort(sorted.begin(), sorted.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  for (const std::string& id : sorted) text = absl::StrReplaceAll(text, {{id, "<id>"}});
  return text;
}

// One answer a client saw: which call, its status and what it answered (ids left out).
struct Answer {
  std::string call;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  std::string detail;
};

// ------------------------------------------------------------------------- metrics

// gpurpc_unary_calls_relayed_total by relay.
struct Relayed {
  double framed = 0;
  double grpc = 0;
  double total() const { return framed + grpc; }
};

absl::StatusOr<Relayed> ParseRelayed(const std::string& body) {
  constexpr char kFamily[] = "gpurpc_unary_calls_relayed_total";
  if (body.find(absl::StrCat("# TYPE ", kFamily, " counter\n")) == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("no counter ", kFamily, " in /metrics"));
  }
  Relayed relayed;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    for (auto [relay, value] : {std::pair<const char*, double*>{"framed", &relayed.framed},
                                std::pair<const char*, double*>{"grpc", &relayed.grpc}}) {
      const std::string prefix = absl::StrCat(kFamily, "{relay=\"", relay, "\"} ");
      if (absl::StartsWith(line, prefix) && !absl::SimpleAtod(line.substr(prefix.size()), value)) {
        return absl::InvalidArgumentError(absl::StrCat("not a value: ", line));
      }
    }
  }
  return relayed;
}

// ------------------------------------------------------------------------- the daemon

// One daemon (--command-relay=`relay`, /metrics on a loopback port), one session opened with
// the C++ client, and raw calls on that session.
class Daemon {
 public:
  static std::unique_ptr<Daemon> Start(const std::string& relay,
                                       std::vector<std::string> flags = {}, int warm_workers = 1) {
    auto port = testing::FreeLoopbackPort();
    EXPECT_THAT(port, IsOk());
    if (!port.ok()) return nullptr;
    TestDaemon::Options options;
    options.backend = kBackend;
    options.warm_workers = warm_workers;
    options.extra_flags = std::move(flags);
    options.extra_flags.push_back("--command-relay=" + relay);
    options.extra_flags.push_back("--fake-memory-bytes=1073741824");
    options.extra_flags.push_back(absl::StrCat("--metrics-listen=127.0.0.1:", *port));
    auto daemon = TestDaemon::Start(std::move(options));
    EXPECT_THAT(daemon, IsOk());
    if (!daemon.ok()) return nullptr;
    auto out = std::unique_ptr<Daemon>(new Daemon());
    out->metrics_port_ = *port;
    out->daemon_ = *std::move(daemon);
    ConnectOptions connect;
    connect.address = out->daemon_->address();
    connect.use_environment = false;  // no direct channel: every call goes by the relay
    connect.call_timeout = absl::Seconds(60);
    auto client = Client::Connect(connect);
    EXPECT_THAT(client, IsOk());
    if (!client.ok()) return nullptr;
    out->client_ = std::make_unique<Client>(*std::move(client));
    auto session = out->client_->OpenSession(0, "unary relay test");
    EXPECT_THAT(session, IsOk());
    if (!session.ok()) return nullptr;
    out->session_ = std::make_unique<Session>(*std::move(session));
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(-1);
    arguments.SetMaxSendMessageSize(-1);
    out->channel_ = grpc::CreateCustomChannel(out->daemon_->address(),
                                              grpc::InsecureChannelCredentials(), arguments);
    return out;
  }

  TestDaemon& daemon() { return *daemon_; }
  int metrics_port() const { return metrics_port_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  Client& client() { return *client_; }
  Session& session() { return *session_; }
  uint64_t session_id() const { return session_id_ != 0 ? session_id_ : session_->id(); }
  // Raw calls go to session `id` from now on (0: the client's session).
  void set_session_id(uint64_t id) { session_id_ = id; }

  // The counters now (a failed scrape fails the test).
  Relayed Scrape() const {
    auto body = testing::ScrapeMetrics(metrics_port_);
    EXPECT_THAT(body, IsOk());
    if (!body.ok()) return Relayed{-1, -1};
    auto relayed = ParseRelayed(*body);
    EXPECT_THAT(relayed, IsOk());
    return relayed.ok() ? *relayed : Relayed{-1, -1};
  }

  void Prepare(grpc::ClientContext* context) const {
    context->AddMetadata("gpurpc-session", std::to_string(session_id()));
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  // A unary call of the session through a generated stub.
  template <typename Stub, typename Request, typename Response>
  grpc::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) const {
    Stub stub(channel_);
    grpc::ClientContext context;
    Prepare(&context);
    return (stub.*method)(&context, request, response);
  }
  template <typename Stub, typename Request, typename Response>
  grpc::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request) const {
    Response ignored;
    return Call(method, request, &ignored);
  }

  // Any number of messages of any bytes to `method` (a full name, "/package.Service/Method")
  // of the session, then a half-close; the first answer in `response`. `session` false: no
  // session metadata at all.
  grpc::Status Raw(const std::string& method, const std::vector<std::string>& requests,
                   std::string* response = nullptr, bool session = true) const {
    grpc::ClientContext context;
    if (session) {
      Prepare(&context);
    } else {
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    }
    testing::RawCallResult call = testing::RawCall(channel_, &context, method, requests);
    if (response != nullptr && !call.responses.empty()) *response = call.responses.front();
    return call.status;
  }

  // The session's state as the front end has it (SessionService.KeepAlive).
  v1::KeepAliveResponse KeepAlive() const {
    v1::KeepAliveResponse response;
    const grpc::Status status = Call(&SessionStub::KeepAlive, v1::KeepAliveRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // An allocation by a raw call: its id (0 on failure, which fails the test).
  uint64_t Allocate(uint64_t size) const {
    v1::AllocateRequest request;
    request.set_size_bytes(size);
    v1::AllocateResponse response;
    const grpc::Status status = Call(&MemoryStub::Allocate, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() ? response.buffer().buffer_id() : 0;
  }

 private:
  Daemon() = default;
  int metrics_port_ = 0;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  std::shared_ptr<grpc::Channel> channel_;
  uint64_t session_id_ = 0;
};

class UnaryRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA relay: " << cuda;
      }
    }
  }
};

// Each test runs on the framed relay and on --command-relay=grpc.
class UnaryRelayBothRelaysTest : public UnaryRelayTest,
                                 public ::testing::WithParamInterface<std::string> {
 protected:
  bool framed() const { return GetParam() == "framed"; }
};

// ------------------------------------------------------- the same answers on both relays

// A client's sequence of unary calls, good ones and failing ones, through raw stubs and the
// C++ client (Module::GetFunction, Function::Launch): every answer, ids made "<id>". Each
// entry is one unary call of the session services.
std::vector<Answer> RunScript(Daemon& d, const Module& module) {
  std::vector<Answer> answers;
  std::vector<uint64_t> ids = {d.session_id(), module.id()};
  auto record = [&](const std::string& call, const grpc::Status& status, std::string detail = "") {
    answers.push_back(Answer{call, status.error_code(), status.error_message(), std::move(detail)});
  };
  auto record_absl = [&](const std::string& call, const absl::Status& status,
                         std::string detail = "") {
    answers.push_back(Answer{call, static_cast<grpc::StatusCode>(status.code()),
                             std::string(status.message()), std::move(detail)});
  };

  grpc::Status status;

  // Memory.
  v1::AllocateRequest allocate;
  allocate.set_size_bytes(4096);
  v1::AllocateResponse allocated;
  status = d.Call(&MemoryStub::Allocate, allocate, &allocated);
  record("Allocate", status,
         absl::StrCat("size ", allocated.buffer().size_bytes(), " addressed ",
                      allocated.buffer().device_address() != 0));
  const uint64_t buffer = allocated.buffer().buffer_id();
  const uint64_t address = allocated.buffer().device_address();
  ids.push_back(buffer);
  const std::string bytes = RandomBytes(1000, 7);
  v1::UploadResponse uploaded;
  status = d.Call(&MemoryStub::Upload, UploadOf(buffer, 16, bytes), &uploaded);
  record("Upload", status, absl::StrCat("written ", uploaded.bytes_written()));
  v1::DownloadRequest download;
  *download.mutable_source() = At(buffer, 16);
  download.set_size_bytes(bytes.size());
  v1::DownloadResponse downloaded;
  status = d.Call(&MemoryStub::Download, download, &downloaded);
  record("Download", status, downloaded.data());
  v1::GetMemInfoResponse meminfo;
  status = d.Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest(), &meminfo);
  record("GetMemInfo", status,
         absl::StrCat("total ", meminfo.total_bytes(), " free <= total ",
                      meminfo.free_bytes() <= meminfo.total_bytes()));
  v1::MemsetRequest memset;
  *memset.mutable_destination() = At(buffer, 2048);
  memset.set_value(0xab);
  memset.set_element_size_bytes(1);
  memset.set_count(64);
  record("Memset", d.Call(&MemoryStub::Memset, memset));
  *download.mutable_source() = At(buffer, 2048);
  download.set_size_bytes(64);
  downloaded.Clear();
  status = d.Call(&MemoryStub::Download, download, &downloaded);
  record("Download memset", status, downloaded.data());

  // A kernel: GetFunction and a unary Launch through the client, then a unary sync.
  absl::StatusOr<Function> fill = module.GetFunction("fill_u32");
  record_absl("GetFunction fill_u32", fill.status(),
              fill.ok() ? absl::StrCat("params ", fill->params().size()) : "");
  if (fill.ok()) {
    ids.push_back(fill->id());
    LaunchConfig config;
    config.grid = {1, 1, 1};
    config.block = {64, 1, 1};
    const DeviceRef out{buffer, 1024, address + 1024};
    record_absl("Launch fill_u32", fill->Launch(config, out, uint32_t{0x5eed1234}, uint64_t{64}));
  }
  record("SynchronizeSession",
         d.Call(&ExecutionStub::SynchronizeSession, v1::SynchronizeSessionRequest()));
  *download.mutable_source() = At(buffer, 1024);
  download.set_size_bytes(256);
  downloaded.Clear();
  status = d.Call(&MemoryStub::Download, download, &downloaded);
  record("Download filled", status, downloaded.data());
  // The same with the wait in the Launch (`synchronize`), and no sync after it.
  if (fill.ok()) {
    LaunchConfig config;
    config.grid = {1, 1, 1};
    config.block = {64, 1, 1};
    const DeviceRef out{buffer, 1536, address + 1536};
    record_absl("LaunchAndSynchronize fill_u32",
                fill->LaunchAndSynchronize(config, out, uint32_t{0x0badcafe}, uint64_t{64}));
  }
  *download.mutable_source() = At(buffer, 1536);
  download.set_size_bytes(256);
  downloaded.Clear();
  status = d.Call(&MemoryStub::Download, download, &downloaded);
  record("Download filled, synchronized", status, downloaded.data());

  // Streams.
  v1::CreateStreamResponse stream;
  status = d.Call(&ExecutionStub::CreateStream, v1::CreateStreamRequest(), &stream);
  record("CreateStream", status, absl::StrCat("nonzero ", stream.stream_id() != 0));
  ids.push_back(stream.stream_id());
  v1::SynchronizeStreamRequest sync_stream;
  sync_stream.set_stream_id(stream.stream_id());
  record("SynchronizeStream", d.Call(&ExecutionStub::SynchronizeStream, sync_stream));
  v1::QueryStreamRequest query_stream;
  query_stream.set_stream_id(stream.stream_id());
  v1::QueryStreamResponse stream_done;
  status = d.Call(&ExecutionStub::QueryStream, query_stream, &stream_done);
  record("QueryStream", status, absl::StrCat("done ", stream_done.done()));
  v1::DestroyStreamRequest destroy_stream;
  destroy_stream.set_stream_id(stream.stream_id());
  record("DestroyStream", d.Call(&ExecutionStub::DestroyStream, destroy_stream));
  record("DestroyStream again", d.Call(&ExecutionStub::DestroyStream, destroy_stream));

  // Events.
  v1::CreateEventResponse event;
  status = d.Call(&ExecutionStub::CreateEvent, v1::CreateEventRequest(), &event);
  record("CreateEvent", status, absl::StrCat("nonzero ", event.event_id() != 0));
  ids.push_back(event.event_id());
  v1::RecordEventRequest record_event;
  record_event.set_event_id(event.event_id());
  record("RecordEvent", d.Call(&ExecutionStub::RecordEvent, record_event));
  v1::SynchronizeEventRequest sync_event;
  sync_event.set_event_id(event.event_id());
  record("SynchronizeEvent", d.Call(&ExecutionStub::SynchronizeEvent, sync_event));
  v1::QueryEventRequest query_event;
  query_event.set_event_id(event.event_id());
  v1::QueryEventResponse event_done;
  status = d.Call(&ExecutionStub::QueryEvent, query_event, &event_done);
  record("QueryEvent", status, absl::StrCat("done ", event_done.done()));
  v1::DestroyEventRequest destroy_event;
  destroy_event.set_event_id(event.event_id());
  record("DestroyEvent", d.Call(&ExecutionStub::DestroyEvent, destroy_event));

  // Errors.
  v1::FreeRequest free_unknown;
  free_unknown.set_buffer_id(123456789);
  record("Free unknown", d.Call(&MemoryStub::Free, free_unknown));
  absl::StatusOr<Function> missing = module.GetFunction("no_such_kernel");
  record_absl("GetFunction missing", missing.status());
  record("Launch bad function", d.Call(&ExecutionStub::Launch, LaunchOf(987654321, "")));
  *download.mutable_source() = At(buffer, 4000);
  download.set_size_bytes(200);
  record("Download past the end", d.Call(&MemoryStub::Download, download));
  memset.set_element_size_bytes(3);
  record("Memset element of 3 bytes", d.Call(&MemoryStub::Memset, memset));

  // The buffer goes, once.
  v1::FreeRequest free;
  free.set_buffer_id(buffer);
  record("Free", d.Call(&MemoryStub::Free, free));
  record("Free again", d.Call(&MemoryStub::Free, free));

  for (Answer& answer : answers) answer.message = Scrub(answer.message, ids);
  return answers;
}

// The script's answers are what they should be (so that two wrong relays cannot agree).
void CheckScript(const std::vector<Answer>& answers, const std::string& relay) {
  SCOPED_TRACE(relay);
  auto find = [&](const std::string& call) -> const Answer* {
    for (const Answer& answer : answers) {
      if (answer.call == call) return &answer;
    }
    ADD_FAILURE() << "no answer of " << call;
    return nullptr;
  };
  for (const char* call : {"Allocate",
                           "Upload",
                           "Download",
                           "GetMemInfo",
                           "Memset",
                           "Download memset",
                           "GetFunction fill_u32",
                           "Launch fill_u32",
                           "SynchronizeSession",
                           "Download filled",
                           "LaunchAndSynchronize fill_u32",
                           "Download filled, synchronized",
                           "CreateStream",
                           "SynchronizeStream",
                           "QueryStream",
                           "DestroyStream",
                           "CreateEvent",
                           "RecordEvent",
                           "SynchronizeEvent",
                           "QueryEvent",
                           "DestroyEvent",
                           "Free"}) {
    if (const Answer* answer = find(call)) {
      EXPECT_EQ(answer->code, grpc::StatusCode::OK) << call << ": " << answer->message;
    }
  }
  if (const Answer* a = find("Upload")) {
    EXPECT_EQ(a->detail, "written 1000");
  }
  if (const Answer* a = find("Download")) {
    EXPECT_TRUE(a->detail == RandomBytes(1000, 7));
  }
  if (const Answer* a = find("Download memset")) {
    EXPECT_EQ(a->detail, std::string(64, '\xab'));
  }
  if (const Answer* a = find("Download filled")) {
    std::string expected;
    for (int i = 0; i < 64; ++i) expected += std::string("\x34\x12\xed\x5e", 4);
    EXPECT_TRUE(a->detail == expected) << "the unary Launch did not fill the buffer";
  }
  if (const Answer* a = find("Download filled, synchronized")) {
    std::string expected;
    for (int i = 0; i < 64; ++i) expected += std::string("\xfe\xca\xad\x0b", 4);
    EXPECT_TRUE(a->detail == expected) << "the synchronized Launch did not fill the buffer";
  }
  if (const Answer* a = find("QueryStream")) {
    EXPECT_EQ(a->detail, "done 1");
  }
  if (const Answer* a = find("QueryEvent")) {
    EXPECT_EQ(a->detail, "done 1");
  }
  if (const Answer* a = find("GetFunction fill_u32")) {
    EXPECT_EQ(a->detail, "params 3");
  }
  for (const auto& [call, code] : std::vector<std::pair<std::string, grpc::StatusCode>>{
           {"DestroyStream again", grpc::StatusCode::NOT_FOUND},
           {"Free unknown", grpc::StatusCode::NOT_FOUND},
           {"GetFunction missing", grpc::StatusCode::NOT_FOUND},
           {"Launch bad function", grpc::StatusCode::NOT_FOUND},
           {"Download past the end", grpc::StatusCode::INVALID_ARGUMENT},
           {"Memset element of 3 bytes", grpc::StatusCode::INVALID_ARGUMENT},
           {"Free again", grpc::StatusCode::NOT_FOUND}}) {
    if (const Answer* answer = find(call)) {
      EXPECT_EQ(answer->code, code) << call << ": " << answer->message;
      EXPECT_FALSE(answer->message.empty()) << call;
    }
  }
}

// Whatever the call, good or failing, the framed relay answers what the gRPC relay answers:
// the same code, message and response; and each call went the relay's way.
TEST_F(UnaryRelayTest, FramedAndGrpcRelaysAnswerAlike) {
  std::unique_ptr<Daemon> framed = Daemon::Start("framed");
  std::unique_ptr<Daemon> grpc_relay = Daemon::Start("grpc");
  ASSERT_NE(framed, nullptr);
  ASSERT_NE(grpc_relay, nullptr);
  auto framed_module = testing::CompileFakeKernels(framed->session());
  ASSERT_THAT(framed_module, IsOk());
  auto grpc_module = testing::CompileFakeKernels(grpc_relay->session());
  ASSERT_THAT(grpc_module, IsOk());

  const Relayed framed_before = framed->Scrape();
  const Relayed grpc_before = grpc_relay->Scrape();
  const std::vector<Answer> by_framed = RunScript(*framed, *framed_module);
  const std::vector<Answer> by_grpc = RunScript(*grpc_relay, *grpc_module);
  const Relayed framed_after = framed->Scrape();
  const Relayed grpc_after = grpc_relay->Scrape();

  ASSERT_EQ(by_framed.size(), by_grpc.size());
  for (size_t i = 0; i < by_grpc.size(); ++i) {
    SCOPED_TRACE(by_grpc[i].call);
    EXPECT_EQ(by_framed[i].call, by_grpc[i].call);
    EXPECT_EQ(by_framed[i].code, by_grpc[i].code);
    EXPECT_EQ(by_framed[i].message, by_grpc[i].message);
    EXPECT_TRUE(by_framed[i].detail == by_grpc[i].detail)
        << "framed '" << absl::CHexEscape(by_framed[i].detail.substr(0, 64)) << "' vs grpc '"
        << absl::CHexEscape(by_grpc[i].detail.substr(0, 64)) << "'";
  }
  CheckScript(by_framed, "framed");
  CheckScript(by_grpc, "grpc");

  // Every call of the script was relayed, each the relay's way.
  const double calls = static_cast<double>(by_framed.size());
  EXPECT_EQ(framed_after.framed - framed_before.framed, calls);
  EXPECT_EQ(framed_after.grpc - framed_before.grpc, 0);
  EXPECT_EQ(grpc_after.grpc - grpc_before.grpc, calls);
  EXPECT_EQ(grpc_after.framed, 0);
}

// ------------------------------------------------------- the metric proves the path

// Small unary calls one after the other: on the framed relay each takes a free channel (the
// framed counter grows by their number, the grpc one not at all); on the gRPC relay none is
// ever framed.
TEST_P(UnaryRelayBothRelaysTest, TheMetricCountsEachSmallCallOnTheRelaysWay) {
  std::unique_ptr<Daemon> d = Daemon::Start(GetParam());
  ASSERT_NE(d, nullptr);
  const Relayed before = d->Scrape();
  int calls = 0;
  auto ok = [&](const grpc::Status& status) {
    ++calls;
    EXPECT_TRUE(status.ok()) << "call " << calls << ": " << status.error_message();
  };
  const uint64_t buffer = d->Allocate(8192);
  ++calls;
  ok(d->Call(&MemoryStub::Upload, UploadOf(buffer, 0, "relayed")));
  v1::DownloadRequest download;
  *download.mutable_source() = At(buffer, 0);
  download.set_size_bytes(7);
  v1::DownloadResponse downloaded;
  ok(d->Call(&MemoryStub::Download, download, &downloaded));
  EXPECT_EQ(downloaded.data(), "relayed");
  for (int i = 0; i < 10; ++i) ok(d->Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest()));
  v1::CreateStreamResponse stream;
  ok(d->Call(&ExecutionStub::CreateStream, v1::CreateStreamRequest(), &stream));
  v1::QueryStreamRequest query;
  query.set_stream_id(stream.stream_id());
  for (int i = 0; i < 5; ++i) ok(d->Call(&ExecutionStub::QueryStream, query));
  v1::DestroyStreamRequest destroy;
  destroy.set_stream_id(stream.stream_id());
  ok(d->Call(&ExecutionStub::DestroyStream, destroy));
  // A call the worker refuses is relayed all the same.
  v1::FreeRequest unknown;
  unknown.set_buffer_id(55555555);
  ++calls;
  EXPECT_EQ(d->Call(&MemoryStub::Free, unknown).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::FreeRequest free;
  free.set_buffer_id(buffer);
  ok(d->Call(&MemoryStub::Free, free));
  const Relayed after = d->Scrape();
  ASSERT_EQ(calls, 22);
  if (framed()) {
    EXPECT_EQ(after.framed - before.framed, calls);
    EXPECT_EQ(after.grpc - before.grpc, 0);
  } else {
    EXPECT_EQ(after.grpc - before.grpc, calls);
    EXPECT_EQ(after.framed, 0) << "the gRPC relay sent calls framed";
  }
}

// ------------------------------------------------------- large requests go by gRPC

// A unary Upload of 1 MiB (a request over 64 KiB) goes by gRPC and its bytes come back
// whole; a request of exactly 64 KiB goes framed, one byte more by gRPC.
TEST_P(UnaryRelayBothRelaysTest, RequestsOver64KiBGoByGrpc) {
  std::unique_ptr<Daemon> d = Daemon::Start(GetParam());
  ASSERT_NE(d, nullptr);
  const uint64_t buffer = d->Allocate(2 * kMiB);
  ASSERT_NE(buffer, 0u);
  v1::DownloadRequest download;
  *download.mutable_source() = At(buffer, 0);
  v1::DownloadResponse downloaded;

  // 1 MiB of data: by gRPC.
  const std::string big = RandomBytes(kMiB, 11);
  Relayed before = d->Scrape();
  v1::UploadResponse uploaded;
  grpc::Status status = d->Call(&MemoryStub::Upload, UploadOf(buffer, 0, big), &uploaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(uploaded.bytes_written(), kMiB);
  Relayed after = d->Scrape();
  EXPECT_EQ(after.grpc - before.grpc, 1);
  EXPECT_EQ(after.framed - before.framed, 0);
  // Its bytes round-trip (the Download's request is small: framed on the framed relay).
  download.set_size_bytes(kMiB);
  before = after;
  status = d->Call(&MemoryStub::Download, download, &downloaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(downloaded.data() == big) << "1 MiB did not round-trip";
  after = d->Scrape();
  EXPECT_EQ(after.framed - before.framed, framed() ? 1 : 0);
  EXPECT_EQ(after.grpc - before.grpc, framed() ? 0 : 1);

  // Exactly the limit: framed; one byte over: gRPC.
  for (const size_t size : {kFramedLimit, kFramedLimit + 1, kFramedLimit - 1}) {
    SCOPED_TRACE(absl::StrCat("an Upload request of ", size, " bytes"));
    const v1::UploadRequest request = UploadOfSize(buffer, size, static_cast<uint32_t>(size));
    ASSERT_EQ(request.ByteSizeLong(), size);
    before = d->Scrape();
    status = d->Call(&MemoryStub::Upload, request, &uploaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(uploaded.bytes_written(), request.data().size());
    after = d->Scrape();
    const bool goes_framed = framed() && size <= kFramedLimit;
    EXPECT_EQ(after.framed - before.framed, goes_framed ? 1 : 0);
    EXPECT_EQ(after.grpc - before.grpc, goes_framed ? 0 : 1);
    download.set_size_bytes(request.data().size());
    downloaded.Clear();
    status = d->Call(&MemoryStub::Download, download, &downloaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(downloaded.data() == request.data()) << "the bytes did not round-trip";
  }
}

// ------------------------------------------------------- many calls at once

// 32 threads of 50 small calls each on one session, more at once than its 4 framed channels
// take: all succeed, some go framed and some by gRPC (each thread's first call waits behind a
// kernel, so that more than 4 are in the worker at once), and the session goes on with its
// channels free.
TEST_F(UnaryRelayTest, ManyCallsOfOneSessionAtOnce) {
  std::unique_ptr<Daemon> d = Daemon::Start("framed");
  ASSERT_NE(d, nullptr);
  auto module = testing::CompileFakeKernels(d->session());
  ASSERT_THAT(module, IsOk());
  auto spin = module->GetFunction("spin_us");
  ASSERT_THAT(spin, IsOk());
  constexpr int kThreads = 32;
  constexpr int kCalls = 50;
  const Relayed before = d->Scrape();
  // A kernel of 2 s: the threads' first calls (SynchronizeSession) all wait for it.
  grpc::Status launched = d->Call(&ExecutionStub::Launch, SpinOf(spin->id(), 2'000'000));
  ASSERT_TRUE(launched.ok()) << launched.error_message();
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::string failure;
      for (int c = 0; c < kCalls && failure.empty(); ++c) {
        grpc::Status status;
        if (c == 0) {
          status = d->Call(&ExecutionStub::SynchronizeSession, v1::SynchronizeSessionRequest());
        } else if (c % 2 == 0) {
          v1::GetMemInfoResponse info;
          status = d->Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest(), &info);
          if (status.ok() && info.total_bytes() == 0) failure = "GetMemInfo answered no memory";
        } else {
          v1::QueryStreamResponse done;
          status = d->Call(&ExecutionStub::QueryStream, v1::QueryStreamRequest(), &done);
        }
        if (!status.ok()) {
          failure = absl::StrCat("thread ", t, " call ", c, ": ", status.error_code(), " ",
                                 status.error_message());
        }
      }
      absl::MutexLock lock(&mu);
      if (!failure.empty()) failures.push_back(failure);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(failures, ::testing::IsEmpty());
  const Relayed after = d->Scrape();
  EXPECT_EQ(after.total() - before.total(), kThreads * kCalls + 1);
  EXPECT_GT(after.framed - before.framed, 0);
  EXPECT_GT(after.grpc - before.grpc, 0) << "no call found the 4 channels busy";

  // The session goes on, framed again: every channel was freed.
  const Relayed again = d->Scrape();
  const uint64_t buffer = d->Allocate(64);
  ASSERT_NE(buffer, 0u);
  ASSERT_TRUE(d->Call(&MemoryStub::Upload, UploadOf(buffer, 0, "still here")).ok());
  v1::DownloadRequest download;
  *download.mutable_source() = At(buffer, 0);
  download.set_size_bytes(10);
  v1::DownloadResponse downloaded;
  ASSERT_TRUE(d->Call(&MemoryStub::Download, download, &downloaded).ok());
  EXPECT_EQ(downloaded.data(), "still here");
  const Relayed last = d->Scrape();
  EXPECT_EQ(last.framed - again.framed, 3);
  EXPECT_EQ(last.grpc - again.grpc, 0);
  EXPECT_THAT(d->session().Synchronize(), IsOk());
}

// ------------------------------------------------------- a worker that dies

// What a client saw of a unary SynchronizeSession waiting behind a long kernel when the worker
// was killed: the code and message (ids and pids made "<id>"), after checking what follows.
Answer KillTheWorkerUnderASync(const std::string& relay) {
  SCOPED_TRACE(relay);
  Answer seen;
  // No warm spare: the session's worker is the device's only worker, the one killed.
  std::unique_ptr<Daemon> d = Daemon::Start(relay, {}, /*warm_workers=*/0);
  EXPECT_NE(d, nullptr);
  if (d == nullptr) return seen;
  auto module = testing::CompileFakeKernels(d->session());
  EXPECT_THAT(module, IsOk());
  if (!module.ok()) return seen;
  auto spin = module->GetFunction("spin_us");
  EXPECT_THAT(spin, IsOk());
  if (!spin.ok()) return seen;
  LaunchConfig config;
  // 60 s: the worker is killed long before the kernel would end.
  EXPECT_THAT(spin->Launch(config, uint64_t{60'000'000}), IsOk());
  const Relayed before = d->Scrape();
  grpc::Status status;
  std::thread sync([&] {
    status = d->Call(&ExecutionStub::SynchronizeSession, v1::SynchronizeSessionRequest());
  });
  // The call went to the worker (counted once it is on its way).
  EXPECT_TRUE(Eventually([&] { return d->Scrape().total() >= before.total() + 1; }));
  const Relayed sent = d->Scrape();
  EXPECT_EQ(sent.framed - before.framed, relay == "framed" ? 1 : 0);
  EXPECT_EQ(sent.grpc - before.grpc, relay == "framed" ? 0 : 1);
  std::vector<pid_t> killed;
  EXPECT_EQ(KillDeviceWorkers(d->daemon(), &killed), 1);
  std::vector<uint64_t> ids = {d->session_id()};
  for (const pid_t pid : killed) ids.push_back(static_cast<uint64_t>(pid));
  sync.join();
  seen.call = "SynchronizeSession";
  seen.code = status.error_code();
  seen.message = Scrub(status.error_message(), ids);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("FAULTED"));
  EXPECT_THAT(status.error_message(), HasSubstr("SynchronizeSession"));

  // The session is FAULTED, and its calls say so without reaching a worker.
  const v1::KeepAliveResponse state = d->KeepAlive();
  EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_FALSE(state.fault_cause().empty());
  const Relayed faulted = d->Scrape();
  const grpc::Status after = d->Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest());
  EXPECT_EQ(after.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << after.error_message();
  EXPECT_EQ(d->Scrape().total(), faulted.total()) << "a call of a FAULTED session was relayed";

  // A new session works, on its framed channels as before.
  auto fresh = d->client().OpenSession(0, "after the kill");
  EXPECT_THAT(fresh, IsOk());
  if (fresh.ok()) {
    d->set_session_id(fresh->id());
    const Relayed fresh_before = d->Scrape();
    const uint64_t buffer = d->Allocate(64);
    EXPECT_NE(buffer, 0u);
    EXPECT_TRUE(d->Call(&MemoryStub::Upload, UploadOf(buffer, 0, "alive")).ok());
    v1::DownloadRequest download;
    *download.mutable_source() = At(buffer, 0);
    download.set_size_bytes(5);
    v1::DownloadResponse downloaded;
    const grpc::Status read = d->Call(&MemoryStub::Download, download, &downloaded);
    EXPECT_TRUE(read.ok()) << read.error_message();
    EXPECT_EQ(downloaded.data(), "alive");
    const Relayed fresh_after = d->Scrape();
    EXPECT_EQ(fresh_after.total() - fresh_before.total(), 3);
    EXPECT_EQ(fresh_after.framed - fresh_before.framed, relay == "framed" ? 3 : 0);
    EXPECT_EQ(d->KeepAlive().state(), v1::SESSION_STATE_ACTIVE);
  }
  return seen;
}

// A worker killed while a framed unary call waits in it: the call ends with the session's
// fault, exactly as on the gRPC relay, and the session is FAULTED.
TEST_F(UnaryRelayTest, AWorkerKilledUnderAFramedCallFaultsTheSession) {
  const Answer framed = KillTheWorkerUnderASync("framed");
  const Answer by_grpc = KillTheWorkerUnderASync("grpc");
  EXPECT_EQ(framed.code, by_grpc.code);
  EXPECT_EQ(framed.message, by_grpc.message);
}

// A client that gives up on a call waiting in the worker (its deadline passes) ends its call
// in the daemon at once on both relays: the gRPC relay cancels its worker call, the framed
// relay abandons the framed call (its answer comes later and is dropped). The session does not
// count it in flight any longer, and serves other calls meanwhile.
TEST_P(UnaryRelayBothRelaysTest, ACallWhoseClientGaveUpEndsAtOnce) {
  std::unique_ptr<Daemon> d = Daemon::Start(GetParam());
  ASSERT_NE(d, nullptr);
  auto module = testing::CompileFakeKernels(d->session());
  ASSERT_THAT(module, IsOk());
  auto spin = module->GetFunction("spin_us");
  ASSERT_THAT(spin, IsOk());
  LaunchConfig config;
  ASSERT_THAT(spin->Launch(config, uint64_t{20'000'000}), IsOk());  // 20 s
  {
    ExecutionStub stub(d->channel());
    grpc::ClientContext context;
    d->Prepare(&context);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    v1::SynchronizeSessionResponse response;
    const grpc::Status status =
        stub.SynchronizeSession(&context, v1::SynchronizeSessionRequest(), &response);
    ASSERT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  }
  // The daemon answered the call (with its deadline or a cancel) long before the kernel ends.
  auto ended = [&] {
    auto body = testing::ScrapeMetrics(d->metrics_port());
    if (!body.ok()) return false;
    for (absl::string_view line : absl::StrSplit(*body, '\n')) {
      if (absl::StartsWith(line, "gpurpc_rpcs_total{") &&
          absl::StrContains(line, "/gpurpc.v1.ExecutionService/SynchronizeSession") &&
          !absl::StrContains(line, "code=\"OK\"")) {
        return true;
      }
    }
    return false;
  };
  EXPECT_TRUE(Eventually(ended, absl::Seconds(8)))
      << "the abandoned SynchronizeSession was still in the daemon after 8 s";
  // Other calls of the session go on while the kernel runs.
  v1::GetMemInfoResponse info;
  const grpc::Status other = d->Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest(), &info);
  EXPECT_TRUE(other.ok()) << other.error_message();
}

// ------------------------------------------------------- the ledger

// The tenant's device memory quota holds through the relay: within it an Allocate goes to the
// worker; over it the call is refused RESOURCE_EXHAUSTED before the worker (not counted as
// relayed); a Free gives the bytes back.
TEST_P(UnaryRelayBothRelaysTest, TheMemoryQuotaHoldsThroughTheRelay) {
  std::unique_ptr<Daemon> d =
      Daemon::Start(GetParam(), {absl::StrCat("--tenant-max-device-memory-bytes=", 64 * kMiB)});
  ASSERT_NE(d, nullptr);
  auto allocate = [&](uint64_t size, uint64_t* id) {
    v1::AllocateRequest request;
    request.set_size_bytes(size);
    v1::AllocateResponse response;
    const grpc::Status status = d->Call(&MemoryStub::Allocate, request, &response);
    *id = response.buffer().buffer_id();
    return status;
  };
  auto free = [&](uint64_t id) {
    v1::FreeRequest request;
    request.set_buffer_id(id);
    return d->Call(&MemoryStub::Free, request);
  };
  const Relayed before = d->Scrape();
  uint64_t first = 0;
  grpc::Status status = allocate(48 * kMiB, &first);
  ASSERT_TRUE(status.ok()) << status.error_message();
  uint64_t refused = 0;
  status = allocate(32 * kMiB, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("max_device_memory_bytes"));
  EXPECT_EQ(refused, 0u);
  // The refused call never reached the worker: one call relayed so far.
  Relayed now = d->Scrape();
  EXPECT_EQ(now.total() - before.total(), 1);
  EXPECT_EQ(now.framed - before.framed, framed() ? 1 : 0);

  status = free(first);
  ASSERT_TRUE(status.ok()) << status.error_message();
  uint64_t second = 0;
  status = allocate(32 * kMiB, &second);
  ASSERT_TRUE(status.ok()) << "the Free did not give the bytes back: " << status.error_message();
  uint64_t third = 0;
  status = allocate(16 * kMiB, &third);
  ASSERT_TRUE(status.ok()) << status.error_message();
  uint64_t over = 0;
  status = allocate(32 * kMiB, &over);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  // A Free the worker refuses gives nothing back.
  EXPECT_EQ(free(777777777).error_code(), grpc::StatusCode::NOT_FOUND);
  status = allocate(32 * kMiB, &over);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  status = free(second);
  ASSERT_TRUE(status.ok()) << status.error_message();
  status = allocate(32 * kMiB, &over);
  EXPECT_TRUE(status.ok()) << status.error_message();
  // Relayed: 4 Allocates that fit, 3 Frees; not the 3 refused.
  now = d->Scrape();
  EXPECT_EQ(now.total() - before.total(), 7);
  EXPECT_EQ(now.framed - before.framed, framed() ? 7 : 0);
  EXPECT_TRUE(free(third).ok());
  EXPECT_TRUE(free(over).ok());
}

// ------------------------------------------------------- hostile raw requests

// What the relay answers to raw requests a hostile client sends, in order (ids made "<id>"),
// and how many of them the counter took as relayed; afterwards the session still works.
std::vector<Answer> SendHostileRequests(Daemon& d, double* relayed) {
  std::vector<Answer> answers;
  auto record = [&](const std::string& call, const grpc::Status& status) {
    answers.push_back(
        Answer{call, status.error_code(), Scrub(status.error_message(), {d.session_id()}), ""});
  };
  const Relayed before = d.Scrape();
  record("garbage Launch", d.Raw(kLaunch, {std::string("\xff\xff\xff\xff\x0f", 5)}));
  record("garbage Allocate", d.Raw(kAllocate, {std::string("\x08\xff\xff", 3)}));
  record("no request message", d.Raw(kGetMemInfo, {}));
  record("two request messages", d.Raw(kGetMemInfo, {std::string(), std::string("\x08\x01", 2)}));
  record("an unknown method of a session service",
         d.Raw("/gpurpc.v1.MemoryService/NoSuchMethod", {std::string()}));
  record("an unknown method of ExecutionService",
         d.Raw("/gpurpc.v1.ExecutionService/Launch2", {std::string()}));
  // 8 million unknown fields: 16 MB that would parse to far more than the bound allows.
  std::string unknown;
  for (int i = 0; i < 8'000'000; ++i) unknown.append("\x78\x01", 2);
  record("a Launch over the parse bound", d.Raw(kLaunch, {unknown}));
  record("no session", d.Raw(kGetMemInfo, {std::string()}, nullptr, /*session=*/false));
  const uint64_t own = d.session_id();
  d.set_session_id(own + 1000003);
  record("an unknown session", d.Raw(kGetMemInfo, {std::string()}));
  d.set_session_id(own);
  // The session still answers a normal call.
  v1::GetMemInfoResponse info;
  std::string answer;
  record("GetMemInfo", d.Raw(kGetMemInfo, {std::string()}, &answer));
  EXPECT_TRUE(info.ParseFromString(answer));
  EXPECT_GT(info.total_bytes(), 0u);
  *relayed = d.Scrape().total() - before.total();
  return answers;
}

// Hostile raw requests on the framed relay are answered as on the gRPC relay, each with the
// code it should have; those refused before the worker are not counted as relayed, and the
// session still works afterwards.
TEST_F(UnaryRelayTest, HostileRawRequestsAreAnsweredAsOnTheGrpcRelay) {
  std::unique_ptr<Daemon> framed = Daemon::Start("framed");
  std::unique_ptr<Daemon> grpc_relay = Daemon::Start("grpc");
  ASSERT_NE(framed, nullptr);
  ASSERT_NE(grpc_relay, nullptr);
  double framed_relayed = 0;
  double grpc_relayed = 0;
  const Relayed framed_before = framed->Scrape();
  const std::vector<Answer> by_framed = SendHostileRequests(*framed, &framed_relayed);
  const Relayed framed_after = framed->Scrape();
  const std::vector<Answer> by_grpc = SendHostileRequests(*grpc_relay, &grpc_relayed);
  ASSERT_EQ(by_framed.size(), by_grpc.size());
  for (size_t i = 0; i < by_framed.size(); ++i) {
    SCOPED_TRACE(by_framed[i].call);
    EXPECT_EQ(by_framed[i].code, by_grpc[i].code);
    EXPECT_EQ(by_framed[i].message, by_grpc[i].message);
  }
  const std::vector<std::pair<grpc::StatusCode, std::string>> expected = {
      {grpc::StatusCode::INVALID_ARGUMENT, "/gpurpc.v1.ExecutionService/Launch: the request"},
      {grpc::StatusCode::INVALID_ARGUMENT, "/gpurpc.v1.MemoryService/Allocate: the request"},
      {grpc::StatusCode::UNIMPLEMENTED, "/gpurpc.v1.MemoryService/GetMemInfo"},
      {grpc::StatusCode::OK, ""},
      {grpc::StatusCode::UNIMPLEMENTED, ""},
      {grpc::StatusCode::UNIMPLEMENTED, ""},
      {grpc::StatusCode::INVALID_ARGUMENT, "/gpurpc.v1.ExecutionService/Launch: the request"},
      {grpc::StatusCode::INVALID_ARGUMENT, ""},
      {grpc::StatusCode::NOT_FOUND, ""},
      {grpc::StatusCode::OK, ""},
  };
  ASSERT_EQ(by_framed.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(by_framed[i].call);
    EXPECT_EQ(by_framed[i].code, expected[i].first) << by_framed[i].message;
    EXPECT_THAT(by_framed[i].message, HasSubstr(expected[i].second));
  }
  // Relayed: the two garbage requests (the worker answers them), the call with two messages
  // (its first) and the last GetMemInfo; none of the refused ones.
  EXPECT_EQ(framed_relayed, 4);
  EXPECT_EQ(framed_after.framed - framed_before.framed, 4);
  EXPECT_EQ(framed_after.grpc - framed_before.grpc, 0);
  EXPECT_EQ(grpc_relayed, 4);
  // Both sessions are untouched.
  EXPECT_EQ(framed->KeepAlive().state(), v1::SESSION_STATE_ACTIVE);
  EXPECT_THAT(framed->session().Synchronize(), IsOk());
  EXPECT_THAT(grpc_relay->session().Synchronize(), IsOk());
}

INSTANTIATE_TEST_SUITE_P(Relays, UnaryRelayBothRelaysTest, ::testing::Values("framed", "grpc"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace gpurpc
