#include "server/parse_limit.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/message.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace gpurpc {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// The costs of the module comment, in bytes (64-bit, protobuf 3.21 without an arena, glibc's
// malloc). Heap blocks are rounded: Block(n) is what malloc takes for n bytes.
constexpr size_t Block(size_t n) { return n + 8 + 15 < 32 ? 32 : (n + 8 + 15) & ~size_t{15}; }
// A std::string of its own (a set singular field holds one on the heap, as does every
// element of a repeated one and an unknown length-delimited field), and its contents'
// block beyond what the length counts.
constexpr size_t kString = Block(32) + 32;
// A slot of a repeated field: three pointers (the array doubles, and the old array lives
// on while the new one is filled), and the field's first array (of four).
constexpr size_t kRepeatedSlot = 24;
constexpr size_t kRepeatedFirst = Block(8 + 4 * 8);
// A repeated scalar's element, likewise, at the largest scalar's size.
constexpr size_t kScalar = 24;
// An entry of the unknown field set (16 bytes, the vector likewise), and the set's own
// container, once per message object that has unknown fields.
constexpr size_t kUnknownField = 48;
constexpr size_t kUnknownFirst = Block(8 + 24) + Block(4 * 16);
// A map entry's node and the hash table's share of it.
constexpr size_t kMapNode = 96;
// A string or bytes field longer than this is read in pieces whose string doubles as it
// grows (CodedInputStream::ReadString), so its contents may take twice their length.
constexpr size_t kChunkedStringBytes = 50'000'000;
constexpr int kMaxDepth = 100;  // protobuf's own recursion limit
// Up to this bound, the one from a message's size alone is taken without a walk (Walk).
constexpr size_t kQuickBoundBytes = size_t{16} << 20;

// What a string or bytes field's contents of `length` bytes take.
size_t StringContents(size_t length) { return length > kChunkedStringBytes ? 2 * length : length; }

// What the walk needs of a message type, computed once per type (Plans) so that a walk
// looks fields up by number in a table rather than in the descriptor.
struct TypePlan;
struct FieldPlan {
  const FieldDescriptor* field = nullptr;  // null: an unknown field number
  WireFormatLite::WireType expected = WireFormatLite::WIRETYPE_VARINT;
  bool packable = false;
  bool repeated = false;
  bool string = false;                // string or bytes: its contents are added too
  size_t element_bytes = 0;           // added per occurrence (see Known)
  const TypePlan* message = nullptr;  // of a message or group field
};
struct TypePlan {
  size_t object_bytes = 0;           // one heap object of the type
  std::vector<FieldPlan> by_number;  // index: field number, up to kMaxTabledNumber
  const Descriptor* type = nullptr;
  // The most any one field occurrence in a message of this type, or nested in one, adds to
  // the bound (FromSize); 0 until For computes it.
  size_t most_per_occurrence = 0;
};
constexpr int kMaxTabledNumber = 63;  // larger field numbers are looked up in the descriptor

FieldPlan PlanOfField(const FieldDescriptor* field, const TypePlan* message) {
  FieldPlan plan;
  plan.field = field;
  plan.expected =
      WireFormatLite::WireTypeForFieldType(static_cast<WireFormatLite::FieldType>(field->type()));
  plan.packable = field->is_packable();
  plan.repeated = field->is_repeated();
  plan.message = message;
  const size_t slot = plan.repeated ? kRepeatedSlot : 0;
  switch (field->type()) {
    case FieldDescriptor::TYPE_MESSAGE:
    case FieldDescriptor::TYPE_GROUP:
      plan.element_bytes = message->object_bytes + slot + (field->is_map() ? kMapNode : 0);
      break;
    case FieldDescriptor::TYPE_STRING:
    case FieldDescriptor::TYPE_BYTES:
      plan.string = true;
      plan.element_bytes = kString + slot;
      break;
    default:
      plan.element_bytes = plan.repeated ? kScalar : 0;
      break;
  }
  return plan;
}

