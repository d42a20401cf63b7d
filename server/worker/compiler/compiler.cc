#include "server/worker/compiler/compiler.h"

#include <sys/stat.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "server/worker/compiler/compile_cache.h"
#include "server/worker/compiler/nvrtc_library.h"
#include "server/worker/compiler/sha256.h"
#include "server/worker/compiler/std_headers.h"
#include "spdlog/spdlog.h"

namespace gpurpc::compiler {
namespace {

// Part of every cache key: bump it whenever what a key covers, or what a cached result
// holds, changes, so that old entries are never mistaken for new ones.
constexpr absl::string_view kKeyFormat = "gpurpc-nvrtc-cache-v2";
constexpr char kDefaultProgramName[] = "kernel.cu";
constexpr size_t kMaxNameLength = 256;

// Length-prefixing every field (and counting every list) makes the encoding injective:
// no two different requests can feed the hash the same bytes.
void HashCount(Sha256* hasher, uint64_t count) {
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(count >> (8 * i));
  hasher->Update(bytes, sizeof(bytes));
}

void HashField(Sha256* hasher, absl::string_view field) {
  HashCount(hasher, field.size());
  hasher->Update(field);
}

absl::Status CheckSize(absl::string_view what, uint64_t size_bytes, uint64_t limit_bytes,
                       absl::string_view limit_name) {
  if (size_bytes <= limit_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " is ", size_bytes,
                                                 " bytes, over the limit of ", limit_bytes,
                                                 " bytes (", limit_name, ")"));
}

// NVRTC takes C strings: an embedded NUL would silently cut the text short.
absl::Status CheckNoNul(absl::string_view what, absl::string_view text) {
  const size_t nul = text.find('\0');
  if (nul == absl::string_view::npos) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " contains a NUL byte at offset ", nul));
}

// Header and program names: NVRTC matches `#include` names against them, so they must
// look like relative paths that cannot point outside the virtual include tree.
absl::Status CheckRelativeName(absl::string_view what, absl::string_view name) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", absl::CHexEscape(name.substr(0, kMaxNameLength)), "' ", why));
  };
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (name.size() > kMaxNameLength) {
    return bad(absl::StrCat("is ", name.size(), " characters long; the limit is ", kMaxNameLength));
  }
  if (name.find('\0') != absl::string_view::npos) return bad("contains a NUL byte");
  if (name.find('\\') != absl::string_view::npos) return bad("contains a backslash");
  if (name.front() == '/') return bad("is an absolute path");
  if (absl::StrContains(name, "..")) return bad("contains \"..\"");
  return absl::OkStatus();
}

// The option's name: "--gpu-architecture=sm_90" -> "--gpu-architecture".
absl::string_view OptionName(absl::string_view option) {
  return option.substr(0, option.find_first_of("= \t"));
}

// Why `option` may not reach NVRTC, or "" when it may. These options make NVRTC read
// (or, for the timing reports, write) files on the server.
std::string ForbiddenReason(absl::string_view option) {
  // NVRTC skips leading blanks: " -I/dir" is an include path.
  option = absl::StripLeadingAsciiWhitespace(option);
  const absl::string_view name = OptionName(option);
  absl::string_view bare = name;
  while (!bare.empty() && bare.front() == '-') bare.remove_prefix(1);
  if (absl::StartsWith(name, "-I") || absl::StartsWith(bare, "include")) {
    return "include paths are not allowed (send headers with the request)";
  }
  if (absl::StartsWith(bare, "pre-include")) return "pre-includes are not allowed";
  if (absl::StrContains(bare, "pch")) return "precompiled headers are not allowed";
  if (absl::StartsWith(bare, "options-file") || absl::StartsWith(bare, "optf")) {
    return "options files are not allowed";
  }
  if (absl::StartsWith(bare, "time") || absl::StartsWith(bare, "fdevice-time-trace")) {
    return "timing reports would write files on the server";
  }
  // The value: after '=' (or a blank) in "-opt=value"; a token of its own otherwise
  // ("-arch", "sm_90" passed as two options).
  absl::string_view value = option;
  if (absl::StartsWith(option, "-")) {
    const size_t separator = option.find_first_of("= \t");
    value =
        separator == absl::string_view::npos ? absl::string_view() : option.substr(separator + 1);
  }
  if (absl::StartsWith(value, "/")) return "option values may not be absolute paths";
  if (absl::StrContains(value, "..")) return "option values may not contain \"..\"";
  // -Xptxas=-v,-O3 hands options on to ptxas, which has its own file options
  // (--options-file ...): each of those must pass the same checks. The other -X options
  // reach tools NVRTC does not document (-Xcudafe: the front end, whose --preinclude,
  // --sys_include and --error_output read and write files): refused.
  if (absl::StartsWith(name, "-X") && name != "-Xptxas") {
    return "only -Xptxas may pass options on to a tool";
  }
  // (A value of its own, "ptxas-options" without dashes, is no option: it is not split.)
  if (absl::StartsWith(option, "-") &&
      (name == "-Xptxas" || absl::StartsWith(bare, "ptxas-options"))) {
    for (absl::string_view part : absl::StrSplit(value, ',')) {
      if (std::string reason = ForbiddenReason(part); !reason.empty()) {
        return absl::StrCat("in '", part, "': ", reason);
      }
    }
  }
  return "";
}

