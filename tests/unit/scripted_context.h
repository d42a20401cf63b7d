// A backend::Context that tests script: kernels with any parameter layout (including ones a
// buggy or hostile image could report), launches that stay "running" until the test
// completes them, and events whose completion follows those launches. No device memory:
// the memory calls answer UNIMPLEMENTED. For the session's argument checks and the kernel
// watchdog (server/worker/watchdog.h), whose tests must not depend on how long anything
// takes.
//
// Streams are numbered by the test: the default stream is 0, CreateStream hands out 1, 2, ...
// Each launch is one unit of work on its stream; Complete(stream, n) finishes the next n.
// An event recorded on a stream completes once every launch queued before the record has.
#ifndef GPURPC_TESTS_UNIT_SCRIPTED_CONTEXT_H_
#define GPURPC_TESTS_UNIT_SCRIPTED_CONTEXT_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/worker/backend/backend.h"

namespace gpurpc::testing {

class ScriptedContext final : public backend::Context {
 public:
  ScriptedContext() {
    info_.name = "scripted test context";
    info_.is_fake = true;
  }
  ~ScriptedContext() override {
    absl::MutexLock lock(&mu_);
    if (events_alive_at_destruction_ != nullptr) *events_alive_at_destruction_ = events_alive_;
  }

  // At destruction, stores how many of its events were still alive (each must go first).
  void ReportEventsAliveAtDestruction(int* out) {
    absl::MutexLock lock(&mu_);
    events_alive_at_destruction_ = out;
  }

  // Every module of this context defines `name` with `params` (in the order given).
  void DefineKernel(const std::string& name, std::vector<backend::ParamInfo> params) {
    absl::MutexLock lock(&mu_);
    kernels_[name] = std::move(params);
  }

  // Finishes the next `count` launches queued on `stream`.
  void Complete(uint64_t stream, uint64_t count) {
    absl::MutexLock lock(&mu_);
    Queue& queue = queues_[stream];
    queue.completed = std::min(queue.launched, queue.completed + count);
  }
  uint64_t launched(uint64_t stream) const {
    absl::MutexLock lock(&mu_);
    auto it = queues_.find(stream);
    return it == queues_.end() ? 0 : it->second.launched;
  }