// The plans of every type met so far, which live as long as the process (as descriptors do).
// A thread keeps the plans it used last, so that a walk rarely takes the lock.
class Plans {
 public:
  static const TypePlan* For(const Descriptor* type) {
    thread_local const Descriptor* last_type = nullptr;
    thread_local const TypePlan* last_plan = nullptr;
    if (type == last_type) return last_plan;
    static auto* const plans = new Plans();
    absl::MutexLock lock(&plans->mu_);
    TypePlan* plan = plans->ForLocked(type);
    if (plan->most_per_occurrence == 0) plan->most_per_occurrence = MostPerOccurrence(plan);
    last_type = type;
    last_plan = plan;
    return plan;
  }

 private:
  // The largest of what a field occurrence adds anywhere in a message of `root`'s type
  // (the first of a repeated field, or the first unknown one, with its one-off cost).
  static size_t MostPerOccurrence(const TypePlan* root) {
    size_t most = kUnknownFirst + kUnknownField + kString;  // an unknown one, the first
    std::vector<const TypePlan*> pending = {root};
    absl::flat_hash_set<const TypePlan*> seen = {root};
    while (!pending.empty()) {
      const TypePlan* plan = pending.back();
      pending.pop_back();
      for (const FieldPlan& field : plan->by_number) {
        most = std::max(most, field.element_bytes + (field.repeated ? kRepeatedFirst : 0));
        if (field.message != nullptr && seen.insert(field.message).second) {
          pending.push_back(field.message);
        }
      }
    }
    return most;
  }

  TypePlan* ForLocked(const Descriptor* type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::unique_ptr<TypePlan>& slot = plans_[type];
    if (slot != nullptr) return slot.get();
    slot = std::make_unique<TypePlan>();
    TypePlan* plan = slot.get();  // stays put: the map holds pointers
    plan->type = type;
    const google::protobuf::Message* prototype =
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(type);
    plan->object_bytes =
        Block(prototype != nullptr ? static_cast<size_t>(prototype->SpaceUsedLong()) : 256);
    int largest = 0;
    for (int i = 0; i < type->field_count(); ++i) {
      largest = std::max(largest, std::min(type->field(i)->number(), kMaxTabledNumber));
    }
    plan->by_number.resize(static_cast<size_t>(largest) + 1);
    for (int i = 0; i < type->field_count(); ++i) {
      const FieldDescriptor* field = type->field(i);
      if (field->number() > kMaxTabledNumber) continue;
      const TypePlan* message =
          field->message_type() != nullptr ? ForLocked(field->message_type()) : nullptr;
      plan->by_number[static_cast<size_t>(field->number())] = PlanOfField(field, message);
    }
    return plan;
  }

  absl::Mutex mu_;
  absl::flat_hash_map<const Descriptor*, std::unique_ptr<TypePlan>> plans_ ABSL_GUARDED_BY(mu_);
};

// One message object being walked: which of its repeated fields have their first array
// (tabled numbers; above the table every occurrence counts as a first), and whether it has
// its unknown field set yet.
struct ObjectState {
  uint64_t repeated_seen = 0;
  bool unknown_seen = false;
};

class Walker {
 public:
  explicit Walker(size_t stop_above) : stop_above_(stop_above) {}

  // Walks a message of `plan`'s type (null: a group of unknown fields) to its end (the end
  // of the input or of the current limit, or `end_group`'s tag); false when the walk is to
  // stop (over the bound, or bytes that are not wire format).
  bool Message(CodedInputStream* in, const TypePlan* plan, int depth, uint32_t end_group) {
    if (depth > kMaxDepth) return false;
    ObjectState object;
    for (;;) {
      const uint32_t tag = in->ReadTag();
      if (tag == 0) return end_group == 0;  // the end (or a malformed tag: parsing fails too)
      if (tag == end_group) return true;
      const int number = WireFormatLite::GetTagFieldNumber(tag);
      const WireFormatLite::WireType wire = WireFormatLite::GetTagWireType(tag);
      const FieldPlan* field = Find(plan, number);
      const bool ok = field != nullptr ? Known(in, *field, wire, depth, &object)
                                       : Unknown(in, wire, number, depth, &object);
      if (!ok || total_ > stop_above_) return false;
    }
  }

