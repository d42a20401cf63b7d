// Fuzzes what the front end parses from callers and operators before anything else:
//   0  the "gpurpc-session" metadata (SessionManager::FindFromMetadata, on a manager that
//      was never started, so every well-formed id is NOT_FOUND naming the id it parsed);
//   1  the authorization metadata (Authenticator::EarlyCheckStatus, the bearer-token check
//      TLS listeners run on every call, against a tokens file with two known tokens);
//   2  a tokens file (TokenTable::Load);
//   3  a DaemonConfig text-format file (ParseDaemonOptions --config=FILE);
//   4  command-line flags, NUL-separated (ParseDaemonOptions).
// The first input byte picks the mode. Invariants (beyond no crash, leak or undefined
// behaviour, and determinism):
//   - a session id is accepted only when the whole value is a decimal number (absl's
//     SimpleAtoi: blanks around it and a leading '+' allowed), and the id looked up is that
//     number (a valid value of more than 64 bytes may be refused);
//   - a call passes the bearer check exactly when its first authorization value is
//     "Bearer " and a known token (or, with --insecure, when it has none), every refusal is
//     UNAUTHENTICATED, and no message quotes the token;
//   - a tokens file loads exactly when every line that is not blank or a comment is
//     tenant:salt_hex:sha256_hex, and the table has one entry per such line;
//   - parsed options hold the documented value constraints, and a worker started with
//     WorkerArgs(options) parses them back to the same values.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "grpcpp/support/string_ref.h"
#include "server/frontend/auth.h"
#include "server/frontend/session_manager.h"
#include "server/options.h"
#include "tests/fuzz/fuzz_check.h"

namespace gpurpc::fuzz {
namespace {

using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// A private folder for the files the parsers read, removed at exit.
class Scratch {
 public:
  static Scratch& Get() {
    static Scratch* const scratch = new Scratch();
    return *scratch;
  }

  // Writes `contents` to `name` in the folder, mode 0600; returns its path.
  std::string Write(const std::string& name, absl::string_view contents) {
    const std::string path = dir_ + "/" + name;
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FUZZ_CHECK(fd >= 0, "cannot create ", path);
    FUZZ_CHECK(fchmod(fd, 0600) == 0, "cannot chmod ", path);
    size_t done = 0;
    while (done < contents.size()) {
      const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
      FUZZ_CHECK(n > 0, "cannot write ", path);
      done += static_cast<size_t>(n);
    }
    close(fd);
    return path;
  }

 private:
  Scratch() {
    const char* tmp = getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp == '/' ? tmp : "/tmp") + "/gpurpc-fuzz-metadata-XXXXXX";
    FUZZ_CHECK(mkdtemp(pattern.data()) != nullptr, "mkdtemp ", pattern);
    dir_ = pattern;
    atexit([] {
      const std::string& dir = Get().dir_;
      for (const char* name : {"tokens", "fuzz-tokens", "config"}) {
        unlink((dir + "/" + name).c_str());
      }
      rmdir(dir.c_str());
    });
  }

  std::string dir_;
};

// ---------------------------------------------------------------- mode 0: session ids

// The whole value as SimpleAtoi reads a uint64: blanks around it, an optional '+', digits.
bool WholeValueId(absl::string_view value, uint64_t* id) {
  value = absl::StripAsciiWhitespace(value);
  absl::ConsumePrefix(&value, "+");
  if (value.empty()) return false;
  uint64_t n = 0;
  for (char c : value) {
    if (c < '0' || c > '9') return false;
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (n > (UINT64_MAX - digit) / 10) return false;
    n = n * 10 + digit;
  }
  *id = n;
  return true;
}

void FuzzSessionId(FuzzedDataProvider& input) {
  static frontend::SessionManager* const manager =
      new frontend::SessionManager(DaemonOptions(), "/nonexistent/gpurpcd");
  std::vector<std::string> storage;
  storage.reserve(8);
  Metadata metadata;
  const int entries = input.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < entries; ++i) {
    if (input.ConsumeBool()) {
      storage.push_back(kSessionMetadataKey);
    } else {
      storage.push_back(input.ConsumeBool() ? std::string(kInstanceMetadataKey)
                                            : input.ConsumeRandomLengthString(20));
    }
    storage.push_back(input.ConsumeRandomLengthString(100));
    metadata.emplace(grpc::string_ref(storage[storage.size() - 2]),
                     grpc::string_ref(storage.back()));
  }
  const std::string tenant = input.ConsumeRandomLengthString(16);
  const auto found = manager->FindFromMetadata(metadata, tenant);
  const auto again = manager->FindFromMetadata(metadata, tenant);
  FUZZ_CHECK(found.status() == again.status(), "FindFromMetadata is not deterministic");
  FUZZ_CHECK(!found.ok(), "a manager without sessions found one");