bool IsArchOption(absl::string_view name) {
  return name == "-arch" || name == "--gpu-architecture";
}

// "sm_90", "sm_90a", "sm_100f", "compute_75".
bool IsArchName(absl::string_view arch) {
  absl::string_view digits;
  if (absl::StartsWith(arch, "sm_")) {
    digits = arch.substr(3);
  } else if (absl::StartsWith(arch, "compute_")) {
    digits = arch.substr(8);
  } else {
    return false;
  }
  if (!digits.empty() && std::islower(static_cast<unsigned char>(digits.back()))) {
    digits.remove_suffix(1);
  }
  return !digits.empty() && digits.find_first_not_of("0123456789") == absl::string_view::npos;
}

// Best effort at naming the option NVRTC rejected, from its log:
// "nvrtc: error: unrecognized option --foo found" or
// "nvrtc: error: invalid value for --gpu-architecture (-arch)".
std::string RejectedOption(const std::vector<std::string>& options, absl::string_view log) {
  constexpr absl::string_view kUnrecognized = "unrecognized option ";
  if (const size_t at = log.find(kUnrecognized); at != absl::string_view::npos) {
    const absl::string_view rest = log.substr(at + kUnrecognized.size());
    const absl::string_view named = rest.substr(0, rest.find(" found"));
    for (const std::string& option : options) {
      if (option == named) return option;
    }
  }
  for (const std::string& option : options) {
    const absl::string_view name = OptionName(option);
    if (name.size() > 1 && absl::StrContains(log, name)) return option;
  }
  return absl::StrJoin(options, " ");
}

// A logical source line: continuations spliced, comments replaced by a blank, trigraphs
// and the %: digraph read as what they stand for -- roughly what the preprocessor sees.
struct LogicalLine {
  int number;  // of its first physical line, from 1
  std::string text;
};

// True when an R" after `before` starts a raw string: R, u8R, uR, UR or LR as a token of
// its own (FOOR"( is the identifier FOOR and an ordinary string).
bool IsRawStringPrefix(absl::string_view before) {
  const auto is_identifier = [](char c) { return absl::ascii_isalnum(c) || c == '_'; };
  size_t start = before.size();
  while (start > 0 && is_identifier(before[start - 1])) --start;
  const absl::string_view prefix = before.substr(start);
  return prefix.empty() || prefix == "u8" || prefix == "u" || prefix == "U" || prefix == "L";
}

// True when `before` ends in a preprocessing number (1, 0x1F, 1'000, .5e3): a ' after it
// is a digit separator.
bool EndsInNumber(absl::string_view before) {
  size_t start = before.size();
  while (start > 0 && (absl::ascii_isalnum(before[start - 1]) || before[start - 1] == '_' ||
                       before[start - 1] == '.' || before[start - 1] == '\'')) {
    --start;
  }
  absl::string_view token = before.substr(start);
  while (!token.empty() && token.front() == '.') token.remove_prefix(1);
  return !token.empty() && absl::ascii_isdigit(token.front());
}

