// The front end's relay of MemoryService.UploadStream and DownloadStream on framed transfer
// channels to the workers (server/frontend/command_relay.h, StartFramedTransferRelay; served by
// ServeRelayedTransfer, server/worker/framed_commands.h), against real daemons with real worker
// processes: a client must see exactly what the gRPC relay (--command-relay=grpc) gives it,
// statuses and bytes alike, for good transfers and hostile ones (bad counts, oversized chunks
// and messages, bytes that are not protobuf, a download with other than one request); many
// transfers of one session at once, more than the framed relay takes (the rest go by gRPC);
// clients that go away mid-transfer, more of them than the worker's bound on relayed
// channels, must leave nothing behind; and a worker that dies mid-transfer ends the call with
// the status the gRPC relay gives, without hanging. Compiled twice: label `service` with the
// fake backend, label `gpu` with the CUDA backend (GPURPC_TEST_BACKEND; it skips without a
// driver).
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::KillDeviceWorkers;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1ull << 20;
constexpr char kBackend[] = GPURPC_TEST_BACKEND;
constexpr char kUploadStream[] = "/gpurpc.v1.MemoryService/UploadStream";
constexpr char kDownloadStream[] = "/gpurpc.v1.MemoryService/DownloadStream";
using MemoryStub = v1::MemoryService::Stub;

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

// The first message of an upload: where, how much in all, and its chunk.
v1::UploadStreamRequest UploadFirst(v1::DevicePointer to, uint64_t total, std::string data) {
  v1::UploadStreamRequest request;
  *request.mutable_destination() = std::move(to);
  request.set_total_size_bytes(total);
  request.set_data(std::move(data));
  return request;
}

// A later message of an upload: its chunk only.
v1::UploadStreamRequest UploadMore(std::string data) {
  v1::UploadStreamRequest request;
  request.set_data(std::move(data));
  return request;
}

v1::DownloadRequest DownloadReq(v1::DevicePointer from, uint64_t size, uint64_t chunk = 0) {
  v1::DownloadRequest request;
  *request.mutable_source() = std::move(from);
  request.set_size_bytes(size);
  request.set_chunk_size_bytes(chunk);
  return request;
}

// `data` to `to` as an upload's messages of `chunk` bytes each.
std::vector<v1::UploadStreamRequest> Chunked(v1::DevicePointer to, const std::string& data,
                                             uint64_t chunk) {
  std::vector<v1::UploadStreamRequest> messages;
  for (uint64_t at = 0; at < data.size() || messages.empty(); at += chunk) {
    std::string piece = data.substr(at, chunk);
    messages.push_back(at == 0 ? UploadFirst(to, data.size(), std::move(piece))
                               : UploadMore(std::move(piece)));
  }
  return messages;
}

// What a client saw of one call.
struct Seen {
  std::vector<std::string> responses;  // serialized, in order
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;

  // The same with every mention of `buffer` (an id, random per session) in the status's
  // message made "<buffer>", so that two sessions' calls compare.
  Seen WithoutId(uint64_t buffer) const {
    Seen out = *this;
    out.message = absl::StrReplaceAll(message, {{std::to_string(buffer), "<buffer>"}});
    return out;
  }

  // The bytes of the DownloadResponses, one after the other.
  std::string Downloaded() const {
    std::string out;
    for (const std::string& serialized : responses) {
      v1::DownloadResponse response;
      if (response.ParseFromString(serialized)) out += response.data();
    }
    return out;
  }

  void Set(const grpc::Status& status) {
    code = status.error_code();
    message = status.error_message();
  }
};

// gpurpc_transfer_streams_total{relay="<relay>"} on the daemon's /metrics at `port`.
std::optional<uint64_t> TransfersRelayed(int port, const std::string& relay) {
  const std::string body = testing::ScrapeMetrics(port).value_or("");
  const std::string series =
      absl::StrCat("\ngpurpc_transfer_streams_total{relay=\"", relay, "\"} ");
  const size_t at = body.find(series);
  if (at == std::string::npos) return std::nullopt;
  const size_t start = at + series.size();
  const size_t end = body.find('\n', start);
  uint64_t count = 0;
  if (end == std::string::npos || !absl::SimpleAtoi(body.substr(start, end - start), &count)) {
    return std::nullopt;
  }
  return count;
}

