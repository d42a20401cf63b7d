// Launches: parameter layouts, typed, packed and server-packed arguments and their errors, launch
// dimensions, and the command stream (order, batches, the failed sequence, bad sequence numbers).
// Shared fixture and helpers: compute_fixture.h.
#include "tests/service/compute_fixture.h"

namespace gpurpc::compute_test {
namespace {

// ------------------------------------------------------------------------------ launches

MATCHER_P2(IsParam, offset_bytes, size_bytes, "") {
  return arg.offset_bytes() == static_cast<uint32_t>(offset_bytes) &&
         arg.size_bytes() == static_cast<uint32_t>(size_bytes);
}

TEST_F(ComputeTest, AxpyParamLayout) {
  ASSERT_OK_AND_ASSIGN(Function axpy, FakeFunction("axpy_f32"));
  EXPECT_THAT(axpy.params(),
              ElementsAre(IsParam(0, 4), IsParam(8, 8), IsParam(16, 8), IsParam(24, 8)));
  EXPECT_EQ(axpy.attributes().max_threads_per_block(), 1024);
}

class AxpyTest : public ComputeTest {
 protected:
  static constexpr uint64_t kN = 1000;
  static constexpr float kA = 2.5f;

  void SetUp() override {
    ComputeTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_OK_AND_ASSIGN(axpy_, FakeFunction("axpy_f32"));
    x_values_ = Iota(kN, 0.0f, 0.5f);
    y_values_ = Iota(kN, 1.0f, 1.0f);
    ASSERT_OK_AND_ASSIGN(x_, session_.Allocate(kN * sizeof(float)));
    ASSERT_OK_AND_ASSIGN(y_, session_.Allocate(kN * sizeof(float)));
    ASSERT_OK(x_.Upload(ToBytes(x_values_)));
    ASSERT_OK(y_.Upload(ToBytes(y_values_)));
  }

  // 4 blocks of 256 threads cover the 1000 elements.
  static LaunchConfig Config() { return Linear(4, 256); }

  void ExpectAxpyApplied() {
    ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
    ASSERT_EQ(y.size(), kN);
    for (uint64_t i = 0; i < kN; ++i) {
      ASSERT_FLOAT_EQ(y[i], kA * x_values_[i] + y_values_[i]) << "element " << i;
    }
  }

  Function axpy_;
  std::vector<float> x_values_, y_values_;
  Buffer x_, y_;
};

TEST_F(AxpyTest, TypedLaunch) {
  ASSERT_OK(axpy_.Launch(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, TypedLaunchAsync) {
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, PackedBlob) {
  const std::vector<v1::ParamInfo>& p = axpy_.params();
  ASSERT_THAT(p, SizeIs(4));
  Blob blob(p[3].offset_bytes() + p[3].size_bytes());
  blob.Put(p[0].offset_bytes(), kA)
      .Put(p[1].offset_bytes(), x_.device_address())
      .Put(p[2].offset_bytes(), y_.device_address())
      .Put(p[3].offset_bytes(), uint64_t{kN});
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), blob.bytes()));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, TypedProtoArgumentsPackedByTheServer) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy_.id());
  SetDim(4, 1, 1, launch.mutable_grid());
  SetDim(256, 1, 1, launch.mutable_block());
  launch.add_args()->set_f32(kA);
  launch.add_args()->set_device_address(x_.device_address());
  launch.add_args()->mutable_buffer()->set_buffer_id(y_.id());
  launch.add_args()->set_u64(kN);
  ASSERT_OK(raw.Launch(launch));
  ASSERT_OK(session_.Synchronize());
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, BufferArgumentOffsetIsApplied) {
  // y[500..1000) += a * x[0..500): the server adds the buffer reference's offset.
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy_.id());
  SetDim(2, 1, 1, launch.mutable_grid());
  SetDim(256, 1, 1, launch.mutable_block());
  launch.add_args()->set_f32(kA);
  launch.add_args()->mutable_buffer()->set_buffer_id(x_.id());
  v1::BufferRef* y = launch.add_args()->mutable_buffer();
  y->set_buffer_id(y_.id());
  y->set_offset_bytes(500 * sizeof(float));
  launch.add_args()->set_u64(500);
  ASSERT_OK(raw.Launch(launch));
  ASSERT_OK_AND_ASSIGN(std::vector<float> result, DownloadFloats(y_));
  for (uint64_t i = 0; i < kN; ++i) {
    const float expected = i < 500 ? y_values_[i] : kA * x_values_[i - 500] + y_values_[i];
    ASSERT_FLOAT_EQ(result[i], expected) << "element " << i;
  }
}

