// Session::Link: JIT linking of sources, data and standard libraries into one module
// (ModuleService.LinkModule, the driver's cuLink* on the daemon; PyCUDA's DynamicModule).
#include <memory>
#include <utility>

#include "client/cpp/src/session_core.h"
#include "client/cpp/src/transport.h"
#include "gpurpc/client.h"
#include "gpurpc/v1/module_service.grpc.pb.h"

namespace gpurpc {

LinkOptions& LinkOptions::AddSource(const CompileOptions& source) {
  v1::LinkSource* out = request.add_inputs()->mutable_source();
  out->set_source(source.source);
  out->set_program_name(source.program_name);
  for (const std::string& option : source.options) out->add_options(option);
  for (const auto& [name, content] : source.headers) {
    v1::Header* header = out->add_headers();
    header->set_name(name);
    header->set_content(content);
  }
  for (const std::string& expression : source.name_expressions) {
    out->add_name_expressions(expression);
  }
  return *this;
}

LinkOptions& LinkOptions::AddData(v1::LinkInputType type, std::string data, std::string name) {
  v1::LinkData* out = request.add_inputs()->mutable_data();
  out->set_type(type);
  out->set_data(std::move(data));
  out->set_name(std::move(name));
  return *this;
}

LinkOptions& LinkOptions::AddStandardLibrary(std::string name) {
  request.add_inputs()->set_standard_library(std::move(name));
  return *this;
}

std::string LinkResult::LoweredName(const std::string& name_expression) const {
  for (const v1::LinkSourceResult& source : response.sources()) {
    for (const v1::LoweredName& name : source.lowered_names()) {
      if (name.name_expression() == name_expression) return name.lowered_name();
    }
  }
  return "";
}

absl::StatusOr<LinkResult> Session::Link(const LinkOptions& options) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("no session (moved from?)");
  internal::SessionCore& core = *core_;
  if (absl::Status usable = core.CheckUsable(); !usable.ok()) return usable;
  v1::LinkModuleRequest request = options.request;
  request.set_log_verbose(options.log_verbose);
  LinkResult result;
  absl::Status status = internal::RunUnary(
      "LinkModule",
      [&core](grpc::ClientContext* context, const v1::LinkModuleRequest& message,
              grpc::CompletionQueue* queue) {
        return core.modules().PrepareAsyncLinkModule(context, message, queue);
      },
      request, &result.response, core.call_timeout(),
      [&core](grpc::ClientContext* context) { core.AddMetadata(context); });
  if (!status.ok()) return status;
  if (result.response.success() && result.response.module_id() != 0) {
    result.module.core_ = core_;
    result.module.handle_ = std::make_shared<internal::ModuleHandle>();
    result.module.handle_->core = core_;
    result.module.handle_->id = result.response.module_id();
  }
  return result;
}

}  // namespace gpurpc
