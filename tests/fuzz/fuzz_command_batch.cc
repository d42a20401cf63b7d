// Fuzzes the worker's command path (server/worker/session.h) over the fake backend, as
// server/worker/service.cc drives it: CommandStream batches (Session::RunBatch), unary
// launches (Session::Launch) with typed or packed kernel arguments, and device-pointer
// resolution (Session::Resolve) followed by the unary Upload/Download it guards.
//
// Each input gets a fresh session holding three buffers, a freed buffer, a stream, two
// events and a module (PTX that defines the fake's built-in kernels and one global,
// registered through GetGlobal), and two CUDA arrays (2D and 3D, for Copy3DCommand). Handle
// ids are random, so the input names them symbolically: an id below 18 is replaced by the
// handle of that number (SymbolicIds), and a device address
// below 2^20 (a typed argument, a pointer, or an 8-byte word of packed arguments) by an
// address near the start of a buffer or the global (SymbolicAddress).
// spin_us launches get a duration of 0, so that the fuzzer never sleeps.
//
// The first input byte picks a mode; the rest is:
//   0  a serialized CommandBatch, run once and then again (a replay must be refused);
//   1  a serialized LaunchRequest;
//   2  a launch of a built-in kernel chosen by the input whose packed arguments are the
//      input's bytes;
//   3  pointers to resolve, each followed by an upload and a download through it.
// Invariants (beyond no crash, leak or undefined behaviour):
//   - every memory access the session hands to the backend lies in one live buffer: the
//     fake's own bounds check ("do not lie within one live fake allocation") never fires;
//   - Resolve answers an address range inside one buffer or global (no wrap-around), and
//     does answer every in-bounds range of a live buffer;
//   - RunBatch returns OK, INVALID_ARGUMENT (sequence numbers) or a sticky fault, after
//     which the session reports FAILED_PRECONDITION; its reply names a command of the batch,
//     and each download carries exactly the bytes asked for;
//   - a call's error codes are those the API documents for it.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "server/parse_limit.h"
#include "server/worker/backend/backend.h"
#include "server/worker/session.h"
#include "tests/fuzz/fuzz_check.h"