TEST_F(AxpyTest, OnlyElementsBelowTheThreadCountAreProcessed) {
  // One block of 100 threads with n = 1000: the fake, like a GPU, runs 100 threads.
  ASSERT_OK(axpy_.Launch(Linear(1, 100), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
  EXPECT_FLOAT_EQ(y[99], kA * x_values_[99] + y_values_[99]);
  EXPECT_FLOAT_EQ(y[100], y_values_[100]);
}

// The server checks arguments whatever the client did: the raw API with typed arguments.
TEST_F(AxpyTest, WrongArgumentCountNamesBothCounts) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args()->RemoveLast();
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("axpy_f32"), HasSubstr("4 parameters"),
                                                 HasSubstr("3 arguments"))));
}

TEST_F(AxpyTest, DoubleForAFloatNamesTheParameterAndSizes) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(0)->set_f64(2.5);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("#0"), HasSubstr("expected 4 bytes"),
                                                 HasSubstr("given 8 bytes"))));
}

TEST_F(AxpyTest, SixteenByteStructForAPointerNamesTheParameterAndSizes) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(2)->set_raw(std::string(16, '\x01'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("#2"), HasSubstr("expected 8 bytes"),
                                                 HasSubstr("given 16 bytes"))));
}

TEST_F(AxpyTest, PackedBlobOfTheWrongLengthNamesBothLengths) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.clear_args();
  launch.set_packed_args(std::string(24, '\0'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kInvalidArgument,
                                           AllOf(HasSubstr("32 bytes"), HasSubstr("24 bytes"))));
}

TEST_F(AxpyTest, UnknownBufferArgumentIsNotFoundNamingTheParameter) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(1)->mutable_buffer()->set_buffer_id(x_.id() ^ 0x5a5a5a5a);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("#1")));
}

TEST_F(AxpyTest, ClientRefusesADoubleForAFloat) {
  EXPECT_THAT(
      axpy_.Launch(Config(), 2.5, x_, y_, uint64_t{kN}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("#0"), HasSubstr("expected 4 bytes"), HasSubstr("given 8 bytes"))));
}

// Session::Synchronize, or a note that it did not return within `timeout`; then the session
// is closed, which ends a wait that would otherwise never end.
absl::Status SynchronizeWithin(Session& session, absl::Duration timeout) {
  std::future<absl::Status> done =
      std::async(std::launch::async, [&session] { return session.Synchronize(); });
  if (done.wait_for(absl::ToChronoNanoseconds(timeout)) == std::future_status::ready) {
    return done.get();
  }
  session.Close().IgnoreError();
  done.wait();
  return absl::DeadlineExceededError(
      absl::StrCat("Session::Synchronize did not return within ", absl::FormatDuration(timeout)));
}

TEST_F(AxpyTest, AsyncArgumentErrorSurfacesAtSynchronize) {
  // The bad launch and the sync marker travel in one batch: the marker is skipped.
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), std::string(8, '\0')));
  ASSERT_THAT(SynchronizeWithin(session_, absl::Seconds(20)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes")));
  // Not a fault: the session goes on.
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(SynchronizeWithin(session_, absl::Seconds(20)));
  ExpectAxpyApplied();
}

TEST_F(AxpyTest, AsyncArgumentErrorOfAnEarlierBatchSurfacesAtSynchronize) {
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), std::string(8, '\0')));
  ASSERT_OK(session_.Flush());
  ASSERT_THAT(SynchronizeWithin(session_, absl::Seconds(20)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes")));
  // Reported once; the session goes on.
  ASSERT_OK(axpy_.LaunchAsync(Config(), kA, x_, y_, uint64_t{kN}));
  ASSERT_OK(SynchronizeWithin(session_, absl::Seconds(20)));
  ExpectAxpyApplied();
}

struct DimCase {
  const char* name;
  Dim3 grid;
  Dim3 block;
  uint32_t shared_memory_bytes;
  const char* names;  // what the message must name
};

class LaunchDimsTest : public AxpyTest, public ::testing::WithParamInterface<DimCase> {};

TEST_P(LaunchDimsTest, IsInvalidArgumentNamingTheDimension) {
  const DimCase& c = GetParam();
  LaunchConfig config;
  config.grid = c.grid;
  config.block = c.block;
  config.shared_memory_bytes = c.shared_memory_bytes;
  EXPECT_THAT(axpy_.Launch(config, kA, x_, y_, uint64_t{kN}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.names)));
  // Nothing ran.
  ASSERT_OK_AND_ASSIGN(std::vector<float> y, DownloadFloats(y_));
  EXPECT_EQ(y, y_values_);
}

