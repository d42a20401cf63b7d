// The front end's relay of CommandStream on framed channels to the workers
// (server/frontend/command_relay.h), against real daemons with real worker processes: a
// client must see exactly what the gRPC relay (--command-relay=grpc) gives it, replies and
// statuses alike, for good streams and broken ones; many streams of one session at once, more
// than the framed relay takes; batches larger than the channel's socket takes at once; and
// clients that go away mid-stream, or a worker that dies, must leave nothing behind. Compiled
// twice: label `service` with the fake backend, label `gpu` with the CUDA backend
// (GPURPC_TEST_BACKEND; it skips without a driver).
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/fake_kernels_module.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::KillDeviceWorkers;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1ull << 20;
constexpr char kBackend[] = GPURPC_TEST_BACKEND;
using Stream = grpc::ClientReaderWriter<v1::CommandBatch, v1::CommandReply>;

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

v1::Command Upload(uint64_t sequence, v1::DevicePointer to, std::string data) {
  v1::Command command;
  command.set_sequence(sequence);
  *command.mutable_upload()->mutable_destination() = std::move(to);
  command.mutable_upload()->set_data(std::move(data));
  return command;
}

v1::Command Download(uint64_t sequence, v1::DevicePointer from, uint64_t size) {
  v1::Command command;
  command.set_sequence(sequence);
  *command.mutable_download()->mutable_source() = std::move(from);
  command.mutable_download()->set_size_bytes(size);
  return command;
}

v1::Command Sync(uint64_t sequence) {
  v1::Command command;
  command.set_sequence(sequence);
  command.mutable_sync();
  return command;
}

v1::CommandBatch Batch(std::vector<v1::Command> commands) {
  v1::CommandBatch batch;
  for (v1::Command& command : commands) *batch.add_commands() = std::move(command);
  return batch;
}

// What a client saw of one stream.
struct Seen {
  std::vector<std::string> replies;  // serialized, in order
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;

  // The same with every mention of `buffer` (an id, random per session) in the replies' and
  // the status's messages made "<buffer>", so that two sessions' streams compare.
  Seen WithoutId(uint64_t buffer) const {
    const std::string id = std::to_string(buffer);
    auto scrub = [&](std::string text) { return absl::StrReplaceAll(text, {{id, "<buffer>"}}); };
    Seen out = *this;
    out.message = scrub(message);
    for (std::string& serialized : out.replies) {
      v1::CommandReply reply;
      if (!reply.ParseFromString(serialized)) continue;
      if (reply.has_error()) reply.mutable_error()->set_message(scrub(reply.error().message()));
      serialized = reply.SerializeAsString();
    }
    return out;
  }
};