  // Called (without the context's lock) inside every Module::GetFunction and every Launch,
  // so that a test can hold a call there while another thread acts.
  void set_get_function_hook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    get_function_hook_ = std::move(hook);
  }
  void set_launch_hook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    launch_hook_ = std::move(hook);
  }
  // Likewise inside every RecordEvent, before its answer.
  void set_record_hook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    record_hook_ = std::move(hook);
  }
  // Modules loaded and not yet destroyed.
  int modules_alive() const {
    absl::MutexLock lock(&mu_);
    return modules_alive_;
  }

  // What the last launch got.
  std::string last_kernel() const {
    absl::MutexLock lock(&mu_);
    return last_kernel_;
  }
  std::vector<uint8_t> last_packed_args() const {
    absl::MutexLock lock(&mu_);
    return last_packed_args_;
  }

  // Answers of the event calls from now on (ABORTED to play a sticky fault).
  void set_query_status(absl::Status status) {
    absl::MutexLock lock(&mu_);
    query_status_ = std::move(status);
  }
  void set_record_status(absl::Status status) {
    absl::MutexLock lock(&mu_);
    record_status_ = std::move(status);
  }
  int events_created() const {
    absl::MutexLock lock(&mu_);
    return events_created_;
  }
  int events_alive() const {
    absl::MutexLock lock(&mu_);
    return events_alive_;
  }
  int records() const {
    absl::MutexLock lock(&mu_);
    return records_;
  }

  // backend::Context.
  const backend::DeviceInfo& device() const override { return info_; }
  std::string CompileTarget() const override { return "compute_75"; }

  absl::StatusOr<backend::DevicePtr> Alloc(uint64_t) override { return Unimplemented("Alloc"); }
  absl::Status Free(backend::DevicePtr) override { return Unimplemented("Free"); }
  absl::StatusOr<backend::MemInfo> GetMemInfo() override { return Unimplemented("GetMemInfo"); }
  absl::Status Upload(backend::DevicePtr, const void*, uint64_t, backend::Stream*) override {
    return Unimplemented("Upload");
  }
  absl::Status Download(void*, backend::DevicePtr, uint64_t, backend::Stream*) override {
    return Unimplemented("Download");
  }
  absl::Status Memset(backend::DevicePtr, uint32_t, uint32_t, uint64_t, backend::Stream*) override {
    return Unimplemented("Memset");
  }
  absl::Status CopyDeviceToDevice(backend::DevicePtr, backend::DevicePtr, uint64_t,
                                  backend::Stream*) override {
    return Unimplemented("CopyDeviceToDevice");
  }

  absl::StatusOr<std::unique_ptr<backend::Module>> LoadModule(
      absl::Span<const uint8_t> image) override {
    if (image.empty()) return absl::InvalidArgumentError("LoadModule: empty image");
    absl::MutexLock lock(&mu_);
    ++modules_alive_;
    return std::unique_ptr<backend::Module>(new Module(this, kernels_));
  }

  absl::Status Launch(backend::Function* function, const backend::LaunchConfig&,
                      absl::Span<const uint8_t> packed_args, backend::Stream* stream) override {
    RunHook(&ScriptedContext::launch_hook_);
    absl::MutexLock lock(&mu_);
    last_kernel_ = static_cast<Function*>(function)->name;
    last_packed_args_.assign(packed_args.begin(), packed_args.end());
    ++queues_[KeyOf(stream)].launched;
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<backend::HostRegistration>> RegisterHostMemory(void*,
                                                                                uint64_t) override {
    return Unimplemented("RegisterHostMemory");
  }
  absl::Status CopyHostToDeviceAsync(backend::DevicePtr, const void*, uint64_t,
                                     backend::Stream*) override {
    return Unimplemented("CopyHostToDeviceAsync");
  }
  absl::Status CopyDeviceToHostAsync(void*, backend::DevicePtr, uint64_t,
                                     backend::Stream*) override {
    return Unimplemented("CopyDeviceToHostAsync");
  }
  absl::StatusOr<std::unique_ptr<backend::Stream>> CreateStream(bool) override {
    absl::MutexLock lock(&mu_);
    return std::unique_ptr<backend::Stream>(new Stream(++streams_created_));
  }
  absl::Status SynchronizeStream(backend::Stream*) override {
    return Unimplemented("SynchronizeStream");
  }
  absl::StatusOr<bool> QueryStream(backend::Stream* stream) override {
    absl::MutexLock lock(&mu_);
    const Queue& queue = queues_[KeyOf(stream)];
    return queue.completed == queue.launched;
  }
  absl::Status StreamWaitEvent(backend::Stream*, backend::Event*) override {
    return Unimplemented("StreamWaitEvent");
  }
  absl::Status Synchronize() override { return Unimplemented("Synchronize"); }

  absl::StatusOr<std::unique_ptr<backend::Event>> CreateEvent(bool, bool) override {
    absl::MutexLock lock(&mu_);
    ++events_created_;
    ++events_alive_;
    return std::unique_ptr<backend::Event>(new Event(this));
  }
  absl::Status RecordEvent(backend::Event* event, backend::Stream* stream) override {
    RunHook(&ScriptedContext::record_hook_);
    absl::MutexLock lock(&mu_);
    if (!record_status_.ok()) return record_status_;
    auto* scripted = static_cast<Event*>(event);
    scripted->recorded = true;
    scripted->stream = KeyOf(stream);
    scripted->position = queues_[scripted->stream].launched;
    ++records_;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> QueryEvent(backend::Event* event) override {
    absl::MutexLock lock(&mu_);
    if (!query_status_.ok()) return query_status_;
    const auto* scripted = static_cast<const Event*>(event);
    return !scripted->recorded || queues_[scripted->stream].completed >= scripted->position;
  }
  absl::Status SynchronizeEvent(backend::Event*) override {
    return Unimplemented("SynchronizeEvent");
  }
  absl::StatusOr<float> ElapsedTime(backend::Event*, backend::Event*) override {
    return Unimplemented("ElapsedTime");
  }

 private:
  struct Queue {
    uint64_t launched = 0;
    uint64_t completed = 0;
  };
  class Stream final : public backend::Stream {
   public:
    explicit Stream(uint64_t key) : key(key) {}
    const uint64_t key;
  };
  class Event final : public backend::Event {
   public:
    explicit Event(ScriptedContext* owner) : owner_(owner) {}
    ~Event() override {
      absl::MutexLock lock(&owner_->mu_);
      --owner_->events_alive_;
    }
    bool recorded = false;  // these three under the owner's mu_
    uint64_t stream = 0;
    uint64_t position = 0;

   private:
    ScriptedContext* const owner_;
  };
  class Function final : public backend::Function {
   public:
    Function(std::string name, std::vector<backend::ParamInfo> params)
        : name(std::move(name)), params_(std::move(params)) {}
    const std::vector<backend::ParamInfo>& params() const override { return params_; }
    const backend::FunctionAttributes& attributes() const override { return attributes_; }
    const std::string name;

   private:
    const std::vector<backend::ParamInfo> params_;
    const backend::FunctionAttributes attributes_;
  };
  class Module final : public backend::Module {
   public:
    Module(ScriptedContext* owner,
           const std::map<std::string, std::vector<backend::ParamInfo>>& kernels)
        : owner_(owner) {
      for (const auto& [name, params] : kernels) {
        functions_.emplace(name, std::make_unique<Function>(name, params));
      }
    }
    ~Module() override {
      absl::MutexLock lock(&owner_->mu_);
      --owner_->modules_alive_;
    }
    absl::StatusOr<backend::Function*> GetFunction(const std::string& name) override {
      owner_->RunHook(&ScriptedContext::get_function_hook_);
      auto it = functions_.find(name);
      if (it == functions_.end()) {
        return absl::NotFoundError(absl::StrCat("scripted module: no kernel '", name, "'"));
      }
      return it->second.get();
    }
    absl::StatusOr<Global> GetGlobal(const std::string& name) override {
      return absl::NotFoundError(absl::StrCat("scripted module: no global '", name, "'"));
    }
    uint64_t device_memory_bytes() const override { return 0; }

   private:
    ScriptedContext* const owner_;
    std::map<std::string, std::unique_ptr<Function>> functions_;
  };

  void RunHook(std::function<void()> ScriptedContext::*hook) {
    std::function<void()> copy;
    {
      absl::MutexLock lock(&mu_);
      copy = this->*hook;
    }
    if (copy) copy();
  }

  static uint64_t KeyOf(backend::Stream* stream) {
    return stream == nullptr ? 0 : static_cast<Stream*>(stream)->key;
  }
  static absl::Status Unimplemented(const char* call) {
    return absl::UnimplementedError(
        absl::StrCat(call, ": the scripted test context has no device memory"));
  }

  backend::DeviceInfo info_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<backend::ParamInfo>> kernels_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Queue> queues_ ABSL_GUARDED_BY(mu_);
  uint64_t streams_created_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_kernel_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> last_packed_args_ ABSL_GUARDED_BY(mu_);
  absl::Status query_status_ ABSL_GUARDED_BY(mu_);
  absl::Status record_status_ ABSL_GUARDED_BY(mu_);
  int events_created_ ABSL_GUARDED_BY(mu_) = 0;
  int events_alive_ ABSL_GUARDED_BY(mu_) = 0;
  int records_ ABSL_GUARDED_BY(mu_) = 0;
  int* events_alive_at_destruction_ ABSL_GUARDED_BY(mu_) = nullptr;
  int modules_alive_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> get_function_hook_ ABSL_GUARDED_BY(mu_);
  std::function<void()> launch_hook_ ABSL_GUARDED_BY(mu_);
  std::function<void()> record_hook_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_UNIT_SCRIPTED_CONTEXT_H_
