#include "server/metrics/registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace gpurpc::metrics {
namespace {

[[noreturn]] void Fatal(const std::string& message) {
  std::fprintf(stderr, "gpurpc metrics: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

}  // namespace

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

absl::Status CheckMetricName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("a metric name may not be empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(IsNameStart(c) || c == ':' || (i > 0 && IsDigit(c)))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "'%s' is not a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*): character %d", name, i + 1));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLabelName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("a label name may not be empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(IsNameStart(c) || (i > 0 && IsDigit(c)))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "'%s' is not a label name ([a-zA-Z_][a-zA-Z0-9_]*): character %d", name, i + 1));
    }
  }
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') {
    return absl::InvalidArgumentError(
        absl::StrFormat("label name '%s': names starting with __ are reserved", name));
  }
  return absl::OkStatus();
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) <= 9007199254740992.0) {
    return absl::StrFormat("%.0f", value);
  }
  for (int precision = 6; precision < 17; ++precision) {
    std::string text = absl::StrFormat("%.*g", precision, value);
    if (std::strtod(text.c_str(), nullptr) == value) return text;
  }
  return absl::StrFormat("%.17g", value);
}

void Gauge::Add(double delta) {
  double old = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(old, old + delta, std::memory_order_relaxed)) {
  }
}

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(*bounds), buckets_(new std::atomic<uint64_t>[bounds->size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  double old = sum_.load(std::memory_order_relaxed);
  while (!sum_.compare_exchange_weak(old, old + value, std::memory_order_relaxed)) {
  }
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  snapshot.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    snapshot.cumulative[i] = total;
  }
  snapshot.count = total;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

const std::vector<double>& LatencyBuckets() {
  static const auto* const kBuckets =
      new std::vector<double>{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                              0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    300};
  return *kBuckets;
}

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)) {
  if (absl::Status status = CheckMetricName(name_); !status.ok()) {
    Fatal(std::string(status.message()));
  }
  std::set<std::string> seen;
  for (const std::string& label : label_names_) {
    if (absl::Status status = CheckLabelName(label); !status.ok()) {
      Fatal(absl::StrCat(name_, ": ", status.message()));
    }
    if (!seen.insert(label).second) Fatal(absl::StrCat(name_, ": label ", label, " twice"));
    if (type_ == MetricType::kHistogram && label == "le") {
      Fatal(absl::StrCat(name_, ": a histogram may not have a label named le"));
    }
  }
}

void FamilyBase::CheckArity(const std::vector<std::string>& values) const {
  if (values.size() != label_names_.size()) {
    Fatal(absl::StrFormat("%s has %d labels (%s); %d values were given", name_, label_names_.size(),
                          absl::StrJoin(label_names_, ", "), values.size()));
  }
}

void FamilyBase::AppendSample(std::string* out, absl::string_view name_suffix,
                              const std::vector<std::string>& values, absl::string_view extra_label,
                              absl::string_view extra_value, absl::string_view value) const {
  absl::StrAppend(out, name_, name_suffix);
  if (!values.empty() || !extra_label.empty()) {
    out->push_back('{');
    for (size_t i = 0; i < values.size(); ++i) {
      absl::StrAppend(out, i == 0 ? "" : ",", label_names_[i], "=\"", EscapeLabelValue(values[i]),
                      "\"");
    }
    if (!extra_label.empty()) {
      absl::StrAppend(out, values.empty() ? "" : ",", extra_label, "=\"",
                      EscapeLabelValue(extra_value), "\"");
    }
    out->push_back('}');
  }
  absl::StrAppend(out, " ", value, "\n");
}

void FamilyBase::Write(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(out, "# TYPE ", name_, " ", TypeName(type_), "\n");
  WriteSamples(out);
}

template <>
std::unique_ptr<Counter> Family<Counter>::Make() const {
  return std::make_unique<Counter>();
}
template <>
std::unique_ptr<Gauge> Family<Gauge>::Make() const {
  return std::make_unique<Gauge>();
}
template <>
std::unique_ptr<Histogram> Family<Histogram>::Make() const {
  return std::make_unique<Histogram>(&bounds_);
}