// One daemon, one session, and raw transfers on it.
class Daemon {
 public:
  // With `metrics`, the daemon serves /metrics on a free loopback port (metrics_port()).
  static std::unique_ptr<Daemon> Start(std::vector<std::string> flags, bool metrics = false) {
    TestDaemon::Options options;
    options.backend = kBackend;
    options.extra_flags = std::move(flags);
    options.extra_flags.push_back("--fake-memory-bytes=1073741824");
    int metrics_port = 0;
    if (metrics) {
      auto port = testing::FreeLoopbackPort();
      EXPECT_THAT(port, IsOk());
      if (!port.ok()) return nullptr;
      metrics_port = *port;
      options.extra_flags.push_back(absl::StrCat("--metrics-listen=127.0.0.1:", metrics_port));
    }
    auto daemon = TestDaemon::Start(std::move(options));
    EXPECT_THAT(daemon, IsOk());
    if (!daemon.ok()) return nullptr;
    auto out = std::unique_ptr<Daemon>(new Daemon());
    out->daemon_ = *std::move(daemon);
    out->metrics_port_ = metrics_port;
    ConnectOptions connect;
    connect.address = out->daemon_->address();
    connect.use_environment = false;  // no direct channel: every transfer goes by the relay
    auto client = Client::Connect(connect);
    EXPECT_THAT(client, IsOk());
    if (!client.ok()) return nullptr;
    out->client_ = std::make_unique<Client>(*std::move(client));
    auto session = out->client_->OpenSession(0, "transfer relay test");
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
  Session& session() { return *session_; }
  int metrics_port() const { return metrics_port_; }
  uint64_t Allocate(uint64_t size) {
    auto buffer = session_->Allocate(size);
    EXPECT_THAT(buffer, IsOk());
    if (!buffer.ok()) return 0;
    buffers_.push_back(*std::move(buffer));
    return buffers_.back().id();
  }

  // A call of the session, ended by a deadline whatever happens.
  void Prepare(grpc::ClientContext* context, int seconds = 60) {
    context->AddMetadata("gpurpc-session", std::to_string(session_->id()));
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }
  std::unique_ptr<MemoryStub> Stub() { return v1::MemoryService::NewStub(channel_); }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  // An UploadStream of these messages through the generated stub.
  Seen Upload(const std::vector<v1::UploadStreamRequest>& messages) {
    grpc::ClientContext context;
    Prepare(&context);
    v1::UploadResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::UploadStreamRequest>> writer =
        Stub()->UploadStream(&context, &response);
    for (const v1::UploadStreamRequest& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    Seen seen;
    seen.Set(writer->Finish());
    if (seen.code == grpc::StatusCode::OK) seen.responses.push_back(response.SerializeAsString());
    return seen;
  }

  // A DownloadStream of `request` through the generated stub.
  Seen Download(const v1::DownloadRequest& request) {
    grpc::ClientContext context;
    Prepare(&context);
    std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
        Stub()->DownloadStream(&context, request);
    Seen seen;
    v1::DownloadResponse chunk;
    while (reader->Read(&chunk)) seen.responses.push_back(chunk.SerializeAsString());
    seen.Set(reader->Finish());
    return seen;
  }

  // Any number of messages of any bytes to `method`, then a half-close (grpc::GenericStub):
  // every answer, and the status.
  Seen Raw(const std::string& method, const std::vector<std::string>& requests) {
    grpc::ClientContext context;
    Prepare(&context);
    testing::RawCallResult call = testing::RawCall(channel_, &context, method, requests);
    Seen seen;
    seen.responses = std::move(call.responses);
    seen.Set(call.status);
    return seen;
  }

  // Ends the session's client, then the daemon at once (SIGKILL; its workers follow it), and
  // reaps it. For a daemon whose graceful end is not under test: after a transfer to a reader
  // slower than the front end's writes, gRPC's TCP backup poller can hold the front end's exit
  // (grpc_shutdown) up to 10 s, on either relay, and TestDaemon waits that long before it
  // kills.
  void Kill() {
    channel_.reset();
    buffers_.clear();
    session_.reset();
    client_.reset();
    kill(daemon_->pid(), SIGKILL);
    for (int i = 0; i < 1000 && daemon_->CheckRunning().ok(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  Daemon() = default;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  std::vector<Buffer> buffers_;
  std::shared_ptr<grpc::Channel> channel_;
  int metrics_port_ = 0;
};

class TransferRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA relay: " << cuda;
      }
    }
  }
};

// The buffer every script works on: the good ones read and write its first 3 MiB, the hostile
// uploads aim at kHostile (so that what they write before they are refused is out of the way),
// and a chunk over 4 MiB fits after it.
constexpr uint64_t kScriptBuffer = 12 * kMiB;
constexpr uint64_t kHostile = 4 * kMiB;
// What the first script uploads, and the others download.
const std::string& Uploaded() {
  static const std::string* const kBytes = new std::string(RandomBytes(3 * kMiB, 1));
  return *kBytes;
}

// `prefix` (a serialized message) and then an unknown length-delimited field (number 31) that
// makes it `total` bytes in all (total - prefix.size() must be in [2^21 + 6, 2^28)), so that
// its size does not depend on the ids it names.
std::string WithUnknownField(std::string prefix, size_t total) {
  const size_t length = total - prefix.size() - 2 - 4;  // tag, 4-byte length
  prefix += std::string("\xfa\x01", 2);
  for (int i = 0; i < 4; ++i) {
    const uint8_t low = static_cast<uint8_t>((length >> (7 * i)) & 0x7f);
    prefix.push_back(static_cast<char>(i < 3 ? low | 0x80 : low));
  }
  prefix.append(length, 'u');
  return prefix;
}

// `prefix` (a serialized message) and then unknown varint fields (number 15, value 0) that
// make it `total` bytes in all, two bytes each (the first three when needed, its zero in two
// bytes), so that its size does not depend on the ids it names: a message whose parse takes
// far more memory than its size, over its parse bound (server/parse_limit.h) from about 2 MB.
std::string WithManyUnknownFields(std::string prefix, size_t total) {
  if ((total - prefix.size()) % 2 == 1) prefix.append("\x78\x80\x00", 3);
  while (prefix.size() < total) prefix.append("\x78\x00", 2);
  return prefix;
}

struct Script {
  std::string name;
  bool good;  // ends OK; else it is refused
  std::function<Seen(Daemon&, uint64_t buffer)> run;
};

// The transfers a client may make, good and hostile, in order, on a session with one buffer
// of kScriptBuffer bytes.
std::vector<Script> Scripts() {
  const std::string kGarbage("\x07\xff\xff", 3);
  return {
      {"upload 3 MiB in 1 MiB chunks", true,
       [](Daemon& d, uint64_t b) { return d.Upload(Chunked(At(b, 0), Uploaded(), kMiB)); }},
      {"download it in 1 MiB chunks", true,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, 0), 3 * kMiB, kMiB)); }},
      {"download it in 4 MiB chunks", true,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, 0), 3 * kMiB, 4 * kMiB)); }},
      {"download it in default chunks, from an offset", true,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, 4096), 3 * kMiB - 4096)); }},
      {"an upload with no message", false, [](Daemon& d, uint64_t) { return d.Upload({}); }},
      {"an upload with no message (raw)", false,
       [](Daemon& d, uint64_t) { return d.Raw(kUploadStream, {}); }},
      {"an upload announcing more than it sends", false,
       [](Daemon& d, uint64_t b) {
         return d.Upload({UploadFirst(At(b, kHostile), 8, "1234"), UploadMore("")});
       }},
      {"an upload announcing less than it sends", false,
       [](Daemon& d, uint64_t b) {
         return d.Upload({UploadFirst(At(b, kHostile), 4, "1234"), UploadMore("5678")});
       }},
      {"an upload chunk of 4 MiB + 1", false,
       [](Daemon& d, uint64_t b) {
         return d.Upload(
             {UploadFirst(At(b, kHostile), 4 * kMiB + 1, std::string(4 * kMiB + 1, 'c'))});
       }},
      {"an upload whose second chunk is 5 MiB", false,
       [](Daemon& d, uint64_t b) {
         return d.Upload({UploadFirst(At(b, kHostile), 6 * kMiB, std::string(kMiB, 'c')),
                          UploadMore(std::string(5 * kMiB, 'd'))});
       }},
      {"a valid first message, then bytes that are not protobuf", false,
       [kGarbage](Daemon& d, uint64_t b) {
         return d.Raw(kUploadStream,
                      {UploadFirst(At(b, kHostile), 8, "abcd").SerializeAsString(), kGarbage});
       }},
      // Every announced byte arrived: the refusal must still come before any response.
      {"a whole upload, then a message over its parse bound", false,
       [](Daemon& d, uint64_t b) {
         return d.Raw(kUploadStream, {UploadFirst(At(b, kHostile), 4, "abcd").SerializeAsString(),
                                      WithManyUnknownFields("", 3'000'000)});
       }},
      {"a first message that is not protobuf", false,
       [kGarbage](Daemon& d, uint64_t) { return d.Raw(kUploadStream, {kGarbage}); }},
      {"a first message of 6 MB, most of it one unknown field", false,
       [](Daemon& d, uint64_t b) {
         return d.Raw(kUploadStream,
                      {WithUnknownField(UploadFirst(At(b, kHostile), 4, "abcd").SerializeAsString(),
                                        6'000'000)});
       }},
      {"an upload to an unknown buffer", false,
       [](Daemon& d, uint64_t) { return d.Upload({UploadFirst(At(12345, 0), 4, "abcd")}); }},
      {"an upload past the buffer's end", false,
       [](Daemon& d, uint64_t b) {
         return d.Upload({UploadFirst(At(b, kScriptBuffer - 2), 4, "abcd")});
       }},
      {"a download of an unknown buffer", false,
       [](Daemon& d, uint64_t) { return d.Download(DownloadReq(At(12345, 0), 16)); }},
      {"a download past the buffer's end", false,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, kScriptBuffer - 8), 16)); }},
      {"a download in chunks of 4 MiB + 1", false,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, 0), 16, 4 * kMiB + 1)); }},
      {"a DownloadStream with two request messages", false,
       [](Daemon& d, uint64_t b) {
         const std::string request = DownloadReq(At(b, 0), 16).SerializeAsString();
         return d.Raw(kDownloadStream, {request, request});
       }},
      {"a DownloadStream with no request message", false,
       [](Daemon& d, uint64_t) { return d.Raw(kDownloadStream, {}); }},
      {"a DownloadStream request over its parse bound", false,
       [](Daemon& d, uint64_t b) {
         return d.Raw(
             kDownloadStream,
             {WithManyUnknownFields(DownloadReq(At(b, 0), 16).SerializeAsString(), 3'000'000)});
       }},
      {"a DownloadStream request over its parse bound, then another", false,
       [](Daemon& d, uint64_t b) {
         const std::string request =
             WithManyUnknownFields(DownloadReq(At(b, 0), 16).SerializeAsString(), 3'000'000);
         return d.Raw(kDownloadStream, {request, request});
       }},
      {"a DownloadStream request that is not protobuf", false,
       [kGarbage](Daemon& d, uint64_t) { return d.Raw(kDownloadStream, {kGarbage}); }},
      // Unknown fields are kept, not refused: the 6 MB parse within the request's bound.
      {"a DownloadStream request of 6 MB, most of it one unknown field", true,
       [](Daemon& d, uint64_t b) {
         return d.Raw(kDownloadStream,
                      {WithUnknownField(DownloadReq(At(b, 0), 16).SerializeAsString(), 6'000'000)});
       }},
      {"a download of 0 bytes", true,
       [](Daemon& d, uint64_t b) { return d.Download(DownloadReq(At(b, 0), 0)); }},
      {"a download of 0 bytes (raw)", true,
       [](Daemon& d, uint64_t b) {
         return d.Raw(kDownloadStream, {DownloadReq(At(b, 0), 0).SerializeAsString()});
       }},
      {"the upload's bytes, read back raw after all that", true,
       [](Daemon& d, uint64_t b) {
         return d.Raw(kDownloadStream, {DownloadReq(At(b, 0), 3 * kMiB).SerializeAsString()});
       }},
  };
}

