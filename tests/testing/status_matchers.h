// GoogleTest matchers for absl::Status / StatusOr, named like Abseil's (Debian's Abseil
// 20220623 ships none): IsOk(), StatusIs(code), StatusIs(code, message_matcher),
// IsOkAndHolds(matcher), plus ASSERT_OK / EXPECT_OK / ASSERT_OK_AND_ASSIGN.
#ifndef GPURPC_TESTS_TESTING_STATUS_MATCHERS_H_
#define GPURPC_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpurpc::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has code " + absl::StatusCodeToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + absl::StatusCodeToString(code) + " and a matching message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code && ::testing::Matches(message_matcher)(std::string(s.message()));
}

MATCHER_P(IsOkAndHolds, matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(matcher, *arg, result_listener);
}

}  // namespace gpurpc::testing

#define GPURPC_TESTING_CONCAT_INNER_(a, b) a##b
#define GPURPC_TESTING_CONCAT_(a, b) GPURPC_TESTING_CONCAT_INNER_(a, b)

#define EXPECT_OK(expr) EXPECT_THAT((expr), ::gpurpc::testing::IsOk())
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::gpurpc::testing::IsOk())
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(GPURPC_TESTING_CONCAT_(gpurpc_statusor_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  ASSERT_TRUE(statusor.ok()) << statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // GPURPC_TESTS_TESTING_STATUS_MATCHERS_H_
