// Session's modules (Compile, LoadModule, LinkModule, GetFunction, GetGlobal) and the
// context and function configuration (session.h). session.cc has the rest: memory,
// execution, command batches.
#include <algorithm>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/byte_count.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "server/worker/backend/module_footprint.h"
#include "server/worker/compiler/cuda_libraries.h"
#include "server/worker/session.h"

namespace gpurpc::worker {
namespace {

// Names are C strings to the driver: "k\0x" would find "k".
absl::Status CheckName(const char* call, const char* field, const std::string& name) {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %s is empty", call, field));
  }
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is %d bytes, more than the limit of %d bytes", call, field,
                        name.size(), kMaxNameBytes));
  }
  if (const size_t nul = name.find('\0'); nul != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s has a NUL byte at offset %d; names are C strings without NUL bytes",
                        call, field, nul));
  }
  return absl::OkStatus();
}

// The packed size of a kernel's parameters as the driver reports them, after checking that
// the layout can be packed: every parameter non-empty, inside kMaxParamBytes and
// overlapping no other, in whatever order they come. A module image is the client's
// input, so a layout that fails is INVALID_ARGUMENT.
absl::StatusOr<uint32_t> CheckParamLayout(const std::string& kernel,
                                          const std::vector<backend::ParamInfo>& params) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return params[a].offset_bytes < params[b].offset_bytes; });
  uint64_t end = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const uint64_t offset = params[i].offset_bytes;
    const uint64_t size = params[i].size_bytes;
    if (size == 0 || offset + size > kMaxParamBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GetFunction: kernel '%s' reports parameter #%d as %d bytes at offset %d, which "
          "is not within a parameter block of 1 to %d bytes; the module image is malformed",
          kernel, i, size, offset, kMaxParamBytes));
    }
    if (k > 0) {
      const size_t previous = order[k - 1];
      if (offset < uint64_t{params[previous].offset_bytes} + params[previous].size_bytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "GetFunction: kernel '%s' reports parameter #%d (%d bytes at offset %d) "
            "overlapping parameter #%d (%d bytes at offset %d); the module image is malformed",
            kernel, i, size, offset, previous, params[previous].size_bytes,
            params[previous].offset_bytes));
      }
    }
    end = std::max(end, offset + size);
  }
  return static_cast<uint32_t>(end);
}

// The wire's ContextLimit, checked: INVALID_ARGUMENT naming it when it is none.
absl::StatusOr<backend::ContextLimit> ToContextLimit(const char* call, int limit) {
  if (!v1::ContextLimit_IsValid(limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: limit %d is not a ContextLimit (0 = STACK_SIZE, 1 = PRINTF_FIFO_SIZE, "
        "2 = MALLOC_HEAP_SIZE, 3 = DEV_RUNTIME_SYNC_DEPTH, 4 = DEV_RUNTIME_PENDING_LAUNCH_COUNT, "
        "5 = MAX_L2_FETCH_GRANULARITY, 6 = PERSISTING_L2_CACHE_SIZE)",
        call, limit));
  }
  return static_cast<backend::ContextLimit>(limit);
}

absl::StatusOr<backend::CacheConfig> ToCacheConfig(const char* call, int config) {
  if (!v1::CacheConfig_IsValid(config)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: cache config %d is not a CacheConfig (0 = PREFER_NONE, 1 = PREFER_SHARED, "
        "2 = PREFER_L1, 3 = PREFER_EQUAL)",
        call, config));
  }
  return static_cast<backend::CacheConfig>(config);
}

// The limit's name as the wire spells it, for messages.
std::string LimitName(backend::ContextLimit limit) {
  return v1::ContextLimit_Name(static_cast<v1::ContextLimit>(limit));
}

}  // namespace

// ---------------------------------------------------------------------------- modules

