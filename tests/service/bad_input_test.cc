// The bad-input suite (issue 8): hostile requests through raw gRPC against a real gpurpcd
// (front end and worker processes, fake backend). Every request must be answered with the
// code its RPC documents (proto/gpurpc/v1/*.proto, DESIGN §3: bad argument ->
// INVALID_ARGUMENT, unknown handle -> NOT_FOUND, quota -> RESOURCE_EXHAUSTED ...), with a
// message that names what was wrong, and after every one of them
//   - the daemon's process still runs and answers a ping,
//   - a control session of another tenant still does an upload/download round trip and a
//     kernel launch with the right bytes,
//   - the victim tenant whose session and handles were aimed at still has them, untouched,
//   - the attacked session still works (cases that must fault a session use a scratch one),
//   - and the attacker's memory ledger still equals what its worker really holds.
//
// Tenants: "mallory" (the attacker: a token over TCP, tight quotas), "bob" (the victim:
// mallory names his session, buffers, module, function, stream and event), "admin" (a token
// tenant named by --admin-tenants) and the test's own user on the Unix socket (the control
// session). Requests are built with the generated stubs where protobuf can say them, with
// grpc::GenericStub and hand-made bytes where it cannot (garbage, truncated and wrongly
// typed fields, unknown methods, oversized messages, wrong message counts), and with a bare
// HTTP/2 client where gRPC's own client refuses to send them (NUL bytes in metadata, a
// lying length prefix, bytes that are not HTTP/2).
//
// Each case is one row of a table: its name, the call, the expected code and a fragment of
// the expected message ("" where any message naming the problem will do). The rows run
// against one daemon per test (two tests: unary RPCs, and streams, wire-level abuse and
// floods), and the health checks are shared by all of them. GPURPC_BAD_INPUT_VERBOSE=1
// prints every case's outcome.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gpurpc/v1/admin_service.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/execution_service.grpc.pb.h"
#include "gpurpc/v1/host_region_service.grpc.pb.h"
#include "gpurpc/v1/memory_service.grpc.pb.h"
#include "gpurpc/v1/module_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/socket_io.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;
using Code = ::grpc::StatusCode;

using AdminStub = v1::AdminService::Stub;
using DeviceStub = v1::DeviceService::Stub;
using ExecutionStub = v1::ExecutionService::Stub;
using HostRegionStub = v1::HostRegionService::Stub;
using MemoryStub = v1::MemoryService::Stub;
using ModuleStub = v1::ModuleService::Stub;
using SessionStub = v1::SessionService::Stub;

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kU64Max = ~0ull;
constexpr uint32_t kU32Max = ~0u;
// What the daemon and its workers take in one unary upload (server/worker/session.h).
constexpr uint64_t kMaxInlineBytes = 1ull << 20;

// The calls one worker runs at once (server/worker/worker_main.cc kWorkerMaxThreads); more
// are refused with RESOURCE_EXHAUSTED, whose message must name this limit.
constexpr int kWorkerMaxThreads = 64;

// Mallory's quotas (the config file below); the flood cases count on them.
constexpr uint32_t kMalloryMaxSessions = 4;
constexpr uint64_t kMalloryMaxMemoryBytes = 256 * kMiB;
constexpr uint32_t kMalloryMaxStreams = 16;
constexpr uint32_t kMalloryMaxEvents = 128;
constexpr uint32_t kMalloryMaxModules = 8;

// A module every session loads: a 64-byte global the memory calls may address, and kernels
// that the fake backend runs as its built-ins of the same names and layouts.
constexpr char kPtx[] = R"(.version 8.0
.target sm_75
.address_size 64

.visible .global .align 4 .b8 table[64];

.visible .entry fill_u32(
	.param .u64 fill_u32_param_0,
	.param .u32 fill_u32_param_1,
	.param .u64 fill_u32_param_2
)
{
	ret;
}

.visible .entry fault_illegal_address()
{
	ret;
}

.visible .entry spin_us(
	.param .u64 spin_us_param_0
)
{
	ret;
}
)";
constexpr uint64_t kTableBytes = 64;

// ---------------------------------------------------------------------------- outcomes

// What a call ended with, as the client sees it.
struct Outcome {
  Code code = Code::OK;
  std::string message;
};

Outcome Of(const grpc::Status& status) { return {status.error_code(), status.error_message()}; }

std::string CodeName(Code code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

std::string Describe(const Outcome& outcome) {
  return absl::StrCat(CodeName(outcome.code), " '",
                      absl::CHexEscape(outcome.message.substr(0, 600)),
                      outcome.message.size() > 600 ? "...'" : "'");
}

// A failed outcome the test itself produced (a precondition of a case did not hold).
Outcome Broken(const std::string& what) {
  return {Code::UNKNOWN, absl::StrCat("[test precondition failed] ", what)};
}

// `count` copies of `element` (wire bytes made by hand).
std::string Repeated(const std::string& element, size_t count) {
  std::string out;
  out.reserve(element.size() * count);
  for (size_t i = 0; i < count; ++i) out += element;
  return out;
}

// ---------------------------------------------------------------------------- callers

// One way of calling the daemon, as an attacker controls it: a channel, the values of the
// "authorization" metadata and the values of the "gpurpc-session" metadata (none, one, or
// several; any bytes gRPC's client will send).
class Caller {
 public:
  Caller() = default;
  Caller(std::shared_ptr<grpc::Channel> channel, const std::string& token)
      : channel_(std::move(channel)) {
    if (!token.empty()) authorization_ = {"Bearer " + token};
  }

  // The same caller with these "gpurpc-session" values.
  Caller Session(std::vector<std::string> values) const {
    Caller c = *this;
    c.session_ = std::move(values);
    c.id_ = 0;
    if (c.session_.size() == 1) absl::SimpleAtoi(c.session_[0], &c.id_);
    return c;
  }
  Caller Session(uint64_t id) const { return Session({std::to_string(id)}); }
  Caller NoSession() const { return Session(std::vector<std::string>()); }
  // The same caller with these "authorization" values.
  Caller Authorization(std::vector<std::string> values) const {
    Caller c = *this;
    c.authorization_ = std::move(values);
    return c;
  }
  uint64_t id() const { return id_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const std::vector<std::string>& authorization() const { return authorization_; }

  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    for (const std::string& value : authorization_) context->AddMetadata("authorization", value);
    for (const std::string& value : session_) context->AddMetadata(kSessionMetadataKey, value);
  }

  // A unary call through a generated stub.
  template <typename Stub, typename Request, typename Response>
  Outcome Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
               const Request& request, Response* response = nullptr) const {
    Stub stub(channel_);
    grpc::ClientContext context;
    Prepare(&context);
    Response ignored;
    return Of((stub.*method)(&context, request, response != nullptr ? response : &ignored));
  }

  // Any number of messages of any bytes to `method` (a full name, "/package.Service/Method"),
  // then a half-close; every answer lands in `responses`.
  Outcome Raw(const std::string& method, const std::vector<std::string>& requests,
              std::vector<std::string>* responses = nullptr) const {
    grpc::ClientContext context;
    Prepare(&context);
    testing::RawCallResult call = testing::RawCall(channel_, &context, method, requests);
    if (responses != nullptr) {
      for (std::string& response : call.responses) responses->push_back(std::move(response));
    }
    return Of(call.status);
  }
  // One message of any bytes.
  Outcome Raw(const std::string& method, const std::string& request,
              std::string* response = nullptr) const {
    std::vector<std::string> responses;
    Outcome outcome = Raw(method, std::vector<std::string>{request}, &responses);
    if (response != nullptr && !responses.empty()) *response = responses.front();
    return outcome;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::string> authorization_;
  std::vector<std::string> session_;
  uint64_t id_ = 0;
};

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Its own connection, not one shared with the other tenants' channels.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// ---------------------------------------------------------------------------- requests

v1::DevicePointer Buf(uint64_t buffer_id, uint64_t offset = 0) {
  v1::DevicePointer pointer;
  pointer.mutable_buffer()->set_buffer_id(buffer_id);
  pointer.mutable_buffer()->set_offset_bytes(offset);
  return pointer;
}
v1::DevicePointer Addr(uint64_t address) {
  v1::DevicePointer pointer;
  pointer.set_device_address(address);
  return pointer;
}
v1::UploadRequest UploadReq(const v1::DevicePointer& to, std::string data, uint64_t stream = 0) {
  v1::UploadRequest request;
  *request.mutable_destination() = to;
  request.set_data(std::move(data));
  request.set_stream_id(stream);
  return request;
}
v1::DownloadRequest DownloadReq(const v1::DevicePointer& from, uint64_t size, uint64_t stream = 0,
                                uint64_t chunk = 0) {
  v1::DownloadRequest request;
  *request.mutable_source() = from;
  request.set_size_bytes(size);
  request.set_stream_id(stream);
  request.set_chunk_size_bytes(chunk);
  return request;
}
v1::MemsetRequest MemsetReq(const v1::DevicePointer& to, uint32_t element, uint64_t count,
                            uint64_t stream = 0) {
  v1::MemsetRequest request;
  *request.mutable_destination() = to;
  request.set_value(0xabababab);
  request.set_element_size_bytes(element);
  request.set_count(count);
  request.set_stream_id(stream);
  return request;
}
v1::CopyDeviceToDeviceRequest CopyReq(const v1::DevicePointer& to, const v1::DevicePointer& from,
                                      uint64_t size, uint64_t stream = 0) {
  v1::CopyDeviceToDeviceRequest request;
  *request.mutable_destination() = to;
  *request.mutable_source() = from;
  request.set_size_bytes(size);
  request.set_stream_id(stream);
  return request;
}
v1::AllocateRequest AllocReq(uint64_t size) {
  v1::AllocateRequest request;
  request.set_size_bytes(size);
  return request;
}
v1::FreeRequest FreeReq(uint64_t id) {
  v1::FreeRequest request;
  request.set_buffer_id(id);
  return request;
}
v1::GetAllocationRequest AllocationOf(uint64_t id) {
  v1::GetAllocationRequest request;
  request.set_buffer_id(id);
  return request;
}
v1::GetAllocationRequest AllocationAt(uint64_t address) {
  v1::GetAllocationRequest request;
  request.set_device_address(address);
  return request;
}
v1::LoadModuleRequest LoadReq(std::string image) {
  v1::LoadModuleRequest request;
  request.set_image(std::move(image));
  return request;
}
v1::UnloadModuleRequest UnloadReq(uint64_t id) {
  v1::UnloadModuleRequest request;
  request.set_module_id(id);
  return request;
}
v1::GetFunctionRequest FunctionReq(uint64_t module, std::string name) {
  v1::GetFunctionRequest request;
  request.set_module_id(module);
  request.set_name(std::move(name));
  return request;
}
v1::GetGlobalRequest GlobalReq(uint64_t module, std::string name) {
  v1::GetGlobalRequest request;
  request.set_module_id(module);
  request.set_name(std::move(name));
  return request;
}
v1::CompileRequest CompileReq(std::string source, std::vector<std::string> options = {}) {
  v1::CompileRequest request;
  request.set_source(std::move(source));
  for (std::string& option : options) request.add_options(std::move(option));
  return request;
}
template <typename Request>
Request StreamReq(uint64_t stream) {
  Request request;
  request.set_stream_id(stream);
  return request;
}
template <typename Request>
Request EventReq(uint64_t event) {
  Request request;
  request.set_event_id(event);
  return request;
}
v1::RecordEventRequest RecordReq(uint64_t event, uint64_t stream) {
  v1::RecordEventRequest request;
  request.set_event_id(event);
  request.set_stream_id(stream);
  return request;
}
v1::StreamWaitEventRequest WaitReq(uint64_t stream, uint64_t event) {
  v1::StreamWaitEventRequest request;
  request.set_stream_id(stream);
  request.set_event_id(event);
  return request;
}
v1::EventElapsedTimeRequest ElapsedReq(uint64_t start, uint64_t end) {
  v1::EventElapsedTimeRequest request;
  request.set_start_event_id(start);
  request.set_end_event_id(end);
  return request;
}
v1::CreateEventRequest CreateEventReq(bool disable_timing = false) {
  v1::CreateEventRequest request;
  request.set_disable_timing(disable_timing);
  return request;
}
v1::KernelArg ArgU8(uint32_t v) {
  v1::KernelArg arg;
  arg.set_u8(v);
  return arg;
}
v1::KernelArg ArgU16(uint32_t v) {
  v1::KernelArg arg;
  arg.set_u16(v);
  return arg;
}
v1::KernelArg ArgU32(uint32_t v) {
  v1::KernelArg arg;
  arg.set_u32(v);
  return arg;
}
v1::KernelArg ArgU64(uint64_t v) {
  v1::KernelArg arg;
  arg.set_u64(v);
  return arg;
}
v1::KernelArg ArgBuffer(uint64_t id, uint64_t offset = 0) {
  v1::KernelArg arg;
  arg.mutable_buffer()->set_buffer_id(id);
  arg.mutable_buffer()->set_offset_bytes(offset);
  return arg;
}
v1::KernelArg ArgAddress(uint64_t address) {
  v1::KernelArg arg;
  arg.set_device_address(address);
  return arg;
}
v1::KernelArg ArgRaw(std::string bytes) {
  v1::KernelArg arg;
  arg.set_raw(std::move(bytes));
  return arg;
}
void SetDim(v1::Dim3* dim, uint32_t x, uint32_t y = 1, uint32_t z = 1) {
  dim->set_x(x);
  dim->set_y(y);
  dim->set_z(z);
}
v1::LaunchRequest LaunchReq(const v1::LaunchCommand& launch) {
  v1::LaunchRequest request;
  *request.mutable_launch() = launch;
  return request;
}
// CUDA graphs: captures `launch` on `stream` of `s` into a graph whose id goes to `graph`.
Outcome CaptureGraph(const Caller& s, uint64_t stream, v1::LaunchCommand launch, uint64_t* graph) {
  v1::BeginCaptureRequest begin;
  begin.set_stream_id(stream);
  const Outcome begun = s.Call(&ExecutionStub::BeginCapture, begin);
  if (begun.code != Code::OK) return begun;
  launch.set_stream_id(stream);
  const Outcome launched = s.Call(&ExecutionStub::Launch, LaunchReq(launch));
  v1::EndCaptureRequest end;
  end.set_stream_id(stream);
  v1::EndCaptureResponse ended;
  const Outcome captured = s.Call(&ExecutionStub::EndCapture, end, &ended);
  if (launched.code != Code::OK) return launched;
  *graph = ended.graph_id();
  return captured;
}
Outcome DestroyGraph(const Caller& s, uint64_t graph) {
  v1::DestroyGraphRequest request;
  request.set_graph_id(graph);
  return s.Call(&ExecutionStub::DestroyGraph, request);
}
v1::Command Cmd(uint64_t sequence) {
  v1::Command command;
  command.set_sequence(sequence);
  return command;
}
v1::CommandBatch Batch(std::vector<v1::Command> commands) {
  v1::CommandBatch batch;
  for (v1::Command& command : commands) *batch.add_commands() = std::move(command);
  return batch;
}

// Protobuf wire format by hand, for requests the generated classes cannot express.
std::string Varint(uint64_t value) {
  std::string out;
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
  return out;
}
std::string Tag(int field, int wire_type) { return Varint((uint64_t(field) << 3) | wire_type); }
std::string LengthDelimited(int field, const std::string& bytes) {
  return Tag(field, 2) + Varint(bytes.size()) + bytes;
}

// Pseudo-random bytes, the same on every run.
std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(random());
  return out;
}

// ---------------------------------------------------------------------------- bare HTTP/2

// HPACK (RFC 7541) as far as a gRPC server's answers need it. gRPC's encoder never
// Huffman-codes keys or non-binary values, so a Huffman string only stands in as a
// placeholder (binary metadata the test does not read).
class HpackDecoder {
 public:
  bool Decode(absl::string_view block, std::vector<std::pair<std::string, std::string>>* out) {
    while (!block.empty()) {
      const uint8_t first = static_cast<uint8_t>(block.front());
      uint64_t index = 0;
      std::pair<std::string, std::string> field;
      if (first & 0x80) {  // indexed field
        if (!Int(&block, 7, &index) || !Lookup(index, &field)) return false;
        out->push_back(field);
        continue;
      }
      if ((first & 0xe0) == 0x20) {  // dynamic table size update
        uint64_t size = 0;
        if (!Int(&block, 5, &size)) return false;
        max_size_ = size;
        Evict();
        continue;
      }
      const bool incremental = (first & 0xc0) == 0x40;
      if (!Int(&block, incremental ? 6 : 4, &index)) return false;
      if (index == 0) {
        if (!Str(&block, &field.first)) return false;
      } else {
        std::pair<std::string, std::string> named;
        if (!Lookup(index, &named)) return false;
        field.first = named.first;
      }
      if (!Str(&block, &field.second)) return false;
      if (incremental) Insert(field);
      out->push_back(std::move(field));
    }
    return true;
  }

 private:
  static bool Int(absl::string_view* in, int prefix_bits, uint64_t* value) {
    if (in->empty()) return false;
    const uint64_t max = (1u << prefix_bits) - 1;
    *value = static_cast<uint8_t>(in->front()) & max;
    in->remove_prefix(1);
    if (*value < max) return true;
    for (int shift = 0; shift < 56; shift += 7) {
      if (in->empty()) return false;
      const uint8_t byte = static_cast<uint8_t>(in->front());
      in->remove_prefix(1);
      *value += uint64_t{byte & 0x7fu} << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }
  static bool Str(absl::string_view* in, std::string* out) {
    if (in->empty()) return false;
    const bool huffman = (static_cast<uint8_t>(in->front()) & 0x80) != 0;
    uint64_t length = 0;
    if (!Int(in, 7, &length) || length > in->size()) return false;
    *out = huffman ? "<huffman>" : std::string(in->substr(0, length));
    in->remove_prefix(length);
    return true;
  }
  bool Lookup(uint64_t index, std::pair<std::string, std::string>* field) const {
    static const char* const kStatic[61][2] = {{":authority", ""},
                                               {":method", "GET"},
                                               {":method", "POST"},
                                               {":path", "/"},
                                               {":path", "/index.html"},
                                               {":scheme", "http"},
                                               {":scheme", "https"},
                                               {":status", "200"},
                                               {":status", "204"},
                                               {":status", "206"},
                                               {":status", "304"},
                                               {":status", "400"},
                                               {":status", "404"},
                                               {":status", "500"},
                                               {"accept-charset", ""},
                                               {"accept-encoding", "gzip, deflate"},
                                               {"accept-language", ""},
                                               {"accept-ranges", ""},
                                               {"accept", ""},
                                               {"access-control-allow-origin", ""},
                                               {"age", ""},
                                               {"allow", ""},
                                               {"authorization", ""},
                                               {"cache-control", ""},
                                               {"content-disposition", ""},
                                               {"content-encoding", ""},
                                               {"content-language", ""},
                                               {"content-length", ""},
                                               {"content-location", ""},
                                               {"content-range", ""},
                                               {"content-type", ""},
                                               {"cookie", ""},
                                               {"date", ""},
                                               {"etag", ""},
                                               {"expect", ""},
                                               {"expires", ""},
                                               {"from", ""},
                                               {"host", ""},
                                               {"if-match", ""},
                                               {"if-modified-since", ""},
                                               {"if-none-match", ""},
                                               {"if-range", ""},
                                               {"if-unmodified-since", ""},
                                               {"last-modified", ""},
                                               {"link", ""},
                                               {"location", ""},
                                               {"max-forwards", ""},
                                               {"proxy-authenticate", ""},
                                               {"proxy-authorization", ""},
                                               {"range", ""},
                                               {"referer", ""},
                                               {"refresh", ""},
                                               {"retry-after", ""},
                                               {"server", ""},
                                               {"set-cookie", ""},
                                               {"strict-transport-security", ""},
                                               {"transfer-encoding", ""},
                                               {"user-agent", ""},
                                               {"vary", ""},
                                               {"via", ""},
                                               {"www-authenticate", ""}};
    if (index >= 1 && index <= 61) {
      *field = {kStatic[index - 1][0], kStatic[index - 1][1]};
      return true;
    }
    if (index < 62 || index - 62 >= dynamic_.size()) return false;
    *field = dynamic_[index - 62];
    return true;
  }
  void Insert(const std::pair<std::string, std::string>& field) {
    dynamic_.push_front(field);
    size_ += field.first.size() + field.second.size() + 32;
    Evict();
  }
  void Evict() {
    while (size_ > max_size_ && !dynamic_.empty()) {
      size_ -= dynamic_.back().first.size() + dynamic_.back().second.size() + 32;
      dynamic_.pop_back();
    }
  }

  std::deque<std::pair<std::string, std::string>> dynamic_;
  uint64_t size_ = 0;
  uint64_t max_size_ = 4096;
};

std::string PercentDecode(absl::string_view in) {
  std::string out;
  for (size_t i = 0; i < in.size(); ++i) {
    int value = 0;
    if (in[i] == '%' && i + 2 < in.size() && absl::SimpleHexAtoi(in.substr(i + 1, 2), &value)) {
      out.push_back(static_cast<char>(value));
      i += 2;
    } else {
      out.push_back(in[i]);
    }
  }
  return out;
}

// A plaintext HTTP/2 connection that sends exactly the bytes it is told to: for what gRPC's
// client refuses to send. One call per connection, on stream 1.
class BareHttp2 {
 public:
  using Headers = std::vector<std::pair<std::string, std::string>>;

