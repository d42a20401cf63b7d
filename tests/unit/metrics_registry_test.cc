// The metrics registry and its Prometheus text exposition (server/metrics/registry.h): names,
// escaping, value formatting, the exact text of counters, gauges, histograms and callback
// families, and consistency under concurrent updates.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/registry.h"

namespace gpurpc::metrics {
namespace {

using ::testing::HasSubstr;

TEST(MetricsRegistryTest, NamesAreChecked) {
  EXPECT_TRUE(CheckMetricName("gpurpc_rpcs_total").ok());
  EXPECT_TRUE(CheckMetricName("a:b_c9").ok());
  EXPECT_TRUE(CheckMetricName(":recording_rule").ok());
  EXPECT_FALSE(CheckMetricName("").ok());
  EXPECT_FALSE(CheckMetricName("9lives").ok());
  EXPECT_FALSE(CheckMetricName("with-dash").ok());
  EXPECT_FALSE(CheckMetricName("with space").ok());
  EXPECT_THAT(std::string(CheckMetricName("bad.name").message()), HasSubstr("bad.name"));

  EXPECT_TRUE(CheckLabelName("method").ok());
  EXPECT_TRUE(CheckLabelName("_x1").ok());
  EXPECT_FALSE(CheckLabelName("").ok());
  EXPECT_FALSE(CheckLabelName("a:b").ok());  // colons are for metric names only
  EXPECT_FALSE(CheckLabelName("1a").ok());
  EXPECT_THAT(std::string(CheckLabelName("__name__").message()), HasSubstr("reserved"));
}

TEST(MetricsRegistryTest, LabelValuesAndHelpAreEscaped) {
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\\b"), "a\\\\b");
  EXPECT_EQ(EscapeLabelValue("say \"hi\""), "say \\\"hi\\\"");
  EXPECT_EQ(EscapeLabelValue("two\nlines"), "two\\nlines");
  EXPECT_EQ(EscapeLabelValue("\\\"\n"), "\\\\\\\"\\n");
  // Other bytes (tabs, UTF-8) are legal as they are.
  EXPECT_EQ(EscapeLabelValue("tab\there \xc3\xa9"), "tab\there \xc3\xa9");
  // HELP escapes backslashes and newlines only: quotes stay.
  EXPECT_EQ(EscapeHelp("a \"quoted\" \\ text\nmore"), "a \"quoted\" \\\\ text\\nmore");
}

TEST(MetricsRegistryTest, ValuesAreFormattedExactly) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "-0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(8589934592.0), "8589934592");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.00025), "0.00025");
  EXPECT_EQ(FormatValue(2.5), "2.5");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  // Every finite double reads back as itself.
  std::mt19937_64 random(42);
  for (int i = 0; i < 10000; ++i) {
    const double value = std::ldexp(static_cast<double>(random() >> 11) * (i % 2 ? 1 : -1),
                                    static_cast<int>(random() % 200) - 100);
    const std::string text = FormatValue(value);
    double back = 0;
    ASSERT_TRUE(absl::SimpleAtod(text, &back)) << text;
    ASSERT_EQ(back, value) << text;
  }
}

TEST(MetricsRegistryTest, CountersAndGaugesWriteTheExactText) {
  Registry registry;
  auto* calls = registry.AddCounter("test_calls_total", "Calls, by \"method\"\\code\nsecond line",
                                    {"method", "code"});
  calls->WithLabels({"/b", "OK"})->Increment(2);
  calls->WithLabels({"/a", "OK"})->Increment();
  calls->WithLabels({"/a\"\\\n", "NOT_FOUND"})->Increment(7);
  EXPECT_EQ(calls->WithLabels({"/b", "OK"}), calls->WithLabels({"/b", "OK"}));
  auto* temperature = registry.AddGauge("test_temperature", "A gauge", {});
  temperature->Get()->Set(-1.5);
  temperature->Get()->Add(0.25);
  registry.AddGauge("test_never_set", "No children yet", {"x"});
  EXPECT_EQ(registry.Exposition(),
            "# HELP test_calls_total Calls, by \"method\"\\\\code\\nsecond line\n"
            "# TYPE test_calls_total counter\n"
            "test_calls_total{method=\"/a\",code=\"OK\"} 1\n"
            "test_calls_total{method=\"/a\\\"\\\\\\n\",code=\"NOT_FOUND\"} 7\n"
            "test_calls_total{method=\"/b\",code=\"OK\"} 2\n"
            "# HELP test_temperature A gauge\n"
            "# TYPE test_temperature gauge\n"
            "test_temperature -1.25\n"
            "# HELP test_never_set No children yet\n"
            "# TYPE test_never_set gauge\n");
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulativeAndEndWithInf) {
  Registry registry;
  auto* latency = registry.AddHistogram("test_seconds", "Latency", {"method"},
                                        {1, 2, 5, std::numeric_limits<double>::infinity()});
  Histogram* a = latency->WithLabels({"a"});
  for (double value : {0.5, 1.0, 1.5, 5.0, 7.0, std::nan("")}) a->Observe(value);
  const Histogram::Snapshot snapshot = a->Read();
  // le is "less or equal": 1.0 is in the first bucket, 5.0 in the third; NaN is not counted.
  EXPECT_EQ(snapshot.cumulative, (std::vector<uint64_t>{2, 3, 4, 5}));
  EXPECT_EQ(snapshot.count, 5u);
  EXPECT_EQ(snapshot.sum, 15.0);
  EXPECT_EQ(registry.Exposition(),
            "# HELP test_seconds Latency\n"
            "# TYPE test_seconds histogram\n"
            "test_seconds_bucket{method=\"a\",le=\"1\"} 2\n"
            "test_seconds_bucket{method=\"a\",le=\"2\"} 3\n"
            "test_seconds_bucket{method=\"a\",le=\"5\"} 4\n"
            "test_seconds_bucket{method=\"a\",le=\"+Inf\"} 5\n"
            "test_seconds_sum{method=\"a\"} 15\n"
            "test_seconds_count{method=\"a\"} 5\n");

  Registry unlabelled;
  auto* sizes = unlabelled.AddHistogram("test_bytes", "Sizes", {}, {0.25});
  sizes->Get()->Observe(-1);
  EXPECT_EQ(unlabelled.Exposition(),
            "# HELP test_bytes Sizes\n"
            "# TYPE test_bytes histogram\n"
            "test_bytes_bucket{le=\"0.25\"} 1\n"
            "test_bytes_bucket{le=\"+Inf\"} 1\n"
            "test_bytes_sum -1\n"
            "test_bytes_count 1\n");
}

TEST(MetricsRegistryTest, CallbackFamiliesAreComputedAtEachScrapeAndAddUp) {
  Registry registry;
  int scrapes = 0;
  registry.AddCallback(MetricType::kGauge, "test_sessions", "Open sessions", {"tenant"},
                       [&scrapes](SampleWriter& out) {
                         ++scrapes;
                         out.Add({"bob"}, 1);
                         out.Add({"alice"}, 1);
                         out.Add({"bob"}, 1);  // the same labels add up
                       });
  registry.AddCallback(MetricType::kCounter, "test_events_total", "Events", {},
                       [](SampleWriter& out) { out.Add({}, 3); });
  const std::string expected =
      "# HELP test_sessions Open sessions\n"
      "# TYPE test_sessions gauge\n"
      "test_sessions{tenant=\"alice\"} 1\n"
      "test_sessions{tenant=\"bob\"} 2\n"
      "# HELP test_events_total Events\n"
      "# TYPE test_events_total counter\n"
      "test_events_total 3\n";
  EXPECT_EQ(registry.Exposition(), expected);
  EXPECT_EQ(registry.Exposition(), expected);
  EXPECT_EQ(scrapes, 2);
}

TEST(MetricsRegistryDeathTest, ProgrammingErrorsAbortNamingTheMistake) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("bad-name", "x", {});
      },
      "bad-name");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("twice_total", "x", {});
        registry.AddGauge("twice_total", "x", {});
      },
      "twice_total added twice");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("arity_total", "x", {"a", "b"})->WithLabels({"only one"});
      },
      "arity_total has 2 labels");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddHistogram("h_seconds", "x", {"le"}, {1});
      },
      "le");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddHistogram("h2_seconds", "x", {}, {2, 1});
      },
      "strictly increasing");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("dup_total", "x", {"a", "a"});
      },
      "label a twice");
}

