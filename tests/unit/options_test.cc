// gpurpcd's flags and configuration file (server/options.h).
#include "server/options.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpurpc/config/v1/daemon_config.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<DaemonOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "gpurpcd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  return ParseDaemonOptions(static_cast<int>(argv.size()), argv.data());
}

std::string WriteConfig(const std::string& text) {
  char path[] = "/tmp/gpurpc-options-test-XXXXXX";
  const int fd = mkstemp(path);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(OptionsTest, SecureByDefault) {
  auto options = Parse({});
  ASSERT_THAT(options.status(), IsOk());
  EXPECT_EQ(options->listen, "");
  EXPECT_EQ(options->unix_socket, DefaultUnixSocket());
  EXPECT_FALSE(options->insecure);
}

TEST(OptionsTest, TcpNeedsCredentialsAndTlsOffLoopback) {
  EXPECT_THAT(Parse({"--listen=127.0.0.1:1"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tokens-file")));
  EXPECT_THAT(Parse({"--listen=127.0.0.1:1", "--tokens-file=/x"}).status(), IsOk());
  EXPECT_THAT(Parse({"--listen=[::1]:1", "--tokens-file=/x"}).status(), IsOk());
  EXPECT_THAT(Parse({"--listen=localhost:1", "--tokens-file=/x"}).status(), IsOk());
  EXPECT_THAT(Parse({"--listen=127.evil.example:1", "--tokens-file=/x"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a loopback")));
  EXPECT_THAT(Parse({"--listen=[::ffff:10.0.0.1]:1", "--tokens-file=/x"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a loopback")));
  EXPECT_THAT(Parse({"--listen=127.0.0.2:1", "--tokens-file=/x"}).status(), IsOk());
  EXPECT_THAT(Parse({"--listen=0.0.0.0:1", "--tokens-file=/x"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a loopback")));
  EXPECT_THAT(Parse({"--listen=10.1.2.3:1", "--tokens-file=/x", "--tls-cert=/c"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-key")));
  EXPECT_THAT(
      Parse({"--listen=10.1.2.3:1", "--tokens-file=/x", "--tls-cert=/c", "--tls-key=/k"}).status(),
      IsOk());
  EXPECT_THAT(Parse({"--listen=0.0.0.0:1", "--insecure"}).status(), IsOk());
  EXPECT_THAT(Parse({"--listen=0.0.0.0:1", "--insecure=false"}).status(), Not(IsOk()));
  EXPECT_THAT(Parse({"--tls-client-ca=/ca"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-cert")));
  EXPECT_THAT(Parse({"--listen=", "--unix-socket="}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nothing to serve on")));
}

TEST(OptionsTest, TheRegionSocketSitsBesideTheUnixSocket) {
  auto options = Parse({"--unix-socket=/run/gpurpc/gpurpcd.sock"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "/run/gpurpc/gpurpcd-regions.sock");
  options = Parse({"--unix-socket=/run/gpurpc/socket"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "/run/gpurpc/socket.regions");
  options = Parse({"--unix-socket=/run/gpurpc/gpurpcd.sock", "--region-socket=/tmp/r.sock"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "/tmp/r.sock");
  options = Parse({"--unix-socket=/run/gpurpc/gpurpcd.sock", "--region-socket="});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "");
  // No Unix socket, no regions.
  options = Parse({"--unix-socket=", "--listen=127.0.0.1:1", "--tokens-file=/x"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "");
  // Beside a socket path too long for one more: none, and the log says why.
  const std::string long_path = "/" + std::string(80, 'd') + "/gpurpcd.sock";
  options = Parse({"--unix-socket=" + long_path});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->region_socket, "");
  EXPECT_THAT(options->region_socket_note, HasSubstr("too long"));
  // Beside a relative unix socket path: still absolute (clients run elsewhere), and a worker
  // accepts it back (the fuzzer found a relative one refused by the worker's parse).
  options = Parse({"--unix-socket=run/gpurpcd.sock"});
  ASSERT_THAT(options, IsOk());
  char cwd[4096];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  if (std::string(cwd).size() + 40 < 107) {
    EXPECT_EQ(options->region_socket, std::string(cwd) + "/run/gpurpcd-regions.sock");
  }
  EXPECT_THAT(Parse(WorkerArgs(*options, 0, 3)), IsOk());
  EXPECT_THAT(Parse({"--region-socket=relative.sock"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("absolute")));
  EXPECT_THAT(Parse({"--max-host-region-bytes=lots"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max-host-region-bytes")));
}

TEST(OptionsTest, QuotaFlagsAndTenantNames) {
  auto options = Parse({"--tenant-max-sessions=3", "--tenant-max-device-memory-bytes=1024",
                        "--admin-tenants=root,ops"});
  ASSERT_THAT(options.status(), IsOk());
  EXPECT_EQ(options->QuotaFor("anyone").max_sessions(), 3u);
  EXPECT_EQ(options->QuotaFor("anyone").max_device_memory_bytes(), 1024u);
  EXPECT_EQ(options->QuotaFor("anyone").max_concurrent_compiles(),
            DaemonOptions::DefaultQuota().max_concurrent_compiles());
  EXPECT_THAT(options->admin_tenants, ::testing::ElementsAre("root", "ops"));
  EXPECT_THAT(Parse({"--admin-tenants=a b"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tenant name")));
  EXPECT_THAT(Parse({"--tenant-max-sessions=-1"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--unix-socket-mode=0999"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto mode = Parse({"--unix-socket-mode=0600"});
  ASSERT_THAT(mode.status(), IsOk());
  EXPECT_EQ(mode->unix_socket_mode, 0600u);
}

TEST(OptionsTest, ConfigFileIsAppliedAndFlagsOverrideIt) {
  const std::string path = WriteConfig(R"(
unix_socket: "/tmp/x.sock"
max_sessions: 7
warm_workers: 0
insecure: true
listen: "0.0.0.0:9"
admin_tenants: "root"
admin_tenants: "ops"
session_idle_timeout: "90s"
default_quota { max_sessions: 2 max_device_memory_bytes: 4096 }
tenant_quotas { key: "alice" value { max_sessions: 5 } }
)");
  auto options = Parse({absl::StrCat("--config=", path), "--max-sessions=9"});
  ASSERT_THAT(options.status(), IsOk());
  EXPECT_EQ(options->unix_socket, "/tmp/x.sock");
  EXPECT_EQ(options->max_sessions, 9);  // the flag wins, wherever it stands
  EXPECT_EQ(options->warm_workers, 0);  // an explicit 0 in the file counts
  EXPECT_TRUE(options->insecure);
  EXPECT_EQ(options->session_idle_timeout, absl::Seconds(90));
  EXPECT_THAT(options->admin_tenants, ::testing::ElementsAre("root", "ops"));
  EXPECT_EQ(options->QuotaFor("bob").max_sessions(), 2u);
  EXPECT_EQ(options->QuotaFor("bob").max_device_memory_bytes(), 4096u);
  EXPECT_EQ(options->QuotaFor("alice").max_sessions(), 5u);
  EXPECT_EQ(options->QuotaFor("alice").max_device_memory_bytes(), 4096u);  // inherited
  // --config given after the flag that overrides it: the flag still wins.
  options = Parse({"--max-sessions=11", "--config", path});
  ASSERT_THAT(options.status(), IsOk());
  EXPECT_EQ(options->max_sessions, 11);
  std::remove(path.c_str());
}

TEST(OptionsTest, ConfigFileErrorsNameTheLineAndField) {
  const std::string syntax = WriteConfig("max_sessions: 3\nno_such_field: 1\n");
  EXPECT_THAT(Parse({absl::StrCat("--config=", syntax)}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("line 2"), HasSubstr("no_such_field"))));
  const std::string value = WriteConfig("backend: \"tpu\"\n");
  EXPECT_THAT(Parse({absl::StrCat("--config=", value)}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("field backend"), HasSubstr("tpu"))));
  const std::string tenant = WriteConfig("tenant_quotas { key: \"a b\" value {} }\n");
  EXPECT_THAT(Parse({absl::StrCat("--config=", tenant)}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tenant name")));
  EXPECT_THAT(Parse({"--config=/nonexistent/gpurpcd.conf"}).status(),
              StatusIs(absl::StatusCode::kNotFound));
  std::remove(syntax.c_str());
  std::remove(value.c_str());
  std::remove(tenant.c_str());
}

// Every scalar field of the configuration is a flag: the file and the flags are one table.
TEST(OptionsTest, EveryConfigFieldIsAFlag) {
  const google::protobuf::Descriptor* descriptor = config::v1::DaemonConfig::descriptor();
  const std::string usage = DaemonUsage();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    if (field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) continue;
    std::string flag = field->name();
    std::replace(flag.begin(), flag.end(), '_', '-');
    EXPECT_TRUE(absl::StrContains(usage, absl::StrCat("  --", flag)))
        << "config field " << field->name() << " has no flag --" << flag;
  }
}

// deploy/config/gpurpcd.conf, which the build copies to `data` beside this test.
std::string ShippedConfigPath() {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len <= 0) return "(cannot read /proc/self/exe)";
  std::string path(exe, static_cast<size_t>(len));
  return absl::StrCat(path.substr(0, path.rfind('/')), "/data/gpurpcd.conf");
}

// The shipped example configuration parses, with the meaning its comments claim.
TEST(OptionsTest, ShippedExampleConfigParses) {
  auto options = Parse({absl::StrCat("--config=", ShippedConfigPath())});
  ASSERT_THAT(options.status(), IsOk());
  EXPECT_EQ(options->listen, "0.0.0.0:50051");
  EXPECT_FALSE(options->tls_client_ca.empty());
  EXPECT_EQ(options->QuotaFor("someone").max_sessions(), 4u);
  EXPECT_EQ(options->QuotaFor("alice").max_sessions(), 8u);
  EXPECT_EQ(options->QuotaFor("alice").max_concurrent_compiles(), 2u);
  EXPECT_EQ(options->QuotaFor("alice").kernel_timeout_ms(), 60'000u);
  EXPECT_EQ(options->QuotaFor("sim").kernel_timeout_ms(), 3'600'000u);
  EXPECT_EQ(options->session_grace, absl::Seconds(10));
}

TEST(OptionsTest, CommandRelay) {
  auto defaults = Parse({});
  ASSERT_THAT(defaults.status(), IsOk());
  EXPECT_EQ(defaults->command_relay, "framed");
  auto grpc = Parse({"--command-relay=grpc"});
  ASSERT_THAT(grpc.status(), IsOk());
  EXPECT_EQ(grpc->command_relay, "grpc");
  auto from_file = Parse({"--config=" + WriteConfig("command_relay: \"grpc\"\n")});
  ASSERT_THAT(from_file.status(), IsOk());
  EXPECT_EQ(from_file->command_relay, "grpc");
  for (const char* bad : {"--command-relay=tcp", "--command-relay=", "--command-relay=GRPC"}) {
    EXPECT_THAT(Parse({bad}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--command-relay")))
        << bad;
  }
}

TEST(OptionsTest, KernelTimeoutAndSessionGrace) {
  auto defaults = Parse({});
  ASSERT_THAT(defaults.status(), IsOk());
  EXPECT_EQ(defaults->QuotaFor("anyone").kernel_timeout_ms(), 60'000u);
  EXPECT_EQ(defaults->session_grace, absl::Seconds(10));

  auto set = Parse({"--kernel-timeout=1.5s", "--session-grace=2s"});
  ASSERT_THAT(set.status(), IsOk());
  EXPECT_EQ(set->QuotaFor("anyone").kernel_timeout_ms(), 1'500u);
  EXPECT_EQ(set->session_grace, absl::Seconds(2));

  auto off = Parse({"--kernel-timeout=0"});
  ASSERT_THAT(off.status(), IsOk());
  EXPECT_EQ(off->QuotaFor("anyone").kernel_timeout_ms(), 0u);

  for (const char* bad : {"--kernel-timeout=soon", "--kernel-timeout=-1s", "--kernel-timeout=10us",
                          "--session-grace=-1s", "--session-grace=x"}) {
    EXPECT_THAT(Parse({bad}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(std::string(bad).substr(0, std::string(bad).find('=')))))
        << bad;
  }

  // A tenant's quota overrides the daemon's watchdog; the others keep the flag's value.
  const std::string config = WriteConfig(
      "kernel_timeout: \"5s\"\n"
      "tenant_quotas { key: \"alice\" value { kernel_timeout_ms: 500 } }\n");
  auto tenant = Parse({"--config=" + config});
  std::remove(config.c_str());
  ASSERT_THAT(tenant.status(), IsOk());
  EXPECT_EQ(tenant->QuotaFor("alice").kernel_timeout_ms(), 500u);
  EXPECT_EQ(tenant->QuotaFor("bob").kernel_timeout_ms(), 5'000u);
}

}  // namespace
}  // namespace gpurpc
