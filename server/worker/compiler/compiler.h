// NVRTC compiles for the worker, with a compile cache shared by the worker processes of a
// host. NVRTC is loaded with dlopen at run time; this header does not expose CUDA types.
//
// A compile is identified by a SHA-256 over the NVRTC build, the architecture, the
// program name, the source, the options NVRTC gets, the headers and the name expressions
// (every field length-prefixed). Successful compiles are cached in memory (LRU) and, when
// `CompilerOptions::cache_dir` is set, on disk (see compile_cache.h for the file format and
// the guarantees under concurrent processes). Toolkit headers found through
// `cuda_include_dir` are not hashed: they change only with the toolkit, and so with the
// NVRTC build, which is (its include path is hashed too, as one of the options).
//
// Every compile also gets the standard header shims of std_headers.h (stdio.h, stdint.h,
// math.h, limits, type_traits ...) as in-memory headers, unless the request brings a header of
// the same name; their digest, and libcu++'s version header, are part of the key.
//
// Security: NVRTC never runs in the worker. Each compile that misses the cache runs in a
// compile helper process of its own (compile_helper.h) that confines itself before it reads
// the request (sandbox.h): with Landlock, or else user + mount namespaces, plus a seccomp
// filter, NVRTC can read the toolkit's include folders and nothing else of the server -- no
// file of the daemon's user, no /proc, /dev or /etc, no cache, whatever the source's
// preprocessor does (line continuations, comments or digraphs in directives, computed
// includes, __has_include, #pragma, #line) and whatever header names or options it gets. The
// helper is bounded in wall time, CPU time and address space. Which protection is in force
// is reported by ProbeSandbox() (and ListDevices); without any sandbox, compiles are refused
// with FAILED_PRECONDITION unless the operator passed --allow-unsandboxed-compile.
//
// On top of that, as early and friendlier errors: the server adds `--no-source-include` and
// the toolkit include folder itself, refuses options that would make NVRTC read or write
// files of the server (include paths, pre-includes, precompiled headers, options files,
// timing reports, and any option value that is an absolute path or contains "..", also
// inside -Xptxas=...), and refuses sources and headers that #include (or __has_include) an
// absolute or "../" name, or use a computed #include. That scan is not the guarantee.
#ifndef GPURPC_SERVER_WORKER_COMPILER_COMPILER_H_
#define GPURPC_SERVER_WORKER_COMPILER_COMPILER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/worker/compiler/compile_helper.h"
#include "server/worker/compiler/sandbox.h"

namespace gpurpc::compiler {

// A header given with the request, found by `#include "name"` and `#include <name>`.
struct Header {
  std::string name;  // non-empty, <= 256 chars, relative, no "..", no NUL, no backslash
  std::string content;
};

struct CompileRequest {
  std::string source;
  std::string program_name;  // "" -> "kernel.cu"; appears in the log's diagnostics
  std::vector<std::string> options;
  std::vector<Header> headers;
  // Expressions such as "my_kernel<float>" whose mangled names are wanted.
  std::vector<std::string> name_expressions;
  // The device's architecture: "sm_90" -> cubin, "compute_75" -> PTX. Ignored when the
  // options carry their own -arch / --gpu-architecture.
  std::string target;
  // The tenant asking. Part of the cache key: a tenant never gets a hit (nor its timing)
  // from another tenant's compile.
  std::string tenant;
};

struct CompileResult {
  bool success = false;
  std::string log;  // NVRTC's log; also on success (warnings)
  // cubin for an sm_XX architecture, PTX (NUL-terminated text) for compute_XX.
  std::vector<uint8_t> image;
  std::vector<std::pair<std::string, std::string>> lowered_names;  // (expression, lowered)
  bool cache_hit = false;
  std::vector<std::string> effective_options;  // exactly what NVRTC was given
  std::string arch;                            // the architecture compiled for
  std::string cache_key;                       // SHA-256 as lower-case hex
};

struct CompilerOptions {
  std::string cache_dir;  // "" disables the disk cache; created (mkdir -p) when missing
  uint64_t cache_max_bytes = 1ull << 30;  // disk bound
  uint64_t memory_cache_max_bytes = 64ull << 20;
  // MAC key of the disk cache's files (32 raw bytes, LoadOrCreateCacheKey in
  // compile_cache.h). A secret, never logged. Empty or short: the disk cache is off.
  std::string mac_key;
  // Toolkit headers (curand_kernel.h, cuda_fp16.h ...); its "cccl" subfolder is added too
  // when present, because CUDA 13's headers include <cuda/std/...> from there.
  std::string cuda_include_dir = "/usr/local/cuda/include";
  uint64_t max_source_bytes = 4ull << 20;
  uint64_t max_header_bytes = 4ull << 20;
  uint64_t max_total_header_bytes = 16ull << 20;
  // How compiles are confined and bounded (sandbox.h).
  SandboxOptions sandbox;
};

// The early checks Compile applies to a request before anything else (see the file
// comment), exposed for tests and fuzzing (tests/fuzz). Pure functions, thread-safe.
//
// Why `option` may not reach NVRTC, or "" when it may: include paths, pre-includes,
// precompiled headers, options files, timing reports, a value that is an absolute path or
// contains "..", the same for every ','-separated part of -Xptxas / --ptxas-options, and
// every other -X... pass-through (-Xcudafe reaches the front end's file options). Leading
// blanks, which NVRTC skips, are skipped here too.
std::string ForbiddenOptionReason(absl::string_view option);
// INVALID_ARGUMENT naming `what` and the line when `text` (a source or a header) has an
// #include, #include_next, #import, #embed, __has_include or __has_embed of an absolute or
// "../" name, or a computed #include; OK otherwise.
absl::Status CheckIncludeDirectives(absl::string_view what, absl::string_view text);
// INVALID_ARGUMENT unless `name` (a header or program name) is non-empty, at most 256
// characters, not absolute, and has no "..", NUL or backslash.
absl::Status CheckRequestName(absl::string_view what, absl::string_view name);

struct NvrtcLibrary;
class CompileCache;

class Compiler {
 public:
  // UNAVAILABLE when NVRTC cannot be loaded (the message names every path tried).
  static absl::StatusOr<std::unique_ptr<Compiler>> Create(CompilerOptions options);