// Exposition while other threads update: every histogram read has +Inf == _count and
// non-decreasing buckets, and the final values are exact.
TEST(MetricsRegistryTest, ConcurrentUpdatesStayConsistentAndExact) {
  Registry registry;
  auto* seconds = registry.AddHistogram("test_seconds", "x", {"t"}, LatencyBuckets());
  auto* calls = registry.AddCounter("test_total", "x", {"t"});
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20000;
  // Some series exist before the threads start, so that every scrape checks something.
  seconds->WithLabels({"odd"});
  seconds->WithLabels({"even"});
  std::atomic<int> running{kThreads};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string label = (i % 2) ? "odd" : "even";
        seconds->WithLabels({label})->Observe((i % 1000) * 0.001 * (t + 1));
        calls->WithLabels({label})->Increment();
      }
      --running;
    });
  }
  int checked = 0;
  for (int scrape = 0; running.load() > 0 || scrape < 10; ++scrape) {
    const std::string text = registry.Exposition();
    std::map<std::string, uint64_t> inf;
    std::map<std::string, uint64_t> count;
    std::map<std::string, uint64_t> last;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      if (line[0] == '#' || absl::StartsWith(line, "test_seconds_sum")) continue;
      const std::vector<std::string> parts = absl::StrSplit(line, ' ');
      ASSERT_EQ(parts.size(), 2u) << line;
      uint64_t value = 0;
      ASSERT_TRUE(absl::SimpleAtoi(parts[1], &value)) << line;
      const std::string series = parts[0];
      const std::string label = series.find("odd") != std::string::npos ? "odd" : "even";
      if (series.rfind("test_seconds_bucket", 0) == 0) {
        EXPECT_GE(value, last[label]) << line;
        last[label] = value;
        if (series.find("+Inf") != std::string::npos) inf[label] = value;
      } else if (series.rfind("test_seconds_count", 0) == 0) {
        count[label] = value;
        last[label] = 0;
        ++checked;
      }
    }
    EXPECT_EQ(inf, count);
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_GE(checked, 20);  // two series, at least ten scrapes
  EXPECT_EQ(calls->WithLabels({"odd"})->value(), uint64_t{kThreads * kPerThread / 2});
  EXPECT_EQ(calls->WithLabels({"even"})->value(), uint64_t{kThreads * kPerThread / 2});
  EXPECT_EQ(seconds->WithLabels({"odd"})->Read().count, uint64_t{kThreads * kPerThread / 2});
  EXPECT_EQ(seconds->WithLabels({"even"})->Read().count, uint64_t{kThreads * kPerThread / 2});
}

}  // namespace
}  // namespace gpurpc::metrics