std::vector<LogicalLine> LogicalLines(absl::string_view raw) {
  // Translation phase 1, for the two trigraphs that matter here.
  std::string text(raw);
  for (size_t at = 0; (at = text.find("??", at)) != std::string::npos;) {
    if (at + 2 < text.size() && (text[at + 2] == '=' || text[at + 2] == '/')) {
      text.replace(at, 3, text[at + 2] == '=' ? "#" : "\\");
    } else {
      ++at;
    }
  }
  std::vector<LogicalLine> lines;
  LogicalLine current{1, ""};
  int physical = 1;
  enum { kCode, kLineComment, kBlockComment, kString, kChar, kRaw } state = kCode;
  std::string raw_end;  // ')delimiter"' of the raw string being read
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    // Phase 2: backslash-newline (also before CR LF) disappears everywhere but in raw strings.
    if (c == '\\' && state != kRaw) {
      size_t next = i + 1;
      if (next < text.size() && text[next] == '\r') ++next;
      if (next < text.size() && text[next] == '\n') {
        ++physical;
        i = next;
        continue;
      }
    }
    if (c == '\n') {
      ++physical;
      if (state == kBlockComment || state == kRaw) {
        if (state == kRaw) current.text.push_back(c);
        continue;
      }
      state = kCode;  // a newline ends a // comment and an unterminated literal
      lines.push_back(std::move(current));
      current = LogicalLine{physical, ""};
      continue;
    }
    const char next = i + 1 < text.size() ? text[i + 1] : '\0';
    switch (state) {
      case kCode:
        if (c == '/' && next == '/') {
          state = kLineComment;
          current.text.push_back(' ');
          ++i;
        } else if (c == '/' && next == '*') {
          state = kBlockComment;
          current.text.push_back(' ');
          ++i;
        } else if (c == 'R' && next == '"' && IsRawStringPrefix(current.text)) {
          const size_t open = text.find('(', i + 2);
          const size_t newline = text.find('\n', i + 2);
          if (open != std::string::npos && open - i - 2 <= 16 && open < newline) {
            raw_end = absl::StrCat(")", text.substr(i + 2, open - i - 2), "\"");
            current.text.append(text, i, open - i + 1);
            i = open;
            state = kRaw;
          } else {
            current.text.push_back(c);
          }
        } else {
          if (c == '"') state = kString;
          // In 1'000 the quote is a digit separator (C++14), not a character literal.
          if (c == '\'' && !EndsInNumber(current.text)) state = kChar;
          current.text.push_back(c);
        }
        break;
      case kLineComment:
        break;
      case kBlockComment:
        if (c == '*' && next == '/') {
          state = kCode;
          ++i;
        }
        break;
      case kString:
      case kChar:
        current.text.push_back(c);
        if (c == '\\' && next != '\0' && next != '\n') {
          current.text.push_back(next);
          ++i;
        } else if (c == (state == kString ? '"' : '\'')) {
          state = kCode;
        }
        break;
      case kRaw:
        current.text.push_back(c);
        if (c == ')' && text.compare(i, raw_end.size(), raw_end) == 0) {
          current.text.append(raw_end, 1, std::string::npos);
          i += raw_end.size() - 1;
          state = kCode;
        }
        break;
    }
  }
  lines.push_back(std::move(current));
  return lines;
}