// One daemon, one session, and raw command streams on it.
class Daemon {
 public:
  static std::unique_ptr<Daemon> Start(std::vector<std::string> flags) {
    TestDaemon::Options options;
    options.backend = kBackend;
    options.extra_flags = std::move(flags);
    options.extra_flags.push_back("--fake-memory-bytes=1073741824");
    auto daemon = TestDaemon::Start(std::move(options));
    EXPECT_THAT(daemon, IsOk());
    if (!daemon.ok()) return nullptr;
    auto out = std::unique_ptr<Daemon>(new Daemon());
    out->daemon_ = *std::move(daemon);
    ConnectOptions connect;
    connect.address = out->daemon_->address();
    connect.use_environment = false;  // no direct channel: every stream goes by the relay
    auto client = Client::Connect(connect);
    EXPECT_THAT(client, IsOk());
    if (!client.ok()) return nullptr;
    out->client_ = std::make_unique<Client>(*std::move(client));
    auto session = out->client_->OpenSession(0, "command relay test");
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
  uint64_t Allocate(uint64_t size) {
    auto buffer = session_->Allocate(size);
    EXPECT_THAT(buffer, IsOk());
    if (!buffer.ok()) return 0;
    buffers_.push_back(*std::move(buffer));
    return buffers_.back().id();
  }

  // A command stream of the session; `context` must outlive it.
  // A unary GetMemInfo of the session.
  grpc::Status GetMemInfo() {
    grpc::ClientContext context;
    context.AddMetadata("gpurpc-session", std::to_string(session_->id()));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GetMemInfoResponse response;
    return v1::MemoryService::NewStub(channel_)->GetMemInfo(&context, v1::GetMemInfoRequest(),
                                                            &response);
  }

  std::unique_ptr<Stream> Open(grpc::ClientContext* context) {
    context->AddMetadata("gpurpc-session", std::to_string(session_->id()));
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    return v1::ExecutionService::NewStub(channel_)->CommandStream(context);
  }

  // Writes each batch and reads its reply, half-closes, reads what is left; what came back.
  Seen Run(const std::vector<v1::CommandBatch>& batches) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = Open(&context);
    Seen seen;
    v1::CommandReply reply;
    bool open = true;
    for (const v1::CommandBatch& batch : batches) {
      if (!stream->Write(batch) || !stream->Read(&reply)) {
        open = false;
        break;
      }
      seen.replies.push_back(reply.SerializeAsString());
    }
    if (open) stream->WritesDone();
    while (stream->Read(&reply)) seen.replies.push_back(reply.SerializeAsString());
    const grpc::Status status = stream->Finish();
    seen.code = status.error_code();
    seen.message = status.error_message();
    return seen;
  }

 private:
  Daemon() = default;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  std::vector<Buffer> buffers_;
  std::shared_ptr<grpc::Channel> channel_;
};

class CommandRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(kBackend) == "cuda") {
      if (absl::Status cuda = testing::CudaAvailable(); !cuda.ok()) {
        GTEST_SKIP() << "skipping the CUDA relay: " << cuda;
      }
    }
  }
};

// The scripts a client may run, good and broken, with the same buffer layout on each daemon.
std::vector<std::vector<v1::CommandBatch>> Scripts(uint64_t buffer) {
  const std::string a = RandomBytes(kMiB, 1);
  const std::string b = RandomBytes(kMiB / 2, 2);
  std::vector<std::vector<v1::CommandBatch>> scripts;
  // Uploads, a download of them and a sync; an empty batch; a clean end.
  scripts.push_back({Batch({Upload(1, At(buffer, 0), a), Upload(2, At(buffer, kMiB), b),
                            Download(3, At(buffer, 0), kMiB + kMiB / 2), Sync(4)}),
                     Batch({}), Batch({Download(5, At(buffer, 100), 1000)})});
  // A command that fails skips the rest of its batch, and the stream goes on.
  scripts.push_back({Batch({Download(1, At(12345, 0), 16), Download(2, At(buffer, 0), 8)}),
                     Batch({Download(3, At(buffer, 0), 16), Sync(4)})});
  // A download past the buffer's end, then one of 64 MiB + 1 (over a batch's limit).
  scripts.push_back({Batch({Download(1, At(buffer, 4 * kMiB - 8), 16)}),
                     Batch({Download(2, At(buffer, 0), 64 * kMiB + 1)})});
  // Sequence numbers that go down: a protocol error ends the stream.
  scripts.push_back({Batch({Sync(5)}), Batch({Sync(3)}), Batch({Sync(9)})});
  // Sequence 0.
  scripts.push_back({Batch({Sync(0)})});
  // A batch of 2.5 million empty commands (5 MB that would parse to far more).
  {
    v1::CommandBatch empties;
    for (int i = 0; i < 2'500'000; ++i) empties.add_commands();
    scripts.push_back({Batch({Sync(1)}), empties, Batch({Sync(2)})});
  }
  return scripts;
}