  const auto it = metadata.find(kSessionMetadataKey);
  const absl::Status& status = found.status();
  if (it == metadata.end()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument, "no session metadata, yet ",
               status);
    return;
  }
  if (metadata.count(kSessionMetadataKey) > 1) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument,
               "more than one session id, yet ", status);
    return;
  }
  const absl::string_view value(it->second.data(), it->second.size());
  uint64_t expected = 0;
  const bool valid = WholeValueId(value, &expected) && expected != 0;
  if (!valid) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument, "session id ", Quote(value),
               " is not a decimal 64-bit number, yet it was looked up: ", status);
    return;
  }
  // A valid id is looked up (NOT_FOUND, "no session N ...") as exactly that number; only a
  // value over 64 bytes (blanks or leading zeros) may be refused instead.
  if (status.code() == absl::StatusCode::kInvalidArgument && value.size() > 64) return;
  FUZZ_CHECK(status.code() == absl::StatusCode::kNotFound, "session id ", Quote(value), " (",
             expected, ") was refused: ", status);
  absl::string_view message = status.message();
  FUZZ_CHECK(absl::ConsumePrefix(&message, "no session "), status);
  const absl::string_view digits = message.substr(0, message.find_first_not_of("0123456789"));
  uint64_t looked_up = 0;
  FUZZ_CHECK(absl::SimpleAtoi(digits, &looked_up), status);
  FUZZ_CHECK(looked_up == expected, "session id ", Quote(value), " is ", expected, ", but session ",
             looked_up, " was looked up");
}

// -------------------------------------------------------------------- mode 1: tokens

constexpr const char* kTokens[] = {"gpurpc_fuzz_token_alice", "gpurpc_fuzz_token_bob"};