// Whatever the script, the framed relay answers byte for byte what the gRPC relay answers,
// and ends with the same status.
TEST_F(TransferRelayTest, FramedAndGrpcRelaysAnswerAlike) {
  std::unique_ptr<Daemon> framed = Daemon::Start({});
  std::unique_ptr<Daemon> grpc_relay = Daemon::Start({"--command-relay=grpc"});
  ASSERT_NE(framed, nullptr);
  ASSERT_NE(grpc_relay, nullptr);
  const uint64_t framed_buffer = framed->Allocate(kScriptBuffer);
  const uint64_t grpc_buffer = grpc_relay->Allocate(kScriptBuffer);
  const std::vector<Script> scripts = Scripts();
  std::vector<Seen> seen;  // the framed relay's, by script
  for (const Script& script : scripts) {
    SCOPED_TRACE(script.name);
    const Seen by_grpc = script.run(*grpc_relay, grpc_buffer).WithoutId(grpc_buffer);
    const Seen by_framed = script.run(*framed, framed_buffer).WithoutId(framed_buffer);
    EXPECT_EQ(by_framed.code, by_grpc.code) << by_framed.message << " / " << by_grpc.message;
    EXPECT_EQ(by_framed.message, by_grpc.message);
    EXPECT_EQ(by_framed.responses.size(), by_grpc.responses.size());
    EXPECT_TRUE(by_framed.responses == by_grpc.responses) << "the responses differ";
    seen.push_back(by_framed);
    if (std::getenv("GPURPC_TRANSFER_RELAY_VERBOSE") != nullptr) {
      std::cerr << script.name << ": " << by_framed.code << " \"" << by_framed.message << "\", "
                << by_framed.responses.size() << " responses\n";
    }
  }
  // The scripts did what they should have (so that two wrong relays cannot agree).
  auto by_name = [&](const std::string& name) -> const Seen& {
    for (size_t i = 0; i < scripts.size(); ++i) {
      if (scripts[i].name == name) return seen[i];
    }
    ADD_FAILURE() << "no script " << name;
    static const Seen kNone;
    return kNone;
  };
  {
    const Seen& upload = by_name("upload 3 MiB in 1 MiB chunks");
    ASSERT_EQ(upload.code, grpc::StatusCode::OK) << upload.message;
    ASSERT_EQ(upload.responses.size(), 1u);
    v1::UploadResponse response;
    ASSERT_TRUE(response.ParseFromString(upload.responses[0]));
    EXPECT_EQ(response.bytes_written(), 3 * kMiB);
  }
  for (const auto& [name, chunks] : std::vector<std::pair<std::string, size_t>>{
           {"download it in 1 MiB chunks", 3},
           {"download it in 4 MiB chunks", 1},
           {"the upload's bytes, read back raw after all that", 3}}) {
    SCOPED_TRACE(name);
    const Seen& download = by_name(name);
    EXPECT_EQ(download.code, grpc::StatusCode::OK) << download.message;
    EXPECT_EQ(download.responses.size(), chunks);
    EXPECT_TRUE(download.Downloaded() == Uploaded()) << "the bytes differ";
  }
  {
    const Seen& offset = by_name("download it in default chunks, from an offset");
    EXPECT_EQ(offset.code, grpc::StatusCode::OK) << offset.message;
    EXPECT_EQ(offset.responses.size(), 3u);
    EXPECT_TRUE(offset.Downloaded() == Uploaded().substr(4096)) << "the bytes differ";
  }
  for (const char* name :
       {"a DownloadStream with two request messages", "a DownloadStream with no request message",
        "a DownloadStream request over its parse bound, then another"}) {
    SCOPED_TRACE(name);
    const Seen& refused = by_name(name);
    EXPECT_EQ(refused.code, grpc::StatusCode::UNIMPLEMENTED) << refused.message;
    EXPECT_THAT(refused.message, HasSubstr("exactly one request message"));
    EXPECT_TRUE(refused.responses.empty());
  }
  for (const auto& [name, what] : std::vector<std::pair<std::string, std::string>>{
           {"a whole upload, then a message over its parse bound", "message 2 of the stream"},
           {"a DownloadStream request over its parse bound", "DownloadStream: the request"}}) {
    SCOPED_TRACE(name);
    const Seen& refused = by_name(name);
    EXPECT_EQ(refused.code, grpc::StatusCode::INVALID_ARGUMENT) << refused.message;
    EXPECT_THAT(refused.message, HasSubstr(what));
    EXPECT_THAT(refused.message, HasSubstr("once parsed"));
    EXPECT_TRUE(refused.responses.empty()) << "answered before it was refused";
  }
  EXPECT_THAT(by_name("a first message of 6 MB, most of it one unknown field").message,
              HasSubstr("message 1 is 6000000 bytes"));
  {
    const Seen& large = by_name("a DownloadStream request of 6 MB, most of it one unknown field");
    EXPECT_EQ(large.Downloaded(), Uploaded().substr(0, 16));
  }
  for (const char* name : {"a download of 0 bytes", "a download of 0 bytes (raw)"}) {
    SCOPED_TRACE(name);
    const Seen& empty = by_name(name);
    EXPECT_EQ(empty.code, grpc::StatusCode::OK) << empty.message;
    EXPECT_TRUE(empty.responses.empty());
  }
  for (size_t i = 0; i < scripts.size(); ++i) {
    SCOPED_TRACE(scripts[i].name);
    if (scripts[i].good) {
      EXPECT_EQ(seen[i].code, grpc::StatusCode::OK) << seen[i].message;
      continue;
    }
    // Refused as a bad request, not as a broken relay or worker.
    EXPECT_NE(seen[i].code, grpc::StatusCode::OK);
    EXPECT_NE(seen[i].code, grpc::StatusCode::DEADLINE_EXCEEDED) << seen[i].message;
    EXPECT_NE(seen[i].code, grpc::StatusCode::UNAVAILABLE) << seen[i].message;
    EXPECT_NE(seen[i].code, grpc::StatusCode::ABORTED) << seen[i].message;
    EXPECT_NE(seen[i].code, grpc::StatusCode::CANCELLED) << seen[i].message;
  }
  // The session, and both daemons, are still well.
  EXPECT_THAT(framed->session().Synchronize(), IsOk());
  EXPECT_THAT(framed->daemon().CheckRunning(), IsOk());
  EXPECT_THAT(grpc_relay->daemon().CheckRunning(), IsOk());
}