INSTANTIATE_TEST_SUITE_P(
    Dims, LaunchDimsTest,
    ::testing::Values(DimCase{"BlockXZero", {1, 1, 1}, {0, 1, 1}, 0, "block.x is 0"},
                      DimCase{"GridZZero", {1, 1, 0}, {32, 1, 1}, 0, "grid.z is 0"},
                      DimCase{"BlockX1025", {1, 1, 1}, {1025, 1, 1}, 0, "block.x = 1025"},
                      DimCase{"Block1056Threads", {1, 1, 1}, {32, 33, 1}, 0, "1056 threads"},
                      DimCase{"BlockZ65", {1, 1, 1}, {1, 1, 65}, 0, "block.z = 65"},
                      DimCase{"GridY65536", {1, 65536, 1}, {32, 1, 1}, 0, "grid.y = 65536"},
                      DimCase{"SharedMemory", {1, 1, 1}, {32, 1, 1}, 1u << 20, "shared memory"}),
    [](const ::testing::TestParamInfo<DimCase>& info) { return info.param.name; });

TEST_F(ComputeTest, UnknownFunctionIsNotFound) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(0x123456789abcdefull);
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(1, 1, 1, launch.mutable_block());
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("function")));
}

TEST_F(ComputeTest, AnotherSessionsFunctionIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Function axpy, FakeFunction("axpy_f32"));
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawSession raw(*client_, other);
  v1::LaunchCommand launch;
  launch.set_function_id(axpy.id());
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(1, 1, 1, launch.mutable_block());
  launch.set_packed_args(std::string(32, '\0'));
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, UnknownStreamIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(64));
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch;
  launch.set_function_id(add_one.id());
  SetDim(1, 1, 1, launch.mutable_grid());
  SetDim(16, 1, 1, launch.mutable_block());
  launch.add_args()->mutable_buffer()->set_buffer_id(data.id());
  launch.add_args()->set_u64(16);
  launch.set_stream_id(0x7777);
  EXPECT_THAT(raw.Launch(launch), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stream")));
}

// ------------------------------------------------------------------ launch and synchronize

TEST_F(AxpyTest, LaunchAndSynchronizeAppliesTheLaunch) {
  ASSERT_OK(axpy_.LaunchAndSynchronize(Config(), kA, x_, y_, uint64_t{kN}));
  ExpectAxpyApplied();
}