namespace gpurpc::fuzz {
namespace {

// The fake backend's second line of defence (fake_device.cc): seeing it means the session
// let an out-of-bounds access through to the backend.
constexpr absl::string_view kBackendBoundsError = "do not lie within one live fake allocation";

constexpr uint64_t kFakeMemoryBytes = 64ull << 20;
constexpr uint64_t kBufferBytes[] = {4096, 256, 1};
constexpr const char* kKernels[] = {"multiply_them", "axpy_f32",   "fill_u32",
                                    "add_one_f32",   "copy_bytes", "fault_illegal_address",
                                    "spin_us"};
constexpr int kSpinKernel = 6;

// The fake runs a built-in kernel only for a module that defines it with the built-in's
// parameter layout (fake_backend.cc). Bodies are not read, and short PTX keeps each input's
// LoadModule cheap.
constexpr char kModulePtx[] = R"(.version 9.0
.target sm_75
.address_size 64
.visible .global .align 4 .b8 fuzz_table[64];
.visible .entry multiply_them(.param .u64 p0, .param .u64 p1, .param .u64 p2)
{
	ret;
}
.visible .entry axpy_f32(.param .f32 p0, .param .u64 p1, .param .u64 p2, .param .u64 p3)
{
	ret;
}
.visible .entry fill_u32(.param .u64 p0, .param .u32 p1, .param .u64 p2)
{
	ret;
}
.visible .entry add_one_f32(.param .u64 p0, .param .u64 p1)
{
	ret;
}
.visible .entry copy_bytes(.param .u64 p0, .param .u64 p1, .param .u64 p2)
{
	ret;
}
.visible .entry fault_illegal_address()
{
	ret;
}
.visible .entry spin_us(.param .u64 p0)
{
	ret;
}
)";

// A device range the session may address.
struct Range {
  uint64_t base = 0;
  uint64_t size = 0;
};

class Fixture {
 public:
  Fixture() {
    static backend::Backend* const fake = backend::MakeFakeBackend(kFakeMemoryBytes).release();
    absl::StatusOr<std::unique_ptr<backend::Context>> context = fake->OpenContext(0);
    FUZZ_CHECK(context.ok(), context.status());
    session_ = std::make_unique<worker::Session>(
        *std::move(context), nullptr, absl::UnavailableError("the fuzzer has no compiler"));
    worker::Session::Limits limits;
    limits.max_streams = 4;
    limits.max_events = 4;
    limits.max_modules = 2;
    FUZZ_CHECK(session_->Bind("fuzz", limits).ok(), "Bind");

    ids_.assign(18, 0);
    for (size_t i = 0; i < std::size(kBufferBytes); ++i) {
      absl::StatusOr<v1::BufferInfo> buffer = session_->Allocate(kBufferBytes[i]);
      FUZZ_CHECK(buffer.ok(), buffer.status());
      ids_[1 + i] = buffer->buffer_id();
      ranges_.push_back({buffer->device_address(), buffer->size_bytes()});
    }
    absl::StatusOr<uint64_t> stream = session_->CreateStream(false);
    FUZZ_CHECK(stream.ok(), stream.status());
    ids_[4] = *stream;
    absl::StatusOr<uint64_t> event = session_->CreateEvent(false, false);
    FUZZ_CHECK(event.ok(), event.status());
    ids_[5] = *event;
    absl::StatusOr<uint64_t> module = session_->LoadModule(kModulePtx);
    FUZZ_CHECK(module.ok(), module.status());
    ids_[6] = *module;
    for (int k = 0; k < 7; ++k) {
      absl::StatusOr<v1::GetFunctionResponse> function =
          session_->GetFunction(*module, kKernels[k]);
      FUZZ_CHECK(function.ok(), function.status());
      ids_[7 + k] = function->function_id();
    }
    absl::StatusOr<v1::GetGlobalResponse> global = session_->GetGlobal(*module, "fuzz_table");
    FUZZ_CHECK(global.ok(), global.status());
    ranges_.push_back({global->device_address(), global->size_bytes()});
    // A freed buffer: its id and address must resolve to nothing.
    absl::StatusOr<v1::BufferInfo> freed = session_->Allocate(512);
    FUZZ_CHECK(freed.ok(), freed.status());
    FUZZ_CHECK(session_->Free(freed->buffer_id()).ok(), "Free");
    ids_[14] = freed->buffer_id();
    freed_ = {freed->device_address(), freed->size_bytes()};
    absl::StatusOr<uint64_t> untimed = session_->CreateEvent(true, false);
    FUZZ_CHECK(untimed.ok(), untimed.status());
    ids_[15] = *untimed;
    // Arrays: 2D float 24 x 10, 3D uchar2 7 x 5 x 3.
    for (int k = 0; k < 2; ++k) {
      v1::ArrayDescriptor descriptor;
      descriptor.set_width(k == 0 ? 24 : 7);
      descriptor.set_height(k == 0 ? 10 : 5);
      descriptor.set_depth(k == 0 ? 0 : 3);
      descriptor.set_format(k == 0 ? v1::ARRAY_FORMAT_FLOAT : v1::ARRAY_FORMAT_UNSIGNED_INT8);
      descriptor.set_num_channels(k == 0 ? 1 : 2);
      absl::StatusOr<v1::BufferInfo> array = session_->AllocateArray(descriptor);
      FUZZ_CHECK(array.ok(), array.status());
      ids_[16 + k] = array->buffer_id();
    }
  }

  worker::Session& session() { return *session_; }
  const std::vector<Range>& ranges() const { return ranges_; }
  uint64_t buffer_id(int i) const { return ids_[1 + i]; }
  uint64_t spin_function() const { return ids_[7 + kSpinKernel]; }

  uint64_t SymbolicId(uint64_t id) const { return id < ids_.size() ? ids_[id] : id; }