std::string Sha256Hex(absl::string_view a, absl::string_view b) {
  std::string input = std::string(a) + std::string(b);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(input.data()), input.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

// Two authenticators over the same tokens file: one plain, one --insecure.
struct Authenticators {
  std::unique_ptr<frontend::Authenticator> strict;
  std::unique_ptr<frontend::Authenticator> insecure;
};

Authenticators& GetAuthenticators() {
  static Authenticators* const authenticators = [] {
    const std::string salt_alice = "00112233445566778899aabbccddeeff";
    const std::string salt_bob = "0f1e2d3c";
    const std::string file = absl::StrCat(
        "# tokens of the fuzzer\n", "alice:", salt_alice, ":",
        Sha256Hex(absl::HexStringToBytes(salt_alice), kTokens[0]), "\n\n  bob:", salt_bob, ":",
        Sha256Hex(absl::HexStringToBytes(salt_bob), kTokens[1]), "  \n");
    DaemonOptions options;
    options.tokens_file = Scratch::Get().Write("tokens", file);
    auto* out = new Authenticators();
    out->strict = std::make_unique<frontend::Authenticator>(options);
    options.insecure = true;
    out->insecure = std::make_unique<frontend::Authenticator>(options);
    FUZZ_CHECK(out->strict->Start().ok(), "the fuzzer's tokens file does not load");
    FUZZ_CHECK(out->insecure->Start().ok(), "the fuzzer's tokens file does not load");
    return out;
  }();
  return *authenticators;
}

void FuzzBearer(FuzzedDataProvider& input) {
  Authenticators& auth = GetAuthenticators();
  std::vector<std::string> storage;
  storage.reserve(8);
  Metadata metadata;
  const int entries = input.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < entries; ++i) {
    static constexpr const char* kKeys[] = {"authorization", "authorization", "Authorization",
                                            "gpurpc-session"};
    storage.push_back(kKeys[input.ConsumeIntegralInRange(0, 3)]);
    static constexpr const char* kSchemes[] = {"Bearer ",  "Bearer ", "bearer ", "Bearer",
                                               "Bearer  ", "",        "Basic "};
    std::string value = kSchemes[input.ConsumeIntegralInRange(0, 6)];
    switch (input.ConsumeIntegralInRange(0, 4)) {
      case 0:
        value += kTokens[input.ConsumeIntegralInRange(0, 1)];
        break;
      case 1:
        value += kTokens[input.ConsumeIntegralInRange(0, 1)] + input.ConsumeRandomLengthString(8);
        break;
      case 2:
        value += input.ConsumeRandomLengthString(8) + kTokens[input.ConsumeIntegralInRange(0, 1)];
        break;
      case 3:
        value += std::string(input.ConsumeIntegralInRange(4090, 4100), 'x');
        break;
      default:
        value += input.ConsumeRandomLengthString(64);
        break;
    }
    storage.push_back(std::move(value));
    metadata.emplace(grpc::string_ref(storage[storage.size() - 2]),
                     grpc::string_ref(storage.back()));
  }
  const absl::Status strict = auth.strict->EarlyCheckStatus(nullptr, metadata);
  const absl::Status insecure = auth.insecure->EarlyCheckStatus(nullptr, metadata);
  // Again: the second check of a valid token is answered from the verified-token cache.
  FUZZ_CHECK(strict == auth.strict->EarlyCheckStatus(nullptr, metadata),
             "the token check is not deterministic");

  const auto it = metadata.find("authorization");
  bool expected = false;
  if (it == metadata.end()) {
    FUZZ_CHECK(insecure.ok(), "--insecure refused a call without credentials: ", insecure);
  } else {
    const absl::string_view value(it->second.data(), it->second.size());
    absl::string_view token = value;
    // More than one authorization header is refused, whatever they hold.
    if (metadata.count("authorization") == 1 && absl::ConsumePrefix(&token, "Bearer ")) {
      for (const char* known : kTokens) expected = expected || token == known;
    }
    FUZZ_CHECK(insecure.ok() == expected, "--insecure: authorization ", Quote(value), " gave ",
               insecure);
  }
  FUZZ_CHECK(strict.ok() == expected, "authorization ",
             it == metadata.end() ? std::string("(none)")
                                  : Quote(absl::string_view(it->second.data(), it->second.size())),
             " gave ", strict);
  for (const absl::Status& status : {strict, insecure}) {
    if (status.ok()) continue;
    FUZZ_CHECK(status.code() == absl::StatusCode::kUnauthenticated, status);
    // Tokens are never quoted: not the known ones, nor a long guess.
    FUZZ_CHECK(
        !absl::StrContains(status.message(), "gpurpc_fuzz_token") && status.message().size() < 512,
        "a refusal quotes the token: ", status);
  }
}

// --------------------------------------------------------------- mode 2: tokens files

bool IsHexDigits(absl::string_view text) {
  if (text.empty() || text.size() % 2 != 0) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

bool IsTenant(absl::string_view name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) &&
        absl::string_view("._@+-=,").find(c) == absl::string_view::npos) {
      return false;
    }
  }
  return true;
}

void FuzzTokensFile(absl::string_view contents) {
  const std::string path = Scratch::Get().Write("fuzz-tokens", contents);
  const auto table = frontend::TokenTable::Load(path);
  const auto again = frontend::TokenTable::Load(path);
  FUZZ_CHECK(table.status() == again.status(), "TokenTable::Load is not deterministic");
  // What the file format (auth.h) allows, line by line.
  size_t entries = 0;
  bool well_formed = true;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ':');
    if (fields.size() != 3 || !IsTenant(fields[0]) || !IsHexDigits(fields[1]) ||
        !IsHexDigits(fields[2]) || fields[2].size() != 64) {
      well_formed = false;
      break;
    }
    ++entries;
  }
  FUZZ_CHECK(table.ok() == well_formed, "a tokens file that is ",
             well_formed ? "well formed" : "malformed", " gave ", table.status(), ": ",
             Quote(contents));
  if (table.ok()) {
    FUZZ_CHECK((*table)->size() == entries, "the table has ", (*table)->size(), " entries for ",
               entries, " lines");
    FUZZ_CHECK((*table)->Find("").empty(), "the empty token matches a tenant");
  } else {
    FUZZ_CHECK(table.status().code() == absl::StatusCode::kInvalidArgument, table.status());
    FUZZ_CHECK(absl::StrContains(table.status().message(), " line "),
               "the refusal names no line: ", table.status());
  }
}