// Waits until `count` threads have arrived, round after round (at most `timeout` each time:
// a thread that never comes cannot hang the test).
class Rendezvous {
 public:
  explicit Rendezvous(int count) : count_(count) {}
  // False when the others did not all come in time.
  bool Arrive(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const uint64_t round = round_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++round_;
      return true;
    }
    auto next = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return round_ != round; };
    return mu_.AwaitWithTimeout(absl::Condition(&next), timeout);
  }

 private:
  absl::Mutex mu_;
  const int count_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t round_ ABSL_GUARDED_BY(mu_) = 0;
};

// More transfers of one session at once than the framed relay takes: 16 uploads, each of its
// own region, all open together (so 8 go framed, the rest by gRPC), then each reads its
// region back; round after round. Every byte comes back where it went.
TEST_F(TransferRelayTest, ManyTransfersOfOneSessionAtOnce) {
  std::unique_ptr<Daemon> d = Daemon::Start({}, /*metrics=*/true);
  ASSERT_NE(d, nullptr);
  constexpr int kThreads = 16;
  constexpr int kRounds = 3;
  constexpr uint64_t kRegion = 2 * kMiB;
  const uint64_t buffer = d->Allocate(kThreads * kRegion);
  Rendezvous all_open(kThreads);
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<std::string> failures;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::string failure;
      const uint64_t at = static_cast<uint64_t>(t) * kRegion;
      for (int round = 0; round < kRounds; ++round) {
        if (!failure.empty()) {
          // A thread that failed still comes to the rounds it leaves, so that no other waits.
          (void)all_open.Arrive(absl::Seconds(60));
          continue;
        }
        const std::string data = RandomBytes(kRegion, static_cast<uint32_t>(t * 100 + round));
        const std::vector<v1::UploadStreamRequest> messages = Chunked(At(buffer, at), data, kMiB);
        {
          grpc::ClientContext context;
          d->Prepare(&context);
          v1::UploadResponse response;
          std::unique_ptr<grpc::ClientWriter<v1::UploadStreamRequest>> writer =
              d->Stub()->UploadStream(&context, &response);
          const bool first = writer->Write(messages[0]);
          // Every thread's upload is open before any ends.
          if (!all_open.Arrive(absl::Seconds(60))) failure = "the others did not come";
          bool rest = first;
          for (size_t m = 1; m < messages.size() && rest; ++m) rest = writer->Write(messages[m]);
          writer->WritesDone();
          const grpc::Status status = writer->Finish();
          if (!status.ok()) {
            failure = absl::StrCat("thread ", t, " round ", round,
                                   ": upload: ", status.error_code(), " ", status.error_message());
          } else if (response.bytes_written() != kRegion) {
            failure = absl::StrCat("thread ", t, " round ", round, ": upload wrote ",
                                   response.bytes_written());
          }
        }
        if (!failure.empty()) continue;
        const Seen seen =
            d->Download(DownloadReq(At(buffer, at), kRegion, round % 2 == 0 ? 0 : kMiB / 2));
        if (seen.code != grpc::StatusCode::OK) {
          failure = absl::StrCat("thread ", t, " round ", round, ": download: ", seen.code, " ",
                                 seen.message);
        } else if (seen.Downloaded() != data) {
          failure = absl::StrCat("thread ", t, " round ", round, ": the bytes differ");
        }
      }
      absl::MutexLock lock(&mu);
      if (!failure.empty()) failures.push_back(failure);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(failures, ::testing::IsEmpty());
  EXPECT_THAT(d->session().Synchronize(), IsOk());
  // Both relays carried some.
  const std::optional<uint64_t> framed = TransfersRelayed(d->metrics_port(), "framed");
  const std::optional<uint64_t> by_grpc = TransfersRelayed(d->metrics_port(), "grpc");
  ASSERT_TRUE(framed.has_value());
  ASSERT_TRUE(by_grpc.has_value());
  EXPECT_GE(*framed, 8u);
  EXPECT_GE(*by_grpc, 8u);
  EXPECT_EQ(*framed + *by_grpc, 2u * kThreads * kRounds);
}