  size_t total() const { return total_; }
  void Add(size_t bytes) { total_ += bytes; }

 private:
  // The plan of field `number` of `plan`'s type; null when the type has none.
  const FieldPlan* Find(const TypePlan* plan, int number) {
    if (plan == nullptr) return nullptr;
    if (number < static_cast<int>(plan->by_number.size())) {
      const FieldPlan& field = plan->by_number[static_cast<size_t>(number)];
      return field.field != nullptr ? &field : nullptr;
    }
    if (number <= kMaxTabledNumber) return nullptr;
    const FieldDescriptor* field = plan->type->FindFieldByNumber(number);
    if (field == nullptr) return nullptr;
    // A field numbered above the table (none of ours is): planned here, once per walk.
    const TypePlan* message =
        field->message_type() != nullptr ? Plans::For(field->message_type()) : nullptr;
    extras_.push_back(PlanOfField(field, message));
    return &extras_.back();
  }

  bool Skip(CodedInputStream* in, WireFormatLite::WireType wire) {
    switch (wire) {
      case WireFormatLite::WIRETYPE_VARINT: {
        uint64_t value = 0;
        return in->ReadVarint64(&value);
      }
      case WireFormatLite::WIRETYPE_FIXED64:
        return in->Skip(8);
      case WireFormatLite::WIRETYPE_FIXED32:
        return in->Skip(4);
      default:
        return false;
    }
  }

  // Reads a length and skips that many bytes, adding `per_byte` times the length (a
  // string's contents when `per_byte` is 0).
  bool SkipLengthDelimited(CodedInputStream* in, size_t per_byte) {
    uint32_t length = 0;
    if (!in->ReadVarint32(&length)) return false;
    Add(per_byte == 0 ? StringContents(length) : static_cast<size_t>(length) * per_byte);
    return in->Skip(static_cast<int>(std::min<uint32_t>(length, INT32_MAX)));
  }

  bool Unknown(CodedInputStream* in, WireFormatLite::WireType wire, int number, int depth,
               ObjectState* object) {
    Add(kUnknownField + (object->unknown_seen ? 0 : kUnknownFirst));
    object->unknown_seen = true;
    switch (wire) {
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED:
        Add(kString);
        return SkipLengthDelimited(in, 0);
      case WireFormatLite::WIRETYPE_START_GROUP:
        // The group's own field set (its entries are counted as they come).
        Add(kUnknownFirst);
        return Message(in, nullptr, depth + 1,
                       WireFormatLite::MakeTag(number, WireFormatLite::WIRETYPE_END_GROUP));
      default:
        return Skip(in, wire);  // false for an END_GROUP that ends nothing, or no wire type
    }
  }

  bool Known(CodedInputStream* in, const FieldPlan& field, WireFormatLite::WireType wire, int depth,
             ObjectState* object) {
    const bool packed = field.packable && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
    if (wire != field.expected && !packed) {
      return Unknown(in, wire, field.field->number(), depth, object);
    }
    if (field.repeated) {
      const int number = field.field->number();
      const uint64_t bit = number < 64 ? uint64_t{1} << number : 0;
      if (bit == 0 || (object->repeated_seen & bit) == 0) Add(kRepeatedFirst);
      object->repeated_seen |= bit;
    }
    if (packed) return SkipLengthDelimited(in, kScalar);  // at most one element per byte
    Add(field.element_bytes);
    if (field.message != nullptr) {
      if (wire == WireFormatLite::WIRETYPE_START_GROUP) {
        return Message(
            in, field.message, depth + 1,
            WireFormatLite::MakeTag(field.field->number(), WireFormatLite::WIRETYPE_END_GROUP));
      }
      uint32_t length = 0;
      if (!in->ReadVarint32(&length)) return false;
      const CodedInputStream::Limit limit =
          in->PushLimit(static_cast<int>(std::min<uint32_t>(length, INT32_MAX)));
      if (!Message(in, field.message, depth + 1, 0)) return false;
      if (in->BytesUntilLimit() != 0) return false;  // a truncated nested message
      in->PopLimit(limit);
      return true;
    }
    if (field.string) return SkipLengthDelimited(in, 0);
    return Skip(in, wire);
  }