  explicit BareHttp2(const std::string& host_port) {
    const size_t colon = host_port.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) return;
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &address.sin_addr);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      close(fd_);
      fd_ = -1;
    }
    const int one = 1;
    if (fd_ >= 0) setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~BareHttp2() {
    if (fd_ >= 0) close(fd_);
  }
  BareHttp2(const BareHttp2&) = delete;
  BareHttp2& operator=(const BareHttp2&) = delete;

  bool connected() const { return fd_ >= 0; }

  bool Send(absl::string_view bytes) {
    return testing::SendAll(fd_, std::string_view(bytes.data(), bytes.size()));
  }

  static std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                           absl::string_view payload) {
    std::string frame;
    const size_t n = payload.size();
    frame.push_back(static_cast<char>((n >> 16) & 0xff));
    frame.push_back(static_cast<char>((n >> 8) & 0xff));
    frame.push_back(static_cast<char>(n & 0xff));
    frame.push_back(static_cast<char>(type));
    frame.push_back(static_cast<char>(flags));
    frame.push_back(static_cast<char>((stream >> 24) & 0x7f));
    frame.push_back(static_cast<char>((stream >> 16) & 0xff));
    frame.push_back(static_cast<char>((stream >> 8) & 0xff));
    frame.push_back(static_cast<char>(stream & 0xff));
    frame.append(payload.data(), payload.size());
    return frame;
  }

  // The connection preface and an empty SETTINGS frame.
  bool Start() { return Send("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") && Send(Frame(0x4, 0, 0, "")); }

  // A gRPC call on stream 1: the pseudo-headers for `path`, then `headers` as given (as
  // literals, any bytes), then `body` as one DATA frame that ends the stream (the caller
  // writes gRPC's 5-byte prefix, so that it can lie in it).
  bool Call(const std::string& path, const Headers& headers, const std::string& body) {
    std::string block;
    Headers all = {{":method", "POST"},
                   {":scheme", "http"},
                   {":path", path},
                   {":authority", "localhost"},
                   {"content-type", "application/grpc"},
                   {"te", "trailers"}};
    all.insert(all.end(), headers.begin(), headers.end());
    for (const auto& [name, value] : all) {
      block.push_back(0x00);  // literal without indexing, new name
      AppendInt(&block, 7, name.size());
      block.append(name);
      AppendInt(&block, 7, value.size());
      block.append(value);
    }
    // HEADERS, then CONTINUATION frames for what does not fit in 16 KiB.
    constexpr size_t kMaxFrame = 16384;
    bool ok = true;
    for (size_t at = 0; at < block.size() || at == 0; at += kMaxFrame) {
      const absl::string_view part = absl::string_view(block).substr(at, kMaxFrame);
      const bool last = at + kMaxFrame >= block.size();
      ok = ok && Send(Frame(at == 0 ? 0x1 : 0x9, last ? 0x4 : 0x0, 1, part));
      if (block.empty()) break;
    }
    return ok && Send(Frame(0x0, 0x1, 1, body));
  }

  // Reads until stream 1 ends; its grpc-status and grpc-message, or what a gRPC client would
  // make of a reset stream or a closed connection.
  Outcome Await() {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    std::string headers_block;
    for (;;) {
      std::string header;
      if (!Read(9, deadline, &header)) {
        return {Code::UNAVAILABLE, "the daemon closed the connection without answering"};
      }
      const size_t length = (size_t{static_cast<uint8_t>(header[0])} << 16) |
                            (size_t{static_cast<uint8_t>(header[1])} << 8) |
                            static_cast<uint8_t>(header[2]);
      const uint8_t type = static_cast<uint8_t>(header[3]);
      const uint8_t flags = static_cast<uint8_t>(header[4]);
      const uint32_t stream = ((uint32_t{static_cast<uint8_t>(header[5])} & 0x7f) << 24) |
                              (uint32_t{static_cast<uint8_t>(header[6])} << 16) |
                              (uint32_t{static_cast<uint8_t>(header[7])} << 8) |
                              static_cast<uint8_t>(header[8]);
      std::string payload;
      if (!Read(length, deadline, &payload)) {
        return {Code::UNAVAILABLE, "the connection ended inside a frame"};
      }
      switch (type) {
        case 0x4:  // SETTINGS
          if ((flags & 0x1) == 0) Send(Frame(0x4, 0x1, 0, ""));
          break;
        case 0x6:  // PING
          if ((flags & 0x1) == 0) Send(Frame(0x6, 0x1, 0, payload));
          break;
        case 0x7: {  // GOAWAY
          return {Code::UNAVAILABLE,
                  absl::StrCat("GOAWAY error ",
                               payload.size() >= 8 ? static_cast<uint8_t>(payload[7]) : 0, ": ",
                               payload.size() > 8 ? payload.substr(8) : "")};
        }
        case 0x3: {  // RST_STREAM
          if (stream != 1) break;
          const uint32_t error = payload.size() >= 4 ? static_cast<uint8_t>(payload[3]) : 0;
          // gRPC's mapping of HTTP/2 errors (doc/PROTOCOL-HTTP2.md).
          Code code = Code::INTERNAL;
          if (error == 0x7) code = Code::UNAVAILABLE;
          if (error == 0x8) code = Code::CANCELLED;
          if (error == 0xb) code = Code::RESOURCE_EXHAUSTED;
          if (error == 0xc) code = Code::PERMISSION_DENIED;
          return {code, absl::StrCat("RST_STREAM error ", error)};
        }
        case 0x1:    // HEADERS
        case 0x9: {  // CONTINUATION
          absl::string_view fragment = payload;
          if (type == 0x1 && (flags & 0x8) != 0 && !fragment.empty()) {  // PADDED
            const size_t pad = static_cast<uint8_t>(fragment.front());
            fragment.remove_prefix(1);
            fragment.remove_suffix(std::min(pad, fragment.size()));
          }
          if (type == 0x1 && (flags & 0x20) != 0)
            fragment.remove_prefix(std::min<size_t>(5, fragment.size()));
          headers_block.append(fragment.data(), fragment.size());
          if (type == 0x1) end_stream_ = (flags & 0x1) != 0;
          if ((flags & 0x4) == 0) break;  // more CONTINUATION to come
          std::vector<std::pair<std::string, std::string>> fields;
          if (!hpack_.Decode(headers_block, &fields)) {
            return {Code::UNKNOWN, "[test] cannot decode the daemon's HPACK"};
          }
          headers_block.clear();
          if (stream != 1) break;
          for (const auto& [name, value] : fields) {
            if (name == "grpc-status") status_ = value;
            if (name == "grpc-message") message_ = PercentDecode(value);
          }
          if (end_stream_) {
            int code = 0;
            if (!absl::SimpleAtoi(status_, &code)) {
              return {Code::UNKNOWN, "the stream ended without grpc-status"};
            }
            return {static_cast<Code>(code), message_};
          }
          break;
        }
        default:
          break;
      }
    }
  }

 private:
  static void AppendInt(std::string* out, int prefix_bits, uint64_t value) {
    const uint64_t max = (1u << prefix_bits) - 1;
    if (value < max) {
      out->push_back(static_cast<char>(value));
      return;
    }
    out->push_back(static_cast<char>(max));
    value -= max;
    while (value >= 0x80) {
      out->push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    out->push_back(static_cast<char>(value));
  }

  bool Read(size_t n, absl::Time deadline, std::string* out) {
    out->clear();
    while (out->size() < n) {
      const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left_ms <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000))) <= 0) continue;
      char buffer[16384];
      const ssize_t got = ::recv(fd_, buffer, std::min(sizeof(buffer), n - out->size()), 0);
      if (got <= 0) return false;
      out->append(buffer, static_cast<size_t>(got));
    }
    return true;
  }

  int fd_ = -1;
  HpackDecoder hpack_;
  bool end_stream_ = false;
  std::string status_;
  std::string message_;
};

// gRPC's length-prefixed message: flag byte, 4-byte big-endian length, the bytes.
std::string GrpcFrame(const std::string& message, uint32_t declared_length, uint8_t flags = 0) {
  std::string out;
  out.push_back(static_cast<char>(flags));
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((declared_length >> shift) & 0xff));
  }
  return out + message;
}
std::string GrpcFrame(const std::string& message) {
  return GrpcFrame(message, static_cast<uint32_t>(message.size()));
}

// ---------------------------------------------------------------------------- the fixture

// What one session holds for the cases to aim at (or, for bob, to be aimed at).
struct Handles {
  v1::BufferInfo buffer;  // 4096 bytes
  v1::BufferInfo small;   // 16 bytes
  uint64_t module = 0;    // kPtx
  uint64_t table = 0;     // device address of the module's 64-byte global
  uint64_t fill = 0;      // fill_u32(unsigned* out, unsigned value, unsigned long long n)
  uint64_t fault = 0;     // fault_illegal_address()
  uint64_t spin = 0;      // spin_us(unsigned long long microseconds)
  uint64_t stream = 0;
  uint64_t event = 0;          // timing enabled, recorded once
  uint64_t event_untimed = 0;  // timing disabled, recorded once
};