// Clients that go away mid-transfer (an upload cancelled after its first chunk, a download
// after its first chunk read), more of them than the worker keeps relayed channels for a
// session, leave nothing behind: the next transfers work, every byte in place.
TEST_F(TransferRelayTest, ClientsThatGoAwayMidTransferLeaveNothingBehind) {
  std::unique_ptr<Daemon> d = Daemon::Start({}, /*metrics=*/true);
  ASSERT_NE(d, nullptr);
  constexpr int kCancelled = 80;  // of each kind: more than kMaxRelayedChannelsPerSession (64)
  constexpr uint64_t kSize = 12 * kMiB;
  const uint64_t buffer = d->Allocate(kSize);
  const std::string chunk(kMiB, 'g');
  for (int i = 0; i < kCancelled; ++i) {
    SCOPED_TRACE(absl::StrCat("transfer ", i));
    {
      grpc::ClientContext context;
      d->Prepare(&context);
      v1::UploadResponse response;
      std::unique_ptr<grpc::ClientWriter<v1::UploadStreamRequest>> writer =
          d->Stub()->UploadStream(&context, &response);
      ASSERT_TRUE(writer->Write(UploadFirst(At(buffer, 0), kSize, chunk)));
      if (i % 2 == 1) {
        ASSERT_TRUE(writer->Write(UploadMore(chunk)));
      }
      context.TryCancel();
      const grpc::Status status = writer->Finish();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    }
    {
      grpc::ClientContext context;
      d->Prepare(&context);
      std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
          d->Stub()->DownloadStream(&context, DownloadReq(At(buffer, 0), kSize, kMiB));
      v1::DownloadResponse response;
      ASSERT_TRUE(reader->Read(&response));
      ASSERT_EQ(response.data().size(), kMiB);
      context.TryCancel();
      const grpc::Status status = reader->Finish();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    }
  }
  // Most of them went framed (so the worker's bound was passed, were its channels not freed).
  const std::optional<uint64_t> framed = TransfersRelayed(d->metrics_port(), "framed");
  ASSERT_TRUE(framed.has_value());
  EXPECT_GT(*framed, 64u);
  // A whole round trip, and then 8 at once (every framed place free again).
  const std::string data = RandomBytes(kSize, 42);
  const Seen upload = d->Upload(Chunked(At(buffer, 0), data, kMiB));
  ASSERT_EQ(upload.code, grpc::StatusCode::OK) << upload.message;
  const Seen download = d->Download(DownloadReq(At(buffer, 0), kSize, 4 * kMiB));
  ASSERT_EQ(download.code, grpc::StatusCode::OK) << download.message;
  EXPECT_TRUE(download.Downloaded() == data) << "the bytes differ";
  {
    std::vector<std::thread> threads;
    std::vector<Seen> seen(8);
    for (size_t t = 0; t < seen.size(); ++t) {
      threads.emplace_back(
          [&, t] { seen[t] = d->Download(DownloadReq(At(buffer, t * kMiB), kMiB, kMiB / 4)); });
    }
    for (std::thread& thread : threads) thread.join();
    for (size_t t = 0; t < seen.size(); ++t) {
      EXPECT_EQ(seen[t].code, grpc::StatusCode::OK) << t << ": " << seen[t].message;
      EXPECT_TRUE(seen[t].Downloaded() == data.substr(t * kMiB, kMiB)) << t << ": bytes differ";
    }
  }
  EXPECT_THAT(d->session().Synchronize(), IsOk());
  EXPECT_THAT(d->daemon().CheckRunning(), IsOk());
}