  const size_t stop_above_;
  size_t total_ = 0;
  std::deque<FieldPlan> extras_;  // Find's plans of fields above the table
};

// Every field occurrence takes at least 2 bytes on the wire (a tag and a value, or a group's
// start and end) and adds at most most_per_occurrence; every byte of a string or of a packed
// run adds at most kScalar.
size_t FromSize(const TypePlan& plan, size_t wire_bytes) {
  const size_t per_byte = std::max(plan.most_per_occurrence / 2 + 1, kScalar);
  if (wire_bytes > (SIZE_MAX - plan.object_bytes) / per_byte) return SIZE_MAX;
  return plan.object_bytes + wire_bytes * per_byte;
}

size_t Walk(const Descriptor& type, CodedInputStream* in, size_t stop_above) {
  const TypePlan* plan = Plans::For(&type);
  Walker walker(stop_above);
  walker.Add(plan->object_bytes);
  walker.Message(in, plan, 0, 0);
  return walker.total();
}

absl::Status Refusal(const Descriptor& type, size_t wire_bytes, const std::string& what,
                     size_t limit) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s (a %s of %d bytes) would take more than %d bytes of memory once parsed: too many "
      "elements (commands, arguments, unknown fields) for one message, or a field of more than "
      "50 MB; send fewer per message",
      what, type.full_name(), wire_bytes, limit));
}

// The bound from the size, when it is small enough to be taken without a walk.
std::optional<size_t> Quick(const TypePlan& plan, size_t wire_bytes, size_t stop_above) {
  const size_t quick = FromSize(plan, wire_bytes);
  if (quick <= std::min(stop_above, kQuickBoundBytes)) return quick;
  return std::nullopt;
}

}  // namespace

size_t ParsedBytesLimit(size_t wire_bytes) {
  return kParsedAllowanceBytes + wire_bytes + wire_bytes / 4;
}

size_t ParsedBytesBoundFromSize(const Descriptor& type, size_t wire_bytes) {
  return FromSize(*Plans::For(&type), wire_bytes);
}

size_t ParsedBytesBound(const Descriptor& type, std::string_view bytes, size_t stop_above) {
  if (auto quick = Quick(*Plans::For(&type), bytes.size(), stop_above)) return *quick;
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                      static_cast<int>(std::min<size_t>(bytes.size(), INT32_MAX)));
  return Walk(type, &in, stop_above);
}

size_t ParsedBytesBound(const Descriptor& type, const grpc::ByteBuffer& message,
                        size_t stop_above) {
  if (!message.Valid()) return ParsedBytesBound(type, std::string_view(), stop_above);
  if (auto quick = Quick(*Plans::For(&type), message.Length(), stop_above)) return *quick;
  grpc::ByteBuffer copy(message);  // shares the slices
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  return Walk(type, &in, stop_above);
}

absl::Status CheckParsedBytes(const Descriptor& type, std::string_view bytes,
                              absl::FunctionRef<std::string()> what, std::optional<size_t> limit) {
  const size_t bound_limit = limit.value_or(ParsedBytesLimit(bytes.size()));
  if (ParsedBytesBound(type, bytes, bound_limit) <= bound_limit) return absl::OkStatus();
  return Refusal(type, bytes.size(), what(), bound_limit);
}

absl::Status CheckParsedBytes(const Descriptor& type, const grpc::ByteBuffer& message,
                              absl::FunctionRef<std::string()> what, std::optional<size_t> limit) {
  const size_t wire_bytes = message.Valid() ? message.Length() : 0;
  const size_t bound_limit = limit.value_or(ParsedBytesLimit(wire_bytes));
  if (ParsedBytesBound(type, message, bound_limit) <= bound_limit) return absl::OkStatus();
  return Refusal(type, wire_bytes, what(), bound_limit);
}

}  // namespace gpurpc