struct Case {
  std::string name;
  std::function<Outcome()> run;
  Code code;
  std::string fragment;  // "" = any message (it must still name the problem: non-empty)
};

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/gpurpc-badinput-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    std::string tokens = "# bad-input tenants\n";
    for (auto [tenant, token] : {std::pair<const char*, std::string*>{"mallory", &mallory_token_},
                                 {"bob", &bob_token_},
                                 {"admin", &admin_token_}}) {
      absl::StatusOr<testing::TestToken> made = testing::MakeToken(tenant);
      ASSERT_TRUE(made.ok()) << made.status();
      *token = made->token;
      absl::StrAppend(&tokens, made->line, "\n");
    }
    const std::string tokens_file = Write("tokens", tokens);
    const std::string config_file = Write(
        "gpurpcd.conf", absl::StrFormat(R"(tenant_quotas {
  key: "mallory"
  value {
    max_sessions: %d max_device_memory_bytes: %d max_streams_per_session: %d
    max_events_per_session: %d max_modules_per_session: %d max_concurrent_compiles: 2
  }
}
)",
                                        kMalloryMaxSessions, kMalloryMaxMemoryBytes,
                                        kMalloryMaxStreams, kMalloryMaxEvents, kMalloryMaxModules));

    TestDaemon::Options options;
    options.listen_tcp = true;
    options.idle_timeout = "600s";
    options.warm_workers = 2;
    options.extra_flags = {absl::StrCat("--tokens-file=", tokens_file),
                           absl::StrCat("--config=", config_file), "--admin-tenants=admin",
                           "--max-sessions=32", "--log-level=info"};
    absl::StatusOr<std::unique_ptr<TestDaemon>> daemon = TestDaemon::Start(options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);

    const auto tcp = MakeChannel(daemon_->tcp_address());
    anonymous_ = Caller(tcp, "");
    mallory_ = Caller(MakeChannel(daemon_->tcp_address()), mallory_token_);
    bob_ = Caller(MakeChannel(daemon_->tcp_address()), bob_token_);
    admin_ = Caller(MakeChannel(daemon_->tcp_address()), admin_token_);
    local_ = Caller(MakeChannel(daemon_->address()), "");

    absl::StatusOr<Caller> control = Open(local_, "bad-input control");
    ASSERT_TRUE(control.ok()) << control.status();
    control_ = *control;
    const absl::Status control_handles = MakeHandles(control_, 0, &ch_);
    ASSERT_TRUE(control_handles.ok()) << control_handles;

    // Bob's objects sit above a 4 GiB spacer, at device addresses mallory's worker never
    // hands out (every fake worker numbers its addresses from the same start).
    absl::StatusOr<Caller> victim = Open(bob_, "bad-input victim");
    ASSERT_TRUE(victim.ok()) << victim.status();
    victim_ = *victim;
    absl::Status made = MakeHandles(victim_, 4ull << 30, &bh_);
    ASSERT_TRUE(made.ok()) << made;
    ASSERT_EQ(Put(victim_, bh_.buffer, std::string(bh_.buffer.size_bytes(), kSecret)).code,
              Code::OK);

    const absl::Status attacker = OpenAttacker();
    ASSERT_TRUE(attacker.ok()) << attacker;
  }

  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      const std::string log = daemon_->Log();
      std::cout << "the end of gpurpcd's log:\n"
                << log.substr(log.size() > 8000 ? log.size() - 8000 : 0) << "\n";
    }
    std::system(absl::StrCat("rm -rf '", dir_, "'").c_str());
  }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path) << text;
    chmod(path.c_str(), 0600);
    return path;
  }

  // ----- sessions and handles

  absl::StatusOr<Caller> Open(const Caller& who, const std::string& label) {
    v1::OpenSessionRequest request;
    request.set_client_label(label);
    v1::OpenSessionResponse response;
    const Outcome outcome = who.Call(&SessionStub::OpenSession, request, &response);
    if (outcome.code != Code::OK) {
      return absl::Status(static_cast<absl::StatusCode>(outcome.code),
                          absl::StrCat("OpenSession: ", outcome.message));
    }
    return who.Session(response.session_id());
  }
  Outcome Close(const Caller& session) {
    return session.Call(&SessionStub::CloseSession, v1::CloseSessionRequest());
  }
  v1::KeepAliveResponse KeepAlive(const Caller& session, Outcome* outcome = nullptr) {
    v1::KeepAliveResponse response;
    Outcome got = session.Call(&SessionStub::KeepAlive, v1::KeepAliveRequest(), &response);
    if (outcome != nullptr) *outcome = got;
    return response;
  }

  absl::Status MakeHandles(const Caller& s, uint64_t spacer_bytes, Handles* h) {
    const auto need = [](const char* what, const Outcome& outcome) {
      return outcome.code == Code::OK
                 ? absl::OkStatus()
                 : absl::InternalError(absl::StrCat(what, ": ", Describe(outcome)));
    };
    if (spacer_bytes > 0) {
      GPURPC_RETURN_IF_ERROR(need("spacer", s.Call(&MemoryStub::Allocate, AllocReq(spacer_bytes))));
    }
    v1::AllocateResponse allocated;
    GPURPC_RETURN_IF_ERROR(
        need("Allocate", s.Call(&MemoryStub::Allocate, AllocReq(4096), &allocated)));
    h->buffer = allocated.buffer();
    GPURPC_RETURN_IF_ERROR(
        need("Allocate", s.Call(&MemoryStub::Allocate, AllocReq(16), &allocated)));
    h->small = allocated.buffer();
    v1::LoadModuleResponse loaded;
    GPURPC_RETURN_IF_ERROR(
        need("LoadModule", s.Call(&ModuleStub::LoadModule, LoadReq(kPtx), &loaded)));
    h->module = loaded.module_id();
    v1::GetGlobalResponse global;
    GPURPC_RETURN_IF_ERROR(
        need("GetGlobal", s.Call(&ModuleStub::GetGlobal, GlobalReq(h->module, "table"), &global)));
    h->table = global.device_address();
    v1::GetFunctionResponse function;
    GPURPC_RETURN_IF_ERROR(
        need("GetFunction",
             s.Call(&ModuleStub::GetFunction, FunctionReq(h->module, "fill_u32"), &function)));
    h->fill = function.function_id();
    GPURPC_RETURN_IF_ERROR(
        need("GetFunction", s.Call(&ModuleStub::GetFunction,
                                   FunctionReq(h->module, "fault_illegal_address"), &function)));
    h->fault = function.function_id();
    GPURPC_RETURN_IF_ERROR(
        need("GetFunction",
             s.Call(&ModuleStub::GetFunction, FunctionReq(h->module, "spin_us"), &function)));
    h->spin = function.function_id();
    v1::CreateStreamResponse stream;
    GPURPC_RETURN_IF_ERROR(need(
        "CreateStream", s.Call(&ExecutionStub::CreateStream, v1::CreateStreamRequest(), &stream)));
    h->stream = stream.stream_id();
    v1::CreateEventResponse event;
    GPURPC_RETURN_IF_ERROR(
        need("CreateEvent", s.Call(&ExecutionStub::CreateEvent, CreateEventReq(false), &event)));
    h->event = event.event_id();
    GPURPC_RETURN_IF_ERROR(
        need("CreateEvent", s.Call(&ExecutionStub::CreateEvent, CreateEventReq(true), &event)));
    h->event_untimed = event.event_id();
    GPURPC_RETURN_IF_ERROR(
        need("RecordEvent", s.Call(&ExecutionStub::RecordEvent, RecordReq(h->event, h->stream))));
    GPURPC_RETURN_IF_ERROR(need("RecordEvent", s.Call(&ExecutionStub::RecordEvent,
                                                      RecordReq(h->event_untimed, h->stream))));
    return absl::OkStatus();
  }

  // Mallory's session M and its handles, (re)made.
  absl::Status OpenAttacker() {
    if (m_.id() != 0) Close(m_);
    absl::StatusOr<Caller> attacker = Open(mallory_, "bad-input attacker");
    if (!attacker.ok()) return attacker.status();
    m_ = *attacker;
    mh_ = Handles();
    return MakeHandles(m_, 0, &mh_);
  }

  // A session of mallory's for a case that may fault or close it; closed again by Scratch's
  // owner.
  absl::StatusOr<Caller> Scratch() { return Open(mallory_, "bad-input scratch"); }

  // A fresh id no object has (64 random bits).
  uint64_t Unknown() {
    uint64_t id = 0;
    while (id == 0) id = random_();
    return id;
  }

  // The number of worker processes once it has not changed for a second (a warm worker
  // taken by an earlier case may still be being replaced).
  size_t StableWorkerCount() {
    size_t count = daemon_->WorkerPids().size();
    for (int unchanged = 0, i = 0; unchanged < 10 && i < 300; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const size_t now = daemon_->WorkerPids().size();
      unchanged = now == count ? unchanged + 1 : 0;
      count = now;
    }
    return count;
  }

  // ----- common calls

  Outcome Put(const Caller& s, const v1::BufferInfo& buffer, const std::string& data) {
    return s.Call(&MemoryStub::Upload, UploadReq(Buf(buffer.buffer_id()), data));
  }
  Outcome Get(const Caller& s, const v1::DevicePointer& from, uint64_t size, std::string* data) {
    v1::DownloadResponse response;
    Outcome outcome = s.Call(&MemoryStub::Download, DownloadReq(from, size), &response);
    *data = response.data();
    return outcome;
  }
  // A valid fill_u32 launch on M (64 threads, 64 elements of its buffer), for the launch
  // cases to spoil one field of.
  v1::LaunchCommand FillLaunch(const Handles& h) const {
    v1::LaunchCommand launch;
    launch.set_function_id(h.fill);
    SetDim(launch.mutable_grid(), 1);
    SetDim(launch.mutable_block(), 64);
    *launch.add_args() = ArgBuffer(h.buffer.buffer_id());
    *launch.add_args() = ArgU32(7);
    *launch.add_args() = ArgU64(64);
    return launch;
  }
  Outcome Launch(const Caller& s, const v1::LaunchCommand& launch) {
    return s.Call(&ExecutionStub::Launch, LaunchReq(launch));
  }
  Outcome Sync(const Caller& s) {
    return s.Call(&ExecutionStub::SynchronizeSession, v1::SynchronizeSessionRequest());
  }
  uint64_t NewEvent(const Caller& s, bool disable_timing = false) {
    v1::CreateEventResponse response;
    const Outcome outcome =
        s.Call(&ExecutionStub::CreateEvent, CreateEventReq(disable_timing), &response);
    EXPECT_EQ(outcome.code, Code::OK) << "CreateEvent: " << Describe(outcome);
    return response.event_id();
  }
  uint64_t NewStream(const Caller& s) {
    v1::CreateStreamResponse response;
    const Outcome outcome =
        s.Call(&ExecutionStub::CreateStream, v1::CreateStreamRequest(), &response);
    EXPECT_EQ(outcome.code, Code::OK) << "CreateStream: " << Describe(outcome);
    return response.stream_id();
  }
  v1::BufferInfo NewBuffer(const Caller& s, uint64_t size) {
    v1::AllocateResponse response;
    const Outcome outcome = s.Call(&MemoryStub::Allocate, AllocReq(size), &response);
    EXPECT_EQ(outcome.code, Code::OK) << "Allocate: " << Describe(outcome);
    return response.buffer();
  }
  uint64_t NewModule(const Caller& s) {
    v1::LoadModuleResponse response;
    const Outcome outcome = s.Call(&ModuleStub::LoadModule, LoadReq(kPtx), &response);
    EXPECT_EQ(outcome.code, Code::OK) << "LoadModule: " << Describe(outcome);
    return response.module_id();
  }

  // Streaming calls through the generated stubs.
  Outcome UploadStream(const Caller& s, const std::vector<v1::UploadStreamRequest>& messages) {
    MemoryStub stub(s.channel());
    grpc::ClientContext context;
    s.Prepare(&context);
    v1::UploadResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::UploadStreamRequest>> writer =
        stub.UploadStream(&context, &response);
    for (const v1::UploadStreamRequest& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return Of(writer->Finish());
  }
  Outcome DownloadStream(const Caller& s, const v1::DownloadRequest& request,
                         uint64_t* bytes = nullptr) {
    MemoryStub stub(s.channel());
    grpc::ClientContext context;
    s.Prepare(&context);
    std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
        stub.DownloadStream(&context, request);
    v1::DownloadResponse chunk;
    uint64_t total = 0;
    while (reader->Read(&chunk)) total += chunk.data().size();
    if (bytes != nullptr) *bytes = total;
    return Of(reader->Finish());
  }
  // A command stream: each batch written, then its reply read; the final status.
  Outcome Commands(const Caller& s, const std::vector<v1::CommandBatch>& batches,
                   std::vector<v1::CommandReply>* replies = nullptr) {
    ExecutionStub stub(s.channel());
    grpc::ClientContext context;
    s.Prepare(&context);
    std::unique_ptr<grpc::ClientReaderWriter<v1::CommandBatch, v1::CommandReply>> stream =
        stub.CommandStream(&context);
    v1::CommandReply reply;
    bool open = true;
    for (const v1::CommandBatch& batch : batches) {
      if (!stream->Write(batch) || !stream->Read(&reply)) {
        open = false;
        break;
      }
      if (replies != nullptr) replies->push_back(reply);
    }
    if (open) stream->WritesDone();
    while (stream->Read(&reply)) {
      if (replies != nullptr) replies->push_back(reply);
    }
    return Of(stream->Finish());
  }
  // The command-stream outcome of one command: the error its batch's reply names, as a
  // unary call would have answered it (OK when none), or the stream's own failure.
  Outcome OneCommand(const Caller& s, v1::Command command) {
    std::vector<v1::CommandReply> replies;
    const Outcome final_status = Commands(s, {Batch({std::move(command)})}, &replies);
    if (final_status.code != Code::OK) return final_status;
    if (replies.size() != 1) return Broken(absl::StrCat(replies.size(), " replies to one batch"));
    if (!replies[0].has_error()) return {};
    return {static_cast<Code>(replies[0].error().code()), replies[0].error().message()};
  }

  // `call` from `threads` threads, `per_thread` times each; every outcome.
  static std::vector<Outcome> Flood(int threads, int per_thread,
                                    const std::function<Outcome(int, int)>& call) {
    std::vector<Outcome> outcomes(static_cast<size_t>(threads * per_thread));
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        for (int i = 0; i < per_thread; ++i) outcomes[t * per_thread + i] = call(t, i);
      });
    }
    for (std::thread& worker : workers) worker.join();
    return outcomes;
  }
  // The first outcome whose code is not `code`, else the first outcome.
  static Outcome AllAre(const std::vector<Outcome>& outcomes, Code code) {
    for (const Outcome& outcome : outcomes) {
      if (outcome.code != code) return outcome;
    }
    return outcomes.empty() ? Broken("no outcomes") : outcomes.front();
  }
  // As AllAre, but a flood may also meet the bound on the calls one session's worker runs at
  // once (RESOURCE_EXHAUSTED; the case "more blocked calls than a worker's threads" checks
  // that refusal itself): those outcomes are let through, as long as some call got `code`.
  static Outcome AllAreOrRefused(const std::vector<Outcome>& outcomes, Code code) {
    std::vector<Outcome> answered;
    for (const Outcome& outcome : outcomes) {
      if (outcome.code != Code::RESOURCE_EXHAUSTED || code == Code::RESOURCE_EXHAUSTED) {
        answered.push_back(outcome);
      }
    }
    if (answered.empty()) return Broken("every call of the flood was refused");
    return AllAre(answered, code);
  }

  // ----- the checks every case shares

  // Runs every case and the health checks after each; prints a summary of which failed.
  void RunCases(const std::vector<Case>& cases) {
    // GPURPC_BAD_INPUT_VERBOSE=1 prints every case's outcome.
    const char* verbose_env = std::getenv("GPURPC_BAD_INPUT_VERBOSE");
    const bool verbose = verbose_env != nullptr && std::string(verbose_env) == "1";
    std::vector<std::string> failed;
    int index = 0;
    for (const Case& c : cases) {
      ++index;
      SCOPED_TRACE(absl::StrCat("case #", index, " \"", c.name, "\""));
      const int failures_before = FailureCount();
      const Outcome got = c.run();
      if (verbose) std::cout << "#" << index << " " << c.name << ": " << Describe(got) << std::endl;
      EXPECT_EQ(CodeName(got.code), CodeName(c.code)) << "got " << Describe(got);
      if (c.code != Code::OK && got.code == c.code) {
        EXPECT_FALSE(got.message.empty()) << "the message must name what was wrong";
        if (!c.fragment.empty()) {
          EXPECT_THAT(got.message, HasSubstr(c.fragment));
        }
      }
      // A message is for people: bounded, whatever the request held.
      EXPECT_LE(got.message.size(), 8 * kKiB) << "an unbounded status message";
      if (!CheckHealth(index)) {
        failed.push_back(c.name);
        ADD_FAILURE() << "gpurpcd is gone; the remaining " << cases.size() - index
                      << " cases were not run";
        break;
      }
      if (FailureCount() != failures_before) failed.push_back(c.name);
    }
    std::cout << "bad-input: " << cases.size() << " cases, " << index << " run, "
              << index - static_cast<int>(failed.size()) << " passed, " << failed.size()
              << " failed" << (failed.empty() ? "" : ":\n  ") << absl::StrJoin(failed, "\n  ")
              << "\n";
  }

  static int FailureCount() {
    const ::testing::TestResult* result =
        ::testing::UnitTest::GetInstance()->current_test_info()->result();
    int failures = 0;
    for (int i = 0; i < result->total_part_count(); ++i) {
      if (result->GetTestPartResult(i).failed()) ++failures;
    }
    return failures;
  }

  // False when the daemon is gone (nothing more can be checked).
  bool CheckHealth(int index) {
    const absl::Status running = daemon_->CheckRunning();
    if (!running.ok()) {
      ADD_FAILURE() << running;
      return false;
    }
    // It answers a ping.
    v1::ListDevicesResponse devices;
    const Outcome ping = local_.Call(&DeviceStub::ListDevices, v1::ListDevicesRequest(), &devices);
    EXPECT_EQ(ping.code, Code::OK) << "ListDevices: " << Describe(ping);
    EXPECT_EQ(devices.devices_size(), 1);

    // The control session: an upload/download round trip and a kernel launch.
    const uint8_t seed = static_cast<uint8_t>(index * 37 + 11);
    EXPECT_TRUE(RoundTrip(control_, ch_.buffer, seed).ok())
        << "control session: " << RoundTrip(control_, ch_.buffer, seed);
    EXPECT_TRUE(LaunchFill(control_, ch_, 1000 + index).ok()) << "control session launch";

    // The victim: his bytes and every handle mallory named are untouched.
    std::string secret;
    const Outcome read =
        Get(victim_, Buf(bh_.buffer.buffer_id()), bh_.buffer.size_bytes(), &secret);
    EXPECT_EQ(read.code, Code::OK) << "victim Download: " << Describe(read);
    EXPECT_EQ(secret, std::string(bh_.buffer.size_bytes(), kSecret))
        << "the victim's bytes changed";
    const Outcome victim_alive = CheckHandles(victim_, bh_);
    EXPECT_EQ(victim_alive.code, Code::OK) << "victim handles: " << Describe(victim_alive);

    // The attacked session still works.
    Outcome keepalive;
    const v1::KeepAliveResponse state = KeepAlive(m_, &keepalive);
    bool attacker_ok = keepalive.code == Code::OK && state.state() == v1::SESSION_STATE_ACTIVE;
    const absl::Status trip = RoundTrip(m_, mh_.buffer, seed ^ 0x5a);
    const Outcome handles = CheckHandles(m_, mh_);
    attacker_ok = attacker_ok && trip.ok() && handles.code == Code::OK;
    EXPECT_TRUE(attacker_ok) << "the attacked session no longer works: KeepAlive "
                             << Describe(keepalive) << " state "
                             << v1::SessionState_Name(state.state()) << "; round trip " << trip
                             << "; handles " << Describe(handles);
    if (!attacker_ok) {
      const absl::Status reopened = OpenAttacker();
      EXPECT_TRUE(reopened.ok()) << "cannot reopen the attacker's session: " << reopened;
    }

    // Mallory's ledger equals what her worker holds (M is her only session between cases);
    // answers of calls she gave up on may still be in flight for a moment.
    absl::Status ledger;
    for (int attempt = 0; attempt < 100; ++attempt) {
      ledger = LedgerMatches();
      if (ledger.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_TRUE(ledger.ok()) << ledger;
    return true;
  }

  absl::Status RoundTrip(const Caller& s, const v1::BufferInfo& buffer, uint8_t seed) {
    std::string data(buffer.size_bytes(), '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(seed + i * 7);
    const Outcome put = Put(s, buffer, data);
    if (put.code != Code::OK) return absl::InternalError(absl::StrCat("Upload: ", Describe(put)));
    std::string back;
    const Outcome get = Get(s, Buf(buffer.buffer_id()), buffer.size_bytes(), &back);
    if (get.code != Code::OK) return absl::InternalError(absl::StrCat("Download: ", Describe(get)));
    if (back != data) return absl::InternalError("the bytes read back differ from those written");
    return absl::OkStatus();
  }

  absl::Status LaunchFill(const Caller& s, const Handles& h, uint32_t value) {
    v1::LaunchCommand launch = FillLaunch(h);
    launch.mutable_args(1)->set_u32(value);
    const Outcome launched = Launch(s, launch);
    if (launched.code != Code::OK) {
      return absl::InternalError(absl::StrCat("Launch: ", Describe(launched)));
    }
    std::string back;
    const Outcome get = Get(s, Buf(h.buffer.buffer_id()), 64 * 4, &back);
    if (get.code != Code::OK) return absl::InternalError(absl::StrCat("Download: ", Describe(get)));
    for (size_t i = 0; i < 64; ++i) {
      uint32_t element;
      std::memcpy(&element, back.data() + 4 * i, 4);
      if (element != value) return absl::InternalError("the kernel did not write its value");
    }
    return absl::OkStatus();
  }

  // Every handle of `h` still answers in `s`.
  Outcome CheckHandles(const Caller& s, const Handles& h) {
    Outcome o = s.Call(&MemoryStub::GetAllocation, AllocationOf(h.small.buffer_id()));
    if (o.code != Code::OK) return o;
    v1::GetFunctionResponse function;
    o = s.Call(&ModuleStub::GetFunction, FunctionReq(h.module, "fill_u32"), &function);
    if (o.code != Code::OK) return o;
    if (function.function_id() != h.fill) return Broken("fill_u32 has a new function id");
    o = s.Call(&ExecutionStub::SynchronizeStream,
               StreamReq<v1::SynchronizeStreamRequest>(h.stream));
    if (o.code != Code::OK) return o;
    o = s.Call(&ExecutionStub::QueryEvent, EventReq<v1::QueryEventRequest>(h.event));
    if (o.code != Code::OK) return o;
    std::string table;
    return Get(s, Addr(h.table), kTableBytes, &table);
  }

  absl::Status LedgerMatches() {
    v1::GetServerInfoResponse info;
    const Outcome got =
        mallory_.Call(&DeviceStub::GetServerInfo, v1::GetServerInfoRequest(), &info);
    if (got.code != Code::OK)
      return absl::InternalError(absl::StrCat("GetServerInfo: ", Describe(got)));
    if (info.sessions_open() != 1) {
      return absl::InternalError(absl::StrCat("mallory holds ", info.sessions_open(),
                                              " sessions after the case; 1 expected"));
    }
    v1::GetMemInfoResponse memory;
    const Outcome mem = m_.Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest(), &memory);
    if (mem.code != Code::OK)
      return absl::InternalError(absl::StrCat("GetMemInfo: ", Describe(mem)));
    const uint64_t used = memory.total_bytes() - memory.free_bytes();
    if (info.device_memory_bytes() != used) {
      return absl::InternalError(absl::StrCat("mallory's ledger says ", info.device_memory_bytes(),
                                              " bytes, her worker holds ", used));
    }
    return absl::OkStatus();
  }

  static constexpr char kSecret = 0x5a;

  std::string dir_;
  std::unique_ptr<TestDaemon> daemon_;
  std::string mallory_token_, bob_token_, admin_token_;
  Caller anonymous_;  // TCP, no credentials
  Caller mallory_;    // TCP, mallory's token, no session
  Caller bob_;
  Caller admin_;
  Caller local_;  // the Unix socket: the test's own user
  Caller m_;      // mallory's session M, the attacked one
  Caller victim_;
  Caller control_;
  Handles mh_, bh_, ch_;
  std::mt19937_64 random_{0x6261642d696e7075};
};

// ---------------------------------------------------------------------------- unary RPCs

TEST_F(BadInputTest, UnaryCallsAnswerTheirDocumentedCodes) {
  const auto mem_info = [](const Caller& c) {
    return c.Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest());
  };
  const auto keep_alive = [](const Caller& c) {
    return c.Call(&SessionStub::KeepAlive, v1::KeepAliveRequest());
  };
  const auto list_devices = [](const Caller& c) {
    return c.Call(&DeviceStub::ListDevices, v1::ListDevicesRequest());
  };
  // Results of the fault case, for the rows after it.
  Outcome after_fault, keepalive_of_faulted;
  uint64_t closed_session = 0;

  const std::vector<Case> cases = {
      // ------------------------------------------------ "gpurpc-session" metadata
      {"session: no gpurpc-session on a relayed call", [&] { return mem_info(m_.NoSession()); },
       Code::INVALID_ARGUMENT, "gpurpc-session"},
      {"session: no gpurpc-session on KeepAlive", [&] { return keep_alive(m_.NoSession()); },
       Code::INVALID_ARGUMENT, "gpurpc-session"},
      {"session: empty value", [&] { return mem_info(m_.Session({""})); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"session: letters", [&] { return mem_info(m_.Session({"abc"})); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"session: the attacker's own id in hex",
       [&] { return mem_info(m_.Session({absl::StrFormat("0x%x", m_.id())})); },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"session: negative", [&] { return mem_info(m_.Session({"-1"})); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"session: 2^64 overflows", [&] { return mem_info(m_.Session({"18446744073709551616"})); },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"session: 0", [&] { return mem_info(m_.Session({"0"})); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"session: 4000 digits", [&] { return mem_info(m_.Session({std::string(4000, '7')})); },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"session: the attacker's own id with a trailing letter",
       [&] { return mem_info(m_.Session({absl::StrCat(m_.id(), "x")})); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"session: an unknown id", [&] { return mem_info(m_.Session(Unknown())); }, Code::NOT_FOUND,
       "no session"},
      {"session: UINT64_MAX", [&] { return mem_info(m_.Session(kU64Max)); }, Code::NOT_FOUND,
       "no session"},
      {"session: another tenant's id is NOT_FOUND, word for word like an unknown one",
       [&] {
         const uint64_t unknown = Unknown();
         const Outcome theirs = mem_info(m_.Session(victim_.id()));
         const Outcome none = mem_info(m_.Session(unknown));
         const std::string a =
             absl::StrReplaceAll(theirs.message, {{std::to_string(victim_.id()), "N"}});
         const std::string b = absl::StrReplaceAll(none.message, {{std::to_string(unknown), "N"}});
         if (a != b) return Broken(absl::StrCat("they differ: '", a, "' vs '", b, "'"));
         return theirs;
       },
       Code::NOT_FOUND, "no session"},
      {"session: another tenant's id on KeepAlive",
       [&] { return keep_alive(m_.Session(victim_.id())); }, Code::NOT_FOUND, "no session"},
      {"session: another tenant's id on CloseSession",
       [&] { return Close(m_.Session(victim_.id())); }, Code::NOT_FOUND, "no session"},
      {"session: another tenant's id on HostRegionService is NOT_FOUND",
       [&] {
         return m_.Session(victim_.id())
             .Call(&HostRegionStub::UnregisterHostRegion, v1::UnregisterHostRegionRequest());
       },
       Code::NOT_FOUND, "no session"},
      {"session: two values, the attacker's then another tenant's",
       [&] {
         return mem_info(m_.Session({std::to_string(m_.id()), std::to_string(victim_.id())}));
       },
       Code::INVALID_ARGUMENT, "gpurpc-session"},
      {"session: two values, another tenant's then the attacker's",
       [&] {
         return mem_info(m_.Session({std::to_string(victim_.id()), std::to_string(m_.id())}));
       },
       Code::INVALID_ARGUMENT, "gpurpc-session"},
      {"session: a closed session",
       [&] {
         absl::StatusOr<Caller> s = Scratch();
         if (!s.ok()) return Broken(s.status().ToString());
         const Outcome closed = Close(*s);
         if (closed.code != Code::OK) return Broken("CloseSession: " + Describe(closed));
         closed_session = s->id();
         return mem_info(*s);
       },
       Code::NOT_FOUND, "no session"},
      {"session: CloseSession again", [&] { return Close(m_.Session(closed_session)); },
       Code::NOT_FOUND, "no session"},
      {"session: metadata on a call that is not session-scoped is ignored",
       [&] {
         return list_devices(m_.Session({"not a session", "-1"}));
       },
       Code::OK, ""},

      // ------------------------------------------------ "authorization" metadata
      {"auth: none, on ListDevices", [&] { return list_devices(anonymous_); },
       Code::UNAUTHENTICATED, "no credentials"},
      {"auth: none, on a relayed call", [&] { return mem_info(anonymous_.Session(m_.id())); },
       Code::UNAUTHENTICATED, "no credentials"},
      {"auth: not a bearer token",
       [&] { return mem_info(m_.Authorization({"Basic bWFsbG9yeTpwYXNzd29yZA=="})); },
       Code::UNAUTHENTICATED, "Bearer"},
      {"auth: an empty bearer token", [&] { return mem_info(m_.Authorization({"Bearer "})); },
       Code::UNAUTHENTICATED, "empty or too long"},
      {"auth: a 5000-byte bearer token",
       [&] { return mem_info(m_.Authorization({"Bearer " + std::string(5000, 'a')})); },
       Code::UNAUTHENTICATED, "empty or too long"},
      {"auth: a valid token with a byte appended",
       [&] { return mem_info(m_.Authorization({"Bearer " + mallory_token_ + "x"})); },
       Code::UNAUTHENTICATED, "not valid"},
      {"auth: a valid token after two spaces",
       [&] { return mem_info(m_.Authorization({"Bearer  " + mallory_token_})); },
       Code::UNAUTHENTICATED, ""},
      {"auth: two tokens of different tenants",
       [&] {
         return mem_info(m_.Authorization({"Bearer " + mallory_token_, "Bearer " + bob_token_}));
       },
       Code::UNAUTHENTICATED, ""},
      {"auth: the victim's valid token on the attacker's session",
       [&] { return mem_info(m_.Authorization({"Bearer " + bob_token_})); }, Code::NOT_FOUND,
       "no session"},

      // ------------------------------------------------ DeviceService
      {"GetDevice: ordinal -1",
       [&] {
         v1::GetDeviceRequest request;
         request.set_ordinal(-1);
         return mallory_.Call(&DeviceStub::GetDevice, request);
       },
       Code::NOT_FOUND, "ordinal -1"},
      {"GetDevice: ordinal INT32_MAX",
       [&] {
         v1::GetDeviceRequest request;
         request.set_ordinal(2147483647);
         return mallory_.Call(&DeviceStub::GetDevice, request);
       },
       Code::NOT_FOUND, "2147483647"},
      {"GetDevice: ordinal INT32_MIN",
       [&] {
         v1::GetDeviceRequest request;
         request.set_ordinal(-2147483647 - 1);
         return mallory_.Call(&DeviceStub::GetDevice, request);
       },
       Code::NOT_FOUND, "-2147483648"},
      {"GetServerInfo: no credentials",
       [&] { return anonymous_.Call(&DeviceStub::GetServerInfo, v1::GetServerInfoRequest()); },
       Code::UNAUTHENTICATED, ""},

      // ------------------------------------------------ SessionService
      {"OpenSession: ordinal -1",
       [&] {
         v1::OpenSessionRequest request;
         request.set_device_ordinal(-1);
         return mallory_.Call(&SessionStub::OpenSession, request);
       },
       Code::NOT_FOUND, "ordinal -1"},
      {"OpenSession: ordinal INT32_MAX",
       [&] {
         v1::OpenSessionRequest request;
         request.set_device_ordinal(2147483647);
         return mallory_.Call(&SessionStub::OpenSession, request);
       },
       Code::NOT_FOUND, "2147483647"},
      {"OpenSession: a 257-byte client label",
       [&] {
         v1::OpenSessionRequest request;
         request.set_client_label(std::string(257, 'l'));
         return mallory_.Call(&SessionStub::OpenSession, request);
       },
       Code::INVALID_ARGUMENT, "client_label"},
      // (over what the front end's own services' requests may take once parsed, 256 KiB:
      // refused before it is parsed; the 257-byte label above gets the label's own error)
      {"OpenSession: a 1 MiB client label",
       [&] {
         v1::OpenSessionRequest request;
         request.set_client_label(std::string(kMiB, 'l'));
         return mallory_.Call(&SessionStub::OpenSession, request);
       },
       Code::INVALID_ARGUMENT, "OpenSession: the request is not a valid message"},
      {"OpenSession: a client label that forges a log line",
       [&] {
         absl::StatusOr<Caller> s = Open(mallory_, "job\n[critical] forged by mallory\x1b[2J");
         if (!s.ok())
           return Outcome{static_cast<Code>(s.status().code()), std::string(s.status().message())};
         const Outcome closed = Close(*s);
         if (daemon_->Log().find("\n[critical] forged by mallory") != std::string::npos) {
           return Broken("the daemon's log has the forged line");
         }
         return closed;
       },
       Code::OK, ""},

      // ------------------------------------------------ MemoryService.Allocate / Free
      {"Allocate: 0 bytes", [&] { return m_.Call(&MemoryStub::Allocate, AllocReq(0)); },
       Code::INVALID_ARGUMENT, "size_bytes"},
      {"Allocate: UINT64_MAX bytes",
       [&] { return m_.Call(&MemoryStub::Allocate, AllocReq(kU64Max)); }, Code::RESOURCE_EXHAUSTED,
       "max_device_memory_bytes"},
      {"Allocate: 2^63 bytes", [&] { return m_.Call(&MemoryStub::Allocate, AllocReq(1ull << 63)); },
       Code::RESOURCE_EXHAUSTED, "max_device_memory_bytes"},
      {"Allocate: one byte over the tenant's quota",
       [&] { return m_.Call(&MemoryStub::Allocate, AllocReq(kMalloryMaxMemoryBytes + 1)); },
       Code::RESOURCE_EXHAUSTED, "max_device_memory_bytes"},
      {"Allocate: UINT64_MAX bytes by a tenant without a memory quota",
       [&] {
         absl::StatusOr<Caller> s = Open(admin_, "bad-input admin scratch");
         if (!s.ok()) return Broken(s.status().ToString());
         const Outcome got = s->Call(&MemoryStub::Allocate, AllocReq(kU64Max));
         const Outcome closed = Close(*s);
         if (closed.code != Code::OK) return Broken("CloseSession: " + Describe(closed));
         return got;
       },
       Code::RESOURCE_EXHAUSTED, "out of memory"},
      {"Free: an unknown buffer", [&] { return m_.Call(&MemoryStub::Free, FreeReq(Unknown())); },
       Code::NOT_FOUND, "no buffer"},
      {"Free: buffer 0", [&] { return m_.Call(&MemoryStub::Free, FreeReq(0)); }, Code::NOT_FOUND,
       "no buffer"},
      {"Free: twice",
       [&] {
         const v1::BufferInfo b = NewBuffer(m_, 64);
         const Outcome first = m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
         if (first.code != Code::OK) return Broken("the first Free: " + Describe(first));
         return m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
       },
       Code::NOT_FOUND, "no buffer"},
      {"Free: another tenant's buffer",
       [&] { return m_.Call(&MemoryStub::Free, FreeReq(bh_.buffer.buffer_id())); }, Code::NOT_FOUND,
       "no buffer"},

      // ------------------------------------------------ MemoryService.GetAllocation
      {"GetAllocation: neither id nor address",
       [&] { return m_.Call(&MemoryStub::GetAllocation, v1::GetAllocationRequest()); },
       Code::INVALID_ARGUMENT, "buffer_id or device_address"},
      {"GetAllocation: an unknown id",
       [&] { return m_.Call(&MemoryStub::GetAllocation, AllocationOf(Unknown())); },
       Code::NOT_FOUND, "no buffer"},
      {"GetAllocation: address 0",
       [&] { return m_.Call(&MemoryStub::GetAllocation, AllocationAt(0)); }, Code::NOT_FOUND,
       "in no buffer"},
      {"GetAllocation: address UINT64_MAX",
       [&] { return m_.Call(&MemoryStub::GetAllocation, AllocationAt(kU64Max)); }, Code::NOT_FOUND,
       "in no buffer"},
      {"GetAllocation: one past the end of a buffer",
       [&] {
         return m_.Call(&MemoryStub::GetAllocation,
                        AllocationAt(mh_.buffer.device_address() + mh_.buffer.size_bytes()));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"GetAllocation: another tenant's buffer id",
       [&] { return m_.Call(&MemoryStub::GetAllocation, AllocationOf(bh_.buffer.buffer_id())); },
       Code::NOT_FOUND, "no buffer"},
      {"GetAllocation: another tenant's buffer address",
       [&] {
         return m_.Call(&MemoryStub::GetAllocation, AllocationAt(bh_.buffer.device_address()));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"GetAllocation: a module global is not a buffer",
       [&] { return m_.Call(&MemoryStub::GetAllocation, AllocationAt(mh_.table)); },
       Code::NOT_FOUND, "in no buffer"},

      // ------------------------------------------------ MemoryService.Upload
      {"Upload: an unknown buffer",
       [&] { return m_.Call(&MemoryStub::Upload, UploadReq(Buf(Unknown()), "x")); },
       Code::NOT_FOUND, "no buffer"},
      {"Upload: buffer 0", [&] { return m_.Call(&MemoryStub::Upload, UploadReq(Buf(0), "x")); },
       Code::NOT_FOUND, "no buffer"},
      {"Upload: no destination",
       [&] { return m_.Call(&MemoryStub::Upload, UploadReq(v1::DevicePointer(), "x")); },
       Code::INVALID_ARGUMENT, "pointer not set"},
      {"Upload: offset one past the end",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id(), mh_.buffer.size_bytes() + 1), "x"));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: offset UINT64_MAX",
       [&] {
         return m_.Call(&MemoryStub::Upload, UploadReq(Buf(mh_.buffer.buffer_id(), kU64Max), "x"));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: offset + size wraps past 2^64",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id(), kU64Max - 2), std::string(8, 'w')));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: one byte too many",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id(), mh_.buffer.size_bytes() - 3),
                                  std::string(4, 'w')));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: 1 MiB + 1 bytes, over the unary limit",
       [&] {
         return m_.Call(&MemoryStub::Upload, UploadReq(Buf(mh_.buffer.buffer_id()),
                                                       std::string(kMaxInlineBytes + 1, 'u')));
       },
       Code::INVALID_ARGUMENT, "unary limit"},
      {"Upload: another tenant's buffer",
       [&] { return m_.Call(&MemoryStub::Upload, UploadReq(Buf(bh_.buffer.buffer_id()), "x")); },
       Code::NOT_FOUND, "no buffer"},
      {"Upload: another tenant's device address",
       [&] {
         return m_.Call(&MemoryStub::Upload, UploadReq(Addr(bh_.buffer.device_address()), "x"));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Upload: address UINT64_MAX",
       [&] { return m_.Call(&MemoryStub::Upload, UploadReq(Addr(kU64Max), "x")); }, Code::NOT_FOUND,
       "in no buffer"},
      {"Upload: an address in the gap after a buffer",
       [&] {
         return m_.Call(
             &MemoryStub::Upload,
             UploadReq(Addr(mh_.buffer.device_address() + mh_.buffer.size_bytes() + 8), "x"));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Upload: past the end of a module global",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Addr(mh_.table + kTableBytes - 4), std::string(8, 'g')));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: an unknown stream",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id()), "x", Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"Upload: another tenant's stream",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id()), "x", bh_.stream));
       },
       Code::NOT_FOUND, "no stream"},
      {"Upload: 0 bytes at the very end is a valid empty range",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id(), mh_.buffer.size_bytes()), ""));
       },
       Code::OK, ""},
      {"Upload: 0 bytes one past the end",
       [&] {
         return m_.Call(&MemoryStub::Upload,
                        UploadReq(Buf(mh_.buffer.buffer_id(), mh_.buffer.size_bytes() + 1), ""));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Upload: 0 bytes on an unknown stream",
       [&] {
         return m_.Call(&MemoryStub::Upload, UploadReq(Buf(mh_.buffer.buffer_id()), "", Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"Upload: a freed buffer",
       [&] {
         const v1::BufferInfo b = NewBuffer(m_, 64);
         const Outcome freed = m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
         if (freed.code != Code::OK) return Broken("Free: " + Describe(freed));
         return m_.Call(&MemoryStub::Upload, UploadReq(Buf(b.buffer_id()), "x"));
       },
       Code::NOT_FOUND, "no buffer"},
      {"Upload: the address of a freed buffer",
       [&] {
         const v1::BufferInfo b = NewBuffer(m_, 64);
         const Outcome freed = m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
         if (freed.code != Code::OK) return Broken("Free: " + Describe(freed));
         return m_.Call(&MemoryStub::Upload, UploadReq(Addr(b.device_address()), "x"));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Upload: the global of an unloaded module",
       [&] {
         const uint64_t module = NewModule(m_);
         v1::GetGlobalResponse global;
         const Outcome got = m_.Call(&ModuleStub::GetGlobal, GlobalReq(module, "table"), &global);
         if (got.code != Code::OK) return Broken("GetGlobal: " + Describe(got));
         const Outcome unloaded = m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
         if (unloaded.code != Code::OK) return Broken("UnloadModule: " + Describe(unloaded));
         return m_.Call(&MemoryStub::Upload, UploadReq(Addr(global.device_address()), "x"));
       },
       Code::NOT_FOUND, "in no buffer"},

      // ------------------------------------------------ MemoryService.Download
      {"Download: 1 MiB + 1 bytes, over the unary limit",
       [&] {
         return m_.Call(&MemoryStub::Download,
                        DownloadReq(Buf(mh_.buffer.buffer_id()), kMaxInlineBytes + 1));
       },
       Code::INVALID_ARGUMENT, "unary limit"},
      {"Download: UINT64_MAX bytes",
       [&] {
         return m_.Call(&MemoryStub::Download, DownloadReq(Buf(mh_.buffer.buffer_id()), kU64Max));
       },
       Code::INVALID_ARGUMENT, ""},
      {"Download: offset UINT64_MAX",
       [&] {
         return m_.Call(&MemoryStub::Download,
                        DownloadReq(Buf(mh_.buffer.buffer_id(), kU64Max), 1));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Download: offset + size wraps past 2^64",
       [&] {
         return m_.Call(&MemoryStub::Download,
                        DownloadReq(Buf(mh_.buffer.buffer_id(), kU64Max - 2), 16));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Download: another tenant's buffer returns no bytes",
       [&] {
         v1::DownloadResponse response;
         const Outcome got = m_.Call(&MemoryStub::Download,
                                     DownloadReq(Buf(bh_.buffer.buffer_id()), 4096), &response);
         if (!response.data().empty()) return Broken("bytes came back");
         return got;
       },
       Code::NOT_FOUND, "no buffer"},
      {"Download: another tenant's module global",
       [&] { return m_.Call(&MemoryStub::Download, DownloadReq(Addr(bh_.table), kTableBytes)); },
       Code::NOT_FOUND, "in no buffer"},
      {"Download: a freed buffer",
       [&] {
         const v1::BufferInfo b = NewBuffer(m_, 64);
         const Outcome freed = m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
         if (freed.code != Code::OK) return Broken("Free: " + Describe(freed));
         return m_.Call(&MemoryStub::Download, DownloadReq(Buf(b.buffer_id()), 64));
       },
       Code::NOT_FOUND, "no buffer"},
      {"Download: an unknown stream",
       [&] {
         return m_.Call(&MemoryStub::Download,
                        DownloadReq(Buf(mh_.buffer.buffer_id()), 4, Unknown()));
       },
       Code::NOT_FOUND, "no stream"},

      // ------------------------------------------------ MemoryService.Memset
      {"Memset: element size 3",
       [&] { return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id()), 3, 1)); },
       Code::INVALID_ARGUMENT, "element_size_bytes"},
      {"Memset: element size 0",
       [&] { return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id()), 0, 1)); },
       Code::INVALID_ARGUMENT, "element_size_bytes"},
      {"Memset: element size 8",
       [&] { return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id()), 8, 1)); },
       Code::INVALID_ARGUMENT, "element_size_bytes"},
      {"Memset: count UINT64_MAX",
       [&] {
         return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id()), 4, kU64Max));
       },
       Code::INVALID_ARGUMENT, ""},
      {"Memset: count 2^62 of 4 bytes wraps to 0 bytes",
       [&] {
         return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id()), 4, 1ull << 62));
       },
       Code::INVALID_ARGUMENT, ""},
      {"Memset: a destination not aligned to the element",
       [&] {
         return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(mh_.buffer.buffer_id(), 1), 4, 1));
       },
       Code::INVALID_ARGUMENT, "aligned"},
      {"Memset: one element past the end",
       [&] {
         return m_.Call(&MemoryStub::Memset,
                        MemsetReq(Buf(mh_.buffer.buffer_id()), 4, mh_.buffer.size_bytes() / 4 + 1));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Memset: an unknown buffer",
       [&] { return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(Unknown()), 1, 1)); },
       Code::NOT_FOUND, "no buffer"},
      {"Memset: another tenant's buffer",
       [&] { return m_.Call(&MemoryStub::Memset, MemsetReq(Buf(bh_.buffer.buffer_id()), 1, 16)); },
       Code::NOT_FOUND, "no buffer"},
      {"Memset: another tenant's device address",
       [&] {
         return m_.Call(&MemoryStub::Memset, MemsetReq(Addr(bh_.buffer.device_address()), 1, 16));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Memset: an unknown stream",
       [&] {
         return m_.Call(&MemoryStub::Memset,
                        MemsetReq(Buf(mh_.buffer.buffer_id()), 1, 1, Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"Memset: 0 elements on an unknown stream",
       [&] {
         return m_.Call(&MemoryStub::Memset,
                        MemsetReq(Buf(mh_.buffer.buffer_id()), 1, 0, Unknown()));
       },
       Code::NOT_FOUND, "no stream"},

      // ------------------------------------------------ MemoryService.CopyDeviceToDevice
      {"Copy: the source runs past its end",
       [&] {
         return m_.Call(&MemoryStub::CopyDeviceToDevice,
                        CopyReq(Buf(mh_.buffer.buffer_id()), Buf(mh_.small.buffer_id()), 17));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Copy: from another tenant's buffer",
       [&] {
         return m_.Call(&MemoryStub::CopyDeviceToDevice,
                        CopyReq(Buf(mh_.buffer.buffer_id()), Buf(bh_.buffer.buffer_id()), 16));
       },
       Code::NOT_FOUND, "no buffer"},
      {"Copy: from another tenant's device address",
       [&] {
         return m_.Call(
             &MemoryStub::CopyDeviceToDevice,
             CopyReq(Buf(mh_.buffer.buffer_id()), Addr(bh_.buffer.device_address()), 16));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Copy: to another tenant's device address",
       [&] {
         return m_.Call(&MemoryStub::CopyDeviceToDevice, CopyReq(Addr(bh_.buffer.device_address()),
                                                                 Buf(mh_.buffer.buffer_id()), 16));
       },
       Code::NOT_FOUND, "in no buffer"},
      {"Copy: UINT64_MAX bytes",
       [&] {
         return m_.Call(&MemoryStub::CopyDeviceToDevice,
                        CopyReq(Buf(mh_.buffer.buffer_id()), Buf(mh_.small.buffer_id()), kU64Max));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Copy: the destination's offset + size wraps past 2^64",
       [&] {
         return m_.Call(
             &MemoryStub::CopyDeviceToDevice,
             CopyReq(Buf(mh_.buffer.buffer_id(), kU64Max - 4), Buf(mh_.small.buffer_id()), 16));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"Copy: no source",
       [&] {
         return m_.Call(&MemoryStub::CopyDeviceToDevice,
                        CopyReq(Buf(mh_.buffer.buffer_id()), v1::DevicePointer(), 4));
       },
       Code::INVALID_ARGUMENT, "pointer not set"},
      {"Copy: an unknown stream",
       [&] {
         return m_.Call(
             &MemoryStub::CopyDeviceToDevice,
             CopyReq(Buf(mh_.buffer.buffer_id()), Buf(mh_.small.buffer_id()), 4, Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"Copy: 0 bytes on an unknown stream",
       [&] {
         return m_.Call(
             &MemoryStub::CopyDeviceToDevice,
             CopyReq(Buf(mh_.buffer.buffer_id()), Buf(mh_.small.buffer_id()), 0, Unknown()));
       },
       Code::NOT_FOUND, "no stream"},

      // ------------------------------------------------ ModuleService.LoadModule / UnloadModule
      {"LoadModule: an empty image", [&] { return m_.Call(&ModuleStub::LoadModule, LoadReq("")); },
       Code::INVALID_ARGUMENT, "empty"},
      {"LoadModule: 4 KiB of random bytes",
       [&] { return m_.Call(&ModuleStub::LoadModule, LoadReq(RandomBytes(4096, 1))); },
       Code::INVALID_ARGUMENT, "image"},
      {"LoadModule: a truncated ELF header",
       [&] {
         return m_.Call(&ModuleStub::LoadModule, LoadReq(std::string("\x7f"
                                                                     "ELF\x02\x01\x01\x33",
                                                                     8) +
                                                         std::string(24, '\0')));
       },
       Code::INVALID_ARGUMENT, "image"},
      {"LoadModule: a fatbin magic and garbage",
       [&] {
         return m_.Call(
             &ModuleStub::LoadModule,
             LoadReq(std::string("\x50\xed\x55\xba\x01\x00\x10\x00", 8) + RandomBytes(256, 2)));
       },
       Code::INVALID_ARGUMENT, "image"},
      {"LoadModule: text that is not PTX",
       [&] {
         return m_.Call(&ModuleStub::LoadModule,
                        LoadReq("this is not PTX {{{ .entry ( ;;; \n .global .b8 [;\n"));
       },
       Code::INVALID_ARGUMENT, "image"},
      {"LoadModule: PTX whose kernel never closes its body",
       [&] {
         return m_.Call(&ModuleStub::LoadModule,
                        LoadReq(".version 8.0\n.target sm_75\n.address_size 64\n"
                                ".visible .entry fill_u32(.param .u64 a)\n{\n\tret;\n"));
       },
       Code::INVALID_ARGUMENT, "PTX"},
      {"LoadModule: a PTX global of UINT64_MAX bytes",
       [&] {
         return m_.Call(&ModuleStub::LoadModule,
                        LoadReq(".version 8.0\n.target sm_90\n.address_size 64\n"
                                ".visible .global .b8 huge[18446744073709551615];\n"));
       },
       Code::RESOURCE_EXHAUSTED, ""},
      {"LoadModule: PTX globals over the tenant's memory quota",
       [&] {
         return m_.Call(&ModuleStub::LoadModule,
                        LoadReq(".version 8.0\n.target sm_90\n.address_size 64\n"
                                ".visible .global .b8 big[314572800];\n"));
       },
       Code::RESOURCE_EXHAUSTED, "max_device_memory_bytes"},
      {"UnloadModule: an unknown module",
       [&] { return m_.Call(&ModuleStub::UnloadModule, UnloadReq(Unknown())); }, Code::NOT_FOUND,
       "no module"},
      {"UnloadModule: module 0", [&] { return m_.Call(&ModuleStub::UnloadModule, UnloadReq(0)); },
       Code::NOT_FOUND, "no module"},
      {"UnloadModule: twice",
       [&] {
         const uint64_t module = NewModule(m_);
         const Outcome first = m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
         if (first.code != Code::OK) return Broken("the first UnloadModule: " + Describe(first));
         return m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
       },
       Code::NOT_FOUND, "no module"},
      {"UnloadModule: another tenant's module",
       [&] { return m_.Call(&ModuleStub::UnloadModule, UnloadReq(bh_.module)); }, Code::NOT_FOUND,
       "no module"},

      // ------------------------------------------------ ModuleService.GetFunction / GetGlobal
      {"GetFunction: an unknown module",
       [&] { return m_.Call(&ModuleStub::GetFunction, FunctionReq(Unknown(), "fill_u32")); },
       Code::NOT_FOUND, "no module"},
      {"GetFunction: another tenant's module",
       [&] { return m_.Call(&ModuleStub::GetFunction, FunctionReq(bh_.module, "fill_u32")); },
       Code::NOT_FOUND, "no module"},
      {"GetFunction: an unknown kernel",
       [&] { return m_.Call(&ModuleStub::GetFunction, FunctionReq(mh_.module, "no_such_kernel")); },
       Code::NOT_FOUND, "no_such_kernel"},
      {"GetFunction: an empty name",
       [&] { return m_.Call(&ModuleStub::GetFunction, FunctionReq(mh_.module, "")); },
       Code::INVALID_ARGUMENT, "empty"},
      {"GetFunction: a kernel name with a NUL byte after a real name",
       [&] {
         return m_.Call(&ModuleStub::GetFunction,
                        FunctionReq(mh_.module, std::string("fill_u32\0x", 10)));
       },
       Code::INVALID_ARGUMENT, "NUL"},
      {"GetFunction: a kernel name that starts with a NUL byte",
       [&] {
         return m_.Call(&ModuleStub::GetFunction,
                        FunctionReq(mh_.module, std::string("\0fill_u32", 9)));
       },
       Code::INVALID_ARGUMENT, "NUL"},
      {"GetFunction: a 1 MiB name",
       [&] {
         return m_.Call(&ModuleStub::GetFunction, FunctionReq(mh_.module, std::string(kMiB, 'k')));
       },
       Code::INVALID_ARGUMENT, "limit"},
      {"GetFunction: 4000 control characters as a name",
       [&] {
         return m_.Call(&ModuleStub::GetFunction,
                        FunctionReq(mh_.module, std::string(4000, '\x01')));
       },
       Code::NOT_FOUND, ""},
      {"GetFunction: an unloaded module",
       [&] {
         const uint64_t module = NewModule(m_);
         const Outcome unloaded = m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
         if (unloaded.code != Code::OK) return Broken("UnloadModule: " + Describe(unloaded));
         return m_.Call(&ModuleStub::GetFunction, FunctionReq(module, "fill_u32"));
       },
       Code::NOT_FOUND, "no module"},
      {"GetGlobal: an unknown module",
       [&] { return m_.Call(&ModuleStub::GetGlobal, GlobalReq(Unknown(), "table")); },
       Code::NOT_FOUND, "no module"},
      {"GetGlobal: an unknown name",
       [&] { return m_.Call(&ModuleStub::GetGlobal, GlobalReq(mh_.module, "no_such_global")); },
       Code::NOT_FOUND, "no_such_global"},
      {"GetGlobal: a name with a NUL byte after a real name",
       [&] {
         return m_.Call(&ModuleStub::GetGlobal, GlobalReq(mh_.module, std::string("table\0x", 7)));
       },
       Code::INVALID_ARGUMENT, "NUL"},
      {"GetGlobal: another tenant's module",
       [&] { return m_.Call(&ModuleStub::GetGlobal, GlobalReq(bh_.module, "table")); },
       Code::NOT_FOUND, "no module"},

      // ------------------------------------------------ ModuleService.Compile
      {"Compile: -I/etc",
       [&] {
         return m_.Call(&ModuleStub::Compile, CompileReq("__global__ void k() {}", {"-I/etc"}));
       },
       Code::INVALID_ARGUMENT, "not allowed"},
      {"Compile: --include-path=/",
       [&] {
         return m_.Call(&ModuleStub::Compile,
                        CompileReq("__global__ void k() {}", {"--include-path=/"}));
       },
       Code::INVALID_ARGUMENT, "not allowed"},
      {"Compile: --pre-include=/etc/passwd",
       [&] {
         return m_.Call(&ModuleStub::Compile,
                        CompileReq("__global__ void k() {}", {"--pre-include=/etc/passwd"}));
       },
       Code::INVALID_ARGUMENT, "not allowed"},
      {"Compile: --options-file=/etc/passwd",
       [&] {
         return m_.Call(&ModuleStub::Compile,
                        CompileReq("__global__ void k() {}", {"--options-file=/etc/passwd"}));
       },
       Code::INVALID_ARGUMENT, "not allowed"},
      {"Compile: an options file smuggled through -Xptxas",
       [&] {
         return m_.Call(&ModuleStub::Compile,
                        CompileReq("__global__ void k() {}", {"-Xptxas=-v,--options-file=x"}));
       },
       Code::INVALID_ARGUMENT, "not allowed"},
      {"Compile: #include of an absolute path",
       [&] { return m_.Call(&ModuleStub::Compile, CompileReq("#include \"/etc/passwd\"\n")); },
       Code::INVALID_ARGUMENT, "outside the request"},
      {"Compile: #include that climbs out with ..",
       [&] {
         return m_.Call(&ModuleStub::Compile, CompileReq("#include <../../../../etc/passwd>\n"));
       },
       Code::INVALID_ARGUMENT, "outside the request"},
      {"Compile: a computed #include",
       [&] {
         return m_.Call(&ModuleStub::Compile, CompileReq("#define F </etc/passwd>\n#include F\n"));
       },
       Code::INVALID_ARGUMENT, "computed"},
      {"Compile: __has_include of a server file",
       [&] {
         return m_.Call(&ModuleStub::Compile,
                        CompileReq("#if __has_include(</etc/shadow>)\n#endif\n"));
       },
       Code::INVALID_ARGUMENT, "outside the request"},
      {"Compile: a header named by an absolute path",
       [&] {
         v1::CompileRequest request = CompileReq("__global__ void k() {}");
         v1::Header* header = request.add_headers();
         header->set_name("/etc/passwd");
         header->set_content("x");
         return m_.Call(&ModuleStub::Compile, request);
       },
       Code::INVALID_ARGUMENT, "absolute"},
      {"Compile: a header name with ..",
       [&] {
         v1::CompileRequest request = CompileReq("__global__ void k() {}");
         v1::Header* header = request.add_headers();
         header->set_name("../up.h");
         header->set_content("x");
         return m_.Call(&ModuleStub::Compile, request);
       },
       Code::INVALID_ARGUMENT, ".."},
      {"Compile: the same header twice",
       [&] {
         v1::CompileRequest request = CompileReq("__global__ void k() {}");
         for (int i = 0; i < 2; ++i) {
           v1::Header* header = request.add_headers();
           header->set_name("twice.h");
           header->set_content("// x");
         }
         return m_.Call(&ModuleStub::Compile, request);
       },
       Code::INVALID_ARGUMENT, "more than once"},
      {"Compile: a NUL byte in the source",
       [&] {
         return m_.Call(
             &ModuleStub::Compile,
             CompileReq(std::string("__global__ void k() {}\0#include </etc/passwd>", 45)));
       },
       Code::INVALID_ARGUMENT, "NUL"},
      {"Compile: an empty option",
       [&] { return m_.Call(&ModuleStub::Compile, CompileReq("__global__ void k() {}", {""})); },
       Code::INVALID_ARGUMENT, "empty"},
      {"Compile: an empty name expression",
       [&] {
         v1::CompileRequest request = CompileReq("__global__ void k() {}");
         request.add_name_expressions("");
         return m_.Call(&ModuleStub::Compile, request);
       },
       Code::INVALID_ARGUMENT, "empty"},
      {"Compile: a source over the size limit",
       [&] { return m_.Call(&ModuleStub::Compile, CompileReq(std::string(4 * kMiB + 1, ' '))); },
       Code::INVALID_ARGUMENT, "max_source_bytes"},
      {"Compile: a NUL byte in the program name",
       [&] {
         v1::CompileRequest request = CompileReq("__global__ void k() {}");
         request.set_program_name(std::string("k.cu\0/etc/passwd", 16));
         return m_.Call(&ModuleStub::Compile, request);
       },
       Code::INVALID_ARGUMENT, "NUL"},

      // ------------------------------------------------ ExecutionService: streams
      {"DestroyStream: the default stream",
       [&] {
         return m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(0));
       },
       Code::NOT_FOUND, "default stream"},
      {"DestroyStream: an unknown stream",
       [&] {
         return m_.Call(&ExecutionStub::DestroyStream,
                        StreamReq<v1::DestroyStreamRequest>(Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"DestroyStream: twice",
       [&] {
         const uint64_t stream = NewStream(m_);
         const Outcome first =
             m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         if (first.code != Code::OK) return Broken("the first DestroyStream: " + Describe(first));
         return m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
       },
       Code::NOT_FOUND, "no stream"},
      {"DestroyStream: another tenant's stream",
       [&] {
         return m_.Call(&ExecutionStub::DestroyStream,
                        StreamReq<v1::DestroyStreamRequest>(bh_.stream));
       },
       Code::NOT_FOUND, "no stream"},
      {"SynchronizeStream: an unknown stream",
       [&] {
         return m_.Call(&ExecutionStub::SynchronizeStream,
                        StreamReq<v1::SynchronizeStreamRequest>(Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"SynchronizeStream: another tenant's stream",
       [&] {
         return m_.Call(&ExecutionStub::SynchronizeStream,
                        StreamReq<v1::SynchronizeStreamRequest>(bh_.stream));
       },
       Code::NOT_FOUND, "no stream"},
      {"QueryStream: a destroyed stream",
       [&] {
         const uint64_t stream = NewStream(m_);
         const Outcome destroyed =
             m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         if (destroyed.code != Code::OK) return Broken("DestroyStream: " + Describe(destroyed));
         return m_.Call(&ExecutionStub::QueryStream, StreamReq<v1::QueryStreamRequest>(stream));
       },
       Code::NOT_FOUND, "no stream"},

      // ------------------------------------------------ ExecutionService: events
      {"DestroyEvent: an unknown event",
       [&] {
         return m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(Unknown()));
       },
       Code::NOT_FOUND, "no event"},
      {"DestroyEvent: twice",
       [&] {
         const uint64_t event = NewEvent(m_);
         const Outcome first =
             m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(event));
         if (first.code != Code::OK) return Broken("the first DestroyEvent: " + Describe(first));
         return m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(event));
       },
       Code::NOT_FOUND, "no event"},
      {"DestroyEvent: another tenant's event",
       [&] {
         return m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(bh_.event));
       },
       Code::NOT_FOUND, "no event"},
      {"RecordEvent: an unknown event",
       [&] { return m_.Call(&ExecutionStub::RecordEvent, RecordReq(Unknown(), 0)); },
       Code::NOT_FOUND, "no event"},
      {"RecordEvent: an unknown stream",
       [&] { return m_.Call(&ExecutionStub::RecordEvent, RecordReq(mh_.event, Unknown())); },
       Code::NOT_FOUND, "no stream"},
      {"RecordEvent: another tenant's event",
       [&] { return m_.Call(&ExecutionStub::RecordEvent, RecordReq(bh_.event, 0)); },
       Code::NOT_FOUND, "no event"},
      {"RecordEvent: on another tenant's stream",
       [&] { return m_.Call(&ExecutionStub::RecordEvent, RecordReq(mh_.event, bh_.stream)); },
       Code::NOT_FOUND, "no stream"},
      {"QueryEvent: an unknown event",
       [&] {
         return m_.Call(&ExecutionStub::QueryEvent, EventReq<v1::QueryEventRequest>(Unknown()));
       },
       Code::NOT_FOUND, "no event"},
      {"QueryEvent: a destroyed event",
       [&] {
         const uint64_t event = NewEvent(m_);
         const Outcome destroyed =
             m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(event));
         if (destroyed.code != Code::OK) return Broken("DestroyEvent: " + Describe(destroyed));
         return m_.Call(&ExecutionStub::QueryEvent, EventReq<v1::QueryEventRequest>(event));
       },
       Code::NOT_FOUND, "no event"},
      {"SynchronizeEvent: another tenant's event",
       [&] {
         return m_.Call(&ExecutionStub::SynchronizeEvent,
                        EventReq<v1::SynchronizeEventRequest>(bh_.event));
       },
       Code::NOT_FOUND, "no event"},
      {"EventElapsedTime: two events never recorded",
       [&] {
         const uint64_t a = NewEvent(m_), b = NewEvent(m_);
         const Outcome got = m_.Call(&ExecutionStub::EventElapsedTime, ElapsedReq(a, b));
         for (uint64_t e : {a, b}) {
           m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(e));
         }
         return got;
       },
       Code::FAILED_PRECONDITION, "not been recorded"},
      {"EventElapsedTime: events with timing disabled",
       [&] {
         return m_.Call(&ExecutionStub::EventElapsedTime,
                        ElapsedReq(mh_.event_untimed, mh_.event_untimed));
       },
       Code::FAILED_PRECONDITION, "timing disabled"},
      {"EventElapsedTime: an unknown start event",
       [&] { return m_.Call(&ExecutionStub::EventElapsedTime, ElapsedReq(Unknown(), mh_.event)); },
       Code::NOT_FOUND, "no event"},
      {"EventElapsedTime: another tenant's end event",
       [&] { return m_.Call(&ExecutionStub::EventElapsedTime, ElapsedReq(mh_.event, bh_.event)); },
       Code::NOT_FOUND, "no event"},
      {"StreamWaitEvent: an unknown event",
       [&] { return m_.Call(&ExecutionStub::StreamWaitEvent, WaitReq(mh_.stream, Unknown())); },
       Code::NOT_FOUND, "no event"},
      {"StreamWaitEvent: an unknown stream",
       [&] { return m_.Call(&ExecutionStub::StreamWaitEvent, WaitReq(Unknown(), mh_.event)); },
       Code::NOT_FOUND, "no stream"},
      {"StreamWaitEvent: another tenant's event",
       [&] { return m_.Call(&ExecutionStub::StreamWaitEvent, WaitReq(0, bh_.event)); },
       Code::NOT_FOUND, "no event"},

      // ------------------------------------------------ ExecutionService: CUDA graphs
      {"BeginCapture: the default stream",
       [&] { return m_.Call(&ExecutionStub::BeginCapture, StreamReq<v1::BeginCaptureRequest>(0)); },
       Code::INVALID_ARGUMENT, "legacy default stream"},
      {"BeginCapture: an unknown stream",
       [&] {
         return m_.Call(&ExecutionStub::BeginCapture,
                        StreamReq<v1::BeginCaptureRequest>(Unknown()));
       },
       Code::NOT_FOUND, "no stream"},
      {"BeginCapture: another tenant's stream",
       [&] {
         return m_.Call(&ExecutionStub::BeginCapture,
                        StreamReq<v1::BeginCaptureRequest>(bh_.stream));
       },
       Code::NOT_FOUND, "no stream"},
      {"BeginCapture: a mode that is no CaptureMode",
       [&] {
         v1::BeginCaptureRequest request = StreamReq<v1::BeginCaptureRequest>(mh_.stream);
         request.set_mode(static_cast<v1::CaptureMode>(99));
         return m_.Call(&ExecutionStub::BeginCapture, request);
       },
       Code::INVALID_ARGUMENT, "not a CaptureMode"},
      {"BeginCapture: twice",
       [&] {
         const uint64_t stream = NewStream(m_);
         const auto begin = StreamReq<v1::BeginCaptureRequest>(stream);
         const Outcome first = m_.Call(&ExecutionStub::BeginCapture, begin);
         if (first.code != Code::OK) return Broken("the first BeginCapture: " + Describe(first));
         const Outcome second = m_.Call(&ExecutionStub::BeginCapture, begin);
         m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         return second;
       },
       Code::FAILED_PRECONDITION, "already capturing"},
      {"EndCapture: a stream that does not capture",
       [&] {
         return m_.Call(&ExecutionStub::EndCapture, StreamReq<v1::EndCaptureRequest>(mh_.stream));
       },
       Code::FAILED_PRECONDITION, "not capturing"},
      {"SynchronizeStream: a capturing stream",
       [&] {
         const uint64_t stream = NewStream(m_);
         const Outcome begun =
             m_.Call(&ExecutionStub::BeginCapture, StreamReq<v1::BeginCaptureRequest>(stream));
         if (begun.code != Code::OK) return Broken("BeginCapture: " + Describe(begun));
         const Outcome synced = m_.Call(&ExecutionStub::SynchronizeStream,
                                        StreamReq<v1::SynchronizeStreamRequest>(stream));
         m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         return synced;
       },
       Code::FAILED_PRECONDITION, "capturing a graph"},
      {"InstantiateGraph: an unknown graph",
       [&] {
         v1::InstantiateGraphRequest request;
         request.set_graph_id(Unknown());
         return m_.Call(&ExecutionStub::InstantiateGraph, request);
       },
       Code::NOT_FOUND, "no graph"},
      {"InstantiateGraph: another tenant's graph",
       [&] {
         uint64_t graph = 0;
         const Outcome captured = CaptureGraph(victim_, bh_.stream, FillLaunch(bh_), &graph);
         if (captured.code != Code::OK) return Broken("bob's capture: " + Describe(captured));
         v1::InstantiateGraphRequest request;
         request.set_graph_id(graph);
         const Outcome got = m_.Call(&ExecutionStub::InstantiateGraph, request);
         DestroyGraph(victim_, graph);
         return got;
       },
       Code::NOT_FOUND, "no graph"},
      {"LaunchGraph: graph exec 0",
       [&] { return m_.Call(&ExecutionStub::LaunchGraph, v1::LaunchGraphRequest()); },
       Code::NOT_FOUND, "no graph exec"},
      {"LaunchGraph: a graph's id is no graph exec's",
       [&] {
         uint64_t graph = 0;
         const Outcome captured = CaptureGraph(m_, mh_.stream, FillLaunch(mh_), &graph);
         if (captured.code != Code::OK) return Broken("capture: " + Describe(captured));
         v1::LaunchGraphRequest request;
         request.mutable_launch()->set_graph_exec_id(graph);
         const Outcome got = m_.Call(&ExecutionStub::LaunchGraph, request);
         DestroyGraph(m_, graph);
         return got;
       },
       Code::NOT_FOUND, "no graph exec"},
      {"GetGraphNodes: UINT64_MAX",
       [&] {
         v1::GetGraphNodesRequest request;
         request.set_graph_id(kU64Max);
         return m_.Call(&ExecutionStub::GetGraphNodes, request);
       },
       Code::NOT_FOUND, "no graph"},
      {"UpdateGraphExec: unknown ids",
       [&] {
         v1::UpdateGraphExecRequest request;
         request.set_graph_exec_id(Unknown());
         request.set_graph_id(Unknown());
         return m_.Call(&ExecutionStub::UpdateGraphExec, request);
       },
       Code::NOT_FOUND, "no graph exec"},
      {"SetGraphExecKernelNodeArgs: a node past the graph",
       [&] {
         uint64_t graph = 0;
         const Outcome captured = CaptureGraph(m_, mh_.stream, FillLaunch(mh_), &graph);
         if (captured.code != Code::OK) return Broken("capture: " + Describe(captured));
         v1::InstantiateGraphRequest instantiate;
         instantiate.set_graph_id(graph);
         v1::InstantiateGraphResponse made;
         const Outcome exec = m_.Call(&ExecutionStub::InstantiateGraph, instantiate, &made);
         DestroyGraph(m_, graph);
         if (exec.code != Code::OK) return Broken("InstantiateGraph: " + Describe(exec));
         v1::SetGraphExecKernelNodeArgsRequest request;
         request.set_graph_exec_id(made.graph_exec_id());
         request.set_node_index(kU32Max);
         const Outcome got = m_.Call(&ExecutionStub::SetGraphExecKernelNodeArgs, request);
         v1::DestroyGraphExecRequest destroy;
         destroy.set_graph_exec_id(made.graph_exec_id());
         m_.Call(&ExecutionStub::DestroyGraphExec, destroy);
         return got;
       },
       Code::INVALID_ARGUMENT, "past the 1 nodes"},
      {"DestroyGraphExec: an unknown graph exec",
       [&] {
         v1::DestroyGraphExecRequest request;
         request.set_graph_exec_id(Unknown());
         return m_.Call(&ExecutionStub::DestroyGraphExec, request);
       },
       Code::NOT_FOUND, "no graph exec"},

      // ------------------------------------------------ ExecutionService.Launch
      {"Launch: an unknown function",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_function_id(Unknown());
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no function"},
      {"Launch: function 0",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_function_id(0);
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no function"},
      {"Launch: another tenant's function",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_function_id(bh_.fill);
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no function"},
      {"Launch: a function of an unloaded module",
       [&] {
         const uint64_t module = NewModule(m_);
         v1::GetFunctionResponse function;
         const Outcome got =
             m_.Call(&ModuleStub::GetFunction, FunctionReq(module, "fill_u32"), &function);
         if (got.code != Code::OK) return Broken("GetFunction: " + Describe(got));
         const Outcome unloaded = m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
         if (unloaded.code != Code::OK) return Broken("UnloadModule: " + Describe(unloaded));
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_function_id(function.function_id());
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no function"},
      {"Launch: grid.x = 0",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_grid()->set_x(0);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "grid.x is 0"},
      {"Launch: no grid at all",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.clear_grid();
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "grid.x is 0"},
      {"Launch: block.z = 0",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_block()->set_z(0);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "block.z is 0"},
      {"Launch: grid.x = UINT32_MAX",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_grid()->set_x(kU32Max);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "grid.x"},
      {"Launch: grid.y = 65536",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_grid()->set_y(65536);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "grid.y"},
      {"Launch: block.x = 1025",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_block()->set_x(1025);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "block.x"},
      {"Launch: 2048 threads in a block",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         SetDim(l.mutable_block(), 32, 32, 2);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "threads per block"},
      {"Launch: UINT32_MAX bytes of shared memory",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_shared_memory_bytes(kU32Max);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "shared memory"},
      {"Launch: more shared memory than a block may use without opting in",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_shared_memory_bytes(100000);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "shared memory"},
      {"Launch: packed arguments one byte short",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.clear_args();
         l.set_packed_args(std::string(23, '\0'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "packed arguments"},
      {"Launch: 1 MiB of packed arguments",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.clear_args();
         l.set_packed_args(std::string(kMiB, '\0'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "packed arguments"},
      {"Launch: packed and typed arguments together",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_packed_args(std::string(24, '\0'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "not both"},
      {"Launch: two typed arguments for three parameters",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_args()->RemoveLast();
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "3 parameters"},
      {"Launch: four typed arguments for three parameters",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.add_args() = ArgU64(1);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "3 parameters"},
      {"Launch: a 4-byte integer for a pointer",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = ArgU32(1);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #0"},
      {"Launch: an argument with no value",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = v1::KernelArg();
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #0"},
      {"Launch: 7 raw bytes for an 8-byte parameter",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(2) = ArgRaw(std::string(7, '\x01'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #2"},
      {"Launch: 1 MiB of raw bytes for an 8-byte parameter",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(2) = ArgRaw(std::string(kMiB, '\x01'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #2"},
      {"Launch: an unknown buffer as an argument",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = ArgBuffer(Unknown());
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "parameter #0"},
      {"Launch: another tenant's buffer as an argument",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = ArgBuffer(bh_.buffer.buffer_id());
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "parameter #0"},
      {"Launch: a buffer argument one past its end",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = ArgBuffer(mh_.buffer.buffer_id(), mh_.buffer.size_bytes() + 1);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #0"},
      {"Launch: a buffer argument at offset UINT64_MAX",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(0) = ArgBuffer(mh_.buffer.buffer_id(), kU64Max);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #0"},
      // The fake's kernels have no 1- or 2-byte parameter (it runs a kernel only with its
      // built-in layout), so these two meet the size check; the range check itself ("does not
      // fit") is reached only on a GPU or by a fake kernel with such a parameter.
      {"Launch: a u8 argument of 300",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(1) = ArgU8(300);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #1"},
      {"Launch: a u16 argument of 70000",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         *l.mutable_args(1) = ArgU16(70000);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "parameter #1"},
      {"Launch: an unknown stream",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_stream_id(Unknown());
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no stream"},
      {"Launch: another tenant's stream",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_stream_id(bh_.stream);
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no stream"},
      {"Launch: a destroyed stream",
       [&] {
         const uint64_t stream = NewStream(m_);
         const Outcome destroyed =
             m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         if (destroyed.code != Code::OK) return Broken("DestroyStream: " + Describe(destroyed));
         v1::LaunchCommand l = FillLaunch(mh_);
         l.set_stream_id(stream);
         return Launch(m_, l);
       },
       Code::NOT_FOUND, "no stream"},
      {"Launch: packed arguments for a kernel without parameters",
       [&] {
         v1::LaunchCommand l;
         l.set_function_id(mh_.fault);
         SetDim(l.mutable_grid(), 1);
         SetDim(l.mutable_block(), 1);
         l.set_packed_args(std::string(8, '\0'));
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "packed arguments"},
      {"Launch: a typed argument for a kernel without parameters",
       [&] {
         v1::LaunchCommand l;
         l.set_function_id(mh_.fault);
         SetDim(l.mutable_grid(), 1);
         SetDim(l.mutable_block(), 1);
         *l.add_args() = ArgU64(0);
         return Launch(m_, l);
       },
       Code::INVALID_ARGUMENT, "0 parameters"},

      // ------------------------------------------------ faults (scratch sessions)
      {"fault: a faulting kernel is enqueued OK; the next synchronising call is ABORTED",
       [&] {
         absl::StatusOr<Caller> s = Scratch();
         if (!s.ok()) return Broken(s.status().ToString());
         Handles h;
         if (absl::Status made = MakeHandles(*s, 0, &h); !made.ok()) return Broken(made.ToString());
         v1::LaunchCommand l;
         l.set_function_id(h.fault);
         SetDim(l.mutable_grid(), 1);
         SetDim(l.mutable_block(), 1);
         const Outcome launched = Launch(*s, l);
         EXPECT_EQ(launched.code, Code::OK) << "the launch itself: " << Describe(launched);
         const Outcome synced = Sync(*s);
         after_fault = s->Call(&MemoryStub::Allocate, AllocReq(16));
         v1::KeepAliveResponse state = KeepAlive(*s, &keepalive_of_faulted);
         EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
         EXPECT_THAT(state.fault_cause(), HasSubstr("ILLEGAL_ADDRESS"));
         const Outcome closed = Close(*s);
         EXPECT_EQ(closed.code, Code::OK) << "closing a FAULTED session: " << Describe(closed);
         return synced;
       },
       Code::ABORTED, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {"fault: every later call on the FAULTED session", [&] { return after_fault; },
       Code::FAILED_PRECONDITION, "FAULTED"},
      {"fault: KeepAlive of a FAULTED session reports it", [&] { return keepalive_of_faulted; },
       Code::OK, ""},
      {"fault: a kernel running past its buffer faults only its own session",
       [&] {
         absl::StatusOr<Caller> s = Scratch();
         if (!s.ok()) return Broken(s.status().ToString());
         Handles h;
         if (absl::Status made = MakeHandles(*s, 0, &h); !made.ok()) return Broken(made.ToString());
         v1::LaunchCommand l = FillLaunch(h);
         *l.mutable_args(0) = ArgBuffer(h.small.buffer_id());  // 16 bytes: 4 elements
         *l.mutable_args(2) = ArgU64(1ull << 40);
         SetDim(l.mutable_grid(), 65535, 65535);
         SetDim(l.mutable_block(), 1024);
         const Outcome launched = Launch(*s, l);
         EXPECT_EQ(launched.code, Code::OK) << "the launch itself: " << Describe(launched);
         const Outcome synced = Sync(*s);
         Close(*s);
         return synced;
       },
       Code::ABORTED, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {"fault: writing through another tenant's raw device address faults only the writer",
       [&] {
         absl::StatusOr<Caller> s = Scratch();
         if (!s.ok()) return Broken(s.status().ToString());
         Handles h;
         if (absl::Status made = MakeHandles(*s, 0, &h); !made.ok()) return Broken(made.ToString());
         v1::LaunchCommand l = FillLaunch(h);
         *l.mutable_args(0) = ArgAddress(bh_.buffer.device_address());
         const Outcome launched = Launch(*s, l);
         EXPECT_EQ(launched.code, Code::OK) << "the launch itself: " << Describe(launched);
         const Outcome synced = Sync(*s);
         Close(*s);
         return synced;
       },
       Code::ABORTED, "CUDA_ERROR_ILLEGAL_ADDRESS"},

      // ------------------------------------------------ HostRegionService
      // (tests/service/host_region_test.cc tries the region socket itself)
      {"RegisterHostRegion: UINT64_MAX bytes",
       [&] {
         v1::RegisterHostRegionRequest request;
         request.set_size_bytes(kU64Max);
         return m_.Call(&HostRegionStub::RegisterHostRegion, request);
       },
       Code::RESOURCE_EXHAUSTED, "--max-host-region-bytes"},
      {"RegisterHostRegion: 0 bytes",
       [&] {
         return m_.Call(&HostRegionStub::RegisterHostRegion, v1::RegisterHostRegionRequest());
       },
       Code::INVALID_ARGUMENT, "size_bytes must be > 0"},
      {"UnregisterHostRegion: an unknown region",
       [&] {
         v1::UnregisterHostRegionRequest request;
         request.set_region_id(Unknown());
         return m_.Call(&HostRegionStub::UnregisterHostRegion, request);
       },
       Code::NOT_FOUND, "no region"},
      {"CopyHostRegion: an unknown region, to another tenant's address, offset and size "
       "UINT64_MAX",
       [&] {
         v1::CopyHostRegionRequest request;
         request.set_region_id(Unknown());
         request.set_region_offset_bytes(kU64Max);
         request.mutable_device()->set_device_address(bh_.buffer.device_address());
         request.set_size_bytes(kU64Max);
         request.set_to_device(true);
         return m_.Call(&HostRegionStub::CopyHostRegion, request);
       },
       Code::NOT_FOUND, "no region"},
      {"CopyHostRegion: a region not attached yet, offset and size UINT64_MAX",
       [&] {
         v1::RegisterHostRegionRequest reg;
         reg.set_size_bytes(4096);
         v1::RegisterHostRegionResponse registered;
         const Outcome made = m_.Call(&HostRegionStub::RegisterHostRegion, reg, &registered);
         if (made.code != Code::OK) return made;
         v1::CopyHostRegionRequest request;
         request.set_region_id(registered.region_id());
         request.set_region_offset_bytes(kU64Max);
         request.mutable_device()->set_device_address(bh_.buffer.device_address());
         request.set_size_bytes(kU64Max);
         request.set_to_device(false);
         return m_.Call(&HostRegionStub::CopyHostRegion, request);
       },
       Code::FAILED_PRECONDITION, "no memfd attached"},

      // ------------------------------------------------ AdminService
      {"Admin ListSessions: not an admin",
       [&] { return mallory_.Call(&AdminStub::ListSessions, v1::ListSessionsRequest()); },
       Code::PERMISSION_DENIED, "not an admin"},
      {"Admin CloseSession: not an admin, on another tenant's session",
       [&] {
         v1::AdminCloseSessionRequest request;
         request.set_session_id(victim_.id());
         return mallory_.Call(&AdminStub::CloseSession, request);
       },
       Code::PERMISSION_DENIED, "not an admin"},
      {"Admin ListSessions: no credentials",
       [&] { return anonymous_.Call(&AdminStub::ListSessions, v1::ListSessionsRequest()); },
       Code::UNAUTHENTICATED, ""},
      {"Admin CloseSession: session 0",
       [&] { return admin_.Call(&AdminStub::CloseSession, v1::AdminCloseSessionRequest()); },
       Code::NOT_FOUND, "no session"},
      {"Admin CloseSession: UINT64_MAX",
       [&] {
         v1::AdminCloseSessionRequest request;
         request.set_session_id(kU64Max);
         return admin_.Call(&AdminStub::CloseSession, request);
       },
       Code::NOT_FOUND, "no session"},
      {"Admin CloseSession: a session closed before",
       [&] {
         v1::AdminCloseSessionRequest request;
         request.set_session_id(closed_session);
         return admin_.Call(&AdminStub::CloseSession, request);
       },
       Code::NOT_FOUND, "no session"},
      {"Admin ListSessions: a 64 KiB tenant filter matches nothing",
       [&] {
         v1::ListSessionsRequest request;
         request.set_tenant(std::string(64 * kKiB, 'b'));
         v1::ListSessionsResponse response;
         const Outcome got = admin_.Call(&AdminStub::ListSessions, request, &response);
         if (response.sessions_size() != 0) return Broken("it listed sessions");
         return got;
       },
       Code::OK, ""},
      {"Admin ListSessions: a filter of the victim's name and a NUL byte matches nothing",
       [&] {
         v1::ListSessionsRequest request;
         request.set_tenant(std::string("bob\0", 4));
         v1::ListSessionsResponse response;
         const Outcome got = admin_.Call(&AdminStub::ListSessions, request, &response);
         if (response.sessions_size() != 0) return Broken("it listed bob's sessions");
         return got;
       },
       Code::OK, ""},
  };
  RunCases(cases);
}

// ------------------------------------------------------- streams, the wire, floods

v1::MemsetCommand MemsetCmd(const v1::DevicePointer& to, uint32_t value, uint32_t element,
                            uint64_t count) {
  v1::MemsetCommand command;
  *command.mutable_destination() = to;
  command.set_value(value);
  command.set_element_size_bytes(element);
  command.set_count(count);
  return command;
}
v1::UploadStreamRequest UploadFirst(const v1::DevicePointer& to, uint64_t total, std::string data,
                                    uint64_t stream = 0) {
  v1::UploadStreamRequest request;
  *request.mutable_destination() = to;
  request.set_total_size_bytes(total);
  request.set_data(std::move(data));
  request.set_stream_id(stream);
  return request;
}

TEST_F(BadInputTest, StreamsWireAndFloodsAnswerTheirDocumentedCodes) {
  // A bare HTTP/2 call of GetMemInfo by mallory, with these extra header fields.
  const auto bare = [this](const BareHttp2::Headers& headers, const std::string& body,
                           const std::string& path = "/gpurpc.v1.MemoryService/GetMemInfo") {
    BareHttp2 connection(daemon_->tcp_address());
    if (!connection.connected() || !connection.Start()) return Broken("cannot connect");
    if (!connection.Call(path, headers, body)) {
      return Outcome{Code::UNAVAILABLE, "the daemon closed the connection during the request"};
    }
    return connection.Await();
  };
  const auto as_mallory = [this](const std::string& session) {
    return BareHttp2::Headers{{"authorization", "Bearer " + mallory_token_},
                              {"gpurpc-session", session}};
  };
  // Creates events on M until the quota refuses one; how many it took, all destroyed again.
  const auto creatable_events = [this](Outcome* refusal) {
    std::vector<uint64_t> events;
    for (int i = 0; i < 1000; ++i) {
      v1::CreateEventResponse created;
      *refusal = m_.Call(&ExecutionStub::CreateEvent, CreateEventReq(), &created);
      if (refusal->code != Code::OK) break;
      events.push_back(created.event_id());
    }
    for (uint64_t event : events) {
      m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(event));
    }
    return events.size();
  };
  const std::string kGetMemInfo = "/gpurpc.v1.MemoryService/GetMemInfo";
  const std::string kAllocate = "/gpurpc.v1.MemoryService/Allocate";

  const std::vector<Case> cases = {
      // ------------------------------------------------ MemoryService.UploadStream
      {"UploadStream: no message at all", [&] { return UploadStream(m_, {}); },
       Code::INVALID_ARGUMENT, "no message"},
      {"UploadStream: a total of UINT64_MAX bytes",
       [&] { return UploadStream(m_, {UploadFirst(Buf(mh_.buffer.buffer_id()), kU64Max, "x")}); },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"UploadStream: more bytes than announced",
       [&] {
         return UploadStream(m_,
                             {UploadFirst(Buf(mh_.buffer.buffer_id()), 4, std::string(8, 'm'))});
       },
       Code::INVALID_ARGUMENT, "more than the announced"},
      {"UploadStream: fewer bytes than announced",
       [&] {
         return UploadStream(m_,
                             {UploadFirst(Buf(mh_.buffer.buffer_id()), 8, std::string(4, 'f'))});
       },
       Code::INVALID_ARGUMENT, "ended after"},
      {"UploadStream: offset + total wraps past 2^64",
       [&] {
         return UploadStream(m_,
                             {UploadFirst(Buf(mh_.buffer.buffer_id(), kU64Max - 1), 4, "wrap")});
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"UploadStream: another tenant's buffer",
       [&] { return UploadStream(m_, {UploadFirst(Buf(bh_.buffer.buffer_id()), 4, "evil")}); },
       Code::NOT_FOUND, "no buffer"},
      {"UploadStream: an unknown stream",
       [&] {
         return UploadStream(m_, {UploadFirst(Buf(mh_.buffer.buffer_id()), 4, "data", Unknown())});
       },
       Code::NOT_FOUND, "no stream"},
      {"UploadStream: a valid first message, then bytes that are not protobuf",
       [&] {
         return m_.Raw("/gpurpc.v1.MemoryService/UploadStream",
                       std::vector<std::string>{
                           UploadFirst(Buf(mh_.buffer.buffer_id()), 4, "abcd").SerializeAsString(),
                           std::string("\x07\xff\xff", 3)});
       },
       Code::INVALID_ARGUMENT, ""},
      {"UploadStream: a 5 MiB chunk, over the documented 4 MiB",
       [&] {
         const v1::BufferInfo b = NewBuffer(m_, 6 * kMiB);
         const Outcome got = UploadStream(
             m_, {UploadFirst(Buf(b.buffer_id()), 5 * kMiB, std::string(5 * kMiB, 'c'))});
         m_.Call(&MemoryStub::Free, FreeReq(b.buffer_id()));
         return got;
       },
       Code::INVALID_ARGUMENT, ""},

      {"UploadStream: a first message of 6 MB, most of it one unknown field",
       [&] {
         return m_.Raw(
             "/gpurpc.v1.MemoryService/UploadStream",
             std::vector<std::string>{
                 UploadFirst(Buf(mh_.buffer.buffer_id()), 4, "abcd").SerializeAsString() +
                 std::string("\xfa\x01\x80\x9b\xee\x02", 6) + std::string(6'000'000, 'u')});
       },
       Code::INVALID_ARGUMENT, "UploadStream: message 1 is 6000"},

      // ------------------------------------------------ MemoryService.DownloadStream
      {"DownloadStream: a chunk of 4 MiB + 1",
       [&] {
         return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id()), 16, 0, 4 * kMiB + 1));
       },
       Code::INVALID_ARGUMENT, "chunk_size_bytes"},
      {"DownloadStream: a chunk of UINT64_MAX",
       [&] { return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id()), 16, 0, kU64Max)); },
       Code::INVALID_ARGUMENT, "chunk_size_bytes"},
      {"DownloadStream: UINT64_MAX bytes",
       [&] { return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id()), kU64Max)); },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"DownloadStream: offset + size wraps past 2^64",
       [&] {
         return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id(), kU64Max - 7), 16));
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"DownloadStream: another tenant's buffer returns no bytes",
       [&] {
         uint64_t bytes = 0;
         const Outcome got =
             DownloadStream(m_, DownloadReq(Buf(bh_.buffer.buffer_id()), 4096), &bytes);
         if (bytes != 0) return Broken(absl::StrCat(bytes, " bytes came back"));
         return got;
       },
       Code::NOT_FOUND, "no buffer"},
      {"DownloadStream: an unknown stream",
       [&] { return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id()), 16, Unknown())); },
       Code::NOT_FOUND, "no stream"},
      {"DownloadStream: 0 bytes on an unknown stream",
       [&] { return DownloadStream(m_, DownloadReq(Buf(mh_.buffer.buffer_id()), 0, Unknown())); },
       Code::NOT_FOUND, "no stream"},

      // ------------------------------------------------ ExecutionService.CommandStream
      {"CommandStream: sequence 0",
       [&] {
         v1::Command c = Cmd(0);
         *c.mutable_sync() = v1::SyncCommand();
         return Commands(m_, {Batch({c})});
       },
       Code::INVALID_ARGUMENT, "does not increase"},
      {"CommandStream: sequence numbers going down in a batch",
       [&] {
         v1::Command a = Cmd(5), b = Cmd(3);
         *a.mutable_sync() = v1::SyncCommand();
         *b.mutable_sync() = v1::SyncCommand();
         return Commands(m_, {Batch({a, b})});
       },
       Code::INVALID_ARGUMENT, "does not increase"},
      {"CommandStream: a sequence number repeated in the next batch",
       [&] {
         v1::Command a = Cmd(7);
         *a.mutable_sync() = v1::SyncCommand();
         return Commands(m_, {Batch({a}), Batch({a})});
       },
       Code::INVALID_ARGUMENT, "does not increase"},
      {"CommandStream: sequence UINT64_MAX, then any other",
       [&] {
         v1::Command a = Cmd(kU64Max), b = Cmd(1);
         *a.mutable_sync() = v1::SyncCommand();
         *b.mutable_sync() = v1::SyncCommand();
         return Commands(m_, {Batch({a}), Batch({b})});
       },
       Code::INVALID_ARGUMENT, "does not increase"},
      {"CommandStream: an empty batch is answered and harmless",
       [&] {
         std::vector<v1::CommandReply> replies;
         const Outcome got = Commands(m_, {v1::CommandBatch()}, &replies);
         if (replies.size() != 1 || replies[0].has_error()) return Broken("no clean reply");
         return got;
       },
       Code::OK, ""},
      {"CommandStream: a command with no kind", [&] { return OneCommand(m_, Cmd(1)); },
       Code::INVALID_ARGUMENT, "no command kind"},
      {"CommandStream: a bad command skips the rest of its batch, and only that",
       [&] {
         v1::Command a = Cmd(1), b = Cmd(2), c = Cmd(3);
         *a.mutable_memset() = MemsetCmd(Buf(mh_.small.buffer_id()), 0x11111111, 4, 4);
         *b.mutable_launch() = FillLaunch(mh_);
         b.mutable_launch()->set_function_id(Unknown());
         *c.mutable_memset() = MemsetCmd(Buf(mh_.small.buffer_id()), 0x22222222, 4, 4);
         std::vector<v1::CommandReply> replies;
         const Outcome final_status = Commands(m_, {Batch({a, b, c})}, &replies);
         if (final_status.code != Code::OK) return final_status;
         if (replies.size() != 1) return Broken(absl::StrCat(replies.size(), " replies"));
         const v1::CommandReply& reply = replies[0];
         if (reply.error().sequence() != 2 || reply.skipped_from_sequence() != 3) {
           return Broken("the reply does not name command 2 and skip from 3: " +
                         reply.ShortDebugString());
         }
         std::string small;
         Get(m_, Buf(mh_.small.buffer_id()), 16, &small);
         if (small != std::string(16, '\x11')) return Broken("command 1 did not run, or 3 did");
         return Outcome{static_cast<Code>(reply.error().code()), reply.error().message()};
       },
       Code::NOT_FOUND, "no function"},
      {"CommandStream: an inline upload over 1 MiB",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_upload()->mutable_destination() = Buf(mh_.buffer.buffer_id());
         c.mutable_upload()->set_data(std::string(kMaxInlineBytes + 1, 'u'));
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "inline limit"},
      {"CommandStream: a download of UINT64_MAX bytes",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_download()->mutable_source() = Buf(mh_.buffer.buffer_id());
         c.mutable_download()->set_size_bytes(kU64Max);
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "DownloadStream"},
      {"CommandStream: downloads over 64 MiB in one batch",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_download()->mutable_source() = Buf(mh_.buffer.buffer_id());
         c.mutable_download()->set_size_bytes(64 * kMiB + 1);
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "DownloadStream"},
      {"CommandStream: a download whose offset + size wraps",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_download()->mutable_source() = Buf(mh_.buffer.buffer_id(), kU64Max - 1);
         c.mutable_download()->set_size_bytes(4);
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "outside the buffer"},
      {"CommandStream: a copy from another tenant's buffer",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_copy()->mutable_destination() = Buf(mh_.buffer.buffer_id());
         *c.mutable_copy()->mutable_source() = Buf(bh_.buffer.buffer_id());
         c.mutable_copy()->set_size_bytes(64);
         return OneCommand(m_, c);
       },
       Code::NOT_FOUND, "no buffer"},
      {"CommandStream: a misaligned memset",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_memset() = MemsetCmd(Buf(mh_.buffer.buffer_id(), 2), 0, 4, 1);
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "aligned"},
      {"CommandStream: recording an unknown event",
       [&] {
         v1::Command c = Cmd(1);
         c.mutable_record_event()->set_event_id(Unknown());
         return OneCommand(m_, c);
       },
       Code::NOT_FOUND, "no event"},
      {"CommandStream: waiting for another tenant's event",
       [&] {
         v1::Command c = Cmd(1);
         c.mutable_wait_event()->set_event_id(bh_.event);
         return OneCommand(m_, c);
       },
       Code::NOT_FOUND, "no event"},
      {"CommandStream: a sync marker on an unknown stream",
       [&] {
         v1::Command c = Cmd(1);
         c.mutable_sync()->set_stream_id(Unknown());
         return OneCommand(m_, c);
       },
       Code::NOT_FOUND, "no stream"},
      {"CommandStream: a launch with a zero grid",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_launch() = FillLaunch(mh_);
         c.mutable_launch()->mutable_grid()->set_y(0);
         return OneCommand(m_, c);
       },
       Code::INVALID_ARGUMENT, "grid.y is 0"},
      {"CommandStream: 20000 commands in one batch",
       [&] {
         std::vector<v1::Command> commands;
         for (uint64_t i = 1; i <= 20000; ++i) {
           v1::Command c = Cmd(i);
           *c.mutable_memset() = MemsetCmd(Buf(mh_.small.buffer_id()), 0, 1, 16);
           commands.push_back(std::move(c));
         }
         std::vector<v1::CommandReply> replies;
         const Outcome got = Commands(m_, {Batch(std::move(commands))}, &replies);
         if (replies.size() != 1 || replies[0].processed_through_sequence() != 20000 ||
             replies[0].has_error()) {
           return Broken("the batch was not processed to its end");
         }
         return got;
       },
       Code::OK, ""},
      {"CommandStream: on another tenant's session",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_sync() = v1::SyncCommand();
         return Commands(m_.Session(victim_.id()), {Batch({c})});
       },
       Code::NOT_FOUND, "no session"},
      {"CommandStream: a batch that is not protobuf",
       [&] {
         return m_.Raw("/gpurpc.v1.ExecutionService/CommandStream",
                       std::vector<std::string>{std::string("\xff\xff\xff\xff\x0f", 5)});
       },
       Code::INVALID_ARGUMENT, ""},
      {"CommandStream: a valid batch, then bytes that are not protobuf",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_sync() = v1::SyncCommand();
         return m_.Raw("/gpurpc.v1.ExecutionService/CommandStream",
                       std::vector<std::string>{Batch({c}).SerializeAsString(),
                                                std::string("\x07\xff\xff", 3)});
       },
       Code::INVALID_ARGUMENT, ""},
      // ------------------------------------------------ what a message parses to
      // (server/parse_limit.h): shapes that are small on the wire and huge once parsed are
      // refused before anything parses them, naming the message.
      {"CommandStream: 2.5 million empty commands (5 MB) in one batch",
       [&] {
         return m_.Raw("/gpurpc.v1.ExecutionService/CommandStream",
                       std::vector<std::string>{Repeated(std::string("\x0a\x00", 2), 2'500'000)});
       },
       Code::INVALID_ARGUMENT,
       "CommandStream message 1 (a gpurpc.v1.CommandBatch of 5000000 bytes) would take more "
       "than"},
      {"CommandStream: a good batch, then 16 MB of unknown fields",
       [&] {
         v1::Command c = Cmd(1);
         *c.mutable_sync() = v1::SyncCommand();
         return m_.Raw("/gpurpc.v1.ExecutionService/CommandStream",
                       std::vector<std::string>{Batch({c}).SerializeAsString(),
                                                Repeated(std::string("\x78\x01", 2), 8'000'000)});
       },
       Code::INVALID_ARGUMENT, "CommandStream message 2"},
      {"CreateStream: a request of 8 million unknown fields",
       [&] {
         return m_.Raw("/gpurpc.v1.ExecutionService/CreateStream",
                       std::vector<std::string>{Repeated(std::string("\x78\x01", 2), 8'000'000)});
       },
       Code::INVALID_ARGUMENT,
       "/gpurpc.v1.ExecutionService/CreateStream: the request (a "
       "gpurpc.v1.CreateStreamRequest of 16000000 bytes) would take more than"},
      {"Launch: one launch of 5 million empty arguments",
       [&] {
         v1::LaunchRequest request;
         *request.mutable_launch() = FillLaunch(mh_);
         request.mutable_launch()->clear_args();
         std::string launch =
             request.launch().SerializeAsString() + Repeated(std::string("\x3a\x00", 2), 5'000'000);
         std::string bytes;
         {
           google::protobuf::io::StringOutputStream out(&bytes);
           google::protobuf::io::CodedOutputStream coded(&out);
           coded.WriteTag((1 << 3) | 2);  // LaunchRequest.launch
           coded.WriteVarint32(static_cast<uint32_t>(launch.size()));
           coded.WriteString(launch);
         }
         return m_.Raw("/gpurpc.v1.ExecutionService/Launch", std::vector<std::string>{bytes});
       },
       Code::INVALID_ARGUMENT, "/gpurpc.v1.ExecutionService/Launch: the request"},
      {"Allocate: 1 MiB asked for, with 8 million unknown fields",
       [&] {
         v1::AllocateRequest request;
         request.set_size_bytes(kMiB);
         return m_.Raw("/gpurpc.v1.MemoryService/Allocate",
                       std::vector<std::string>{request.SerializeAsString() +
                                                Repeated(std::string("\x78\x01", 2), 8'000'000)});
       },
       Code::INVALID_ARGUMENT, "/gpurpc.v1.MemoryService/Allocate: the request"},
      {"UploadStream: a good first chunk, then one with 24 MB of unknown fields",
       [&] {
         return m_.Raw("/gpurpc.v1.MemoryService/UploadStream",
                       std::vector<std::string>{
                           UploadFirst(Buf(mh_.buffer.buffer_id()), 8, "abcd").SerializeAsString(),
                           Repeated(std::string("\xf8\x01\x01", 3), 8'000'000)});
       },
       Code::INVALID_ARGUMENT, "/gpurpc.v1.MemoryService/UploadStream: message 2 of the stream"},
      {"CommandStream: a fault ends the stream with ABORTED after a reply naming it",
       [&] {
         absl::StatusOr<Caller> s = Scratch();
         if (!s.ok()) return Broken(s.status().ToString());
         Handles h;
         if (absl::Status made = MakeHandles(*s, 0, &h); !made.ok()) return Broken(made.ToString());
         v1::Command a = Cmd(1), b = Cmd(2);
         a.mutable_launch()->set_function_id(h.fault);
         SetDim(a.mutable_launch()->mutable_grid(), 1);
         SetDim(a.mutable_launch()->mutable_block(), 1);
         b.mutable_sync()->set_whole_session(true);
         std::vector<v1::CommandReply> replies;
         const Outcome got = Commands(*s, {Batch({a, b})}, &replies);
         EXPECT_EQ(replies.size(), 1u);
         if (!replies.empty()) {
           EXPECT_EQ(replies[0].error().code(), static_cast<int>(Code::ABORTED));
         }
         Close(*s);
         return got;
       },
       Code::ABORTED, "CUDA_ERROR_ILLEGAL_ADDRESS"},

      // ------------------------------------------------ bytes that are not the request
      {"garbage: a relayed request that is not protobuf",
       [&] { return m_.Raw(kGetMemInfo, std::string("\x07\xff\xff\xff", 4)); },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: a truncated varint (Allocate, which the front end's ledger parses too)",
       [&] { return m_.Raw(kAllocate, std::string("\x08\xff\xff", 3)); }, Code::INVALID_ARGUMENT,
       ""},
      {"garbage: a length-delimited field longer than the message",
       [&] { return m_.Raw("/gpurpc.v1.MemoryService/Upload", Tag(2, 2) + Varint(100) + "abc"); },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: Allocate's size sent as a string reads as no size",
       [&] { return m_.Raw(kAllocate, LengthDelimited(1, "4096")); }, Code::INVALID_ARGUMENT,
       "size_bytes"},
      {"garbage: Download's pointer sent as an integer reads as no pointer",
       [&] {
         return m_.Raw("/gpurpc.v1.MemoryService/Download",
                       Tag(1, 0) + Varint(mh_.buffer.buffer_id()) + Tag(2, 0) + Varint(4));
       },
       Code::INVALID_ARGUMENT, "pointer not set"},
      {"garbage: a kernel name that is not UTF-8",
       [&] {
         return m_.Raw("/gpurpc.v1.ModuleService/GetFunction",
                       Tag(1, 0) + Varint(mh_.module) + LengthDelimited(2, "fill\xff\xfe"));
       },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: a CUDA source that is not UTF-8",
       [&] {
         return m_.Raw("/gpurpc.v1.ModuleService/Compile",
                       LengthDelimited(1, "__global__ void k() {} // \xc3\x28"));
       },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: 10000 nested groups",
       [&] {
         std::string nested;
         for (int i = 0; i < 10000; ++i) nested += Tag(15, 3);
         for (int i = 0; i < 10000; ++i) nested += Tag(15, 4);
         return m_.Raw(kAllocate, Tag(1, 0) + Varint(64) + nested);
       },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: unknown fields around a valid Allocate are ignored",
       [&] {
         std::string answer;
         const Outcome got =
             m_.Raw(kAllocate,
                    Tag(1, 0) + Varint(64) + Tag(999, 0) + Varint(5) + LengthDelimited(1000, "x"),
                    &answer);
         v1::AllocateResponse response;
         if (!response.ParseFromString(answer) || response.buffer().size_bytes() != 64) {
           return Broken("no 64-byte buffer came back");
         }
         m_.Call(&MemoryStub::Free, FreeReq(response.buffer().buffer_id()));
         return got;
       },
       Code::OK, ""},
      {"garbage: ListDevices",
       [&] { return mallory_.Raw("/gpurpc.v1.DeviceService/ListDevices", std::string("\x07", 1)); },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: OpenSession",
       [&] {
         return mallory_.Raw("/gpurpc.v1.SessionService/OpenSession", std::string("\x08\x80", 2));
       },
       Code::INVALID_ARGUMENT, ""},
      // The front end's own services check what a request parses to before gRPC parses it,
      // also for a caller with no credentials (server/parse_checked_service.h).
      {"parse bound: OpenSession of 8 million unknown fields, with no credentials",
       [&] {
         return anonymous_.Raw("/gpurpc.v1.SessionService/OpenSession",
                               Repeated(std::string("\x78\x01", 2), 8'000'000));
       },
       Code::INVALID_ARGUMENT,
       "/gpurpc.v1.SessionService/OpenSession: the request is not a valid message of the "
       "method's request type (it does not parse as protobuf, or it would take too much memory "
       "once parsed)"},
      {"parse bound: ListDevices of 8 million unknown fields",
       [&] {
         return mallory_.Raw("/gpurpc.v1.DeviceService/ListDevices",
                             Repeated(std::string("\x78\x01", 2), 8'000'000));
       },
       Code::INVALID_ARGUMENT, "or it would take too much memory once parsed"},
      {"parse bound: WatchSession (server streaming) of 8 million unknown fields",
       [&] {
         return m_.Raw("/gpurpc.v1.SessionService/WatchSession",
                       Repeated(std::string("\x78\x01", 2), 8'000'000));
       },
       Code::INVALID_ARGUMENT, "or it would take too much memory once parsed"},
      {"garbage: an OpenSession client label that is not UTF-8",
       [&] {
         return mallory_.Raw("/gpurpc.v1.SessionService/OpenSession",
                             LengthDelimited(2, "label \xc3\x28"));
       },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: KeepAlive",
       [&] { return m_.Raw("/gpurpc.v1.SessionService/KeepAlive", std::string("\xff", 1)); },
       Code::INVALID_ARGUMENT, ""},
      {"garbage: AdminService.ListSessions",
       [&] {
         return admin_.Raw("/gpurpc.v1.AdminService/ListSessions", std::string("\x0a\x05"
                                                                               "ab",
                                                                               4));
       },
       Code::INVALID_ARGUMENT, ""},
      {"cardinality: no request message for a unary call (relayed)",
       [&] { return m_.Raw(kAllocate, std::vector<std::string>{}); }, Code::UNIMPLEMENTED, ""},
      // gRPC reads one message of a unary call; a second is never read. What runs is the
      // first, charged to the ledger as any Allocate: the 8 MiB, never the 200 MiB.
      {"cardinality: two request messages for a unary call (relayed, ledgered)",
       [&] {
         std::vector<std::string> answers;
         Outcome got = m_.Raw(kAllocate,
                              std::vector<std::string>{AllocReq(8 * kMiB).SerializeAsString(),
                                                       AllocReq(200 * kMiB).SerializeAsString()},
                              &answers);
         std::vector<uint64_t> sizes;
         for (const std::string& answer : answers) {  // whatever was allocated goes again
           v1::AllocateResponse response;
           if (response.ParseFromString(answer) && response.buffer().buffer_id() != 0) {
             sizes.push_back(response.buffer().size_bytes());
             m_.Call(&MemoryStub::Free, FreeReq(response.buffer().buffer_id()));
           }
         }
         if (got.code == Code::OK && (sizes.size() != 1 || sizes[0] != 8 * kMiB)) {
           return Broken(absl::StrCat(sizes.size(), " buffers allocated; one of 8 MiB expected"));
         }
         return got;
       },
       Code::OK, ""},
      {"oversized: an 81 MiB module image",
       [&] { return m_.Call(&ModuleStub::LoadModule, LoadReq(std::string(81 * kMiB, 'x'))); },
       Code::RESOURCE_EXHAUSTED, ""},
      {"oversized: an 81 MiB ListDevices request",
       [&] {
         return mallory_.Raw("/gpurpc.v1.DeviceService/ListDevices",
                             LengthDelimited(1000, std::string(81 * kMiB, 'x')));
       },
       Code::RESOURCE_EXHAUSTED, ""},

      // ------------------------------------------------ methods that do not exist
      {"method: an unknown service", [&] { return mallory_.Raw("/gpurpc.v1.Nothing/Nothing", ""); },
       Code::UNIMPLEMENTED, ""},
      {"method: the workers' private control service",
       [&] { return m_.Raw("/gpurpc.internal.v1.WorkerControl/Bind", LengthDelimited(1, "bob")); },
       Code::UNIMPLEMENTED, ""},
      {"method: the workers' control service behind a session service's prefix",
       [&] {
         return m_.Raw("/gpurpc.v1.MemoryService/../../gpurpc.internal.v1.WorkerControl/Bind",
                       LengthDelimited(1, "bob"));
       },
       Code::UNIMPLEMENTED, ""},
      {"method: an unknown method of a session service",
       [&] { return m_.Raw("/gpurpc.v1.MemoryService/Bind", LengthDelimited(1, "bob")); },
       Code::UNIMPLEMENTED, ""},
      {"method: an empty method name", [&] { return m_.Raw("/gpurpc.v1.ExecutionService/", ""); },
       Code::UNIMPLEMENTED, ""},
      {"method: health checks are not served on the main listener",
       [&] { return mallory_.Raw("/grpc.health.v1.Health/Check", ""); }, Code::UNIMPLEMENTED, ""},
      {"method: reflection is not served on the main listener",
       [&] {
         return mallory_.Raw("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                             std::string("\x3a\x00", 2));
       },
       Code::UNIMPLEMENTED, ""},
      {"method: names are case-sensitive",
       [&] { return mallory_.Raw("/gpurpc.v1.deviceservice/listdevices", ""); },
       Code::UNIMPLEMENTED, ""},

      // ------------------------------------------------ bare HTTP/2
      {"wire: a NUL byte after the session id",
       [&] {
         return bare(as_mallory(std::to_string(m_.id()) + std::string(1, '\0')), GrpcFrame(""));
       },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"wire: a NUL byte before the session id",
       [&] {
         return bare(as_mallory(std::string(1, '\0') + std::to_string(m_.id())), GrpcFrame(""));
       },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"wire: a NUL byte after a valid bearer token",
       [&] {
         return bare({{"authorization", "Bearer " + mallory_token_ + std::string(1, '\0')},
                      {"gpurpc-session", std::to_string(m_.id())}},
                     GrpcFrame(""));
       },
       Code::UNAUTHENTICATED, ""},
      {"wire: CR LF and a forged header inside the session id",
       [&] { return bare(as_mallory(absl::StrCat(m_.id(), "\r\nx-forged: 1")), GrpcFrame("")); },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"wire: bytes above 0x7f in the session id",
       [&] { return bare(as_mallory("\xff\xfe\xfd"), GrpcFrame("")); }, Code::INVALID_ARGUMENT,
       "not a session id"},
      {"wire: a 20 KiB session id",
       [&] { return bare(as_mallory(std::string(20 * kKiB, '9')), GrpcFrame("")); },
       Code::INVALID_ARGUMENT, "not a session id"},
      {"wire: a 4 GiB length prefix, and the stream ends after 10 bytes",
       [&] { return bare(as_mallory(std::to_string(m_.id())), GrpcFrame("0123456789", kU32Max)); },
       // No whole request arrived: a cardinality violation for a one-message method.
       Code::UNIMPLEMENTED, "exactly one request message"},
      {"wire: a message shorter than its length prefix",
       [&] { return bare(as_mallory(std::to_string(m_.id())), GrpcFrame("abc", 100)); },
       Code::UNIMPLEMENTED, "exactly one request message"},
      {"wire: HTTP/1.1 instead of HTTP/2",
       [&] {
         BareHttp2 connection(daemon_->tcp_address());
         if (!connection.connected()) return Broken("cannot connect");
         connection.Send("GET /gpurpc.v1.DeviceService/ListDevices HTTP/1.1\r\nHost: x\r\n\r\n");
         return connection.Await();
       },
       Code::UNAVAILABLE, ""},
      {"wire: random bytes after the HTTP/2 preface",
       [&] {
         BareHttp2 connection(daemon_->tcp_address());
         if (!connection.connected() || !connection.Start()) return Broken("cannot connect");
         connection.Send(RandomBytes(4096, 3));
         return connection.Await();
       },
       Code::UNAVAILABLE, ""},

      // ------------------------------------------------ floods
      {"flood: 64 threads x 20 CreateEvent + DestroyEvent",
       [&] {
         const auto create_and_destroy = [&](int, int) {
           v1::CreateEventResponse created;
           const Outcome o = m_.Call(&ExecutionStub::CreateEvent, CreateEventReq(), &created);
           if (o.code != Code::OK) return o;
           // A destroy refused at the worker's thread bound is retried: the next case counts
           // what is left.
           Outcome destroyed;
           for (int attempt = 0; attempt < 100; ++attempt) {
             destroyed = m_.Call(&ExecutionStub::DestroyEvent,
                                 EventReq<v1::DestroyEventRequest>(created.event_id()));
             if (destroyed.code != Code::RESOURCE_EXHAUSTED) break;
             std::this_thread::sleep_for(std::chrono::milliseconds(20));
           }
           return destroyed;
         };
         return AllAreOrRefused(Flood(64, 20, create_and_destroy), Code::OK);
       },
       Code::OK, ""},
      {"flood: afterwards no event leaked (exactly the quota's room is left)",
       [&] {
         Outcome refusal;
         const size_t made = creatable_events(&refusal);
         if (made != kMalloryMaxEvents - 2) {
           return Broken(absl::StrCat(made, " events fit; ", kMalloryMaxEvents - 2, " expected"));
         }
         return refusal;
       },
       Code::RESOURCE_EXHAUSTED, "max_events_per_session"},
      {"flood: 32 threads x 8 CreateEvent past the quota",
       [&] {
         std::mutex mu;
         std::vector<uint64_t> created;
         const std::vector<Outcome> all = Flood(32, 8, [&](int, int) {
           v1::CreateEventResponse response;
           const Outcome o = m_.Call(&ExecutionStub::CreateEvent, CreateEventReq(), &response);
           if (o.code == Code::OK) {
             std::lock_guard<std::mutex> lock(mu);
             created.push_back(response.event_id());
           }
           return o;
         });
         for (uint64_t event : created) {
           m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(event));
         }
         if (created.size() != kMalloryMaxEvents - 2) {
           return Broken(absl::StrCat(created.size(),
                                      " events were created; the quota leaves room for ",
                                      kMalloryMaxEvents - 2));
         }
         for (const Outcome& o : all) {
           if (o.code != Code::OK) return AllAre({o}, Code::RESOURCE_EXHAUSTED);
         }
         return Broken("nothing was refused");
       },
       Code::RESOURCE_EXHAUSTED, "max_events_per_session"},
      {"flood: 64 threads x 20 EventElapsedTime on unrecorded events",
       [&] {
         const uint64_t a = NewEvent(m_), b = NewEvent(m_);
         const Outcome got = AllAreOrRefused(
             Flood(64, 20,
                   [&](int, int) {
                     return m_.Call(&ExecutionStub::EventElapsedTime, ElapsedReq(a, b));
                   }),
             Code::FAILED_PRECONDITION);
         for (uint64_t e : {a, b}) {
           m_.Call(&ExecutionStub::DestroyEvent, EventReq<v1::DestroyEventRequest>(e));
         }
         return got;
       },
       Code::FAILED_PRECONDITION, "not been recorded"},
      {"flood: 64 concurrent OpenSession past the tenant's quota; no worker leaks",
       [&] {
         const size_t workers_before = StableWorkerCount();
         std::mutex mu;
         std::vector<Caller> opened;
         const std::vector<Outcome> all = Flood(64, 1, [&](int, int) {
           absl::StatusOr<Caller> s = Open(mallory_, "bad-input flood");
           if (!s.ok()) {
             return Outcome{static_cast<Code>(s.status().code()),
                            std::string(s.status().message())};
           }
           std::lock_guard<std::mutex> lock(mu);
           opened.push_back(*s);
           return Outcome{};
         });
         for (const Caller& s : opened) Close(s);
         if (opened.size() != kMalloryMaxSessions - 1) {
           return Broken(absl::StrCat(opened.size(), " sessions opened; the quota leaves room for ",
                                      kMalloryMaxSessions - 1));
         }
         size_t workers_after = 0;
         for (int i = 0; i < 300; ++i) {
           workers_after = daemon_->WorkerPids().size();
           if (workers_after == workers_before) break;
           std::this_thread::sleep_for(std::chrono::milliseconds(100));
         }
         if (workers_after != workers_before) {
           return Broken(
               absl::StrCat(workers_after, " worker processes, ", workers_before, " before"));
         }
         for (const Outcome& o : all) {
           if (o.code != Code::OK) return AllAre({o}, Code::RESOURCE_EXHAUSTED);
         }
         return Broken("nothing was refused");
       },
       Code::RESOURCE_EXHAUSTED, "max_sessions"},
      {"flood: 32 concurrent CreateStream past the quota",
       [&] {
         std::mutex mu;
         std::vector<uint64_t> created;
         const std::vector<Outcome> all = Flood(32, 1, [&](int, int) {
           v1::CreateStreamResponse response;
           const Outcome o =
               m_.Call(&ExecutionStub::CreateStream, v1::CreateStreamRequest(), &response);
           if (o.code == Code::OK) {
             std::lock_guard<std::mutex> lock(mu);
             created.push_back(response.stream_id());
           }
           return o;
         });
         for (uint64_t stream : created) {
           m_.Call(&ExecutionStub::DestroyStream, StreamReq<v1::DestroyStreamRequest>(stream));
         }
         if (created.size() != kMalloryMaxStreams - 1) {
           return Broken(
               absl::StrCat(created.size(), " streams; room for ", kMalloryMaxStreams - 1));
         }
         for (const Outcome& o : all) {
           if (o.code != Code::OK) return o;
         }
         return Broken("nothing was refused");
       },
       Code::RESOURCE_EXHAUSTED, "max_streams_per_session"},
      {"flood: 16 concurrent LoadModule past the quota",
       [&] {
         std::mutex mu;
         std::vector<uint64_t> loaded;
         const std::vector<Outcome> all = Flood(16, 1, [&](int, int) {
           v1::LoadModuleResponse response;
           const Outcome o = m_.Call(&ModuleStub::LoadModule, LoadReq(kPtx), &response);
           if (o.code == Code::OK) {
             std::lock_guard<std::mutex> lock(mu);
             loaded.push_back(response.module_id());
           }
           return o;
         });
         for (uint64_t module : loaded) m_.Call(&ModuleStub::UnloadModule, UnloadReq(module));
         if (loaded.size() != kMalloryMaxModules - 1) {
           return Broken(
               absl::StrCat(loaded.size(), " modules; room for ", kMalloryMaxModules - 1));
         }
         for (const Outcome& o : all) {
           if (o.code != Code::OK) return o;
         }
         return Broken("nothing was refused");
       },
       Code::RESOURCE_EXHAUSTED, "max_modules_per_session"},
      {"flood: 32 threads x 2 Allocate of 8 MiB past the memory quota",
       [&] {
         std::mutex mu;
         std::vector<uint64_t> buffers;
         const std::vector<Outcome> all = Flood(32, 2, [&](int, int) {
           v1::AllocateResponse response;
           const Outcome o = m_.Call(&MemoryStub::Allocate, AllocReq(8 * kMiB), &response);
           if (o.code == Code::OK) {
             std::lock_guard<std::mutex> lock(mu);
             buffers.push_back(response.buffer().buffer_id());
           }
           return o;
         });
         for (uint64_t buffer : buffers) m_.Call(&MemoryStub::Free, FreeReq(buffer));
         // M holds 4096 + 16 bytes of buffers and a 64-byte global: 31 more of 8 MiB fit.
         if (buffers.size() != kMalloryMaxMemoryBytes / (8 * kMiB) - 1) {
           return Broken(absl::StrCat(buffers.size(), " allocations fit"));
         }
         for (const Outcome& o : all) {
           if (o.code != Code::OK) return o;
         }
         return Broken("nothing was refused");
       },
       Code::RESOURCE_EXHAUSTED, "max_device_memory_bytes"},
      {"flood: more blocked calls than a session's worker has threads",
       [&] {
         // A kernel that runs for a while; every SynchronizeStream then holds a worker thread.
         v1::LaunchCommand l;
         l.set_function_id(mh_.spin);
         SetDim(l.mutable_grid(), 1);
         SetDim(l.mutable_block(), 1);
         l.set_stream_id(mh_.stream);
         *l.add_args() = ArgU64(1500 * 1000);
         const Outcome launched = Launch(m_, l);
         if (launched.code != Code::OK) return Broken("spin_us: " + Describe(launched));
         const std::vector<Outcome> all = Flood(2 * kWorkerMaxThreads, 1, [&](int, int) {
           return m_.Call(&ExecutionStub::SynchronizeStream,
                          StreamReq<v1::SynchronizeStreamRequest>(mh_.stream));
         });
         Outcome refusal = Broken("no call was refused");
         for (const Outcome& o : all) {
           if (o.code != Code::OK) {
             refusal = o;
             if (o.code != Code::RESOURCE_EXHAUSTED) break;
           }
         }
         return refusal;
       },
       Code::RESOURCE_EXHAUSTED, absl::StrCat(kWorkerMaxThreads)},
      {"flood: 64 threads x 10 Free of unknown buffers",
       [&] {
         std::vector<uint64_t> ids;
         for (int i = 0; i < 640; ++i) ids.push_back(Unknown());
         return AllAreOrRefused(Flood(64, 10,
                                      [&](int t, int i) {
                                        return m_.Call(&MemoryStub::Free, FreeReq(ids[t * 10 + i]));
                                      }),
                                Code::NOT_FOUND);
       },
       Code::NOT_FOUND, "no buffer"},
      {"flood: 64 threads x 10 calls on guessed session ids",
       [&] {
         std::vector<uint64_t> ids;
         for (int i = 0; i < 640; ++i) ids.push_back(Unknown());
         return AllAre(Flood(64, 10,
                             [&](int t, int i) {
                               return m_.Session(ids[t * 10 + i])
                                   .Call(&MemoryStub::GetMemInfo, v1::GetMemInfoRequest());
                             }),
                       Code::NOT_FOUND);
       },
       Code::NOT_FOUND, "no session"},
      {"flood: 64 threads x 10 launches with a zero block",
       [&] {
         v1::LaunchCommand l = FillLaunch(mh_);
         l.mutable_block()->set_x(0);
         return AllAreOrRefused(Flood(64, 10, [&](int, int) { return Launch(m_, l); }),
                                Code::INVALID_ARGUMENT);
       },
       Code::INVALID_ARGUMENT, "block.x is 0"},
      {"flood: 16 threads x 4 relayed requests that are not protobuf",
       [&] {
         return AllAreOrRefused(
             Flood(
                 16, 4,
                 [&](int, int) { return m_.Raw(kGetMemInfo, std::string("\x07\xff\xff\xff", 4)); }),
             Code::INVALID_ARGUMENT);
       },
       Code::INVALID_ARGUMENT, ""},
  };
  RunCases(cases);
}

}  // namespace
}  // namespace gpurpc