// Transfers stuck in the worker behind a long kernel (their clients left: their front-end
// places are free again while the worker's threads still wait) have a bound of their own
// (kMaxRelayedTransfersPerSession), below the worker's bound on relayed channels: past it a
// transfer is refused RESOURCE_EXHAUSTED, saying why, and a command stream still goes framed.
// The worker's bound on the transfers it relays at once (kMaxRelayedTransfersPerSession).
constexpr size_t kMaxStuckTransfers = 32;

TEST_F(TransferRelayTest, TransfersStuckBehindAKernelLeaveRoomForCommandStreams) {
  std::unique_ptr<Daemon> d = Daemon::Start({}, /*metrics=*/true);
  ASSERT_NE(d, nullptr);
  const uint64_t buffer = d->Allocate(kMiB);
  auto module = testing::CompileFakeKernels(d->session());
  ASSERT_THAT(module, IsOk());
  auto spin = module->GetFunction("spin_us");
  ASSERT_THAT(spin, IsOk());
  auto side = d->session().CreateStream(/*non_blocking=*/true);
  ASSERT_THAT(side, IsOk());
  ASSERT_THAT(spin->Launch({}, uint64_t{10'000'000}), IsOk());  // on the default stream
  // Downloads on the default stream, whose clients leave while they wait behind the kernel:
  // more than the bound. (A refusal that came before the cancel reads as CANCELLED too.)
  for (size_t i = 0; i < kMaxStuckTransfers + 8; ++i) {
    grpc::ClientContext context;
    d->Prepare(&context);
    std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
        d->Stub()->DownloadStream(&context, DownloadReq(At(buffer, 0), kMiB));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    context.TryCancel();
    (void)reader->Finish();
  }
  // A download of the idle side stream, which would not wait for the kernel: refused.
  v1::DownloadRequest side_download = DownloadReq(At(buffer, 0), 4096);
  side_download.set_stream_id(side->id());
  const Seen refused = d->Download(side_download);
  EXPECT_EQ(refused.code, grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.message;
  EXPECT_THAT(refused.message, HasSubstr("relayed transfers (UploadStream, DownloadStream) in "
                                         "its worker, the most it may"));
  // A command stream, while the kernel still runs: framed, and its Sync of the idle side
  // stream answered.
  {
    grpc::ClientContext context;
    d->Prepare(&context);
    std::unique_ptr<v1::ExecutionService::Stub> execution =
        v1::ExecutionService::NewStub(d->channel());
    auto stream = execution->CommandStream(&context);
    v1::CommandBatch batch;
    v1::Command* sync = batch.add_commands();
    sync->set_sequence(1);
    sync->mutable_sync()->set_stream_id(side->id());
    ASSERT_TRUE(stream->Write(batch));
    v1::CommandReply reply;
    EXPECT_TRUE(stream->Read(&reply));
    EXPECT_FALSE(reply.has_error()) << reply.error().message();
    stream->WritesDone();
    const grpc::Status status = stream->Finish();
    EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  }
  const std::string metrics = testing::ScrapeMetrics(d->metrics_port()).value_or("");
  EXPECT_THAT(metrics, HasSubstr("gpurpc_command_streams_total{relay=\"framed\"} 1"));
  d->Kill();
}

// What a client sees of a transfer whose worker is killed under it: `upload` one of 256 MiB
// after its first chunk went, else a download of 256 MiB after its first chunk came.
Seen KilledMidTransfer(const std::string& relay, bool upload) {
  std::unique_ptr<Daemon> d = Daemon::Start({"--command-relay=" + relay});
  if (d == nullptr) return Seen{{}, grpc::StatusCode::INTERNAL, "no daemon"};
  constexpr uint64_t kSize = 256 * kMiB;
  const uint64_t buffer = d->Allocate(kSize);
  grpc::ClientContext context;
  d->Prepare(&context, 30);
  Seen seen;
  if (upload) {
    v1::UploadResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::UploadStreamRequest>> writer =
        d->Stub()->UploadStream(&context, &response);
    const std::string chunk(kMiB, 'k');
    EXPECT_TRUE(writer->Write(UploadFirst(At(buffer, 0), kSize, chunk)));
    EXPECT_TRUE(writer->Write(UploadMore(chunk)));
    EXPECT_GT(KillDeviceWorkers(d->daemon()), 0);
    // Write on until the call ends (or all of it went: the status says what happened).
    for (uint64_t sent = 2 * kMiB; sent < kSize; sent += kMiB) {
      if (!writer->Write(UploadMore(chunk))) break;
    }
    writer->WritesDone();
    seen.Set(writer->Finish());
  } else {
    std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
        d->Stub()->DownloadStream(&context, DownloadReq(At(buffer, 0), kSize, kMiB));
    v1::DownloadResponse response;
    EXPECT_TRUE(reader->Read(&response));
    EXPECT_GT(KillDeviceWorkers(d->daemon()), 0);
    uint64_t chunks = 1;
    while (reader->Read(&response)) ++chunks;
    EXPECT_LT(chunks, kSize / kMiB) << "the whole download came";
    seen.Set(reader->Finish());
  }
  EXPECT_THAT(d->daemon().CheckRunning(), IsOk());
  // The session's id (random) made "<session>", so that two daemons' answers compare.
  seen.message =
      absl::StrReplaceAll(seen.message, {{std::to_string(d->session().id()), "<session>"}});
  d->Kill();
  return seen;
}

// A worker that dies mid-transfer ends the call as on the gRPC relay: the session FAULTED
// (ABORTED), naming the worker's end; not a hang until the call's 30 s deadline.
TEST_F(TransferRelayTest, AWorkerThatDiesMidTransferEndsTheCallAsOnTheGrpcRelay) {
  for (const bool upload : {false, true}) {
    SCOPED_TRACE(upload ? "upload" : "download");
    const Seen framed = KilledMidTransfer("framed", upload);
    const Seen by_grpc = KilledMidTransfer("grpc", upload);
    if (std::getenv("GPURPC_TRANSFER_RELAY_VERBOSE") != nullptr) {
      std::cerr << (upload ? "upload" : "download") << ": framed " << framed.code << " \""
                << framed.message << "\", grpc " << by_grpc.code << " \"" << by_grpc.message
                << "\"\n";
    }
    EXPECT_NE(framed.code, grpc::StatusCode::OK);
    EXPECT_NE(framed.code, grpc::StatusCode::DEADLINE_EXCEEDED) << framed.message;
    EXPECT_EQ(framed.code, by_grpc.code) << framed.message << " / " << by_grpc.message;
    EXPECT_EQ(framed.message, by_grpc.message);
    EXPECT_EQ(framed.code, grpc::StatusCode::ABORTED) << framed.message;
    EXPECT_THAT(framed.message, HasSubstr("FAULTED"));
  }
}

}  // namespace
}  // namespace gpurpc