// As Stream::Synchronize would: an asynchronous error since the last sync is the answer.
TEST_F(AxpyTest, LaunchAndSynchronizeAnswersAnEarlierAsyncError) {
  ASSERT_OK(axpy_.LaunchBlobAsync(Config(), std::string(8, '\0')));
  EXPECT_THAT(axpy_.LaunchAndSynchronize(Config(), kA, x_, y_, uint64_t{kN}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes")));
  ExpectAxpyApplied();  // the launch itself ran
  // Said once.
  EXPECT_OK(session_.Synchronize());
}

TEST_F(ComputeTest, LaunchAndSynchronizeAnswersOnlyOnceItsKernelHasRun) {
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  // 300 ms of work: a call that answered once the launch was enqueued would leave the
  // stream busy.
  ASSERT_OK(spin.LaunchAndSynchronize(Linear(1, 1, &stream), uint64_t{300000}));
  EXPECT_THAT(stream.Query(), IsOkAndHolds(true));
}

TEST_F(AxpyTest, LaunchWithSynchronizeRefusesBadArgumentsAsLaunchDoes) {
  RawSession raw(*client_, session_);
  v1::LaunchCommand launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(1)->mutable_buffer()->set_buffer_id(x_.id() ^ 0x5a5a5a5a);
  EXPECT_THAT(raw.Launch(launch, /*synchronize=*/true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("#1")));
  launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args()->RemoveLast();
  EXPECT_THAT(raw.Launch(launch, /*synchronize=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 arguments")));
  launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.set_stream_id(0x7777);
  EXPECT_THAT(raw.Launch(launch, /*synchronize=*/true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("stream")));
  // Nothing ran, and the session is fine: the valid launch applies once.
  launch = ValidAxpyLaunch(axpy_, x_, y_, kN);
  launch.mutable_args(0)->set_f32(kA);
  ASSERT_OK(raw.Launch(launch, /*synchronize=*/true));
  ExpectAxpyApplied();
}

TEST_F(ComputeTest, LaunchAndSynchronizeOnACapturingStreamAddsNothingToTheGraph) {
  constexpr uint64_t kN = 64;
  ASSERT_OK_AND_ASSIGN(Function fill, FakeFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(kN * sizeof(uint32_t)));
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK(stream.BeginCapture());
  ASSERT_OK(fill.LaunchAsync(Linear(1, kN, &stream), data, 1u, kN));
  EXPECT_THAT(fill.LaunchAndSynchronize(Linear(1, kN, &stream), data, 2u, kN),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("Launch with synchronize"), HasSubstr("captur"))));
  ASSERT_OK_AND_ASSIGN(Graph graph, stream.EndCapture());
  EXPECT_EQ(graph.node_count(), 1u);
  // Neither launch ran: the captured one runs only with the graph.
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, data.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Not(Contains(2u)));
}

// ------------------------------------------------------------------------------ command stream

TEST_F(ComputeTest, AsyncCommandsRunInOrder) {
  constexpr uint64_t kN = 1024;
  ASSERT_OK_AND_ASSIGN(Function fill, FakeFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(kN * 4));
  ASSERT_OK_AND_ASSIGN(Buffer copy, session_.Allocate(kN * 4));
  const LaunchConfig all = Linear(4, 256);
  // 10.0 everywhere; then 1.0 in the first half; then +1 three times over the first three
  // quarters; then a copy. Any reordering changes some element.
  ASSERT_OK(session_.MemsetAsync(data.at(), FloatBits(10.0f), 4, kN));
  ASSERT_OK(fill.LaunchAsync(all, data, FloatBits(1.0f), uint64_t{kN / 2}));
  for (int i = 0; i < 3; ++i) ASSERT_OK(add_one.LaunchAsync(all, data, uint64_t{kN * 3 / 4}));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(copy.at(), data.at(), kN * 4));
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<float> values, DownloadFloats(copy));
  ASSERT_EQ(values.size(), kN);
  for (uint64_t i = 0; i < kN; ++i) {
    const float expected = i < kN / 2 ? 4.0f : i < kN * 3 / 4 ? 13.0f : 10.0f;
    ASSERT_EQ(values[i], expected) << "element " << i;
  }
}

TEST_F(ComputeTest, TenThousandAsyncLaunchesAreAllApplied) {
  constexpr uint64_t kN = 64;
  constexpr int kLaunches = 10000;
  ASSERT_OK_AND_ASSIGN(Function add_one, FakeFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer data, session_.Allocate(kN * 4));
  ASSERT_OK(data.Upload(ToBytes(Iota(kN, 0.0f, 1.0f))));
  for (int i = 0; i < kLaunches; ++i) {
    ASSERT_OK(add_one.LaunchAsync(Linear(1, 64), data, kN));
  }
  ASSERT_OK(session_.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<float> values, DownloadFloats(data));
  EXPECT_EQ(values, Iota(kN, static_cast<float>(kLaunches), 1.0f));
}