// Whatever the script, the framed relay answers byte for byte what the gRPC relay answers,
// and ends with the same status.
TEST_F(CommandRelayTest, FramedAndGrpcRelaysAnswerAlike) {
  std::unique_ptr<Daemon> framed = Daemon::Start({});
  std::unique_ptr<Daemon> grpc_relay = Daemon::Start({"--command-relay=grpc"});
  ASSERT_NE(framed, nullptr);
  ASSERT_NE(grpc_relay, nullptr);
  const uint64_t framed_buffer = framed->Allocate(4 * kMiB);
  const uint64_t grpc_buffer = grpc_relay->Allocate(4 * kMiB);
  const auto scripts = Scripts(framed_buffer);
  const auto grpc_scripts = Scripts(grpc_buffer);
  for (size_t i = 0; i < scripts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("script ", i));
    const Seen by_grpc = grpc_relay->Run(grpc_scripts[i]).WithoutId(grpc_buffer);
    const Seen by_framed = framed->Run(scripts[i]).WithoutId(framed_buffer);
    EXPECT_EQ(by_framed.code, by_grpc.code) << by_framed.message << " / " << by_grpc.message;
    EXPECT_EQ(by_framed.message, by_grpc.message);
    ASSERT_EQ(by_framed.replies.size(), by_grpc.replies.size());
    for (size_t r = 0; r < by_grpc.replies.size(); ++r) {
      EXPECT_TRUE(by_framed.replies[r] == by_grpc.replies[r]) << "reply " << r << " differs";
    }
  }
  // The scripts did what they should have (so that two wrong relays cannot agree).
  const Seen good = framed->Run(scripts[0]);
  ASSERT_EQ(good.code, grpc::StatusCode::OK) << good.message;
  ASSERT_EQ(good.replies.size(), 3u);
  v1::CommandReply first;
  ASSERT_TRUE(first.ParseFromString(good.replies[0]));
  ASSERT_EQ(first.downloads_size(), 1);
  EXPECT_TRUE(first.downloads(0).data() == RandomBytes(kMiB, 1) + RandomBytes(kMiB / 2, 2));
  EXPECT_EQ(framed->Run(scripts[3]).code, grpc::StatusCode::INVALID_ARGUMENT);
  const Seen parse = framed->Run(scripts[5]);
  EXPECT_EQ(parse.code, grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(parse.message, HasSubstr("CommandStream message 2"));
  // The session is still usable.
  EXPECT_THAT(framed->session().Synchronize(), IsOk());
}

// Batches larger than the channel's socket takes at once go out in pieces, and a reply of
// 64 MiB comes back whole.
TEST_F(CommandRelayTest, LargeBatchesAndRepliesGoThroughWhole) {
  std::unique_ptr<Daemon> d = Daemon::Start({});
  ASSERT_NE(d, nullptr);
  const uint64_t buffer = d->Allocate(64 * kMiB);
  std::string expected;
  std::vector<v1::Command> uploads;
  for (uint64_t i = 0; i < 48; ++i) {
    std::string piece = RandomBytes(kMiB, static_cast<uint32_t>(100 + i));
    expected += piece;
    uploads.push_back(Upload(i + 1, At(buffer, i * kMiB), std::move(piece)));
  }
  std::string tail = RandomBytes(16 * kMiB, 7);
  const Seen seen = d->Run({Batch(std::move(uploads)),
                            Batch({Upload(49, At(buffer, 48 * kMiB), std::string(kMiB, 'x'))}),
                            Batch({Download(50, At(buffer, 0), 64 * kMiB), Sync(51)})});
  ASSERT_EQ(seen.code, grpc::StatusCode::OK) << seen.message;
  ASSERT_EQ(seen.replies.size(), 3u);
  v1::CommandReply last;
  ASSERT_TRUE(last.ParseFromString(seen.replies[2]));
  EXPECT_FALSE(last.has_error()) << last.error().message();
  ASSERT_EQ(last.downloads_size(), 1);
  const std::string& data = last.downloads(0).data();
  ASSERT_EQ(data.size(), 64 * kMiB);
  EXPECT_TRUE(data.compare(0, expected.size(), expected) == 0);
  EXPECT_TRUE(data.compare(48 * kMiB, kMiB, std::string(kMiB, 'x')) == 0);
}

