#include "tests/testing/raw_call.h"

#include "grpcpp/generic/generic_stub.h"

namespace gpurpc::testing {

std::string ByteBufferToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                      const std::string& method, const std::vector<std::string>& requests) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(context, method, &cq);
  const auto step = [&cq]() {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) return false;
    return ok;
  };
  void* const tag = reinterpret_cast<void*>(1);
  call->StartCall(tag);
  bool open = step();
  for (const std::string& request : requests) {
    if (!open) break;
    grpc::Slice slice(request);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, tag);
    open = step();
  }
  if (open) {
    call->WritesDone(tag);
    step();
  }
  RawCallResult result;
  for (;;) {
    grpc::ByteBuffer answer;
    call->Read(&answer, tag);
    if (!step()) break;
    result.responses.push_back(ByteBufferToString(answer));
  }
  call->Finish(&result.status, tag);
  step();
  cq.Shutdown();
  void* ignored_tag;
  bool ignored_ok;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  return result;
}

}  // namespace gpurpc::testing
