// The parse bound (server/parse_limit.h) against protobuf itself: for every message that
// parses, the bound is at least what the parsed message holds (SpaceUsedLong), for valid
// messages of every command kind and for thousands of random and mutated ones; the messages
// our clients send stay well under the limit; hostile shapes (many empty commands, many
// arguments, unknown fields, packed runs, unknown groups) are refused without being parsed.
#include "server/parse_limit.h"

#include <malloc.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "gtest/gtest.h"

namespace gpurpc {
namespace {

v1::CommandBatch EveryKind() {
  v1::CommandBatch batch;
  uint64_t sequence = 0;
  auto next = [&] {
    v1::Command* command = batch.add_commands();
    command->set_sequence(++sequence);
    return command;
  };
  v1::LaunchCommand* launch = next()->mutable_launch();
  launch->set_function_id(7);
  launch->mutable_grid()->set_x(1024);
  launch->mutable_block()->set_x(256);
  for (int i = 0; i < 8; ++i) launch->add_args()->set_u64(static_cast<uint64_t>(i) << 40);
  launch->add_args()->set_f32(1.5f);
  next()->mutable_memset()->set_count(1 << 20);
  next()->mutable_copy()->set_size_bytes(4096);
  v1::UploadCommand* upload = next()->mutable_upload();
  upload->mutable_destination()->mutable_buffer()->set_buffer_id(3);
  upload->set_data(std::string(100000, 'x'));
  next()->mutable_download()->set_size_bytes(64);
  next()->mutable_record_event()->set_event_id(9);
  next()->mutable_wait_event()->set_event_id(9);
  next()->mutable_sync();
  next()->mutable_region_copy()->set_region_id(2);
  next()->mutable_launch_graph();
  next()->mutable_copy_3d();
  return batch;
}

// 400 KB of an unknown length-delimited field (number 15): a prefix that makes any message
// too large for the bound from its size alone (16 MiB), so that it is walked.
const std::string& Walked() {
  static const std::string* const prefix =
      new std::string(std::string("\x7a\x80\xb5\x18", 4) + std::string(400000, 'w'));
  return *prefix;
}

// The bound covers what protobuf allocates for `bytes` whenever they parse, both from
// their size alone and walked.
template <typename Message>
void ExpectCovers(const std::string& bytes, const std::string& what) {
  for (const std::string& variant : {bytes, Walked() + bytes}) {
    Message parsed;
    if (!parsed.ParseFromString(variant)) continue;
    const size_t used = parsed.SpaceUsedLong();
    EXPECT_GE(ParsedBytesBound(*Message::descriptor(), variant, SIZE_MAX), used) << what;
  }
}

TEST(ParseLimit, CoversValidMessagesOfEveryKind) {
  const std::string bytes = EveryKind().SerializeAsString();
  ExpectCovers<v1::CommandBatch>(bytes, "every kind");
  // A message this small is bounded from its size alone (no walk), generously.
  EXPECT_LT(ParsedBytesBound(*v1::CommandBatch::descriptor(), bytes), 200 * bytes.size());
  // A larger one is walked, and its bound is not wildly more than the parse: its bytes
  // dominate here.
  v1::CommandBatch large = EveryKind();
  large.add_commands()->mutable_upload()->set_data(std::string(4 << 20, 'y'));
  const std::string large_bytes = large.SerializeAsString();
  ExpectCovers<v1::CommandBatch>(large_bytes, "large");
  EXPECT_LT(ParsedBytesBound(*v1::CommandBatch::descriptor(), large_bytes),
            large_bytes.size() + (64u << 10));
  ExpectCovers<v1::CommandBatch>("", "empty");
  EXPECT_TRUE(CheckParsedBytes(*v1::CommandBatch::descriptor(), bytes, [] { return "x"; }).ok());
}

TEST(ParseLimit, CoversRandomAndMutatedMessages) {
  std::mt19937 random(12345);
  const std::string valid = EveryKind().SerializeAsString();
  for (int i = 0; i < 2000; ++i) {
    std::string bytes = valid;
    switch (i % 4) {
      case 0:  // random bytes
        bytes.resize(random() % 200);
        for (char& c : bytes) c = static_cast<char>(random());
        break;
      case 1:  // flipped bytes
        for (int flips = 0; flips < 4; ++flips)
          bytes[random() % bytes.size()] ^= 1 << (random() % 8);
        break;
      case 2:  // truncated
        bytes.resize(random() % bytes.size());
        break;
      default: {  // a random run spliced in
        std::string run(random() % 64, '\0');
        for (char& c : run) c = static_cast<char>(random() % 32);
        bytes.insert(random() % bytes.size(), run);
        break;
      }
    }
    ExpectCovers<v1::CommandBatch>(bytes, "mutation " + std::to_string(i));
    ExpectCovers<v1::UploadStreamRequest>(bytes, "as an upload, mutation " + std::to_string(i));
  }
}

TEST(ParseLimit, ClientBatchesStayWellUnderTheLimit) {
  // The C++ client's largest batch: 4096 launches of 16 arguments.
  v1::CommandBatch launches;
  for (int i = 0; i < 4096; ++i) {
    v1::LaunchCommand* launch = launches.add_commands()->mutable_launch();
    launch->set_function_id(1);
    for (int a = 0; a < 16; ++a) launch->add_args()->set_u64(~uint64_t{0});
  }
  const std::string bytes = launches.SerializeAsString();
  ExpectCovers<v1::CommandBatch>(bytes, "launches");
  EXPECT_LT(ParsedBytesBound(*v1::CommandBatch::descriptor(), bytes), ParsedBytesLimit(0) / 2);
  // Uploads of the largest message size, in the 1 MiB inline uploads a batch may carry.
  v1::CommandBatch uploads;
  const std::string mib(1 << 20, 'u');
  for (int i = 0; i < 79; ++i) uploads.add_commands()->mutable_upload()->set_data(mib);
  const std::string big = uploads.SerializeAsString();
  EXPECT_TRUE(CheckParsedBytes(*v1::CommandBatch::descriptor(), big, [] { return "x"; }).ok());
  // One string above 50 MB may take twice its size (protobuf reads it in doubling pieces):
  // such a message is over its limit (no request of ours carries one).
  v1::CommandBatch one;
  one.add_commands()->mutable_upload()->set_data(std::string(kMaxMessageBytes - 64, 'u'));
  EXPECT_FALSE(CheckParsedBytes(*v1::CommandBatch::descriptor(), one.SerializeAsString(), [] {
                 return "x";
               }).ok());
}

// `count` copies of `element` (raw wire bytes).
std::string Repeat(const std::string& element, size_t count) {
  std::string out;
  out.reserve(element.size() * count);
  for (size_t i = 0; i < count; ++i) out += element;
  return out;
}

// A hostile shape: the bound covers its parse at a size that is cheap to parse here, and a
// message of `wire_bytes` of it is refused, naming what was sent.
template <typename Message>
void ExpectRefused(const std::string& element, size_t wire_bytes, const std::string& what) {
  ExpectCovers<Message>(Repeat(element, 20000), what);
  const std::string bytes = Repeat(element, wire_bytes / element.size());
  const absl::Status status =
      CheckParsedBytes(*Message::descriptor(), bytes, [] { return "CommandStream message 7"; });
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
  EXPECT_NE(status.message().find("CommandStream message 7"), std::string::npos) << status;
  EXPECT_NE(status.message().find(Message::descriptor()->full_name()), std::string::npos) << status;
  EXPECT_NE(status.message().find(std::to_string(bytes.size())), std::string::npos) << status;
}

TEST(ParseLimit, RefusesHostileShapes) {
  // Empty commands (field 1, length 0), 2 bytes each: 10 MB of them would parse to ~400 MB.
  ExpectRefused<v1::CommandBatch>(std::string("\x0a\x00", 2), 10 << 20, "empty commands");
  // Commands of an empty launch each (a Command holding a LaunchCommand).
  ExpectRefused<v1::CommandBatch>(std::string("\x0a\x02\x12\x00", 4), 20 << 20, "empty launches");
  // Unknown varint fields (field 15), 2 bytes each.
  ExpectRefused<v1::CommandBatch>(std::string("\x78\x01", 2), 20 << 20, "unknown fields");
  // Empty unknown groups (field 15).
  ExpectRefused<v1::CommandBatch>(std::string("\x7b\x7c", 2), 20 << 20, "unknown groups");
  // A known field of the wrong wire type is kept as unknown: commands as varints.
  ExpectRefused<v1::CommandBatch>(std::string("\x08\x01", 2), 20 << 20, "wrong wire type");
  // An upload request's data field repeated many times: each replaces the last, but unknown
  // fields of the request's type pile up.
  ExpectRefused<v1::UploadStreamRequest>(std::string("\xf8\x01\x01", 3), 30 << 20,
                                         "unknown fields of an upload");
}

TEST(ParseLimit, RefusesAHugeLaunchOfEmptyArguments) {
  // One command whose launch has millions of empty arguments (field 7, length 0).
  const std::string args = Repeat(std::string("\x3a\x00", 2), 5'000'000);
  v1::LaunchCommand launch;
  launch.set_function_id(1);
  std::string launch_bytes = launch.SerializeAsString() + args;
  std::string command_bytes;
  google::protobuf::io::StringOutputStream out(&command_bytes);
  {
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
        2, google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint32(static_cast<uint32_t>(launch_bytes.size()));
    coded.WriteString(launch_bytes);
  }
  std::string batch_bytes;
  google::protobuf::io::StringOutputStream batch_out(&batch_bytes);
  {
    google::protobuf::io::CodedOutputStream coded(&batch_out);
    coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
        1, google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint32(static_cast<uint32_t>(command_bytes.size()));
    coded.WriteString(command_bytes);
  }
  EXPECT_FALSE(
      CheckParsedBytes(*v1::CommandBatch::descriptor(), batch_bytes, [] { return "x"; }).ok());
}

// The heap `bytes` take once parsed as `Message` (malloc's own count, mmapped blocks too).
template <typename Message>
std::optional<size_t> HeapOfParse(const std::string& bytes) {
  const struct mallinfo2 before = mallinfo2();
  auto parsed = std::make_unique<Message>();
  if (!parsed->ParseFromString(bytes)) return std::nullopt;
  const struct mallinfo2 after = mallinfo2();
  return (after.uordblks + after.hblkhd) - (before.uordblks + before.hblkhd);
}

// The bound covers the heap a parse really takes (malloc's blocks, strings protobuf makes
// even for empty fields, the unknown field set's container, a repeated field's first array,
// a string read in doubling pieces), not only what SpaceUsedLong counts; from the size
// alone and walked.
TEST(ParseLimit, CoversTheHeapAParseTakes) {
  const auto expect_covers = [](auto message, const std::string& bytes, const std::string& what) {
    using Message = decltype(message);
    for (const std::string& variant : {bytes, Walked() + bytes}) {
      const std::optional<size_t> heap = HeapOfParse<Message>(variant);
      ASSERT_TRUE(heap.has_value()) << what;
      EXPECT_GE(ParsedBytesBound(*Message::descriptor(), variant, SIZE_MAX), *heap) << what;
    }
  };
  // Headers of an empty name, empty contents and an unknown varint each.
  expect_covers(v1::CompileRequest(),
                Repeat(std::string("\x22\x06\x0a\x00\x12\x00\x78\x00", 8), 200000), "headers");
  // One launch whose arguments are each empty raw bytes and an unknown varint.
  {
    std::string launch = Repeat(std::string("\x3a\x04\x42\x00\x78\x00", 6), 200000);
    std::string command;
    google::protobuf::io::StringOutputStream out(&command);
    {
      google::protobuf::io::CodedOutputStream coded(&out);
      coded.WriteTag((2 << 3) | 2);
      coded.WriteVarint32(static_cast<uint32_t>(launch.size()));
      coded.WriteString(launch);
    }
    std::string batch;
    google::protobuf::io::StringOutputStream batch_out(&batch);
    {
      google::protobuf::io::CodedOutputStream coded(&batch_out);
      coded.WriteTag((1 << 3) | 2);
      coded.WriteVarint32(static_cast<uint32_t>(command.size()));
      coded.WriteString(command);
    }
    expect_covers(v1::CommandBatch(), batch, "arguments");
  }
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x0a\x00", 2), 500000), "commands");
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x78\x01", 2), 500000), "unknown");
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x7b\x7c", 2), 500000), "groups");
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x7a\x00", 2), 500000), "unknown strings");
  // Unknown fields in every command, and short strings in every upload.
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x0a\x02\x78\x01", 4), 300000),
                "unknown in commands");
  expect_covers(v1::CommandBatch(), Repeat(std::string("\x0a\x06\x2a\x04\x12\x02xy", 8), 200000),
                "uploads");
  // One string longer than protobuf reads at once.
  v1::UploadStreamRequest large;
  large.mutable_data()->resize(60'000'000, 'd');
  expect_covers(v1::UploadStreamRequest(), large.SerializeAsString(), "a 60 MB string");
}

TEST(ParseLimit, MalformedBytesEndTheWalk) {
  // A truncated length, a truncated nested message, a stray end-group and a deep nest of
  // unknown groups, each after 1 MB of a valid field (field 15, so that the bound is walked,
  // not taken from the size): each walk ends without reading past the bytes, with a bound
  // of what came before.
  const std::string valid = std::string("\x7a\xc0\x84\x3d", 4) + std::string(1000000, 'v');
  const size_t before = ParsedBytesBound(*v1::CommandBatch::descriptor(), valid);
  EXPECT_LT(before, 1000000u + (64u << 10));
  for (const std::string& bad : {std::string("\x0a\xff\xff", 3), std::string("\x0a\x05\x08\x01", 4),
                                 std::string("\x7c", 1), Repeat(std::string("\x7b", 1), 100000)}) {
    const std::string bytes = valid + bad;
    EXPECT_LT(ParsedBytesBound(*v1::CommandBatch::descriptor(), bytes), before + (64u << 10));
    ExpectCovers<v1::CommandBatch>(bytes, "malformed");
  }
}

TEST(ParseLimit, RawMessagesInPiecesGiveTheSameBound) {
  const std::string bytes = EveryKind().SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 777) {
    slices.emplace_back(bytes.data() + at, std::min<size_t>(777, bytes.size() - at));
  }
  const grpc::ByteBuffer raw(slices.data(), slices.size());
  EXPECT_EQ(ParsedBytesBound(*v1::CommandBatch::descriptor(), raw),
            ParsedBytesBound(*v1::CommandBatch::descriptor(), bytes));
  EXPECT_EQ(ParsedBytesBound(*v1::CommandBatch::descriptor(), grpc::ByteBuffer()),
            ParsedBytesBound(*v1::CommandBatch::descriptor(), std::string()));
}

}  // namespace
}  // namespace gpurpc
