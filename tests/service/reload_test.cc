// SIGHUP re-reads the configuration of a running gpurpcd (frontend_main.h): tenant quotas,
// --max-sessions and admin tenants change at once, for a client already connected; a
// setting that needs a restart is named in the log; a file that does not parse changes
// nothing. Through the C++ client against a real daemon (fake backend).
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpurpc/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/eventually.h"
#include "tests/testing/status_matchers.h"

namespace gpurpc {
namespace {

using ::gpurpc::testing::Eventually;
using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::StatusIs;
using ::gpurpc::testing::TestDaemon;
using ::testing::HasSubstr;

class ReloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpurpc-reload-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    config_ = dir_ + "/gpurpcd.conf";
    Write("default_quota { max_sessions: 1 }\n");
    TestDaemon::Options options;
    options.extra_flags = {"--config=" + config_};
    auto daemon = TestDaemon::Start(std::move(options));
    ASSERT_THAT(daemon, IsOk());
    daemon_ = *std::move(daemon);
    auto client = Client::Connect(daemon_->address());
    ASSERT_THAT(client, IsOk());
    client_ = std::make_unique<Client>(*std::move(client));
  }
  void TearDown() override {
    daemon_.reset();
    std::system(absl::StrCat("rm -rf '", dir_, "'").c_str());
  }

  void Write(const std::string& text) {
    std::ofstream(config_ + ".new") << text;
    ASSERT_EQ(rename((config_ + ".new").c_str(), config_.c_str()), 0);
  }
  void Hangup() { ASSERT_EQ(kill(daemon_->pid(), SIGHUP), 0); }
  uint32_t QuotaSessions() {
    auto info = client_->GetServerInfo();
    return info.ok() ? info->quota().max_sessions() : 0;
  }

  std::string dir_, config_;
  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(ReloadTest, QuotasMaxSessionsAndAdminsChangeOnSighup) {
  auto info = client_->GetServerInfo();
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->quota().max_sessions(), 1u);
  EXPECT_FALSE(info->admin());
  const std::string tenant = info->tenant();
  auto first = client_->OpenSession();
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(client_->OpenSession(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_sessions")));
  EXPECT_THAT(client_->AdminListSessions(), StatusIs(absl::StatusCode::kPermissionDenied));

  // More sessions for everyone, this tenant an admin, and a setting only a restart applies.
  Write(absl::StrCat("default_quota { max_sessions: 3 }\nadmin_tenants: \"", tenant,
                     "\"\ncache_max_bytes: 12345678\n"));
  Hangup();
  ASSERT_TRUE(Eventually([&] { return QuotaSessions() == 3; })) << daemon_->Log();
  auto second = client_->OpenSession();
  EXPECT_THAT(second, IsOk());
  auto admin = client_->AdminListSessions();
  ASSERT_THAT(admin, IsOk());
  EXPECT_EQ(admin->sessions_size(), 2);
  ASSERT_TRUE(Eventually([&] {
    return absl::StrContains(daemon_->Log(), "take effect only at a restart: cache_max_bytes");
  })) << daemon_->Log();

  // The daemon-wide cap, lowered below what is open: open sessions stay, new ones wait.
  Write("default_quota { max_sessions: 3 }\nmax_sessions: 2\n");
  Hangup();
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(daemon_->Log(), "max_sessions 2,"); }))
      << daemon_->Log();
  EXPECT_THAT(client_->OpenSession(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-sessions")));
  EXPECT_THAT(first->Allocate(4096), IsOk());
  EXPECT_THAT(client_->AdminListSessions(), StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST_F(ReloadTest, AFileThatDoesNotParseChangesNothing) {
  Write("default_quota { max_sessions: 2 }\n");
  Hangup();
  ASSERT_TRUE(Eventually([&] { return QuotaSessions() == 2; })) << daemon_->Log();
  Write("default_quota { max_sessions: 5 }\nno_such_setting: 1\n");
  Hangup();
  ASSERT_TRUE(Eventually([&] {
    return absl::StrContains(daemon_->Log(), "does not parse, keeping the settings in force");
  })) << daemon_->Log();
  EXPECT_THAT(daemon_->Log(), HasSubstr("no_such_setting"));
  EXPECT_EQ(QuotaSessions(), 2u);
  EXPECT_THAT(daemon_->CheckRunning(), IsOk());
  // A file that is gone: the same.
  ASSERT_EQ(unlink(config_.c_str()), 0);
  Hangup();
  ASSERT_TRUE(Eventually([&] {
    std::string log = daemon_->Log();
    size_t first = log.find("does not parse");
    return first != std::string::npos && log.find("does not parse", first + 1) != std::string::npos;
  })) << daemon_->Log();
  EXPECT_EQ(QuotaSessions(), 2u);
}

}  // namespace
}  // namespace gpurpc
