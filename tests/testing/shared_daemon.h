// SharedDaemonTest<Suite>: one real daemon for every test of a suite, started in
// SetUpTestSuite and stopped in TearDownTestSuite, for suites whose tests only open their own
// sessions and so cannot disturb each other. A suite derives with itself as the argument
// (each suite gets its own daemon) and may define `static TestDaemon::Options DaemonOptions()`.
//
//   class GraphTest : public SharedDaemonTest<GraphTest> {
//     void SetUp() override {
//       ASSERT_NO_FATAL_FAILURE(SharedDaemonTest::SetUp());  // fails if the daemon did not start
//       ... daemon().address() ...
//     }
//   };
#ifndef GPURPC_TESTS_TESTING_SHARED_DAEMON_H_
#define GPURPC_TESTS_TESTING_SHARED_DAEMON_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"

namespace gpurpc::testing {

template <typename Suite>
class SharedDaemonTest : public ::testing::Test {
 protected:
  static TestDaemon::Options DaemonOptions() { return TestDaemon::Options(); }

  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<TestDaemon>> daemon = TestDaemon::Start(Suite::DaemonOptions());
    if (daemon.ok()) {
      daemon_ = *std::move(daemon);
    } else {
      start_error_ = daemon.status().ToString();
    }
  }
  static void TearDownTestSuite() {
    daemon_.reset();
    start_error_.clear();
  }

  // A fatal failure naming why when the suite's daemon did not start.
  void SetUp() override { ASSERT_NE(daemon_, nullptr) << "the suite's daemon: " << start_error_; }

  static TestDaemon& daemon() { return *daemon_; }

 private:
  static inline std::unique_ptr<TestDaemon> daemon_;
  static inline std::string start_error_;
};

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_SHARED_DAEMON_H_