absl::StatusOr<v1::CompileResponse> Session::Compile(const v1::CompileRequest& request) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (compiler_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("Compile: NVRTC is not available on this server: ",
                                               compiler_status_.message()));
  }
  compiler::CompileRequest creq;
  creq.source = request.source();
  creq.program_name = request.program_name();
  creq.options.assign(request.options().begin(), request.options().end());
  for (const v1::Header& header : request.headers()) {
    creq.headers.push_back(compiler::Header{header.name(), header.content()});
  }
  creq.name_expressions.assign(request.name_expressions().begin(),
                               request.name_expressions().end());
  creq.target = context_->CompileTarget();
  creq.tenant = tenant();
  // Every compile that misses the cache is a helper process: bound how many run at once
  // (the front end's per-tenant count ends when a client cancels, the compile does not).
  GPURPC_RETURN_IF_ERROR(BeginCompile());
  absl::StatusOr<compiler::CompileResult> compiled = compiler_->Compile(creq);
  EndCompile();
  GPURPC_ASSIGN_OR_RETURN(compiler::CompileResult result, std::move(compiled));

  v1::CompileResponse response;
  response.set_success(result.success);
  response.set_log(std::move(result.log));
  response.set_cache_hit(result.cache_hit);
  response.set_arch(result.arch);
  response.set_cache_key(result.cache_key);
  for (auto& option : result.effective_options) response.add_effective_options(option);
  for (auto& [expression, lowered] : result.lowered_names) {
    v1::LoweredName* name = response.add_lowered_names();
    name->set_name_expression(expression);
    name->set_lowered_name(lowered);
  }
  if (!result.success) return response;
  response.mutable_image()->assign(result.image.begin(), result.image.end());
  if (!request.compile_only()) {
    uint64_t device_memory_bytes = 0;
    GPURPC_ASSIGN_OR_RETURN(uint64_t module_id, LoadModule(response.image(), &device_memory_bytes));
    response.set_module_id(module_id);
    response.set_device_memory_bytes(device_memory_bytes);
  }
  return response;
}

absl::Status Session::BeginCompile() {
  absl::MutexLock lock(&mu_);
  uint32_t limit = kMaxConcurrentCompiles;
  if (limits_.max_concurrent_compiles != 0 && limits_.max_concurrent_compiles < limit) {
    limit = limits_.max_concurrent_compiles;
  }
  if (compiles_running_ >= limit) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "Compile: this session already runs %d compiles, the most it may run at once (quota "
        "max_concurrent_compiles of tenant '%s', at most %d per session); retry when one has "
        "finished",
        compiles_running_, tenant_, kMaxConcurrentCompiles));
  }
  ++compiles_running_;
  return absl::OkStatus();
}

void Session::EndCompile() {
  absl::MutexLock lock(&mu_);
  --compiles_running_;
}

absl::StatusOr<uint64_t> Session::LoadModule(const std::string& image,
                                             uint64_t* device_memory_bytes) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (image.empty()) return absl::InvalidArgumentError("LoadModule: the image is empty");
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("modules", modules_.size(), limits_.max_modules,
                                            "max_modules_per_session"));
  }
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<backend::Module> module,
                          RecordFault(context_->LoadModule(absl::Span<const uint8_t>(
                              reinterpret_cast<const uint8_t*>(image.data()), image.size()))));
  const uint64_t footprint = module->device_memory_bytes();
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, AddModule(std::move(module)));
  if (device_memory_bytes != nullptr) *device_memory_bytes = footprint;
  return id;
}

absl::StatusOr<uint64_t> Session::AddModule(std::unique_ptr<backend::Module> module) {
  auto entry = std::make_shared<ModuleEntry>();
  entry->module = std::move(module);
  absl::MutexLock lock(&mu_);
  // Checked again: concurrent loads may have passed the first check together.
  GPURPC_RETURN_IF_ERROR(
      CheckCountLocked("modules", modules_.size(), limits_.max_modules, "max_modules_per_session"));
  const uint64_t id = NewIdLocked();
  modules_.Insert(id, std::move(entry));
  return id;
}