  // Below 2^20: bits 16..19 pick a buffer, the global or the freed buffer, and the low 16
  // bits an offset from 128 bytes before its start.
  uint64_t SymbolicAddress(uint64_t address) const {
    if (address >= (uint64_t{1} << 20)) return address;
    const size_t pick = (address >> 16) % (ranges_.size() + 1);
    const uint64_t base = pick < ranges_.size() ? ranges_[pick].base : freed_.base;
    return base + (address & 0xffff) - 128;
  }

  void MapPointer(v1::DevicePointer* pointer) const {
    if (pointer->has_buffer()) {
      pointer->mutable_buffer()->set_buffer_id(SymbolicId(pointer->buffer().buffer_id()));
    } else if (pointer->target_case() == v1::DevicePointer::kDeviceAddress) {
      pointer->set_device_address(SymbolicAddress(pointer->device_address()));
    }
  }

  void MapLaunch(v1::LaunchCommand* launch) const {
    launch->set_function_id(SymbolicId(launch->function_id()));
    launch->set_stream_id(SymbolicId(launch->stream_id()));
    for (v1::KernelArg& arg : *launch->mutable_args()) {
      if (arg.has_buffer()) {
        arg.mutable_buffer()->set_buffer_id(SymbolicId(arg.buffer().buffer_id()));
      } else if (arg.value_case() == v1::KernelArg::kDeviceAddress) {
        arg.set_device_address(SymbolicAddress(arg.device_address()));
      }
    }
    // Small 8-byte words of packed arguments become addresses in the session's buffers, so
    // that kernels run.
    std::string packed = launch->packed_args();
    for (size_t at = 0; at + 8 <= packed.size(); at += 8) {
      uint64_t word;
      std::memcpy(&word, packed.data() + at, 8);
      word = SymbolicAddress(word);
      std::memcpy(packed.data() + at, &word, 8);
    }
    launch->set_packed_args(std::move(packed));
    if (launch->function_id() == spin_function()) {
      // No sleeping: every argument becomes a zero (the count is kept, so a wrong count is
      // still refused).
      if (!launch->packed_args().empty()) {
        launch->set_packed_args(std::string(launch->packed_args().size(), '\0'));
      }
      for (v1::KernelArg& arg : *launch->mutable_args()) arg.set_u64(0);
    }
  }

  void MapCommand(v1::Command* command) const {
    switch (command->kind_case()) {
      case v1::Command::kLaunch:
        MapLaunch(command->mutable_launch());
        break;
      case v1::Command::kMemset:
        MapPointer(command->mutable_memset()->mutable_destination());
        command->mutable_memset()->set_stream_id(SymbolicId(command->memset().stream_id()));
        break;
      case v1::Command::kCopy:
        MapPointer(command->mutable_copy()->mutable_destination());
        MapPointer(command->mutable_copy()->mutable_source());
        command->mutable_copy()->set_stream_id(SymbolicId(command->copy().stream_id()));
        break;
      case v1::Command::kCopy3D: {
        v1::Copy3DCommand* copy = command->mutable_copy_3d();
        for (v1::Copy3DEndpoint* end : {copy->mutable_destination(), copy->mutable_source()}) {
          if (end->target_case() == v1::Copy3DEndpoint::kArrayId) {
            end->set_array_id(SymbolicId(end->array_id()));
          } else if (end->has_device()) {
            MapPointer(end->mutable_device());
          }
        }
        copy->set_stream_id(SymbolicId(copy->stream_id()));
        break;
      }
      case v1::Command::kUpload:
        MapPointer(command->mutable_upload()->mutable_destination());
        command->mutable_upload()->set_stream_id(SymbolicId(command->upload().stream_id()));
        break;
      case v1::Command::kDownload:
        MapPointer(command->mutable_download()->mutable_source());
        command->mutable_download()->set_stream_id(SymbolicId(command->download().stream_id()));
        break;
      case v1::Command::kRecordEvent: {
        v1::RecordEventCommand* record = command->mutable_record_event();
        record->set_event_id(SymbolicId(record->event_id()));
        record->set_stream_id(SymbolicId(record->stream_id()));
        break;
      }
      case v1::Command::kWaitEvent: {
        v1::WaitEventCommand* wait = command->mutable_wait_event();
        wait->set_event_id(SymbolicId(wait->event_id()));
        wait->set_stream_id(SymbolicId(wait->stream_id()));
        break;
      }
      case v1::Command::kSync:
        command->mutable_sync()->set_stream_id(SymbolicId(command->sync().stream_id()));
        break;
      case v1::Command::kLaunchGraph: {
        // The fixture holds no graph exec: every id is refused (NOT_FOUND).
        v1::LaunchGraphCommand* launch = command->mutable_launch_graph();
        launch->set_graph_exec_id(SymbolicId(launch->graph_exec_id()));
        launch->set_stream_id(SymbolicId(launch->stream_id()));
        break;
      }
      default:
        break;
    }
  }

