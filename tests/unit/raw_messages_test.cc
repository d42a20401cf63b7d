// The worker's raw-message path (server/worker/raw_messages.h) against protobuf itself: a
// chunk split without copying its data must be accepted exactly when protobuf parses it, with
// the same fields and the same bytes; messages built in pooled buffers must parse as protobuf
// builds them. Valid messages, and a few thousand random and mutated ones (truncations, flipped
// bytes, repeated data fields, wrong wire types, unknown fields and groups, bad nested messages).
#include "server/worker/raw_messages.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpurpc/v1/memory_service.pb.h"
#include "gtest/gtest.h"

namespace gpurpc::worker {
namespace {

// `bytes` as a raw message of `pieces` slices (as gRPC hands them over, in pieces).
grpc::ByteBuffer Raw(const std::string& bytes, int pieces) {
  std::vector<grpc::Slice> slices;
  const size_t step = bytes.size() / static_cast<size_t>(std::max(pieces, 1)) + 1;
  for (size_t at = 0; at < bytes.size(); at += step) {
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back();  // an empty message is one empty slice
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const SplitMessage& split) {
  std::string out;
  for (absl::Span<const uint8_t> piece : split.pieces) {
    out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  return out;
}

// SplitBytesField agrees with protobuf on `bytes`, whichever way it is sliced.
void ExpectAgrees(const std::string& bytes, const std::string& what) {
  v1::UploadStreamRequest parsed;
  const bool parses = parsed.ParseFromString(bytes);
  for (int pieces : {1, 2, 7}) {
    SCOPED_TRACE(what + ", " + std::to_string(pieces) + " piece(s), " +
                 std::to_string(bytes.size()) + " bytes");
    grpc::ByteBuffer raw = Raw(bytes, pieces);
    v1::UploadStreamRequest rest;
    SplitMessage split;
    const bool split_ok =
        SplitBytesField(&raw, v1::UploadStreamRequest::kDataFieldNumber, &rest, &split);
    ASSERT_EQ(split_ok, parses);
    if (!parses) continue;
    EXPECT_EQ(Joined(split), parsed.data());
    EXPECT_EQ(split.size, parsed.data().size());
    v1::UploadStreamRequest without_data = parsed;
    without_data.clear_data();
    // Top-level fields of numbers the type does not have are skipped, not kept (those of
    // known numbers and the wrong wire type may be: the parse keeps them as unknown).
    without_data.GetReflection()->MutableUnknownFields(&without_data)->Clear();
    rest.GetReflection()->MutableUnknownFields(&rest)->Clear();
    EXPECT_EQ(rest.SerializeAsString(), without_data.SerializeAsString());
  }
}

v1::UploadStreamRequest Valid(size_t data_bytes) {
  v1::UploadStreamRequest request;
  request.mutable_destination()->mutable_buffer()->set_buffer_id(0x1234567890abcdefULL);
  request.mutable_destination()->mutable_buffer()->set_offset_bytes(4096);
  request.set_total_size_bytes(3u << 20);
  request.set_stream_id(7);
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = static_cast<char>(i * 131 + 7);
  request.set_data(data);
  return request;
}

TEST(RawMessagesTest, ValidChunksSplitAsProtobufParsesThem) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{4096}, size_t{1} << 20,
                      (size_t{1} << 20) + 3}) {
    ExpectAgrees(Valid(size).SerializeAsString(), "valid, data " + std::to_string(size));
  }
  ExpectAgrees("", "empty message");
  {
    grpc::ByteBuffer none;  // no buffer at all: also an empty message
    v1::UploadStreamRequest rest;
    SplitMessage split;
    EXPECT_TRUE(SplitBytesField(&none, v1::UploadStreamRequest::kDataFieldNumber, &rest, &split));
    EXPECT_EQ(split.size, 0u);
  }
  v1::UploadStreamRequest only_data;
  only_data.set_data("abc");
  ExpectAgrees(only_data.SerializeAsString(), "data only");
}

TEST(RawMessagesTest, EdgeCasesAgreeWithProtobuf) {
  const std::string valid = Valid(100).SerializeAsString();
  // The data field twice: protobuf keeps the last.
  v1::UploadStreamRequest second;
  second.set_data("second");
  ExpectAgrees(valid + second.SerializeAsString(), "data twice");
  // The data field's number with a varint wire type: an unknown field to protobuf.
  ExpectAgrees(valid + std::string("\x20\x05", 2), "data number as a varint");
  // Unknown fields: varint, fixed64, length-delimited, a group.
  ExpectAgrees(valid + std::string("\xa8\x06\x01", 3), "unknown varint");
  ExpectAgrees(valid + std::string("\xa9\x06", 2) + std::string(8, 'x'), "unknown fixed64");
  ExpectAgrees(valid + std::string("\xaa\x06\x03xyz", 6), "unknown bytes");
  ExpectAgrees(valid + std::string("\xab\x06\xa8\x06\x01\xac\x06", 7), "unknown group");
  // A group end with no start, a zero tag, a truncated length, a length past the end.
  ExpectAgrees(valid + std::string("\xac\x06", 2), "stray group end");
  ExpectAgrees(valid + std::string("\x00", 1), "zero tag");
  ExpectAgrees(valid + std::string("\x22\xff", 2), "truncated length");
  ExpectAgrees(valid + std::string("\x22\x7f", 2), "length past the end");
  // A destination that is not a DevicePointer (a truncated nested message).
  ExpectAgrees(std::string("\x0a\x03\x0a\x05\x08", 5), "bad nested destination");
  // Nested groups deeper than protobuf's recursion limit.
  std::string deep;
  for (int i = 0; i < 150; ++i) deep += std::string("\xab\x06", 2);
  for (int i = 0; i < 150; ++i) deep += std::string("\xac\x06", 2);
  ExpectAgrees(valid + deep, "150 nested groups");
}

TEST(RawMessagesTest, RandomAndMutatedBytesAgreeWithProtobuf) {
  std::mt19937_64 random(20261130);
  const std::string valid = Valid(300).SerializeAsString();
  for (int round = 0; round < 3000; ++round) {
    std::string bytes;
    switch (round % 4) {
      case 0: {  // random bytes
        bytes.resize(random() % 64);
        for (char& c : bytes) c = static_cast<char>(random());
        break;
      }
      case 1: {  // a valid message, truncated
        bytes = valid.substr(0, random() % valid.size());
        break;
      }
      case 2: {  // a valid message with a few bytes flipped
        bytes = valid;
        for (int k = 0; k < 1 + static_cast<int>(random() % 3); ++k) {
          bytes[random() % bytes.size()] = static_cast<char>(random());
        }
        break;
      }
      default: {  // a valid message with random bytes after it
        bytes = valid;
        for (int k = 0; k < 1 + static_cast<int>(random() % 8); ++k) {
          bytes.push_back(static_cast<char>(random()));
        }
        break;
      }
    }
    ExpectAgrees(bytes, "round " + std::to_string(round));
    if (HasFatalFailure()) return;
  }
}

TEST(RawMessagesTest, PooledChunksParseAsProtobufBuildsThem) {
  v1::DownloadResponse header_part;  // a download chunk has nothing but its data
  for (size_t size : {size_t{0}, size_t{5}, size_t{1} << 20}) {
    grpc::ByteBuffer message;
    ASSERT_TRUE(ChunkMessage(
                    header_part.SerializeAsString(), v1::DownloadResponse::kDataFieldNumber, size,
                    [&](uint8_t* to) {
                      for (size_t i = 0; i < size; ++i) to[i] = static_cast<uint8_t>(i);
                      return absl::OkStatus();
                    },
                    &message)
                    .ok());
    v1::DownloadResponse parsed;
    ASSERT_TRUE(ParseRaw(message, &parsed));
    ASSERT_EQ(parsed.data().size(), size);
    for (size_t i = 0; i < size; ++i) {
      ASSERT_EQ(static_cast<uint8_t>(parsed.data()[i]), static_cast<uint8_t>(i));
    }
  }
  // With other fields before the data (as an upload's first chunk).
  v1::UploadStreamRequest first = Valid(0);
  first.clear_data();
  grpc::ByteBuffer message;
  ASSERT_TRUE(ChunkMessage(
                  first.SerializeAsString(), v1::UploadStreamRequest::kDataFieldNumber, 3,
                  [](uint8_t* to) {
                    to[0] = 'a';
                    to[1] = 'b';
                    to[2] = 'c';
                    return absl::OkStatus();
                  },
                  &message)
                  .ok());
  v1::UploadStreamRequest parsed;
  ASSERT_TRUE(ParseRaw(message, &parsed));
  EXPECT_EQ(parsed.data(), "abc");
  EXPECT_EQ(parsed.stream_id(), 7u);
  EXPECT_EQ(parsed.destination().buffer().offset_bytes(), 4096u);
  // A fill that fails leaves no message and gives its buffer back.
  grpc::ByteBuffer failed;
  const absl::Status status = ChunkMessage(
      "", v1::DownloadResponse::kDataFieldNumber, 16,
      [](uint8_t*) { return absl::DataLossError("the device said no"); }, &failed);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(failed.Length(), 0u);
}

TEST(RawMessagesTest, SerializeAndParseRoundTrip) {
  const v1::UploadStreamRequest request = Valid(1000);
  v1::UploadStreamRequest back;
  ASSERT_TRUE(ParseRaw(SerializeRaw(request), &back));
  EXPECT_EQ(back.SerializeAsString(), request.SerializeAsString());
  EXPECT_FALSE(ParseRaw(Raw(std::string("\x22\x7f", 2), 1), &back));
}

}  // namespace
}  // namespace gpurpc::worker
