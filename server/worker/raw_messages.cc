#include "server/worker/raw_messages.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace gpurpc::worker {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

// Calls `visit(data, size)` for the bytes [begin, end) of `slices`, in order.
template <typename Visit>
void ForRange(const std::vector<grpc::Slice>& slices, size_t begin, size_t end, Visit visit) {
  size_t offset = 0;
  for (const grpc::Slice& slice : slices) {
    const size_t slice_end = offset + slice.size();
    if (slice_end > begin && offset < end) {
      const size_t from = std::max(begin, offset);
      const size_t to = std::min(end, slice_end);
      visit(slice.begin() + (from - offset), to - from);
    }
    offset = slice_end;
    if (offset >= end) break;
  }
}

// Guards the pool of free blocks (FreeBlocks).
absl::Mutex& PoolMutex() {
  static auto* const mu = new absl::Mutex();
  return *mu;
}
std::vector<PooledBlock*>& FreeBlocks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(PoolMutex()) {
  static auto* const blocks = new std::vector<PooledBlock*>();
  return *blocks;
}
constexpr size_t kUsualBlockBytes = (1u << 20) + 256;  // a 1 MiB chunk and its header
constexpr size_t kKeptBlocks = 16;

}  // namespace

bool SplitBytesField(grpc::ByteBuffer* message, int field_number, google::protobuf::Message* rest,
                     SplitMessage* out) {
  out->slices.clear();
  out->pieces.clear();
  out->size = 0;
  if (!message->Valid()) return rest->ParseFromString("");  // an empty message
  const size_t length = message->Length();
  if (!message->Dump(&out->slices).ok()) return false;
  grpc::ByteBuffer view(out->slices.data(), out->slices.size());  // shares the slices
  grpc::ProtoBufferReader reader(&view);
  CodedInputStream in(&reader);
  std::string others;  // every other field rest knows, as it came
  const google::protobuf::Descriptor* known = rest->GetDescriptor();
  size_t field_begin = 0;
  size_t field_size = 0;
  bool seen = false;
  for (;;) {
    const size_t start = static_cast<size_t>(in.CurrentPosition());
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (start != length) return false;  // a malformed tag (0, or a truncated varint)
      break;
    }
    if (WireFormatLite::GetTagFieldNumber(tag) == field_number &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t size = 0;
      if (!in.ReadVarint32(&size)) return false;
      field_begin = static_cast<size_t>(in.CurrentPosition());
      if (!in.Skip(static_cast<int>(std::min<uint32_t>(size, INT32_MAX)))) return false;
      field_size = size;
      seen = true;
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return false;
    // A field `rest` has no number for is skipped, not kept: its bytes would cost a copy here
    // and another in rest's unknown fields, and nothing reads them.
    if (known->FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag)) == nullptr) continue;
    const size_t end = static_cast<size_t>(in.CurrentPosition());
    ForRange(out->slices, start, end, [&](const uint8_t* data, size_t size) {
      others.append(reinterpret_cast<const char*>(data), size);
    });
  }
  if (!rest->ParseFromString(others)) return false;
  if (seen) {
    ForRange(out->slices, field_begin, field_begin + field_size,
             [&](const uint8_t* data, size_t size) { out->pieces.emplace_back(data, size); });
    out->size = field_size;
  }
  message->Clear();
  return true;
}

bool ParseRaw(const grpc::ByteBuffer& message, google::protobuf::Message* out) {
  grpc::ByteBuffer copy(message);  // shares the slices
  return grpc::GenericDeserialize<grpc::ProtoBufferReader, google::protobuf::Message>(&copy, out)
      .ok();
}

grpc::ByteBuffer SerializeRaw(const google::protobuf::Message& message) {
  grpc::ByteBuffer out;
  bool own = false;
  grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(message, &out, &own)
      .IgnoreError();
  return out;
}

PooledBlock* TakeBlock(size_t size) {
  {
    absl::MutexLock lock(&PoolMutex());
    std::vector<PooledBlock*>& blocks = FreeBlocks();
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i]->capacity >= size) {
        PooledBlock* block = blocks[i];
        blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
        return block;
      }
    }
  }
  const size_t capacity = std::max(size, kUsualBlockBytes);
  return new PooledBlock{capacity, new uint8_t[capacity]};
}

void GiveBlock(void* user_data) {
  auto* block = static_cast<PooledBlock*>(user_data);
  {
    absl::MutexLock lock(&PoolMutex());
    std::vector<PooledBlock*>& blocks = FreeBlocks();
    if (blocks.size() < kKeptBlocks) {
      blocks.push_back(block);
      return;
    }
  }
  delete[] block->bytes;
  delete block;
}

size_t ChunkSize(const std::string& header, int field_number, size_t size) {
  const uint32_t tag =
      WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  return header.size() + CodedOutputStream::VarintSize32(tag) +
         CodedOutputStream::VarintSize32(static_cast<uint32_t>(size)) + size;
}

uint8_t* BeginChunk(PooledBlock* block, const std::string& header, int field_number, size_t size) {
  const uint32_t tag =
      WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  uint8_t* p = block->bytes;
  std::memcpy(p, header.data(), header.size());
  p += header.size();
  p = CodedOutputStream::WriteVarint32ToArray(tag, p);
  return CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(size), p);
}

std::string NotParsedMessage(const char* method, uint64_t index, const char* type) {
  return absl::StrFormat(
      "%s: message %d of the stream is not a valid %s (it does not parse as protobuf); the "
      "stream ends here and that message was not applied",
      method, index, type);
}

}  // namespace gpurpc::worker