 private:
  std::unique_ptr<worker::Session> session_;
  std::vector<uint64_t> ids_;
  std::vector<Range> ranges_;  // the buffers, then the global
  Range freed_;
};

bool IsSticky(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted || code == absl::StatusCode::kDataLoss;
}

void CheckNoBackendBoundsError(absl::string_view message) {
  FUZZ_CHECK(!absl::StrContains(message, kBackendBoundsError),
             "the session let an out-of-bounds access reach the backend: ", message);
}

// After a sticky fault every call answers FAILED_PRECONDITION.
void CheckFaultContract(Fixture& fixture, const absl::Status& status) {
  if (!IsSticky(status.code())) return;
  const absl::Status later = fixture.session().fault();
  FUZZ_CHECK(later.code() == absl::StatusCode::kFailedPrecondition, "after the fault ", status,
             " the session answers ", later);
}

// ------------------------------------------------------------- mode 0: command batches

// 400 KB of an unknown length-delimited field (number 15): before a batch's bytes, it makes
// the parse bound walk them rather than bound them from their size.
const std::string& Walked() {
  static const std::string* const prefix =
      new std::string(std::string("\x7a\x80\xb5\x18", 4) + std::string(400000, 'w'));
  return *prefix;
}

void FuzzBatch(Fixture& fixture, absl::string_view bytes) {
  v1::CommandBatch batch;
  if (!batch.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  // The parse bound the server checks before parsing (server/parse_limit.h) covers what
  // the parse took, from the size alone and walked.
  const size_t used = batch.SpaceUsedLong();
  const std::string_view wire(bytes.data(), bytes.size());
  FUZZ_CHECK(ParsedBytesBound(*v1::CommandBatch::descriptor(), wire, SIZE_MAX) >= used,
             "the parse bound is below the ", used, " bytes the batch takes");
  FUZZ_CHECK(ParsedBytesBound(*v1::CommandBatch::descriptor(),
                              std::string(Walked()) + std::string(wire), SIZE_MAX) >= used,
             "the walked parse bound is below the ", used, " bytes the batch takes");
  for (v1::Command& command : *batch.mutable_commands()) fixture.MapCommand(&command);

  uint64_t last_sequence = 0;
  v1::CommandReply reply;
  const absl::Status status = fixture.session().RunBatch(batch, &last_sequence, &reply);
  const absl::StatusCode code = status.code();
  FUZZ_CHECK(status.ok() || code == absl::StatusCode::kInvalidArgument || IsSticky(code),
             "RunBatch may end a stream only for sequence numbers or a sticky fault: ", status);
  CheckNoBackendBoundsError(status.message());
  CheckFaultContract(fixture, status);

  std::set<uint64_t> sequences;
  for (const v1::Command& command : batch.commands()) sequences.insert(command.sequence());
  if (code != absl::StatusCode::kInvalidArgument) {
    if (reply.has_error()) {
      FUZZ_CHECK(sequences.count(reply.error().sequence()) == 1,
                 "the reply's error names "
                 "sequence ",
                 reply.error().sequence(), ", no command of the batch");
      FUZZ_CHECK(reply.error().code() != 0, "an error with code OK");
      CheckNoBackendBoundsError(reply.error().message());
      FUZZ_CHECK(IsSticky(static_cast<absl::StatusCode>(reply.error().code())) == IsSticky(code),
                 "the batch's status ", status, " and its error code ", reply.error().code(),
                 " disagree on a fault");
      FUZZ_CHECK(reply.processed_through_sequence() == reply.error().sequence(),
                 "processed through ", reply.processed_through_sequence(), " after command ",
                 reply.error().sequence(), " failed");
    } else if (!batch.commands().empty()) {
      FUZZ_CHECK(reply.processed_through_sequence() == batch.commands().rbegin()->sequence(),
                 "a batch without error processed through ", reply.processed_through_sequence());
    }
    uint64_t download_bytes = 0;
    uint64_t previous = 0;
    for (const v1::DownloadResult& result : reply.downloads()) {
      FUZZ_CHECK(previous == 0 || result.sequence() > previous, "downloads out of order");
      previous = result.sequence();
      const v1::Command* asked = nullptr;
      for (const v1::Command& command : batch.commands()) {
        if (command.sequence() == result.sequence() && command.has_download()) asked = &command;
      }
      FUZZ_CHECK(asked != nullptr, "a download result for sequence ", result.sequence(),
                 ", which is no download of the batch");
      FUZZ_CHECK(result.data().size() == asked->download().size_bytes(), "download ",
                 result.sequence(), " carries ", result.data().size(), " bytes of ",
                 asked->download().size_bytes());
      download_bytes += result.data().size();
    }
    FUZZ_CHECK(download_bytes <= worker::kMaxBatchDownloadBytes, "downloads of ", download_bytes,
               " bytes in one batch");
  }

  // The client sends the same batch again: its sequence numbers do not increase.
  if (!batch.commands().empty()) {
    v1::CommandReply again;
    const absl::Status replay = fixture.session().RunBatch(batch, &last_sequence, &again);
    FUZZ_CHECK(replay.code() == absl::StatusCode::kInvalidArgument,
               "a replayed batch was not refused: ", replay);
  }
}

// -------------------------------------------------------------------- mode 1: launches

void CheckLaunchStatus(Fixture& fixture, const absl::Status& status) {
  const absl::StatusCode code = status.code();
  FUZZ_CHECK(status.ok() || code == absl::StatusCode::kInvalidArgument ||
                 code == absl::StatusCode::kNotFound || IsSticky(code) ||
                 code == absl::StatusCode::kFailedPrecondition,
             "Launch answered ", status);
  CheckNoBackendBoundsError(status.message());
  CheckFaultContract(fixture, status);
}

void FuzzLaunchRequest(Fixture& fixture, absl::string_view bytes) {
  v1::LaunchRequest request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return;
  fixture.MapLaunch(request.mutable_launch());
  CheckLaunchStatus(fixture, fixture.session().Launch(request.launch()));
  // The launch surfaces its fault (if any) at the next synchronising call.
  CheckLaunchStatus(fixture, fixture.session().Synchronize());
}

// ---------------------------------------------------------------- mode 2: packed arguments

void FuzzPackedArgs(Fixture& fixture, FuzzedDataProvider& input) {
  const int kernel = input.ConsumeIntegralInRange(0, 6);
  v1::LaunchCommand launch;
  launch.set_function_id(7 + kernel);  // symbolic, like every id below
  launch.mutable_grid()->set_x(input.ConsumeIntegralInRange<uint32_t>(0, 8));
  launch.mutable_grid()->set_y(input.ConsumeIntegralInRange<uint32_t>(0, 2));
  launch.mutable_grid()->set_z(input.ConsumeIntegralInRange<uint32_t>(0, 2));
  launch.mutable_block()->set_x(input.ConsumeIntegralInRange<uint32_t>(0, 1100));
  launch.mutable_block()->set_y(input.ConsumeIntegralInRange<uint32_t>(0, 2));
  launch.mutable_block()->set_z(input.ConsumeIntegralInRange<uint32_t>(0, 2));
  launch.set_shared_memory_bytes(input.ConsumeBool() ? 0 : input.ConsumeIntegral<uint32_t>());
  launch.set_stream_id(input.ConsumeIntegralInRange<uint64_t>(0, 5));
  launch.set_packed_args(input.ConsumeRemainingBytesAsString());
  fixture.MapLaunch(&launch);
  CheckLaunchStatus(fixture, fixture.session().Launch(launch));
  CheckLaunchStatus(fixture, fixture.session().Synchronize());
}

// --------------------------------------------------------------- mode 3: pointer resolution

void FuzzResolve(Fixture& fixture, FuzzedDataProvider& input) {
  worker::Session& session = fixture.session();
  while (input.remaining_bytes() > 0) {
    v1::DevicePointer pointer;
    const int kind = input.ConsumeIntegralInRange(0, 2);
    if (kind == 0) {
      pointer.mutable_buffer()->set_buffer_id(
          fixture.SymbolicId(input.ConsumeIntegralInRange<uint64_t>(0, 17)));
      pointer.mutable_buffer()->set_offset_bytes(
          input.ConsumeBool() ? input.ConsumeIntegralInRange<uint64_t>(0, 5000)
                              : input.ConsumeIntegral<uint64_t>());
    } else if (kind == 1) {
      pointer.set_device_address(fixture.SymbolicAddress(input.ConsumeIntegral<uint64_t>() >>
                                                         input.ConsumeIntegralInRange(0, 63)));
    }
    const uint64_t size = input.ConsumeBool() ? input.ConsumeIntegralInRange<uint64_t>(0, 5000)
                                              : input.ConsumeIntegral<uint64_t>();
    const absl::StatusOr<backend::DevicePtr> address = session.Resolve(pointer, size, "fuzz");

    // Completeness: an in-bounds range of a live buffer resolves, to base + offset.
    if (pointer.has_buffer()) {
      for (int i = 0; i < 3; ++i) {
        if (pointer.buffer().buffer_id() != fixture.buffer_id(i)) continue;
        const Range& range = fixture.ranges()[i];
        const uint64_t offset = pointer.buffer().offset_bytes();
        if (offset <= range.size && size <= range.size - offset) {
          FUZZ_CHECK(address.ok() && *address == range.base + offset, "buffer ", i, " + ", offset,
                     " for ", size, " bytes of ", range.size, " did not resolve: ",
                     address.ok() ? std::string("wrong address") : address.status().ToString());
        }
      }
    }
    if (!address.ok()) {
      const absl::StatusCode code = address.status().code();
      FUZZ_CHECK(code == absl::StatusCode::kNotFound || code == absl::StatusCode::kInvalidArgument,
                 "Resolve answered ", address.status());
      continue;
    }
    // Soundness: the range lies inside one buffer or global, without wrapping around.
    bool inside = false;
    for (const Range& range : fixture.ranges()) {
      if (*address >= range.base && *address - range.base <= range.size &&
          size <= range.size - (*address - range.base)) {
        inside = true;
      }
    }
    FUZZ_CHECK(inside, "Resolve answered 0x", std::hex, *address, std::dec, " for ", size,
               " bytes, outside every buffer and global");
    // What the unary Upload and Download calls do next (service.cc), within their limit.
    if (size <= worker::kMaxInlineBytes) {
      const std::string data(size, 'x');
      const absl::Status uploaded = session.Upload(*address, data.data(), size, 0);
      FUZZ_CHECK(uploaded.ok(), "Upload to a resolved range: ", uploaded);
      std::string back(size, '\0');
      const absl::Status downloaded = session.Download(*address, back.data(), size, 0);
      FUZZ_CHECK(downloaded.ok(), "Download from a resolved range: ", downloaded);
      FUZZ_CHECK(back == data, "Download does not return what Upload wrote");
    }
  }
}

}  // namespace
}  // namespace gpurpc::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  gpurpc::fuzz::Fixture fixture;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  FuzzedDataProvider input(data + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      gpurpc::fuzz::FuzzBatch(fixture, rest);
      break;
    case 1:
      gpurpc::fuzz::FuzzLaunchRequest(fixture, rest);
      break;
    case 2:
      gpurpc::fuzz::FuzzPackedArgs(fixture, input);
      break;
    default:
      gpurpc::fuzz::FuzzResolve(fixture, input);
      break;
  }
  return 0;
}
