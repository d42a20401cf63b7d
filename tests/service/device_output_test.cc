// Device printf output (server/worker/device_output.h) through the C++ client against a real
// gpurpcd on the fake backend (ctest label `service`): a kernel that #includes <stdio.h>
// (the compiler's shim) and printf's compiles, and what it prints reaches its own session's
// handler with the synchronisation that follows, never another session's. The fake runs
// its built-in print_i32 on the host and prints the very lines the CUDA source below would
// print on a GPU (tests/python/test_printf.py runs the same on the H200).

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "google/protobuf/message.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/shared_daemon.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::RawCall;
using ::gpurpc::testing::SharedDaemonTest;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kPrintSource[] = R"(
#include <stdio.h>
extern "C" __global__ void print_i32(const int* values, unsigned long long n) {
  const unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) printf("print_i32 %llu %d\n", i, values[i]);
}
)";

// What a session's handler received, from whichever thread delivered it.
class Collected {
 public:
  std::function<void(absl::string_view)> Handler() {
    return [this](absl::string_view text) {
      std::lock_guard<std::mutex> lock(mu_);
      text_.append(text.data(), text.size());
    };
  }
  std::string Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(text_, std::string());
  }

 private:
  std::mutex mu_;
  std::string text_;
};

std::string Lines(const std::vector<int32_t>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i)
    absl::StrAppend(&out, "print_i32 ", i, " ", values[i], "\n");
  return out;
}

LaunchConfig Threads(uint64_t n, const Stream* stream = nullptr) {
  LaunchConfig config;
  config.block.x = 256;
  config.grid.x = static_cast<uint32_t>((n + 255) / 256);
  config.stream = stream;
  return config;
}

class DeviceOutputTest : public SharedDaemonTest<DeviceOutputTest> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SharedDaemonTest::SetUp());
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon().address()));
    client_.emplace(std::move(client));
  }

  // A session with print_i32 loaded and its output going to `collected`.
  struct Printer {
    Session session;
    Module module;
    Function print;
  };
  absl::StatusOr<Printer> OpenPrinter(Collected* collected) {
    absl::StatusOr<Session> session = client_->OpenSession();
    if (!session.ok()) return session.status();
    session->SetDeviceOutputHandler(collected->Handler());
    CompileOptions options;
    options.source = kPrintSource;
    absl::StatusOr<CompileResult> compiled = session->Compile(options);
    if (!compiled.ok()) return compiled.status();
    if (!compiled->success()) return absl::InternalError(compiled->log());
    absl::StatusOr<Function> print = compiled->module.GetFunction("print_i32");
    if (!print.ok()) return print.status();
    return Printer{*std::move(session), std::move(compiled->module), *std::move(print)};
  }

  // Uploads `values` and launches print_i32 over them, asynchronously.
  static absl::StatusOr<Buffer> Print(const Printer& printer, const std::vector<int32_t>& values,
                                      const Stream* stream = nullptr) {
    const uint64_t bytes = values.size() * sizeof(int32_t);
    absl::StatusOr<Buffer> buffer = printer.session.Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    absl::Status status = printer.session.Upload(
        buffer->at(0), absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values.data()), bytes));
    if (!status.ok()) return status;
    status =
        printer.print.LaunchAsync(Threads(values.size(), stream), *buffer, uint64_t{values.size()});
    if (!status.ok()) return status;
    return buffer;
  }

  // Until `stream`'s work has run (on the fake, a kernel prints as it runs); a query takes
  // no output.
  static void ExpectDoneEventually(const Stream& stream) {
    EXPECT_TRUE(::gpurpc::testing::Eventually([&] {
      absl::StatusOr<bool> done = stream.Query();
      return done.ok() && *done;
    }));
  }

  std::optional<Client> client_;
};

TEST_F(DeviceOutputTest, PrintfReachesTheHandlerWithTheSynchronisation) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  const std::vector<int32_t> values = {7, -3, 42};
  ASSERT_OK_AND_ASSIGN(Buffer buffer, Print(printer, values));
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_EQ(collected.Take(), Lines(values));
  // Taken once: the next synchronisation brings nothing more.
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_THAT(collected.Take(), IsEmpty());
}

TEST_F(DeviceOutputTest, StreamAndEventSynchronisationsDeliverToo) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  ASSERT_OK_AND_ASSIGN(Stream stream, printer.session.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer first, Print(printer, {1, 2}, &stream));
  ASSERT_OK(stream.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({1, 2}));

  ASSERT_OK_AND_ASSIGN(Event event, printer.session.CreateEvent());
  ASSERT_OK_AND_ASSIGN(Buffer second, Print(printer, {5}, &stream));
  ASSERT_OK(event.Record(&stream));
  ASSERT_OK(event.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({5}));
}

TEST_F(DeviceOutputTest, LaunchAndSynchronizeDeliversItsKernelsOutput) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  const std::vector<int32_t> values = {11, 12, 13, 14};
  ASSERT_OK_AND_ASSIGN(Buffer buffer, printer.session.Allocate(values.size() * sizeof(int32_t)));
  ASSERT_OK(buffer.Upload(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(values.data()),
                                              values.size() * sizeof(int32_t))));
  ASSERT_OK(
      printer.print.LaunchAndSynchronize(Threads(values.size()), buffer, uint64_t{values.size()}));
  EXPECT_EQ(collected.Take(), Lines(values));
}