// NVRTC resolves an absolute or "../" include name against the server's file system, and
// no option turns that off: refuse such directives (and computed ones, whose name cannot be
// checked) in everything the client sends. Toolkit headers are not scanned. This is an
// early, readable refusal, not the protection: the compile sandbox is (compile_helper.h).
absl::Status CheckIncludes(absl::string_view what, absl::string_view text) {
  for (const LogicalLine& logical : LogicalLines(text)) {
    const absl::string_view line = logical.text;
    const auto refuse = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " line ", logical.number, ": '", absl::StripAsciiWhitespace(line), "' ", why,
          "; include headers sent with the request or toolkit headers by relative name"));
    };
    // The header name an operand names, or a refusal.
    const auto check = [&](absl::string_view operand) -> absl::Status {
      if (operand.empty() || (operand.front() != '"' && operand.front() != '<')) {
        return refuse("is a computed #include, which the server does not allow");
      }
      const char close = operand.front() == '"' ? '"' : '>';
      const size_t end = operand.find(close, 1);
      const absl::string_view name =
          operand.substr(1, end == absl::string_view::npos ? absl::string_view::npos : end - 1);
      if (absl::StartsWith(name, "/") || absl::StrContains(name, "..")) {
        return refuse("names a file outside the request and the toolkit");
      }
      return absl::OkStatus();
    };
    // Every __has_include(...) and __has_embed(...) of the line, wherever it stands.
    for (absl::string_view keyword : {"__has_include", "__has_embed"}) {
      for (size_t has = line.find(keyword); has != absl::string_view::npos;
           has = line.find(keyword, has + 1)) {
        absl::string_view operand = line.substr(has);
        while (!operand.empty() &&
               (absl::ascii_isalnum(operand.front()) || operand.front() == '_')) {
          operand.remove_prefix(1);
        }
        operand = absl::StripLeadingAsciiWhitespace(operand);
        if (!absl::ConsumePrefix(&operand, "(")) continue;  // defined(__has_include) ...
        GPURPC_RETURN_IF_ERROR(check(absl::StripLeadingAsciiWhitespace(operand)));
      }
    }
    absl::string_view rest = absl::StripLeadingAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&rest, "#") && !absl::ConsumePrefix(&rest, "%:")) continue;
    rest = absl::StripLeadingAsciiWhitespace(rest);
    if (!absl::ConsumePrefix(&rest, "include_next") && !absl::ConsumePrefix(&rest, "include") &&
        !absl::ConsumePrefix(&rest, "import") && !absl::ConsumePrefix(&rest, "embed")) {
      continue;
    }
    GPURPC_RETURN_IF_ERROR(check(absl::StripLeadingAsciiWhitespace(rest)));
  }
  return absl::OkStatus();
}