// ------------------------------------------------------- modes 3 and 4: daemon options

absl::StatusOr<DaemonOptions> Parse(const std::vector<std::string>& args) {
  std::vector<std::string> copy = args;  // argv may be written to by a parser
  std::vector<char*> argv;
  for (std::string& arg : copy) argv.push_back(arg.data());
  argv.push_back(nullptr);
  return ParseDaemonOptions(static_cast<int>(copy.size()), argv.data());
}

// The documented value constraints (server/options.h, gpurpcd --help).
void CheckOptions(const DaemonOptions& options) {
  FUZZ_CHECK(options.backend == "auto" || options.backend == "cuda" || options.backend == "fake",
             "backend ", Quote(options.backend));
  FUZZ_CHECK(options.compile_sandbox == "auto" || options.compile_sandbox == "landlock" ||
                 options.compile_sandbox == "namespace" || options.compile_sandbox == "none",
             "compile sandbox ", Quote(options.compile_sandbox));
  static const char* const kLevels[] = {"trace", "debug", "info", "warn", "error"};
  bool level = false;
  for (const char* known : kLevels) level = level || options.log_level == known;
  FUZZ_CHECK(level, "log level ", Quote(options.log_level));
  FUZZ_CHECK(options.log_format == "text" || options.log_format == "json", "log format ",
             Quote(options.log_format));
  FUZZ_CHECK(options.unix_socket_mode <= 0777, "socket mode ", options.unix_socket_mode);
  FUZZ_CHECK(options.max_sessions >= 1, "max sessions ", options.max_sessions);
  FUZZ_CHECK(options.warm_workers >= 0, "warm workers ", options.warm_workers);
  FUZZ_CHECK(options.session_idle_timeout > absl::ZeroDuration(), "idle timeout");
  FUZZ_CHECK(options.session_grace >= absl::ZeroDuration(), "session grace");
  FUZZ_CHECK(options.compile_timeout > absl::ZeroDuration(), "compile timeout");
  FUZZ_CHECK(options.compile_cpu_seconds >= 1, "compile cpu seconds");
  FUZZ_CHECK(options.compile_memory_bytes >= (64ull << 20), "compile memory bytes");
  for (const std::string& admin : options.admin_tenants) {
    FUZZ_CHECK(IsTenant(admin), "admin tenant ", Quote(admin));
  }
  for (const auto& [tenant, quota] : options.tenant_quotas) {
    FUZZ_CHECK(IsTenant(tenant), "quota of tenant ", Quote(tenant));
  }
  if (!options.new_token_tenant.empty()) {
    FUZZ_CHECK(IsTenant(options.new_token_tenant), "new token tenant");
  }
  if (options.internal_worker || options.internal_compile_helper || options.help ||
      !options.new_token_tenant.empty()) {
    return;  // these modes serve nothing
  }
  FUZZ_CHECK(!options.listen.empty() || !options.unix_socket.empty(), "nothing to serve on");
  FUZZ_CHECK(options.tls_cert.empty() == options.tls_key.empty(), "a certificate without key");
  FUZZ_CHECK(options.tls_client_ca.empty() || !options.tls_cert.empty(), "mTLS without TLS");
  if (!options.listen.empty() && !options.insecure) {
    FUZZ_CHECK(!options.tokens_file.empty() || !options.tls_client_ca.empty(),
               "a TCP listener without authentication: ", Quote(options.listen));
    FUZZ_CHECK(!options.tls_cert.empty() || IsLoopbackAddress(options.listen),
               "a non-loopback TCP listener without TLS: ", Quote(options.listen));
  }
}