template <typename Metric>
Metric* Family<Metric>::WithLabels(const std::vector<std::string>& label_values) {
  CheckArity(label_values);
  {
    absl::ReaderMutexLock lock(&mu_);
    if (auto it = children_.find(label_values); it != children_.end()) return it->second.get();
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Metric>& child = children_[label_values];
  if (child == nullptr) child = Make();
  return child.get();
}

template <>
void Family<Counter>::WriteSamples(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [values, counter] : children_) {
    AppendSample(out, "", values, "", "", absl::StrCat(counter->value()));
  }
}

template <>
void Family<Gauge>::WriteSamples(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [values, gauge] : children_) {
    AppendSample(out, "", values, "", "", FormatValue(gauge->value()));
  }
}

template <>
void Family<Histogram>::WriteSamples(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [values, histogram] : children_) {
    const Histogram::Snapshot snapshot = histogram->Read();
    for (size_t i = 0; i < bounds_.size(); ++i) {
      AppendSample(out, "_bucket", values, "le", FormatValue(bounds_[i]),
                   absl::StrCat(snapshot.cumulative[i]));
    }
    AppendSample(out, "_bucket", values, "le", "+Inf", absl::StrCat(snapshot.count));
    AppendSample(out, "_sum", values, "", "", FormatValue(snapshot.sum));
    AppendSample(out, "_count", values, "", "", absl::StrCat(snapshot.count));
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

void SampleWriter::Add(const std::vector<std::string>& label_values, double value) {
  if (label_values.size() != family_->label_names().size()) {
    Fatal(absl::StrFormat("%s has %d labels (%s); a callback gave %d values", family_->name(),
                          family_->label_names().size(),
                          absl::StrJoin(family_->label_names(), ", "), label_values.size()));
  }
  samples_[label_values] += value;
}

// A family whose samples a function writes at each scrape.
class CallbackFamily final : public FamilyBase {
 public:
  CallbackFamily(std::string name, std::string help, MetricType type,
                 std::vector<std::string> label_names, std::function<void(SampleWriter&)> collect)
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
        collect_(std::move(collect)) {}

 private:
  void WriteSamples(std::string* out) const override {
    SampleWriter writer(this);
    collect_(writer);
    for (const auto& [values, value] : writer.samples_) {
      AppendSample(out, "", values, "", "", FormatValue(value));
    }
  }

  const std::function<void(SampleWriter&)> collect_;
};

template <typename F>
F* Registry::Add(std::unique_ptr<F> family) {
  absl::MutexLock lock(&mu_);
  for (const auto& existing : families_) {
    if (existing->name() == family->name()) Fatal(absl::StrCat(family->name(), " added twice"));
  }
  F* raw = family.get();
  families_.push_back(std::move(family));
  return raw;
}

Family<Counter>* Registry::AddCounter(const std::string& name, const std::string& help,
                                      const std::vector<std::string>& label_names) {
  return Add(std::unique_ptr<Family<Counter>>(
      new Family<Counter>(name, help, MetricType::kCounter, label_names)));
}

Family<Gauge>* Registry::AddGauge(const std::string& name, const std::string& help,
                                  const std::vector<std::string>& label_names) {
  return Add(std::unique_ptr<Family<Gauge>>(
      new Family<Gauge>(name, help, MetricType::kGauge, label_names)));
}

Family<Histogram>* Registry::AddHistogram(const std::string& name, const std::string& help,
                                          const std::vector<std::string>& label_names,
                                          std::vector<double> bounds) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      Fatal(absl::StrCat(name, ": histogram bounds must be finite and strictly increasing"));
    }
  }
  return Add(std::unique_ptr<Family<Histogram>>(
      new Family<Histogram>(name, help, MetricType::kHistogram, label_names, std::move(bounds))));
}

void Registry::AddCallback(MetricType type, const std::string& name, const std::string& help,
                           const std::vector<std::string>& label_names,
                           std::function<void(SampleWriter&)> collect) {
  if (type == MetricType::kHistogram) {
    Fatal(absl::StrCat(name, ": a callback family is a counter or a gauge"));
  }
  Add(std::make_unique<CallbackFamily>(name, help, type, label_names, std::move(collect)));
}

std::string Registry::Exposition() const {
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& family : families_) family->Write(&out);
  return out;
}

}  // namespace gpurpc::metrics