// More streams of one session at once than the framed relay takes (the rest go by gRPC): each
// gets its own answers, in order, and all end cleanly.
TEST_F(CommandRelayTest, ManyStreamsOfOneSessionAtOnce) {
  std::unique_ptr<Daemon> d = Daemon::Start({});
  ASSERT_NE(d, nullptr);
  constexpr int kStreams = 12;
  constexpr int kBatches = 20;
  constexpr uint64_t kSlice = 64 << 10;
  const uint64_t buffer = d->Allocate(kStreams * kSlice);
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<std::string> failures;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      grpc::ClientContext context;
      std::unique_ptr<Stream> stream = d->Open(&context);
      v1::CommandReply reply;
      std::string failure;
      for (int b = 0; b < kBatches && failure.empty(); ++b) {
        const std::string data = RandomBytes(kSlice, static_cast<uint32_t>(s * 1000 + b));
        const uint64_t at = static_cast<uint64_t>(s) * kSlice;
        const uint64_t seq = static_cast<uint64_t>(b) * 3;
        if (!stream->Write(Batch({Upload(seq + 1, At(buffer, at), data),
                                  Download(seq + 2, At(buffer, at), kSlice), Sync(seq + 3)})) ||
            !stream->Read(&reply)) {
          failure = absl::StrCat("stream ", s, " ended at batch ", b);
        } else if (reply.has_error() || reply.downloads_size() != 1 ||
                   reply.downloads(0).data() != data) {
          failure =
              absl::StrCat("stream ", s, " batch ", b, ": wrong reply ", reply.error().message());
        }
      }
      stream->WritesDone();
      const grpc::Status status = stream->Finish();
      if (failure.empty() && !status.ok()) {
        failure = absl::StrCat("stream ", s, ": ", status.error_message());
      }
      absl::MutexLock lock(&mu);
      if (!failure.empty()) failures.push_back(failure);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(failures, ::testing::IsEmpty());
  EXPECT_THAT(d->session().Synchronize(), IsOk());
}

// Clients that go away mid-stream (cancelled with a batch half sent, or with a reply not
// read) leave the session usable, with its framed streams free for the next ones.
TEST_F(CommandRelayTest, ClientsThatGoAwayMidStreamLeaveNothingBehind) {
  std::unique_ptr<Daemon> d = Daemon::Start({});
  ASSERT_NE(d, nullptr);
  const uint64_t buffer = d->Allocate(32 * kMiB);
  for (int round = 0; round < 24; ++round) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = d->Open(&context);
    std::vector<v1::Command> uploads;
    for (uint64_t i = 0; i < 16; ++i) {
      uploads.push_back(Upload(i + 1, At(buffer, i * kMiB), std::string(kMiB, 'c')));
    }
    ASSERT_TRUE(stream->Write(Batch(std::move(uploads))));
    ASSERT_TRUE(stream->Write(Batch({Download(17, At(buffer, 0), 32 * kMiB)})));
    if (round % 2 == 1) {
      v1::CommandReply reply;
      ASSERT_TRUE(stream->Read(&reply));
    }
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  const Seen seen =
      d->Run({Batch({Upload(1, At(buffer, 0), "after"), Download(2, At(buffer, 0), 5), Sync(3)})});
  ASSERT_EQ(seen.code, grpc::StatusCode::OK) << seen.message;
  ASSERT_EQ(seen.replies.size(), 1u);
  v1::CommandReply reply;
  ASSERT_TRUE(reply.ParseFromString(seen.replies[0]));
  ASSERT_EQ(reply.downloads_size(), 1);
  EXPECT_EQ(reply.downloads(0).data(), "after");
  // Twelve streams at once still work (none of the cancelled ones holds a place).
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < 12; ++s) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(d->Open(contexts.back().get()));
    ASSERT_TRUE(streams.back()->Write(Batch({Sync(1)})));
    v1::CommandReply sync;
    ASSERT_TRUE(streams.back()->Read(&sync)) << "stream " << s;
  }
  for (auto& stream : streams) {
    stream->WritesDone();
    EXPECT_THAT(stream->Finish().error_code(), grpc::StatusCode::OK);
  }
  EXPECT_THAT(d->session().Synchronize(), IsOk());
}