namespace {

// The CUDA linker's input type of a wire one; nullopt for one that is not a LinkInputType
// (or is unspecified).
std::optional<backend::LinkInputType> ToBackendInputType(int type) {
  switch (type) {
    case v1::LINK_INPUT_TYPE_CUBIN:
      return backend::LinkInputType::kCubin;
    case v1::LINK_INPUT_TYPE_PTX:
      return backend::LinkInputType::kPtx;
    case v1::LINK_INPUT_TYPE_FATBINARY:
      return backend::LinkInputType::kFatbinary;
    case v1::LINK_INPUT_TYPE_OBJECT:
      return backend::LinkInputType::kObject;
    case v1::LINK_INPUT_TYPE_LIBRARY:
      return backend::LinkInputType::kLibrary;
    default:
      return std::nullopt;
  }
}

// Whether a source's options already ask for relocatable device code: true for
// "-rdc=true" and its spellings, INVALID_ARGUMENT for one that turns it off.
absl::StatusOr<bool> HasRelocatableDeviceCode(
    int index, const google::protobuf::RepeatedPtrField<std::string>& options) {
  bool has = false;
  for (int i = 0; i < options.size(); ++i) {
    absl::string_view option = absl::StripLeadingAsciiWhitespace(options.Get(i));
    absl::string_view value;
    if (absl::ConsumePrefix(&option, "--relocatable-device-code") ||
        absl::ConsumePrefix(&option, "-rdc")) {
      if (absl::ConsumePrefix(&option, "=")) {
        value = option;
      } else if (option.empty() && i + 1 < options.size()) {
        value = options.Get(i + 1);
      } else if (!option.empty()) {
        continue;  // another option that starts alike
      }
      if (value == "true") {
        has = true;
      } else {
        return absl::InvalidArgumentError(absl::StrFormat(
            "LinkModule: input %d: option '%s' turns relocatable device code off; linked "
            "sources are compiled with --relocatable-device-code=true",
            index, absl::CHexEscape(options.Get(i).substr(0, 256))));
      }
    }
  }
  return has;
}

// The structural checks LoadModule applies to an image, for a data input of a link: the
// driver's linker trusts the sizes inside cubin, ELF object and fatbin headers as its loader
// does, so their bytes must first be shown to lie within the input; compressed fatbin
// entries are refused (what they inflate to is unknown). Libraries are linked only by name
// from the server's toolkit: an archive's members would reach the linker unchecked.
absl::Status CheckLinkData(int index, const v1::LinkData& data) {
  const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data.data().data()),
                                        data.data().size());
  const std::string what =
      absl::StrFormat("LinkModule: input %d ('%s')", index, absl::CHexEscape(data.name()));
  const backend::ImageFormat format = backend::DetectImageFormat(bytes);
  const auto declared = [&](backend::ImageFormat expected, const char* type) -> absl::Status {
    if (format == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is declared %s but its bytes are %s", what, type, backend::ImageFormatName(format)));
  };
  const auto annotate = [&](const absl::Status& status) {
    return status.ok() ? status
                       : absl::InvalidArgumentError(absl::StrCat(what, ": ", status.message()));
  };
  switch (data.type()) {
    case v1::LINK_INPUT_TYPE_PTX:
      return declared(backend::ImageFormat::kPtx, "PTX");
    case v1::LINK_INPUT_TYPE_CUBIN:
    case v1::LINK_INPUT_TYPE_OBJECT:
      GPURPC_RETURN_IF_ERROR(declared(backend::ImageFormat::kCubin, "a cubin or ELF object"));
      return annotate(backend::ValidateCubin(bytes));
    case v1::LINK_INPUT_TYPE_FATBINARY:
      GPURPC_RETURN_IF_ERROR(declared(backend::ImageFormat::kFatbin, "a fatbin"));
      // Validates the header and every entry, and refuses compressed entries.
      return annotate(backend::ModuleFootprintBytes(bytes).status());
    case v1::LINK_INPUT_TYPE_LIBRARY:
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          ": libraries are linked only from the server's toolkit, by name "
          "(standard_library \"cudadevrt\"); send your own library's members as "
          "LINK_INPUT_TYPE_OBJECT or _CUBIN inputs, which are checked before the linker "
          "reads them"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(what, ": unknown input type"));
  }
}

// "sm_90" -> "compute_90" (the device's virtual architecture: PTX, which the linker
// compiles for the device); anything else as it is.
std::string VirtualArchitecture(const std::string& target) {
  if (absl::StartsWith(target, "sm_")) return absl::StrCat("compute_", target.substr(3));
  return target;
}

}  // namespace