// A worker parses the flags WorkerArgs gives it back to what the front end has.
void CheckWorkerRoundTrip(const DaemonOptions& options) {
  std::vector<std::string> args = {"gpurpcd"};
  for (std::string& arg : WorkerArgs(options, 0, 3)) args.push_back(std::move(arg));
  const absl::StatusOr<DaemonOptions> worker = Parse(args);
  FUZZ_CHECK(worker.ok(), "a worker refuses its WorkerArgs: ", worker.status());
  FUZZ_CHECK(worker->internal_worker && worker->worker_fd == 3 && worker->device == 0,
             "worker identity");
  const auto same = [](const auto& a, const auto& b) { return a == b; };
  FUZZ_CHECK(same(worker->backend, options.backend), "backend");
  FUZZ_CHECK(same(worker->cache_dir, options.cache_dir), "cache dir ", Quote(options.cache_dir),
             " became ", Quote(worker->cache_dir));
  FUZZ_CHECK(same(worker->cache_key_file, options.cache_key_file), "cache key file");
  FUZZ_CHECK(same(worker->cache_max_bytes, options.cache_max_bytes), "cache max bytes");
  FUZZ_CHECK(same(worker->fake_memory_bytes, options.fake_memory_bytes), "fake memory bytes");
  FUZZ_CHECK(same(worker->cuda_include_dir, options.cuda_include_dir), "cuda include dir");
  FUZZ_CHECK(same(worker->compile_sandbox, options.compile_sandbox), "compile sandbox");
  FUZZ_CHECK(same(worker->allow_unsandboxed_compile, options.allow_unsandboxed_compile),
             "allow unsandboxed compile");
  FUZZ_CHECK(same(worker->compile_timeout, options.compile_timeout), "compile timeout ",
             absl::FormatDuration(options.compile_timeout), " became ",
             absl::FormatDuration(worker->compile_timeout));
  FUZZ_CHECK(same(worker->compile_cpu_seconds, options.compile_cpu_seconds), "cpu seconds");
  FUZZ_CHECK(same(worker->compile_memory_bytes, options.compile_memory_bytes), "memory bytes");
  FUZZ_CHECK(same(worker->log_level, options.log_level), "log level");
  FUZZ_CHECK(same(worker->log_format, options.log_format), "log format");
}

void CheckParsed(const std::vector<std::string>& args) {
  const absl::StatusOr<DaemonOptions> options = Parse(args);
  const absl::StatusOr<DaemonOptions> again = Parse(args);
  // The outcome and the values must not vary. (Which of several bad tenant_quotas keys a
  // refusal names does: protobuf maps iterate in a per-instance random order.)
  FUZZ_CHECK(options.status().code() == again.status().code(),
             "ParseDaemonOptions is not deterministic: ", options.status(), " then ",
             again.status());
  if (options.ok()) {
    FUZZ_CHECK(WorkerArgs(*options, 0, 3) == WorkerArgs(*again, 0, 3) &&
                   options->admin_tenants == again->admin_tenants &&
                   options->tenant_quotas.size() == again->tenant_quotas.size() &&
                   options->listen == again->listen,
               "ParseDaemonOptions parsed the same flags to different values");
  }
  if (!options.ok()) {
    const absl::StatusCode code = options.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound,
               options.status());
    return;
  }
  CheckOptions(*options);
  if (!options->internal_worker && !options->internal_compile_helper) {
    CheckWorkerRoundTrip(*options);
  }
}

void FuzzConfigFile(absl::string_view contents) {
  const std::string path = Scratch::Get().Write("config", contents);
  CheckParsed({"gpurpcd", "--config=" + path});
}

void FuzzFlags(absl::string_view bytes) {
  std::vector<std::string> args = {"gpurpcd"};
  for (absl::string_view arg : absl::StrSplit(bytes, '\0')) {
    // --config names a file to read: mode 3 fuzzes its contents; here it could name any
    // file of this machine (a FIFO, /dev/zero ...).
    if (absl::StartsWith(arg, "--config")) continue;
    args.emplace_back(arg);
  }
  CheckParsed(args);
}

}  // namespace
}  // namespace gpurpc::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The parsers read these; fixed values keep every run alike.
  setenv("HOME", "/nonexistent-home", 1);
  unsetenv("XDG_CACHE_HOME");
  unsetenv("XDG_RUNTIME_DIR");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  FuzzedDataProvider input(data + 1, size - 1);
  switch (data[0] % 5) {
    case 0:
      gpurpc::fuzz::FuzzSessionId(input);
      break;
    case 1:
      gpurpc::fuzz::FuzzBearer(input);
      break;
    case 2:
      gpurpc::fuzz::FuzzTokensFile(rest);
      break;
    case 3:
      gpurpc::fuzz::FuzzConfigFile(rest);
      break;
    default:
      gpurpc::fuzz::FuzzFlags(rest);
      break;
  }
  return 0;
}