absl::Status NvrtcError(const NvrtcLibrary& nvrtc, absl::string_view call, nvrtcResult result) {
  const std::string message = absl::StrCat(call, " failed: ", nvrtc.ErrorName(result));
  switch (result) {
    case NVRTC_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(message);
    case NVRTC_ERROR_INVALID_INPUT:
    case NVRTC_ERROR_INVALID_OPTION:
    case NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

// The checked request, with what the server derives from it.
struct PreparedRequest {
  std::string program_name;
  std::vector<std::string> effective_options;
  std::string arch;
};

}  // namespace

std::string ForbiddenOptionReason(absl::string_view option) { return ForbiddenReason(option); }

absl::Status CheckIncludeDirectives(absl::string_view what, absl::string_view text) {
  return CheckIncludes(what, text);
}

absl::Status CheckRequestName(absl::string_view what, absl::string_view name) {
  return CheckRelativeName(what, name);
}

absl::StatusOr<std::unique_ptr<Compiler>> Compiler::Create(CompilerOptions options) {
  GPURPC_ASSIGN_OR_RETURN(std::unique_ptr<const NvrtcLibrary> nvrtc,
                          NvrtcLibrary::Load(options.cuda_include_dir));
  spdlog::info("compiler: NVRTC {}.{} from {}; cache {}", nvrtc->major, nvrtc->minor, nvrtc->path,
               options.cache_dir.empty() ? "in memory only" : options.cache_dir);
  return std::unique_ptr<Compiler>(new Compiler(std::move(options), std::move(nvrtc)));
}

Compiler::Compiler(CompilerOptions options, std::unique_ptr<const NvrtcLibrary> nvrtc)
    : options_(std::move(options)),
      nvrtc_(std::move(nvrtc)),
      cache_(std::make_unique<CompileCache>(
          CompileCacheOptions{options_.cache_dir, options_.cache_max_bytes,
                              options_.memory_cache_max_bytes, options_.mac_key})) {
  helper_settings_.sandbox = options_.sandbox;
  helper_settings_.nvrtc_path = nvrtc_->path;
  const std::string& include_dir = options_.cuda_include_dir;
  struct stat st;
  if (!include_dir.empty() && stat(include_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    server_options_.emplace_back("--include-path=" + include_dir);
    helper_settings_.read_dirs.push_back(include_dir);
    // CUDA 13 moved libcu++ (<cuda/std/...>, used by curand_kernel.h) under cccl/.
    const std::string cccl = include_dir + "/cccl";
    if (stat(cccl.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      server_options_.emplace_back("--include-path=" + cccl);
      helper_settings_.read_dirs.push_back(cccl);
      // libcu++ can be upgraded apart from NVRTC, and the standard header shims include it
      // in most compiles: its version is part of the cache key.
      std::ifstream version(cccl + "/cuda/std/__cccl/version.h", std::ios::binary);
      toolkit_identity_.assign(std::istreambuf_iterator<char>(version),
                               std::istreambuf_iterator<char>());
    }
  } else if (!include_dir.empty()) {
    spdlog::warn(
        "compiler: CUDA include folder {} not found; toolkit headers will not be "
        "available to kernels",
        include_dir);
  }
  // Without it NVRTC also searches the folder of the program name, i.e. the worker's
  // working directory, for `#include "..."`.
  server_options_.emplace_back("--no-source-include");
}

Compiler::~Compiler() = default;

int Compiler::nvrtc_version() const { return nvrtc_->major * 1000 + nvrtc_->minor * 10; }

std::string Compiler::ProbeSandbox() const { return ProbeCompileSandbox(helper_settings_); }

absl::StatusOr<CompileResult> Compiler::Compile(const CompileRequest& request) {
  // Checks run before the cache lookup so that a request is refused the same way whether
  // or not an identical one was compiled before.
  GPURPC_RETURN_IF_ERROR(
      CheckSize("source", request.source.size(), options_.max_source_bytes, "max_source_bytes"));
  GPURPC_RETURN_IF_ERROR(CheckNoNul("source", request.source));
  GPURPC_RETURN_IF_ERROR(CheckIncludes("source", request.source));
  PreparedRequest prepared;
  prepared.program_name = request.program_name.empty() ? kDefaultProgramName : request.program_name;
  GPURPC_RETURN_IF_ERROR(CheckRelativeName("program name", prepared.program_name));

  uint64_t total_header_bytes = 0;
  std::set<absl::string_view> seen_header_names;
  for (const Header& header : request.headers) {
    GPURPC_RETURN_IF_ERROR(CheckRelativeName("header name", header.name));
    if (!seen_header_names.insert(header.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("header '", header.name, "' is given more than once"));
    }
    const std::string what = absl::StrCat("header '", header.name, "'");
    GPURPC_RETURN_IF_ERROR(
        CheckSize(what, header.content.size(), options_.max_header_bytes, "max_header_bytes"));
    GPURPC_RETURN_IF_ERROR(CheckNoNul(what, header.content));
    GPURPC_RETURN_IF_ERROR(CheckIncludes(what, header.content));
    total_header_bytes += header.content.size();
  }
  GPURPC_RETURN_IF_ERROR(CheckSize("all headers together", total_header_bytes,
                                   options_.max_total_header_bytes, "max_total_header_bytes"));
  for (const std::string& expression : request.name_expressions) {
    if (expression.empty()) return absl::InvalidArgumentError("a name expression is empty");
    GPURPC_RETURN_IF_ERROR(
        CheckNoNul(absl::StrCat("name expression '", expression, "'"), expression));
  }

  bool has_arch = false;
  std::string user_arch;
  for (size_t i = 0; i < request.options.size(); ++i) {
    const std::string& option = request.options[i];
    if (option.empty()) return absl::InvalidArgumentError("an option is empty");
    GPURPC_RETURN_IF_ERROR(CheckNoNul(absl::StrCat("option '", option, "'"), option));
    if (const std::string reason = ForbiddenReason(option); !reason.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("option '", option, "' is not allowed: ", reason));
    }
    const absl::string_view name = OptionName(option);
    if (IsArchOption(name)) {
      has_arch = true;  // NVRTC honours the last one
      if (name.size() < option.size()) {
        user_arch = option.substr(name.size() + 1);
      } else if (i + 1 < request.options.size()) {
        user_arch = request.options[i + 1];
      } else {
        user_arch.clear();  // NVRTC will reject the dangling -arch
      }
    }
  }
  if (has_arch) {
    prepared.arch = user_arch;
  } else {
    if (!IsArchName(request.target)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target '", request.target,
          "' is not an architecture such as sm_90 or compute_75, and no -arch option is given"));
    }
    prepared.arch = request.target;
    prepared.effective_options.push_back("--gpu-architecture=" + request.target);
  }
  prepared.effective_options.insert(prepared.effective_options.end(), request.options.begin(),
                                    request.options.end());
  prepared.effective_options.insert(prepared.effective_options.end(), server_options_.begin(),
                                    server_options_.end());

  Sha256 hasher;
  HashField(&hasher, kKeyFormat);
  HashField(&hasher, nvrtc_->build_identity);
  HashField(&hasher, request.tenant);
  HashField(&hasher, prepared.arch);
  HashField(&hasher, prepared.program_name);
  HashField(&hasher, request.source);
  HashCount(&hasher, prepared.effective_options.size());
  for (const std::string& option : prepared.effective_options) HashField(&hasher, option);
  HashCount(&hasher, request.headers.size());
  for (const Header& header : request.headers) {
    HashField(&hasher, header.name);
    HashField(&hasher, header.content);
  }
  // The standard header shims offered alongside (std_headers.h), and libcu++'s version.
  HashField(&hasher, StdHeaderShimsDigest());
  HashField(&hasher, toolkit_identity_);
  HashCount(&hasher, request.name_expressions.size());
  for (const std::string& expression : request.name_expressions) {
    HashField(&hasher, expression);
  }
  const Sha256Digest key = hasher.Finish();

  CompileResult result;
  result.cache_key = DigestToHex(key);
  if (std::shared_ptr<const CacheEntry> entry = cache_->Lookup(key)) {
    result.success = true;
    result.cache_hit = true;
    result.log = entry->log;
    result.image = entry->image;
    result.lowered_names = entry->lowered_names;
    result.effective_options = entry->effective_options;
    result.arch = entry->arch;
    return result;
  }

  // NVRTC runs in a confined helper process of its own (compile_helper.h).
  const NvrtcLibrary& nvrtc = *nvrtc_;
  const bool cubin = absl::StartsWith(prepared.arch, "sm_");
  NvrtcInvocation invocation;
  invocation.source = request.source;
  invocation.program_name = prepared.program_name;
  invocation.options = prepared.effective_options;
  for (const Header& header : request.headers) {
    invocation.headers.emplace_back(header.name, header.content);
  }
  // The standard header shims, unless the request brings a header of the same name.
  for (const Header& shim : StdHeaderShims()) {
    if (seen_header_names.count(shim.name) == 0) {
      invocation.headers.emplace_back(shim.name, shim.content);
    }
  }
  invocation.name_expressions = request.name_expressions;
  invocation.cubin = cubin;
  GPURPC_ASSIGN_OR_RETURN(NvrtcOutcome outcome, RunNvrtcInHelper(helper_settings_, invocation));
  const nvrtcResult compiled = static_cast<nvrtcResult>(outcome.compile_result);
  std::string log = std::move(outcome.log);

  if (compiled == NVRTC_ERROR_INVALID_OPTION) {
    return absl::InvalidArgumentError(absl::StrCat("NVRTC rejected option '",
                                                   RejectedOption(prepared.effective_options, log),
                                                   "' (NVRTC_ERROR_INVALID_OPTION): ", log));
  }
  if (compiled == NVRTC_ERROR_COMPILATION) {
    result.success = false;
    result.log = std::move(log);
    result.effective_options = std::move(prepared.effective_options);
    result.arch = std::move(prepared.arch);
    return result;
  }
  if (compiled != NVRTC_SUCCESS) {
    const absl::Status error = NvrtcError(nvrtc, "nvrtcCompileProgram", compiled);
    return absl::Status(error.code(), absl::StrCat(error.message(), log.empty() ? "" : ": ", log));
  }

  // NVRTC reports an empty cubin (and a PTX of just the NUL) when the options ask for
  // something else, e.g. LTO-IR with -dlto: nothing a device could load.
  if (outcome.image.size() <= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the options produce no loadable ", cubin ? "cubin" : "PTX", " for ", prepared.arch,
        " (options: ", absl::StrJoin(prepared.effective_options, " "), ")"));
  }
  auto entry = std::make_shared<CacheEntry>();
  entry->image = std::move(outcome.image);
  entry->lowered_names = std::move(outcome.lowered_names);
  entry->log = std::move(log);
  entry->effective_options = std::move(prepared.effective_options);
  entry->arch = std::move(prepared.arch);

  result.success = true;
  result.log = entry->log;
  result.image = entry->image;
  result.lowered_names = entry->lowered_names;
  result.effective_options = entry->effective_options;
  result.arch = entry->arch;
  cache_->Insert(key, std::move(entry));
  return result;
}

}  // namespace gpurpc::compiler