absl::StatusOr<v1::LinkModuleResponse> Session::LinkModule(const v1::LinkModuleRequest& request) {
  GPURPC_RETURN_IF_ERROR(fault());
  const int count = request.inputs_size();
  if (count == 0) {
    return absl::InvalidArgumentError(
        "LinkModule: no inputs; give sources, data or standard libraries to link");
  }
  if (count > kMaxLinkInputs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LinkModule: %d inputs, more than the %d one link may have", count, kMaxLinkInputs));
  }
  // Every input is checked before anything is compiled, read or linked.
  int sources = 0;
  std::vector<bool> add_rdc(count, false);
  std::set<std::string> libraries;
  for (int i = 0; i < count; ++i) {
    const v1::LinkInput& input = request.inputs(i);
    switch (input.input_case()) {
      case v1::LinkInput::kSource: {
        ++sources;
        if (input.source().source().empty()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the source is empty", i));
        }
        GPURPC_ASSIGN_OR_RETURN(const bool has_rdc,
                                HasRelocatableDeviceCode(i, input.source().options()));
        add_rdc[i] = !has_rdc;
        break;
      }
      case v1::LinkInput::kData: {
        const v1::LinkData& data = input.data();
        if (!ToBackendInputType(data.type())) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d has unknown input type %d; it must be one of "
                              "LINK_INPUT_TYPE_CUBIN, _PTX, _FATBINARY, _OBJECT or _LIBRARY",
                              i, static_cast<int>(data.type())));
        }
        if (data.data().empty()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the data is empty", i));
        }
        if (data.name().size() > static_cast<size_t>(kMaxLinkInputNameBytes)) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the name is %d bytes long, more than %d", i,
                              data.name().size(), kMaxLinkInputNameBytes));
        }
        if (data.name().find('\0') != std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrFormat("LinkModule: input %d: the name contains a NUL byte", i));
        }
        GPURPC_RETURN_IF_ERROR(CheckLinkData(i, data));
        break;
      }
      case v1::LinkInput::kStandardLibrary: {
        const std::string& name = input.standard_library();
        if (name != "cudadevrt") {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: unknown standard library '%s'; the server links only "
              "'cudadevrt' (the device runtime) by name",
              i, absl::CHexEscape(name.substr(0, kMaxLinkInputNameBytes))));
        }
        if (!libraries.insert(name).second) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: standard library '%s' is named twice", i, name));
        }
        break;
      }
      case v1::LinkInput::INPUT_NOT_SET:
        return absl::InvalidArgumentError(absl::StrFormat(
            "LinkModule: input %d sets none of source, data and standard_library", i));
    }
  }
  if (sources > kMaxLinkSources) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LinkModule: %d sources, more than the %d one link may compile", sources, kMaxLinkSources));
  }
  if (sources > 0 && compiler_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "LinkModule: NVRTC is not available on this server: ", compiler_status_.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    GPURPC_RETURN_IF_ERROR(CheckCountLocked("modules", modules_.size(), limits_.max_modules,
                                            "max_modules_per_session"));
  }

  v1::LinkModuleResponse response;
  // Compiled images and library files, kept until the link is done (a deque: its elements
  // stay where they are as it grows).
  std::deque<std::string> owned;
  std::deque<std::vector<uint8_t>> images;
  uint64_t held_bytes = 0;
  for (const v1::LinkInput& input : request.inputs()) {
    if (input.input_case() == v1::LinkInput::kData) held_bytes += input.data().data().size();
  }
  std::vector<backend::LinkInput> inputs(count);
  const std::string include_dir =
      compiler_ != nullptr ? compiler_->cuda_include_dir() : "/usr/local/cuda/include";
  for (int i = 0; i < count; ++i) {
    const v1::LinkInput& input = request.inputs(i);
    backend::LinkInput& linked = inputs[i];
    const auto span_of = [](const std::string& bytes) {
      return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                       bytes.size());
    };
    switch (input.input_case()) {
      case v1::LinkInput::kSource: {
        const v1::LinkSource& source = input.source();
        compiler::CompileRequest creq;
        creq.source = source.source();
        creq.program_name = source.program_name();
        creq.options.assign(source.options().begin(), source.options().end());
        if (add_rdc[i]) creq.options.emplace_back("--relocatable-device-code=true");
        for (const v1::Header& header : source.headers()) {
          creq.headers.push_back(compiler::Header{header.name(), header.content()});
        }
        creq.name_expressions.assign(source.name_expressions().begin(),
                                     source.name_expressions().end());
        creq.target = VirtualArchitecture(context_->CompileTarget());
        creq.tenant = tenant();
        GPURPC_RETURN_IF_ERROR(BeginCompile());
        absl::StatusOr<compiler::CompileResult> compiled = compiler_->Compile(creq);
        EndCompile();
        if (!compiled.ok()) {
          return absl::Status(
              compiled.status().code(),
              absl::StrFormat("LinkModule: input %d: %s", i, compiled.status().message()));
        }
        v1::LinkSourceResult* result = response.add_sources();
        result->set_input_index(i);
        result->set_success(compiled->success);
        result->set_log(std::move(compiled->log));
        result->set_cache_hit(compiled->cache_hit);
        result->set_arch(compiled->arch);
        for (auto& option : compiled->effective_options) result->add_effective_options(option);
        for (auto& [expression, lowered] : compiled->lowered_names) {
          v1::LoweredName* name = result->add_lowered_names();
          name->set_name_expression(expression);
          name->set_lowered_name(lowered);
        }
        if (!compiled->success) {
          response.set_success(false);
          return response;
        }
        // What one link holds in this worker is bounded like one message: the compiled
        // images (a cache hit costs no compile time, so the bound must be on bytes) plus
        // the data inputs.
        held_bytes += compiled->image.size();
        if (held_bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "LinkModule: input %d: the compiled sources and data come to more than %d MiB, "
              "the most one link may hold; link fewer or smaller inputs",
              i, kMaxMessageBytes >> 20));
        }
        images.push_back(std::move(compiled->image));
        linked.type = absl::StartsWith(compiled->arch, "sm_") ? backend::LinkInputType::kCubin
                                                              : backend::LinkInputType::kPtx;
        linked.name = source.program_name().empty() ? "kernel.cu" : source.program_name();
        linked.data = absl::MakeConstSpan(images.back());
        break;
      }
      case v1::LinkInput::kData:
        linked.type = *ToBackendInputType(input.data().type());
        linked.name = input.data().name().empty() ? absl::StrCat("input", i) : input.data().name();
        linked.data = span_of(input.data().data());
        break;
      case v1::LinkInput::kStandardLibrary: {
        absl::StatusOr<std::string> library =
            compiler::ReadStandardLibrary(input.standard_library(), include_dir);
        if (!library.ok()) {
          return absl::Status(
              library.status().code(),
              absl::StrFormat("LinkModule: input %d: %s", i, library.status().message()));
        }
        owned.push_back(*std::move(library));
        linked.type = backend::LinkInputType::kLibrary;
        linked.name = absl::StrCat("lib", input.standard_library(), ".a");
        linked.data = span_of(owned.back());
        break;
      }
      case v1::LinkInput::INPUT_NOT_SET:
        break;  // refused above
    }
  }
  absl::StatusOr<backend::LinkedModule> linked =
      RecordFault(context_->LinkModule(inputs, request.log_verbose()));
  if (!linked.ok()) {
    return absl::Status(linked.status().code(),
                        absl::StrCat("LinkModule: ", linked.status().message()));
  }
  const uint64_t footprint = linked->module->device_memory_bytes();
  GPURPC_ASSIGN_OR_RETURN(const uint64_t id, AddModule(std::move(linked->module)));
  response.set_success(true);
  response.set_log(std::move(linked->info_log));
  response.set_module_id(id);
  response.set_device_memory_bytes(footprint);
  return response;
}

