// Escape attempts against the compile sandbox, shared by the unit test (the sandboxed NVRTC
// entry point, no text scan in the way) and the service test (a real daemon through the
// C++ client): a secret with a random marker planted beside the test, and every route we
// know that makes NVRTC read a file of the server. A test passes when the marker never
// comes back; RoutesAreRealWithoutTheSandbox-style tests check that the routes marked
// `leaks_unconfined` do read it when NVRTC runs unconfined, so that a passing escape test
// means something.
#ifndef GPURPC_TESTS_TESTING_COMPILE_ESCAPE_H_
#define GPURPC_TESTS_TESTING_COMPILE_ESCAPE_H_

#include <fcntl.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace gpurpc::testing {

struct EscapeSecret {
  std::string marker;        // GPURPC_SECRET_<32 hex>: in every secret, never in a path
  std::string dir;           // a fresh folder under the test's temporary folder
  std::string file;          // dir/secret.h
  std::string link;          // dir/links/link.h -> dir/secret.h
  std::string fake_toolkit;  // dir/toolkit: evil.h -> secret.h, up -> dir, ok.h
  std::string options_file;  // dir/opts: options naming the marker
  int fd = -1;               // an inheritable descriptor on `file` (>= 100) in this process
};

// Where the marker is also put: this process's environment (children started after
// PlantEscapeSecret() have it in their /proc/<pid>/environ).
inline constexpr char kEscapeSecretEnv[] = "GPURPC_SANDBOX_TEST_SECRET";

// Plants the secret once per process; `temp_dir` ends with '/'.
inline const EscapeSecret& PlantEscapeSecret(const std::string& temp_dir) {
  static const EscapeSecret* const secret = [&temp_dir] {
    auto* s = new EscapeSecret;
    std::random_device random;
    char hex[33];
    for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", random() & 0xff);
    s->marker = std::string("GPURPC_SECRET_") + hex;
    std::string dir = temp_dir + "compile_escape_XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) abort();
    s->dir = dir;
    const auto write = [](const std::string& path, const std::string& content) {
      std::ofstream(path) << content;
    };
    s->file = dir + "/secret.h";
    // Whatever reads this shows the marker: #error quotes it, and so does any parse error.
    write(s->file, "#error " + s->marker + "\n" + s->marker + " garbage;\nstatic_assert(false, \"" +
                       s->marker + "\");\n");
    std::filesystem::create_directories(dir + "/links");
    s->link = dir + "/links/link.h";
    std::filesystem::create_symlink(s->file, s->link);
    s->fake_toolkit = dir + "/toolkit";
    std::filesystem::create_directories(s->fake_toolkit);
    std::filesystem::create_symlink(s->file, s->fake_toolkit + "/evil.h");
    std::filesystem::create_symlink(dir, s->fake_toolkit + "/up");
    write(s->fake_toolkit + "/ok.h", "#define FAKE_TOOLKIT_OK 1\n");
    s->options_file = dir + "/opts";
    write(s->options_file, "-D" + s->marker + "\n--" + s->marker + "\n");
    // Above 0-3, which a helper's spawn replaces anyway; inherited by children that do not
    // close it (a compile helper must).
    const int fd = open(s->file.c_str(), O_RDONLY);
    s->fd = fcntl(fd, F_DUPFD, 100);
    close(fd);
    setenv(kEscapeSecretEnv, s->marker.c_str(), 1);
    // Removed when this process exits normally (forked children _exit).
    static std::string to_remove;
    to_remove = s->dir;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(to_remove, ignored);
    });
    return s;
  }();
  return *secret;
}

// A process whose /proc entries the routes name.
struct EscapePid {
  pid_t pid;
  bool environ_has_marker = false;  // started after PlantEscapeSecret, environment inherited
  bool has_secret_fd = false;       // holds EscapeSecret::fd
  bool cwd_is_secret_dir = false;
};

struct EscapeRoute {
  std::string name;
  std::string source;  // a complete translation unit (ends with a kernel)
  std::string program_name;
  // The client's own options: no architecture, no toolkit include path.
  std::vector<std::string> options;
  std::vector<std::pair<std::string, std::string>> headers;  // (name, content)
  // Reads the secret when NVRTC runs unconfined, given these options.
  bool leaks_unconfined = false;
  // Needs the compiling process's working directory to be EscapeSecret::dir.
  bool needs_secret_cwd = false;
  // Needs EscapeSecret::fake_toolkit among the folders the sandbox lets NVRTC read.
  bool needs_fake_toolkit = false;
};