v1::Command MemsetCommand(uint64_t sequence, uint64_t buffer_id, uint32_t value, uint64_t count) {
  v1::Command command;
  command.set_sequence(sequence);
  v1::MemsetCommand* memset = command.mutable_memset();
  memset->mutable_destination()->mutable_buffer()->set_buffer_id(buffer_id);
  memset->set_value(value);
  memset->set_element_size_bytes(4);
  memset->set_count(count);
  return command;
}

v1::Command DownloadCommand(uint64_t sequence, uint64_t buffer_id, uint64_t size_bytes) {
  v1::Command command;
  command.set_sequence(sequence);
  command.mutable_download()->mutable_source()->mutable_buffer()->set_buffer_id(buffer_id);
  command.mutable_download()->set_size_bytes(size_bytes);
  return command;
}

TEST_F(ComputeTest, CommandStreamReportsTheFailedSequenceAndSkipsTheRestOfItsBatch) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);

  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(1, buffer.id(), 1, 4);
  *batch.add_commands() = MemsetCommand(2, buffer.id() ^ 0x5a5a5a5a, 2, 4);  // no such buffer
  *batch.add_commands() = MemsetCommand(3, buffer.id(), 3, 4);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_error());
  EXPECT_EQ(reply.error().sequence(), 2u);
  EXPECT_EQ(reply.error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(reply.error().message(), HasSubstr("buffer"));
  EXPECT_EQ(reply.skipped_from_sequence(), 3u);
  EXPECT_EQ(reply.processed_through_sequence(), 2u);

  // A later batch runs, and shows that #1 ran and #3 did not.
  batch.Clear();
  *batch.add_commands() = MemsetCommand(4, buffer.id(), 4, 1);
  *batch.add_commands() = DownloadCommand(5, buffer.id(), 16);
  ASSERT_TRUE(stream->Write(batch));
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_FALSE(reply.has_error()) << reply.error().message();
  EXPECT_EQ(reply.processed_through_sequence(), 5u);
  ASSERT_THAT(reply.downloads(), SizeIs(1));
  EXPECT_EQ(reply.downloads(0).sequence(), 5u);
  EXPECT_THAT(FromBytes<uint32_t>(std::vector<uint8_t>(reply.downloads(0).data().begin(),
                                                       reply.downloads(0).data().end())),
              ElementsAre(4u, 1u, 1u, 1u));

  stream->WritesDone();
  EXPECT_OK(FromGrpcStatus(stream->Finish()));
}

TEST_F(ComputeTest, CommandStreamErrorInTheLastCommandSkipsNothing) {
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(7, 0x5a5a5a5a, 0, 1);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_EQ(reply.error().sequence(), 7u);
  EXPECT_EQ(reply.skipped_from_sequence(), 0u);
  EXPECT_EQ(reply.processed_through_sequence(), 7u);
  stream->WritesDone();
  EXPECT_OK(FromGrpcStatus(stream->Finish()));
}

TEST_F(ComputeTest, NonIncreasingSequenceNumbersEndTheStreamWithInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(5, buffer.id(), 1, 4);
  ASSERT_TRUE(stream->Write(batch));
  v1::CommandReply reply;
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_FALSE(reply.has_error());

  batch.Clear();
  *batch.add_commands() = MemsetCommand(5, buffer.id(), 2, 4);
  stream->Write(batch);  // may already fail if the server has ended the call
  while (stream->Read(&reply)) {
  }
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not increase")));
  // A protocol error is not a fault: the session goes on.
  EXPECT_OK(session_.Allocate(16).status());
}

TEST_F(ComputeTest, DecreasingSequenceInsideABatchEndsTheStream) {
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session_.Allocate(16));
  RawSession raw(*client_, session_);
  grpc::ClientContext context;
  raw.Prepare(&context);
  auto stream = raw.execution().CommandStream(&context);
  v1::CommandBatch batch;
  *batch.add_commands() = MemsetCommand(9, buffer.id(), 1, 4);
  *batch.add_commands() = MemsetCommand(8, buffer.id(), 2, 4);
  stream->Write(batch);
  v1::CommandReply reply;
  while (stream->Read(&reply)) {
  }
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not increase")));
}

}  // namespace
}  // namespace gpurpc::compute_test