absl::Status Session::UnloadModule(uint64_t module_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  std::shared_ptr<ModuleEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(entry, modules_.Take(module_id, "UnloadModule"));
    for (const auto& [name, function_id] : entry->functions_by_name) functions_.Erase(function_id);
    for (backend::DevicePtr address : entry->global_addresses) ranges_.erase(address);
  }
  // Launches still holding the entry keep the module loaded until they are enqueued.
  return absl::OkStatus();
}

absl::StatusOr<v1::GetFunctionResponse> Session::GetFunction(uint64_t module_id,
                                                             const std::string& name) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(CheckName("GetFunction", "name", name));
  std::shared_ptr<ModuleEntry> entry;
  v1::GetFunctionResponse response;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(entry, modules_.Find(module_id, "GetFunction"));
    auto known = entry->functions_by_name.find(name);
    if (known != entry->functions_by_name.end()) response.set_function_id(known->second);
  }
  // `entry` keeps the module, and so `function`, alive whatever UnloadModule does meanwhile.
  GPURPC_ASSIGN_OR_RETURN(backend::Function * function,
                          RecordFault(entry->module->GetFunction(name)));
  GPURPC_ASSIGN_OR_RETURN(const uint32_t packed_bytes, CheckParamLayout(name, function->params()));
  if (response.function_id() == 0) {
    auto function_entry = std::make_shared<FunctionEntry>();
    function_entry->function = function;
    function_entry->name = std::make_shared<const std::string>(name);
    function_entry->module = entry;
    function_entry->module_id = module_id;
    function_entry->packed_bytes = packed_bytes;
    absl::MutexLock lock(&mu_);
    // Unloaded while we looked: registering the function now would resurrect the module.
    const std::shared_ptr<ModuleEntry>* current = modules_.Lookup(module_id);
    if (current == nullptr || *current != entry) {
      return absl::NotFoundError(absl::StrFormat(
          "GetFunction: module %d was unloaded while kernel '%s' was looked up", module_id, name));
    }
    auto [known, inserted] = entry->functions_by_name.emplace(name, 0);
    if (inserted) {
      known->second = NewIdLocked();
      functions_.Insert(known->second, std::move(function_entry));
    }
    response.set_function_id(known->second);
  }
  for (const backend::ParamInfo& param : function->params()) {
    v1::ParamInfo* info = response.add_params();
    info->set_offset_bytes(param.offset_bytes);
    info->set_size_bytes(param.size_bytes);
  }
  std::shared_ptr<FunctionEntry> function_entry;
  {
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<FunctionEntry>* found = functions_.Lookup(response.function_id());
    if (found != nullptr) function_entry = *found;
  }
  if (function_entry != nullptr) {
    FillAttributes(*function_entry, response.mutable_attributes());
  } else {  // unloaded meanwhile: the attributes it was loaded with
    FunctionEntry loaded;
    loaded.function = function;
    FillAttributes(loaded, response.mutable_attributes());
  }
  return response;
}