// A worker that dies under a stream ends it with the session's fault, as on the gRPC relay.
TEST_F(CommandRelayTest, AWorkerThatDiesEndsTheStreamWithTheFault) {
  std::unique_ptr<Daemon> d = Daemon::Start({});
  ASSERT_NE(d, nullptr);
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = d->Open(&context);
  ASSERT_TRUE(stream->Write(Batch({Sync(1)})));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_GT(KillDeviceWorkers(d->daemon()), 0);
  EXPECT_FALSE(stream->Read(&reply));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("FAULTED"));
}

// -------------------------------------------------- both relays, behind a busy worker
// (each test runs on the framed relay and on --command-relay=grpc, which must agree)

v1::Command Spin(uint64_t sequence, uint64_t function, uint64_t micros) {
  v1::Command command;
  command.set_sequence(sequence);
  v1::LaunchCommand* launch = command.mutable_launch();
  launch->set_function_id(function);
  for (v1::Dim3* dim : {launch->mutable_grid(), launch->mutable_block()}) {
    dim->set_x(1);
    dim->set_y(1);
    dim->set_z(1);
  }
  std::string packed(8, '\0');
  for (int i = 0; i < 8; ++i) packed[i] = static_cast<char>((micros >> (8 * i)) & 0xff);
  launch->set_packed_args(packed);
  return command;
}

class BothRelaysTest : public CommandRelayTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    CommandRelayTest::SetUp();
    if (IsSkipped()) return;
    daemon_ = Daemon::Start({"--command-relay=" + GetParam()});
    ASSERT_NE(daemon_, nullptr);
    auto module = testing::CompileFakeKernels(daemon_->session());
    ASSERT_THAT(module, IsOk());
    module_ = std::make_unique<Module>(*std::move(module));
    auto spin = module_->GetFunction("spin_us");
    ASSERT_THAT(spin, IsOk());
    spin_ = spin->id();
  }
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Module> module_;
  uint64_t spin_ = 0;
};

// A client that half-closed and waits for its answers is told the worker died under its
// batch: the session FAULTED, not a clean end.
TEST_P(BothRelaysTest, AWorkerThatDiesAfterTheClientHalfClosedIsAFault) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = daemon_->Open(&context);
  ASSERT_TRUE(stream->Write(Batch({Spin(1, spin_, 3'000'000), Sync(2)})));
  ASSERT_TRUE(stream->WritesDone());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_GT(KillDeviceWorkers(daemon_->daemon()), 0);
  v1::CommandReply reply;
  while (stream->Read(&reply)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("FAULTED"));
}