inline constexpr char kEscapeKernel[] = "\nextern \"C\" __global__ void k(int* p) { *p = 1; }\n";

inline std::vector<EscapeRoute> EscapeRoutes(const EscapeSecret& s,
                                             const std::vector<EscapePid>& pids) {
  const std::string& f = s.file;
  const std::string fd = std::to_string(s.fd);
  const std::string q = "\"" + f + "\"";
  std::vector<EscapeRoute> routes;
  const auto add = [&](std::string name, const std::string& text, bool leaks,
                       std::vector<std::string> options = {}) -> EscapeRoute& {
    EscapeRoute route;
    route.name = std::move(name);
    route.source = text + kEscapeKernel;
    route.options = std::move(options);
    route.leaks_unconfined = leaks;
    routes.push_back(std::move(route));
    return routes.back();
  };

  // Plain and respelled directives. (Trigraphs are spelled with "?\\?" so that this file has
  // none of its own.)
  add("include quoted", "#include " + q, true);
  add("include angled", "#include <" + f + ">", true);
  add("include_next", "#include_next " + q, true);
  add("continuation in 'include'", "#inc\\\nlude " + q, true);
  add("continuation after '#'", "#\\\ninclude " + q, true);
  add("continuation before the name", "#include \\\n" + q, true);
  add("continuation inside the name", "#include \"" + f.substr(0, 4) + "\\\n" + f.substr(4) + "\"",
      true);
  add("CRLF continuation", "#inc\\\r\nlude " + q, true);
  add("comment after '#'", "#/**/include " + q, true);
  add("comment before the name", "#include/* x */" + q, true);
  add("multi-line comment in the directive", "# /*\n*/ include " + q, true);
  add("blanks and tabs", " \t# \t include\t" + q, true);
  add("digraph %:", "%:include " + q, true);
  add("digraph %: with blanks", "  %:  include " + q, true);
  add("trigraph for # (c++03)", "?\?=include " + q, true, {"-std=c++03"});
  add("trigraph for # (c++11)", "?\?=include " + q, true, {"--std=c++11"});
  add("trigraph for # (default std)", "?\?=include " + q, false);
  add("trigraph for \\ continuation", "#inc?\?/\nlude " + q, true, {"-std=c++03"});
  add("import", "#import " + q, false);
  add("embed", "const unsigned char d[] = {\n#embed " + q + "\n};", false, {"-std=c++20"});
  // Existence and content probes.
  add("__has_include", "#if __has_include(" + q + ")\n#include " + q + "\n#endif", true);
  add("__has_include_next", "#if __has_include_next(" + q + ")\n#include_next " + q + "\n#endif",
      true);
  add("__has_embed", "#if __has_embed(" + q + ")\n#endif", false);
  // Computed names.
  add("computed include", "#define F " + q + "\n#include F", true);
  add("computed angled include", "#define F <" + f + ">\n#include F", true);
  add("stringized include",
      "#define S(x) #x\n#define X(x) S(x)\n#define P " + f + "\n#include X(P)", true);
  add("pasted include",
      "#define S(x) #x\n#define X(x) S(x)\n#define C(a, b) a##b\n#include X(C(" +
          f.substr(0, f.rfind('/')) + "/sec, ret.h))",
      true);
  add("option macro include", "#include SECRET", true, {"-DSECRET=" + q});
  // An identifier ending in R before a string is not a raw string: the #include is real.
  add("identifier ending in R", "#define FOOR 1\nint y = FOOR\"(\";\n#include " + q + "\n)\";",
      true);
  add("#line then __FILE__", "#line 1 " + q + "\n#include __FILE__", true);
  add("#line then an error", "#line 1 " + q + "\nint x = ;", false);
  add("_Pragma then #line", "_Pragma(\"once\")\n#line 1 " + q + "\n#include __FILE__", true);
  // Pragmas.
  add("pragma include_alias", "#pragma include_alias(\"a.h\", " + q + ")\n#include \"a.h\"", false);
  add("_Pragma include_alias",
      "_Pragma(\"include_alias(\\\"a.h\\\", \\\"" + f + "\\\")\")\n#include \"a.h\"", false);
  add("pragma GCC dependency", "#pragma GCC dependency " + q, false);
  add("pragma push_macro",
      "#pragma push_macro(\"F\")\n#define F " + q + "\n#include F\n#pragma pop_macro(\"F\")", true);
  // Paths: symlinks, /proc, /dev/fd, odd spellings.
  add("symlink", "#include \"" + s.link + "\"", true);
  add("/proc/self/root", "#include \"/proc/self/root" + f + "\"", true);
  add("/proc/self/fd (inherited)", "#include \"/proc/self/fd/" + fd + "\"", false);
  add("/dev/fd (inherited)", "#include \"/dev/fd/" + fd + "\"", false);
  add("/proc/self/environ", "#include \"/proc/self/environ\"", false);
  add("/proc/self/cwd", "#include \"/proc/self/cwd/secret.h\"", true).needs_secret_cwd = true;
  for (const EscapePid& p : pids) {
    const std::string proc = "/proc/" + std::to_string(p.pid);
    add(proc + "/root", "#include \"" + proc + "/root" + f + "\"", true);
    add(proc + "/cwd", "#include \"" + proc + "/cwd/secret.h\"", p.cwd_is_secret_dir)
        .needs_secret_cwd = p.cwd_is_secret_dir;
    add(proc + "/fd", "#include \"" + proc + "/fd/" + fd + "\"", p.has_secret_fd);
    // NVRTC quotes only the first line of a file it cannot parse, and an environment has
    // no newlines: whether the marker shows depends on where it is; never counted on.
    add(proc + "/environ", "#include \"" + proc + "/environ\"", false);
    add(proc + "/cmdline", "#include \"" + proc + "/cmdline\"", false);
  }
  add("relative up the tree", "#include \"../../../../../../../../.." + f + "\"", true);
  add("double slashes", "#include \"//" + f + "\"", true);
  add("dot segments", "#include \"" + s.dir + "/./links/../secret.h\"", true);
  add("cwd-relative quoted", "#include \"secret.h\"", true).needs_secret_cwd = true;
  add("cwd-relative angled", "#include <secret.h>", false).needs_secret_cwd = true;
  // Request headers and the program name.
  {
    EscapeRoute& route = add("request header that includes the secret", "#include \"h.h\"", true);
    route.headers = {{"h.h", "#include " + q + "\n"}};
  }
  {
    EscapeRoute& route = add("absolute header name as decoy", "#include " + q, true);
    route.headers = {{s.dir + "/other.h", "// decoy\n"}};
  }
  {
    EscapeRoute& route = add("header name with .. segments", "#include \"../../x.h\"", true);
    route.headers = {{"../../x.h", "#include " + q + "\n"}};
  }
  add("program name in the secret's folder", "#include \"secret.h\"", true).program_name =
      s.dir + "/kernel.cu";
  // NVRTC answers that the file "includes itself".
  add("program name is the secret, __FILE__", "#include __FILE__", false).program_name = f;
  // Options.
  add("-I the secret's folder", "#include \"secret.h\"", true, {"-I" + s.dir});
  add("--include-path the secret's folder", "#include <secret.h>", true,
      {"--include-path=" + s.dir});
  add("-I a symlink's folder", "#include \"link.h\"", true, {"-I" + s.dir + "/links"});
  add("-include", "", true, {"-include", f});
  add("--pre-include", "", true, {"--pre-include=" + f});
  add("--pre-include /proc/self/root", "", true, {"--pre-include=/proc/self/root" + f});
  add("--options-file", "", false, {"--options-file=" + s.options_file});
  add("-optf", "", false, {"-optf", s.options_file});
  add("--config", "", false, {"--config=" + s.options_file});
  add("--use-pch", "", false, {"--use-pch=" + f});
  add("--pch-dir", "", false, {"-pch", "--pch-dir=" + s.dir});
  add("-Xptxas --options-file", "", false, {"-Xptxas=--options-file=" + s.options_file});
  add("--jobserver-auth", "", false, {"--split-compile=2", "--jobserver-auth=fifo:" + f});
  add("--orig_src_file_name", "int x = ;", false, {"--orig_src_file_name=" + f});
  // A folder offered to NVRTC whose symlinks point outside it.
  add("symlink inside an allowed folder", "#include <evil.h>", true,
      {"--include-path=" + s.fake_toolkit})
      .needs_fake_toolkit = true;
  add("folder symlink inside an allowed folder", "#include <up/secret.h>", true,
      {"--include-path=" + s.fake_toolkit})
      .needs_fake_toolkit = true;
  return routes;
}

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_COMPILE_ESCAPE_H_