void Session::FillAttributes(const FunctionEntry& entry, v1::FunctionAttributes* out) {
  const backend::FunctionAttributes& attrs = entry.function->attributes();
  out->set_num_regs(attrs.num_regs);
  out->set_shared_size_bytes(attrs.shared_size_bytes);
  out->set_const_size_bytes(attrs.const_size_bytes);
  out->set_local_size_bytes(attrs.local_size_bytes);
  out->set_max_threads_per_block(attrs.max_threads_per_block);
  out->set_ptx_version(attrs.ptx_version);
  out->set_binary_version(attrs.binary_version);
  const int dynamic_shared = entry.max_dynamic_shared_bytes.load(std::memory_order_acquire);
  out->set_max_dynamic_shared_size_bytes(dynamic_shared >= 0 ? dynamic_shared
                                                             : attrs.max_dynamic_shared_size_bytes);
  out->set_preferred_shared_memory_carveout(entry.carveout.load(std::memory_order_acquire));
}

// ---------------------------------------------------------------- context configuration

uint64_t Session::StackReservationBytes(uint64_t stack_bytes) const {
  // As the front end's ledger counts local memory (SessionManager::ChargeLocalMemory):
  // multiprocessors x CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR (39), 2048 when
  // the device does not say.
  const backend::DeviceInfo& device = context_->device();
  auto it = device.attributes.find(39);
  const uint64_t per_multiprocessor =
      it != device.attributes.end() && it->second > 0 ? static_cast<uint64_t>(it->second) : 2048;
  const uint64_t threads =
      static_cast<uint64_t>(std::max(device.multiprocessor_count, 1)) * per_multiprocessor;
  return stack_bytes > UINT64_MAX / threads ? UINT64_MAX : stack_bytes * threads;
}

absl::StatusOr<v1::SetContextLimitResponse> Session::SetContextLimit(int limit_value,
                                                                     uint64_t value) {
  constexpr char kCall[] = "SetContextLimit";
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::ContextLimit limit, ToContextLimit(kCall, limit_value));
  const std::string name = LimitName(limit);
  const auto out_of_bounds = [&](uint64_t low, uint64_t high, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s = %d is outside %d..%d%s", kCall, name, value, low, high, why));
  };
  const backend::DeviceInfo& device = context_->device();
  switch (limit) {
    case backend::ContextLimit::kStackSize: {
      if (value == 0 || value > kMaxStackBytesPerThread) {
        return out_of_bounds(1, kMaxStackBytesPerThread, " (bytes of stack per GPU thread)");
      }
      const uint64_t reservation = StackReservationBytes(value);
      if (reservation > kMaxStackReservationBytes) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s = %d bytes per thread makes the driver reserve %s of device memory (for "
            "each of the device's %d resident threads), more than the %s gpurpc allows; at "
            "most %d bytes per thread on this device",
            kCall, name, value, FormatBytes(reservation), StackReservationBytes(1),
            FormatBytes(kMaxStackReservationBytes),
            kMaxStackReservationBytes / std::max<uint64_t>(StackReservationBytes(1), 1)));
      }
      break;
    }
    case backend::ContextLimit::kPrintfFifoSize:
      if (value == 0 || value > kMaxPrintfFifoBytes) {
        return out_of_bounds(1, kMaxPrintfFifoBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kMallocHeapSize:
      if (value == 0 || value > kMaxMallocHeapBytes) {
        return out_of_bounds(1, kMaxMallocHeapBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kDevRuntimeSyncDepth:
      if (value > kMaxDevRuntimeSyncDepth) return out_of_bounds(0, kMaxDevRuntimeSyncDepth, "");
      break;
    case backend::ContextLimit::kDevRuntimePendingLaunchCount:
      if (value == 0 || value > kMaxDevRuntimePendingLaunchCount) {
        return out_of_bounds(1, kMaxDevRuntimePendingLaunchCount, "");
      }
      break;
    case backend::ContextLimit::kMaxL2FetchGranularity:
      if (value > kMaxL2FetchGranularityBytes) {
        return out_of_bounds(0, kMaxL2FetchGranularityBytes, " (bytes)");
      }
      break;
    case backend::ContextLimit::kPersistingL2CacheSize: {
      // CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE (108); 0 when the device has none.
      auto it = device.attributes.find(108);
      const uint64_t max =
          it != device.attributes.end() && it->second > 0 ? static_cast<uint64_t>(it->second) : 0;
      if (value > max) {
        return out_of_bounds(0, max, " (bytes; the device's max persisting L2 cache size)");
      }
      break;
    }
  }

  const bool reserves = limit == backend::ContextLimit::kStackSize ||
                        limit == backend::ContextLimit::kPrintfFifoSize ||
                        limit == backend::ContextLimit::kMallocHeapSize;
  absl::MutexLock limits_lock(&limits_mu_);
  // The three reservations at the values they will have.
  const auto reservation_with = [&](uint64_t* total) -> absl::Status {
    uint64_t sum = 0;
    for (backend::ContextLimit each :
         {backend::ContextLimit::kStackSize, backend::ContextLimit::kPrintfFifoSize,
          backend::ContextLimit::kMallocHeapSize}) {
      uint64_t current = value;
      if (each != limit) {
        GPURPC_ASSIGN_OR_RETURN(current, RecordFault(context_->GetLimit(each)));
      }
      const uint64_t bytes =
          each == backend::ContextLimit::kStackSize ? StackReservationBytes(current) : current;
      sum = bytes > UINT64_MAX - sum ? UINT64_MAX : sum + bytes;
    }
    *total = sum;
    return absl::OkStatus();
  };
  if (reserves) {
    uint64_t quota = 0;
    {
      absl::MutexLock lock(&mu_);
      quota = limits_.max_device_memory_bytes;
    }
    uint64_t total = 0;
    GPURPC_RETURN_IF_ERROR(reservation_with(&total));
    if (quota > 0 && total > quota) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: %s = %d would make the driver reserve %s for the context's stack, printf FIFO "
          "and malloc heap together, more than the tenant's max_device_memory_bytes quota of "
          "%s",
          kCall, name, value, FormatBytes(total), FormatBytes(quota)));
    }
  }
  GPURPC_RETURN_IF_ERROR(RecordFault(context_->SetLimit(limit, value)));
  v1::SetContextLimitResponse response;
  GPURPC_ASSIGN_OR_RETURN(const uint64_t now, RecordFault(context_->GetLimit(limit)));
  response.set_value(now);
  uint64_t reserved = 0;
  for (backend::ContextLimit each :
       {backend::ContextLimit::kStackSize, backend::ContextLimit::kPrintfFifoSize,
        backend::ContextLimit::kMallocHeapSize}) {
    GPURPC_ASSIGN_OR_RETURN(const uint64_t current, RecordFault(context_->GetLimit(each)));
    const uint64_t bytes =
        each == backend::ContextLimit::kStackSize ? StackReservationBytes(current) : current;
    reserved = bytes > UINT64_MAX - reserved ? UINT64_MAX : reserved + bytes;
  }
  response.set_reserved_device_bytes(reserved);
  return response;
}