// An error answer carries no message, so a synchronising call that fails must leave what
// was printed for the next one rather than take it.
TEST_F(DeviceOutputTest, AFailedSynchronisingCallLeavesTheOutputForTheNext) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  ASSERT_OK_AND_ASSIGN(Stream stream, printer.session.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, Print(printer, {21, 22}, &stream));
  ExpectDoneEventually(stream);
  LaunchConfig too_wide = Threads(1);
  too_wide.block.x = 1 << 20;  // over every device's threads per block: refused by the worker
  EXPECT_THAT(printer.print.LaunchAndSynchronize(too_wide, buffer, uint64_t{1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(collected.Take(), IsEmpty());
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({21, 22}));
}

// The same for the unary synchronisations of the raw API: each fails, and the output is
// still there for the one after.
TEST_F(DeviceOutputTest, FailedUnarySynchronisationsLeaveTheOutputForTheNext) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  ASSERT_OK_AND_ASSIGN(Stream stream, printer.session.CreateStream());
  ASSERT_OK_AND_ASSIGN(Buffer buffer, Print(printer, {31, 32, 33}, &stream));
  ExpectDoneEventually(stream);
  // The code of one raw call of the session's.
  auto code_of = [&](const std::string& method, const google::protobuf::Message& request) {
    grpc::ClientContext context;
    context.AddMetadata(kSessionMetadataKey, std::to_string(printer.session.id()));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return RawCall(client_->channel(), &context, method, {request.SerializeAsString()})
        .status.error_code();
  };
  v1::SynchronizeStreamRequest no_stream;
  no_stream.set_stream_id(0x5eed);
  EXPECT_EQ(code_of("/gpurpc.v1.ExecutionService/SynchronizeStream", no_stream),
            grpc::StatusCode::NOT_FOUND);
  v1::SynchronizeEventRequest no_event;
  no_event.set_event_id(0x5eed);
  EXPECT_EQ(code_of("/gpurpc.v1.ExecutionService/SynchronizeEvent", no_event),
            grpc::StatusCode::NOT_FOUND);
  // SynchronizeSession is refused while any stream captures.
  ASSERT_OK_AND_ASSIGN(Stream capturing, printer.session.CreateStream(/*non_blocking=*/true));
  ASSERT_OK(capturing.BeginCapture());
  EXPECT_EQ(
      code_of("/gpurpc.v1.ExecutionService/SynchronizeSession", v1::SynchronizeSessionRequest()),
      grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_OK(capturing.EndCapture().status());
  EXPECT_THAT(collected.Take(), IsEmpty());
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({31, 32, 33}));
}

TEST_F(DeviceOutputTest, SessionsNeverSeeEachOthersOutput) {
  Collected a_out, b_out;
  ASSERT_OK_AND_ASSIGN(Printer a, OpenPrinter(&a_out));
  ASSERT_OK_AND_ASSIGN(Printer b, OpenPrinter(&b_out));
  const std::vector<int32_t> a_values = {100, 101, 102};
  const std::vector<int32_t> b_values = {-200, -201};
  ASSERT_OK_AND_ASSIGN(Buffer a_buffer, Print(a, a_values));
  ASSERT_OK_AND_ASSIGN(Buffer b_buffer, Print(b, b_values));
  ASSERT_OK(a.session.Synchronize());
  ASSERT_OK(b.session.Synchronize());
  EXPECT_EQ(a_out.Take(), Lines(a_values));
  EXPECT_EQ(b_out.Take(), Lines(b_values));
}

TEST_F(DeviceOutputTest, NullHandlerDropsTheOutput) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  printer.session.SetDeviceOutputHandler(nullptr);
  ASSERT_OK_AND_ASSIGN(Buffer dropped, Print(printer, {9}));
  ASSERT_OK(printer.session.Synchronize());
  printer.session.SetDeviceOutputHandler(collected.Handler());
  ASSERT_OK_AND_ASSIGN(Buffer kept, Print(printer, {10}));
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({10}));
}

TEST_F(DeviceOutputTest, OutputBeyondTheBoundIsDroppedWithANote) {
  Collected collected;
  ASSERT_OK_AND_ASSIGN(Printer printer, OpenPrinter(&collected));
  // About 6.5 MB of lines against the worker's 4 MiB between two synchronisations.
  std::vector<int32_t> values(300000, 123456);
  ASSERT_OK_AND_ASSIGN(Buffer buffer, Print(printer, values));
  ASSERT_OK(printer.session.Synchronize());
  const std::string text = collected.Take();
  EXPECT_THAT(text, HasSubstr("bytes of device printf output were dropped"));
  EXPECT_LE(text.size(), (4u << 20) + 200);
  EXPECT_EQ(text.substr(0, 40), Lines(values).substr(0, 40));
  // The session goes on, and the next output is whole again.
  ASSERT_OK_AND_ASSIGN(Buffer next, Print(printer, {1}));
  ASSERT_OK(printer.session.Synchronize());
  EXPECT_EQ(collected.Take(), Lines({1}));
}

}  // namespace
}  // namespace gpurpc
