// Streams and events (create, destroy, record, query, synchronize, elapsed time, waits) and
// module globals in device and constant memory. Shared fixture and helpers: compute_fixture.h.
#include "tests/service/compute_fixture.h"

namespace gpurpc::compute_test {
namespace {

// ------------------------------------------------------------------------------ streams, events

TEST_F(ComputeTest, StreamCreateAndDestroy) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t stream, raw.CreateStream());
  EXPECT_NE(stream, 0u);
  EXPECT_OK(raw.DestroyStream(stream));
  EXPECT_THAT(raw.DestroyStream(stream), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, DestroyUnknownOrDefaultStreamIsNotFound) {
  RawSession raw(*client_, session_);
  EXPECT_THAT(raw.DestroyStream(0x4242), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw.DestroyStream(0), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, EventCreateAndDestroy) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t event, raw.CreateEvent());
  EXPECT_NE(event, 0u);
  EXPECT_OK(raw.DestroyEvent(event));
  EXPECT_THAT(raw.DestroyEvent(event), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(raw.DestroyEvent(0x4242), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, AnotherSessionsStreamIsNotFound) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Session other, client_->OpenSession());
  RawSession raw(*client_, other);
  EXPECT_THAT(raw.DestroyStream(stream.id()), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ComputeTest, EventRecordQuerySynchronize) {
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream());
  ASSERT_OK_AND_ASSIGN(Event event, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  // 0.2 s of work before the record: Synchronize (a sync marker naming the event on the
  // command stream) returns only after it, so the event has completed then.
  ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &stream), uint64_t{200'000}));
  ASSERT_OK(event.Record(&stream));
  EXPECT_OK(event.Synchronize());
  EXPECT_THAT(event.Query(), IsOkAndHolds(true));
  EXPECT_OK(stream.Synchronize());
}

TEST_F(ComputeTest, StreamQueryReportsItsWorkWithoutWaiting) {
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Stream stream, session_.CreateStream(/*non_blocking=*/true));
  EXPECT_THAT(stream.Query(), IsOkAndHolds(true));
  // A second of work, sent by the query itself (it is still in the command stream).
  ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &stream), uint64_t{1000000}));
  EXPECT_THAT(stream.Query(), IsOkAndHolds(false));
  ASSERT_OK(stream.Synchronize());
  EXPECT_THAT(stream.Query(), IsOkAndHolds(true));
  ASSERT_OK(stream.BeginCapture());
  EXPECT_THAT(stream.Query(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(stream.EndCapture(), IsOk());
}

TEST_F(ComputeTest, ElapsedTimeBetweenEventsIsNotNegative) {
  ASSERT_OK_AND_ASSIGN(Event start, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Event end, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK(start.Record());
  ASSERT_OK(spin.LaunchAsync({}, uint64_t{2000}));
  ASSERT_OK(end.Record());
  ASSERT_OK(end.Synchronize());
  ASSERT_OK_AND_ASSIGN(float elapsed_ms, end.ElapsedSince(start));
  EXPECT_THAT(elapsed_ms, Ge(0.0f));
  // The fake runs the 2 ms spin between the two records.
  EXPECT_THAT(elapsed_ms, Ge(1.5f));
}

TEST_F(ComputeTest, ElapsedTimeOfAnUnrecordedEventIsFailedPrecondition) {
  RawSession raw(*client_, session_);
  ASSERT_OK_AND_ASSIGN(uint64_t start, raw.CreateEvent());
  ASSERT_OK_AND_ASSIGN(uint64_t end, raw.CreateEvent());
  EXPECT_THAT(raw.ElapsedTime(start, end), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(ComputeTest, StreamWaitEventOrdersTwoStreams) {
  constexpr uint64_t kN = 256;
  ASSERT_OK_AND_ASSIGN(Stream writer, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Stream reader, session_.CreateStream(/*non_blocking=*/true));
  ASSERT_OK_AND_ASSIGN(Event written, session_.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Function spin, FakeFunction("spin_us"));
  ASSERT_OK_AND_ASSIGN(Function fill, FakeFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer source, session_.Allocate(kN * 4));
  ASSERT_OK_AND_ASSIGN(Buffer destination, session_.Allocate(kN * 4));
  ASSERT_OK(session_.Memset(source.at(), 0, 4, kN));
  ASSERT_OK(session_.Memset(destination.at(), 0, 4, kN));

  ASSERT_OK(spin.LaunchAsync(Linear(1, 1, &writer), uint64_t{5000}));
  ASSERT_OK(fill.LaunchAsync(Linear(1, 256, &writer), source, 0xC0FFEEu, kN));
  ASSERT_OK(written.Record(&writer));
  ASSERT_OK(reader.WaitEvent(written));
  ASSERT_OK(session_.CopyDeviceToDeviceAsync(destination.at(), source.at(), kN * 4, &reader));
  ASSERT_OK(reader.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> values, DownloadU32(destination));
  EXPECT_THAT(values, Each(0xC0FFEEu));
}

TEST_F(ComputeTest, WaitOnAnUnknownEventIsNotFound) {
  RawSession raw(*client_, session_);
  v1::StreamWaitEventRequest request;
  request.set_event_id(0x4242);
  v1::StreamWaitEventResponse response;
  grpc::ClientContext context;
  raw.Prepare(&context);
  EXPECT_THAT(FromGrpcStatus(raw.execution().StreamWaitEvent(&context, request, &response)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("event")));
}

// ------------------------------------------------------------------------------ globals

TEST_F(ComputeTest, DeviceAndConstantGlobalsCanBeWrittenAndRead) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kGlobals)));
  ASSERT_TRUE(result.success()) << result.log();
  for (const char* name : {"g", "c"}) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(Module::Global global, result.module.GetGlobal(name));
    EXPECT_NE(global.device_address, 0u);
    EXPECT_EQ(global.size_bytes, 4 * sizeof(float));
    const std::vector<float> values = {1.5f, -2.0f, 3.25f, 42.0f};
    ASSERT_OK(session_.Upload(global.ref(), ToBytes(values)));
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                         session_.Download(global.ref(), global.size_bytes));
    EXPECT_EQ(FromBytes<float>(bytes), values);
    // The range is bounded by the global's size.
    EXPECT_THAT(session_.Download(global.ref(), global.size_bytes + 4).status(), Not(IsOk()));
  }
}

TEST_F(ComputeTest, UnknownGlobalIsNotFound) {
  ASSERT_OK_AND_ASSIGN(CompileResult result, session_.Compile(Source(kGlobals)));
  ASSERT_TRUE(result.success()) << result.log();
  EXPECT_THAT(result.module.GetGlobal("no_such_global"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no_such_global")));
}

}  // namespace
}  // namespace gpurpc::compute_test