absl::StatusOr<uint64_t> Session::GetContextLimit(int limit_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::ContextLimit limit,
                          ToContextLimit("GetContextLimit", limit_value));
  return RecordFault(context_->GetLimit(limit));
}

absl::Status Session::SetCacheConfig(int config_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config,
                          ToCacheConfig("SetCacheConfig", config_value));
  return RecordFault(context_->SetCacheConfig(config));
}

absl::StatusOr<bool> Session::SetProfiling(bool enabled) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(RecordFault(context_->SetProfiling(enabled)));
  absl::MutexLock lock(&mu_);
  return std::exchange(profiling_, enabled);
}

absl::StatusOr<int> Session::GetCacheConfig() {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config,
                          RecordFault(context_->GetCacheConfig()));
  return static_cast<int>(config);
}

absl::Status Session::SetSharedConfig(int config, uint64_t function_id) {
  GPURPC_RETURN_IF_ERROR(fault());
  if (!v1::SharedConfig_IsValid(config)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SetSharedConfig: config %d is not a SharedConfig (0 = DEFAULT_BANK_SIZE, "
                        "1 = FOUR_BYTE_BANK_SIZE, 2 = EIGHT_BYTE_BANK_SIZE)",
                        config));
  }
  if (function_id != 0) GPURPC_RETURN_IF_ERROR(FindFunction(function_id).status());
  // cuCtxSetSharedMemConfig / cuFuncSetSharedMemConfig are deprecated, and on the devices
  // CUDA 13 supports (compute capability 7.5 and later) the bank width is fixed: the driver
  // does nothing ("This function will do nothing on devices with fixed shared memory bank
  // size", cuda.h). Nor does gpurpc.
  return absl::OkStatus();
}

absl::StatusOr<int> Session::GetSharedConfig() {
  GPURPC_RETURN_IF_ERROR(fault());
  // What cuCtxGetSharedMemConfig answers on a device with a fixed bank width.
  return static_cast<int>(v1::SHARED_CONFIG_FOUR_BYTE_BANK_SIZE);
}

