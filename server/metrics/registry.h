// A small metrics registry and its Prometheus text exposition (format 0.0.4), for the
// daemon's /metrics endpoint (docs/METRICS.md). Counters, gauges and histograms, each in a
// family of one name with a fixed list of label names; a family's children (one per list of
// label values) are made on first use and live as long as the registry, so that a pointer
// to one may be kept and updated without any lock. Families whose samples are computed when
// scraped (the open sessions by tenant, say) are callback families.
//
// Updates are lock-free (relaxed atomics); WithLabels takes a reader lock (a writer lock the
// first time a list of label values is seen): keep the child on hot paths. Exposition reads
// every value once; a histogram's _count is the sum of its buckets as read, so that the
// +Inf bucket always equals _count even while observations go on.
//
// Names and label names are checked at registration; a bad one, a second family of the same
// name, or a list of label values of the wrong length is a programming error and aborts
// with a message naming it.
//
// Thread safety: everything may be called from any thread.
#ifndef GPURPC_SERVER_METRICS_REGISTRY_H_
#define GPURPC_SERVER_METRICS_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace gpurpc::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// "counter", "gauge", "histogram": the word of a # TYPE line.
const char* TypeName(MetricType type);

// OK for a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), else INVALID_ARGUMENT saying why.
absl::Status CheckMetricName(absl::string_view name);
// OK for a label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with "__"), else
// INVALID_ARGUMENT saying why.
absl::Status CheckLabelName(absl::string_view name);

// A label value as it goes between the quotes: \ as \\, " as \", a newline as \n.
std::string EscapeLabelValue(absl::string_view value);
// HELP text: \ as \\, a newline as \n.
std::string EscapeHelp(absl::string_view text);
// A sample value: integers (up to 2^53) without a fraction, others in the shortest form
// that reads back as the same double, "+Inf", "-Inf", "NaN".
std::string FormatValue(double value);

// A monotonic count of events (or bytes).
class Counter {
 public:
  void Increment(uint64_t by = 1) { value_.fetch_add(by, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into buckets by upper bound (a value goes into the first bucket whose
// bound is >= it; the last bucket, +Inf, takes the rest), with their count and sum. A NaN is
// not counted.
class Histogram {
 public:
  // `bounds`: strictly increasing, finite; owned by the family, outliving the histogram.
  explicit Histogram(const std::vector<double>* bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double>& bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1, not cumulative
  std::atomic<double> sum_{0};
};

class Registry;

// What every family has: its name, help, type and label names, and how it writes itself.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

 protected:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names);
  // Aborts unless `values` has one value per label name.
  void CheckArity(const std::vector<std::string>& values) const;
  // Appends `name_suffix{label="value",...[,extra_label="extra_value"]} value\n`.
  void AppendSample(std::string* out, absl::string_view name_suffix,
                    const std::vector<std::string>& values, absl::string_view extra_label,
                    absl::string_view extra_value, absl::string_view value) const;

 private:
  friend class Registry;
  // Appends the HELP and TYPE lines and every sample.
  void Write(std::string* out) const;
  virtual void WriteSamples(std::string* out) const = 0;

  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// Counters, gauges or histograms of one name, one per list of label values.
template <typename Metric>
class Family final : public FamilyBase {
 public:
  // The child for `label_values` (one per label name, in their order), made on first use.
  // The pointer stays valid for the life of the registry.
  Metric* WithLabels(const std::vector<std::string>& label_values) ABSL_LOCKS_EXCLUDED(mu_);
  // The child of a family without labels.
  Metric* Get() { return WithLabels({}); }

 private:
  friend class Registry;
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::vector<double> bounds = {})
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
        bounds_(std::move(bounds)) {}
  void WriteSamples(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);
  std::unique_ptr<Metric> Make() const;

  const std::vector<double> bounds_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_ ABSL_GUARDED_BY(mu_);
};

// Collects the samples of a callback family while it is scraped.
class SampleWriter {
 public:
  // One sample; samples with the same label values add up.
  void Add(const std::vector<std::string>& label_values, double value);

 private:
  friend class CallbackFamily;
  explicit SampleWriter(const FamilyBase* family) : family_(family) {}
  const FamilyBase* family_;
  std::map<std::vector<std::string>, double> samples_;
};

// Default buckets of a latency histogram, in seconds: 100 µs to 5 minutes.
const std::vector<double>& LatencyBuckets();

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Families are written in the order they were added. Each aborts on a bad or taken name.
  Family<Counter>* AddCounter(const std::string& name, const std::string& help,
                              const std::vector<std::string>& label_names);
  Family<Gauge>* AddGauge(const std::string& name, const std::string& help,
                          const std::vector<std::string>& label_names);
  // `bounds`: strictly increasing and finite (a trailing +Inf is dropped: it is implied);
  // "le" may not be a label name.
  Family<Histogram>* AddHistogram(const std::string& name, const std::string& help,
                                  const std::vector<std::string>& label_names,
                                  std::vector<double> bounds);
  // A counter or gauge family whose samples `collect` writes each time it is scraped. It
  // runs on the scraping thread and must not call back into the registry.
  void AddCallback(MetricType type, const std::string& name, const std::string& help,
                   const std::vector<std::string>& label_names,
                   std::function<void(SampleWriter&)> collect);

  // The whole text exposition (Content-Type: text/plain; version=0.0.4).
  std::string Exposition() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  template <typename F>
  F* Add(std::unique_ptr<F> family) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
};

inline constexpr char kExpositionContentType[] = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace gpurpc::metrics

#endif  // GPURPC_SERVER_METRICS_REGISTRY_H_