// A batch queued behind a long one does not run once its client cancelled.
TEST_P(BothRelaysTest, ABatchQueuedBehindALongOneDoesNotRunAfterACancel) {
  const uint64_t buffer = daemon_->Allocate(4096);
  ASSERT_EQ(daemon_->Run({Batch({Upload(1, At(buffer, 0), "before"), Sync(2)})}).code,
            grpc::StatusCode::OK);
  {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = daemon_->Open(&context);
    ASSERT_TRUE(stream->Write(Batch({Spin(1, spin_, 1'000'000), Sync(2)})));
    ASSERT_TRUE(stream->Write(Batch({Upload(3, At(buffer, 0), "AFTER!")})));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const Seen seen = daemon_->Run({Batch({Download(1, At(buffer, 0), 6), Sync(2)})});
  ASSERT_EQ(seen.code, grpc::StatusCode::OK) << seen.message;
  v1::CommandReply reply;
  ASSERT_TRUE(reply.ParseFromString(seen.replies.at(0)));
  ASSERT_EQ(reply.downloads_size(), 1);
  EXPECT_EQ(reply.downloads(0).data(), "before");
}

// Many streams cancelled while the worker runs a long kernel: each cancelled relay waits for
// its worker side (so the worker never holds more channels than the front end counts), and
// the next stream works.
TEST_P(BothRelaysTest, StreamsCancelledBehindALongKernelLeaveRoomForTheNext) {
  for (int i = 0; i < 40; ++i) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = daemon_->Open(&context);
    ASSERT_TRUE(
        stream->Write(i == 0 ? Batch({Spin(1, spin_, 4'000'000), Sync(2)}) : Batch({Sync(1)})));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    context.TryCancel();
    (void)stream->Finish();
  }
  const Seen seen = daemon_->Run({Batch({Sync(1)})});
  EXPECT_EQ(seen.code, grpc::StatusCode::OK) << seen.message;
  EXPECT_EQ(seen.replies.size(), 1u);
}

// Past the worker's own bound (kMaxRelayedChannelsPerSession: streams whose clients left while
// their batches wait behind a long kernel), a stream is refused RESOURCE_EXHAUSTED, saying
// why: not a fault, and the session goes on once the kernel is done.
class WorkerBoundTest : public BothRelaysTest {};  // the framed relay only

TEST_P(WorkerBoundTest, TheWorkersBoundIsARefusalNotAFault) {
  grpc::ClientContext first;
  std::unique_ptr<Stream> spinning = daemon_->Open(&first);
  ASSERT_TRUE(spinning->Write(Batch({Spin(1, spin_, 20'000'000), Sync(2)})));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Streams whose clients leave while their Sync waits in the worker behind the kernel, until
  // one is refused (past kMaxRelayedChannelsPerSession of them). Each ends CANCELLED, or is
  // refused before its client cancels it.
  std::string refusal;
  for (int i = 0; i < 150 && refusal.empty(); ++i) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = daemon_->Open(&context);
    (void)stream->Write(Batch({Sync(1)}));  // false once the stream was refused
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    context.TryCancel();
    const grpc::Status status = stream->Finish();
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      refusal = status.error_message();
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    }
  }
  if (refusal.empty()) {
    const Seen next = daemon_->Run({Batch({Sync(1)})});
    EXPECT_EQ(next.code, grpc::StatusCode::RESOURCE_EXHAUSTED) << next.message;
    refusal = next.message;
  }
  EXPECT_THAT(refusal,
              HasSubstr("relayed channels (command streams, unary calls and transfers), the most "
                        "it may"));
  // Unary calls at the bound: more at once than the session's open unary channels, so that
  // new ones are opened and refused; those calls go by gRPC instead, and every call answers.
  {
    std::vector<grpc::Status> statuses(8);
    std::vector<std::thread> callers;
    for (size_t i = 0; i < statuses.size(); ++i) {
      callers.emplace_back([&, i] { statuses[i] = daemon_->GetMemInfo(); });
    }
    for (std::thread& caller : callers) caller.join();
    for (const grpc::Status& status : statuses) {
      EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
    }
  }
  // Not a fault: once the kernel is done, the session goes on.
  v1::CommandReply reply;
  EXPECT_TRUE(spinning->Read(&reply));
  spinning->WritesDone();
  EXPECT_TRUE(spinning->Finish().ok());
  const Seen after = daemon_->Run({Batch({Sync(1)})});
  EXPECT_EQ(after.code, grpc::StatusCode::OK) << after.message;
}

INSTANTIATE_TEST_SUITE_P(Framed, WorkerBoundTest, ::testing::Values("framed"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });
INSTANTIATE_TEST_SUITE_P(Relays, BothRelaysTest, ::testing::Values("framed", "grpc"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace gpurpc