absl::StatusOr<v1::SetFunctionAttributeResponse> Session::SetFunctionAttribute(uint64_t function_id,
                                                                               int attribute,
                                                                               int64_t value) {
  constexpr char kCall[] = "SetFunctionAttribute";
  GPURPC_RETURN_IF_ERROR(fault());
  if (!v1::FunctionAttribute_IsValid(attribute)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: attribute %d is not a FunctionAttribute (8 = MAX_DYNAMIC_SHARED_SIZE_BYTES and "
        "9 = PREFERRED_SHARED_MEMORY_CARVEOUT can be set)",
        kCall, attribute));
  }
  const std::string name =
      v1::FunctionAttribute_Name(static_cast<v1::FunctionAttribute>(attribute));
  if (attribute != v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
      attribute != v1::FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s is read-only (only FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and "
        "FUNCTION_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT can be set)",
        kCall, name));
  }
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<FunctionEntry> entry, FindFunction(function_id));
  backend::FunctionAttribute backend_attribute;
  if (attribute == v1::FUNCTION_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    const backend::DeviceInfo& device = context_->device();
    const int64_t optin = std::max(device.max_shared_memory_per_block_optin_bytes,
                                   device.max_shared_memory_per_block_bytes);
    const int64_t max =
        std::max<int64_t>(0, optin - entry->function->attributes().shared_size_bytes);
    if (value < 0 || value > max) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s = %d for kernel '%s' is outside 0..%d (the device's %d bytes of shared "
          "memory per block with opt-in, minus the kernel's %d bytes of static shared memory)",
          kCall, name, value, *entry->name, max, optin,
          entry->function->attributes().shared_size_bytes));
    }
    backend_attribute = backend::FunctionAttribute::kMaxDynamicSharedSizeBytes;
  } else {
    if (value < -1 || value > 100) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s = %d for kernel '%s' is outside -1..100 (percent of the maximum shared "
          "memory; -1 = no preference)",
          kCall, name, value, *entry->name));
    }
    backend_attribute = backend::FunctionAttribute::kPreferredSharedMemoryCarveout;
  }
  GPURPC_RETURN_IF_ERROR(RecordFault(
      context_->SetFunctionAttribute(entry->function, backend_attribute, static_cast<int>(value))));
  if (backend_attribute == backend::FunctionAttribute::kMaxDynamicSharedSizeBytes) {
    entry->max_dynamic_shared_bytes.store(static_cast<int>(value), std::memory_order_release);
  } else {
    entry->carveout.store(static_cast<int>(value), std::memory_order_release);
  }
  v1::SetFunctionAttributeResponse response;
  FillAttributes(*entry, response.mutable_attributes());
  return response;
}

absl::Status Session::SetFunctionCacheConfig(uint64_t function_id, int config_value) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_ASSIGN_OR_RETURN(const backend::CacheConfig config,
                          ToCacheConfig("SetFunctionCacheConfig", config_value));
  GPURPC_ASSIGN_OR_RETURN(std::shared_ptr<FunctionEntry> entry, FindFunction(function_id));
  return RecordFault(context_->SetFunctionCacheConfig(entry->function, config));
}

absl::StatusOr<v1::GetGlobalResponse> Session::GetGlobal(uint64_t module_id,
                                                         const std::string& name) {
  GPURPC_RETURN_IF_ERROR(fault());
  GPURPC_RETURN_IF_ERROR(CheckName("GetGlobal", "name", name));
  std::shared_ptr<ModuleEntry> entry;
  {
    absl::MutexLock lock(&mu_);
    GPURPC_ASSIGN_OR_RETURN(entry, modules_.Find(module_id, "GetGlobal"));
  }
  GPURPC_ASSIGN_OR_RETURN(backend::Module::Global global,
                          RecordFault(entry->module->GetGlobal(name)));
  {
    // Register the global as a device range so that memory calls can address it; never
    // for a module unloaded meanwhile (its globals are gone with it).
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<ModuleEntry>* current = modules_.Lookup(module_id);
    if (current == nullptr || *current != entry) {
      return absl::NotFoundError(absl::StrFormat(
          "GetGlobal: module %d was unloaded while global '%s' was looked up", module_id, name));
    }
    if (global.size_bytes > 0 &&
        ranges_.emplace(global.address, Range{0, global.size_bytes}).second) {
      entry->global_addresses.push_back(global.address);
    }
  }
  v1::GetGlobalResponse response;
  response.set_device_address(global.address);
  response.set_size_bytes(global.size_bytes);
  return response;
}

}  // namespace gpurpc::worker