  ~Compiler();
  Compiler(const Compiler&) = delete;
  Compiler& operator=(const Compiler&) = delete;

  // Compiles `request`, or returns the cached result of an identical earlier compile
  // (cache_hit = true; a hit costs a hash and a lookup, well under a millisecond).
  //
  // A compile error is not a failed call: OK with success = false and the log.
  // INVALID_ARGUMENT, with a message naming the culprit, for: a forbidden option (see the
  // file comment), an option NVRTC rejects (NVRTC_ERROR_INVALID_OPTION; the log is
  // included), a bad header name or duplicate header, a source/header/total header size
  // over its limit, NUL bytes in text fields, a missing or malformed target, and options
  // that yield no loadable image (e.g. -dlto). RESOURCE_EXHAUSTED when NVRTC runs out of
  // memory; INTERNAL for other NVRTC failures. Only those two may succeed on a retry.
  // From the compile helper: FAILED_PRECONDITION when no sandbox can be applied as
  // configured; DEADLINE_EXCEEDED over --compile-timeout; RESOURCE_EXHAUSTED over
  // --compile-cpu-seconds or --compile-memory-bytes (each message names its limit).
  //
  // Thread-safe: any number of compiles may run at once.
  absl::StatusOr<CompileResult> Compile(const CompileRequest& request);

  // The toolkit include folder compiles use (CompilerOptions::cuda_include_dir); standard
  // libraries are looked up beside it (cuda_libraries.h).
  const std::string& cuda_include_dir() const { return options_.cuda_include_dir; }

  // NVRTC's version as major * 1000 + minor * 10 (13.0 -> 13000).
  int nvrtc_version() const;

  // Starts a helper that confines itself and compiles a trivial kernel, and describes the
  // protection compiles run under (see ProbeCompileSandbox). Takes a spawn and a compile.
  std::string ProbeSandbox() const;

  // What this compiler starts helpers with; RunNvrtcInHelper(helper_settings(), ...) is the
  // sandboxed NVRTC without any of Compile's checks (for tests of the sandbox itself).
  const HelperSettings& helper_settings() const { return helper_settings_; }

 private:
  Compiler(CompilerOptions options, std::unique_ptr<const NvrtcLibrary> nvrtc);

  const CompilerOptions options_;
  const std::unique_ptr<const NvrtcLibrary> nvrtc_;
  // Options the server appends to every compile (toolkit include paths,
  // --no-source-include).
  std::vector<std::string> server_options_;
  // The toolkit's libcu++ version header (cccl/cuda/std/__cccl/version.h), "" without one:
  // hashed into every key.
  std::string toolkit_identity_;
  HelperSettings helper_settings_;
  const std::unique_ptr<CompileCache> cache_;
};

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_COMPILER_H_
