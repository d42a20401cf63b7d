// The kernel watchdog (server/worker/watchdog.h), in process: on a scripted context whose
// kernels run until the test completes them, with a manual clock and PollOnce, so that no
// test depends on how long anything takes; then its thread, and the session's launch paths
// (unary and command batches) reporting to it.
#include "server/worker/watchdog.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker/session.h"
#include "tests/testing/status_matchers.h"
#include "tests/unit/scripted_context.h"

namespace gpurpc::worker {
namespace {

using ::gpurpc::testing::IsOk;
using ::gpurpc::testing::ScriptedContext;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Le;

using Clock = Watchdog::Clock;

// Records what the watchdog fired with.
class Fired {
 public:
  Watchdog::FireFn callback() {
    return [this](const std::string& message) {
      absl::MutexLock lock(&mu_);
      messages_.push_back(message);
      if (!done_.HasBeenNotified()) done_.Notify();
    };
  }
  std::vector<std::string> messages() const {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  // For tests with the real thread: a generous deadline, never a timing assertion.
  bool WaitForFirst() { return done_.WaitForNotificationWithTimeout(absl::Seconds(60)); }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

class WatchdogTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kTimeoutMs = 1000;

  std::unique_ptr<Watchdog> Make(size_t max_markers_per_stream = 1024, size_t max_events = 4096) {
    Watchdog::Options options;
    options.timeout_ms = kTimeoutMs;
    options.max_markers_per_stream = max_markers_per_stream;
    options.max_events = max_events;
    options.now = [this] { return now_; };
    options.start_thread = false;
    return std::make_unique<Watchdog>(&context_, std::move(options), fired_.callback());
  }

  void SetUp() override {
    context_.DefineKernel("kernel", {});
    const uint8_t image[] = {1};
    auto module = context_.LoadModule(image);
    ASSERT_THAT(module, IsOk());
    module_ = *std::move(module);
    auto function = module_->GetFunction("kernel");
    ASSERT_THAT(function, IsOk());
    function_ = *function;
  }

  // A launch as the session makes it: the kernel is queued, then the watchdog is told.
  void Launch(Watchdog& watchdog, uint64_t stream_id, backend::Stream* stream,
              const std::string& kernel) {
    ASSERT_THAT(context_.Launch(function_, backend::LaunchConfig{}, {}, stream), IsOk());
    watchdog.OnLaunch(stream_id, stream, std::make_shared<const std::string>(kernel));
  }

  void Advance(int64_t ms) { now_ += std::chrono::milliseconds(ms); }

  ScriptedContext context_;
  std::unique_ptr<backend::Module> module_;
  backend::Function* function_ = nullptr;
  Fired fired_;
  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
};

TEST(KernelTimeoutMessageTest, IsExactlyTheDocumentedLine) {
  EXPECT_EQ(KernelTimeoutMessage("spin", 5000),
            "kernel 'spin' ran longer than the kernel timeout of 5s (--kernel-timeout or the "
            "tenant's kernel_timeout_ms quota)");
  EXPECT_EQ(FormatKernelTimeout(60000), "60s");
  EXPECT_EQ(FormatKernelTimeout(1500), "1500ms");
  EXPECT_EQ(FormatKernelTimeout(1), "1ms");
}

TEST_F(WatchdogTest, FiresOnceForTheFirstUnfinishedKernelWhenItIsOverdue) {
  auto watchdog = Make();
  Launch(*watchdog, 0, nullptr, "a");
  Launch(*watchdog, 0, nullptr, "b");
  Launch(*watchdog, 0, nullptr, "c");
  watchdog->PollOnce();
  Advance(500);
  context_.Complete(0, 1);  // a ran 500 ms; b is the oldest from now on
  watchdog->PollOnce();
  EXPECT_EQ(watchdog->pending_markers(), 2u);
  Advance(kTimeoutMs);  // b has run exactly the timeout: not yet longer
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), IsEmpty());
  Advance(1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("b", kTimeoutMs)));
  EXPECT_FALSE(watchdog->watching());
  Advance(10 * kTimeoutMs);
  watchdog->PollOnce();
  EXPECT_EQ(fired_.messages().size(), 1u);
}

TEST_F(WatchdogTest, KernelsEachWithinTheTimeoutNeverFireHoweverLongTheirQueue) {
  auto watchdog = Make();
  for (int i = 0; i < 20; ++i) Launch(*watchdog, 0, nullptr, "k" + std::to_string(i));
  for (int i = 0; i < 20; ++i) {  // 20 x 900 ms of work queued at once
    Advance(900);
    context_.Complete(0, 1);
    watchdog->PollOnce();
  }
  EXPECT_THAT(fired_.messages(), IsEmpty());
  EXPECT_TRUE(watchdog->watching());
  EXPECT_EQ(watchdog->pending_markers(), 0u);
}

TEST_F(WatchdogTest, AKernelOnAnIdleStreamIsTimedFromItsLaunch) {
  auto watchdog = Make();
  Launch(*watchdog, 0, nullptr, "early");
  context_.Complete(0, 1);
  watchdog->PollOnce();
  Advance(60 * 1000);  // idle for a minute
  Launch(*watchdog, 0, nullptr, "late");
  Advance(kTimeoutMs - 1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), IsEmpty());
  Advance(2);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("late", kTimeoutMs)));
}

TEST_F(WatchdogTest, StreamsAreTimedIndependently) {
  auto watchdog = Make();
  auto stream = context_.CreateStream(false);  // scripted stream 1
  ASSERT_THAT(stream, IsOk());
  Launch(*watchdog, 77, stream->get(), "hung");
  for (int i = 0; i < 3; ++i) {
    Launch(*watchdog, 0, nullptr, "quick");
    Advance(300);
    context_.Complete(0, 1);
    watchdog->PollOnce();
  }
  EXPECT_THAT(fired_.messages(), IsEmpty());
  EXPECT_EQ(watchdog->streams_tracked(), 1u);  // the default stream's entry went when idle
  Advance(kTimeoutMs - 900 + 1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("hung", kTimeoutMs)));
}

TEST_F(WatchdogTest, EventsComeFromAReusedPool) {
  auto watchdog = Make();
  for (int i = 0; i < 10000; ++i) {
    Launch(*watchdog, 0, nullptr, "k");
    Launch(*watchdog, 0, nullptr, "k");
    context_.Complete(0, 2);
    watchdog->PollOnce();
  }
  EXPECT_EQ(context_.events_created(), 2);
  EXPECT_EQ(watchdog->events_created(), 2u);
  EXPECT_EQ(watchdog->pending_markers(), 0u);
  EXPECT_EQ(watchdog->streams_tracked(), 0u);
  watchdog.reset();
  EXPECT_EQ(context_.events_alive(), 0);  // destroyed with the watchdog
}

TEST_F(WatchdogTest, PastTheStreamBoundLaunchesCoalesceAndTheFirstUnfinishedIsNamed) {
  auto watchdog = Make(/*max_markers_per_stream=*/2);
  for (int i = 0; i < 6; ++i) Launch(*watchdog, 0, nullptr, "k" + std::to_string(i));
  // k0 has its own marker; the second covers k1..k5 and was recorded again behind each.
  EXPECT_EQ(context_.events_created(), 2);
  EXPECT_EQ(watchdog->pending_markers(), 2u);
  EXPECT_EQ(context_.records(), 6);
  context_.Complete(0, 1);  // k0
  watchdog->PollOnce();
  EXPECT_EQ(watchdog->pending_markers(), 1u);
  context_.Complete(0, 3);  // k1..k3: the group is not done until k5 is
  watchdog->PollOnce();
  EXPECT_EQ(watchdog->pending_markers(), 1u);
  Advance(kTimeoutMs + 1);
  watchdog->PollOnce();
  // The group's first launch: the markers cannot tell which of k1..k5 still runs.
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("k1", kTimeoutMs)));
}

TEST_F(WatchdogTest, ThePoolBoundCoalescesButEveryStreamKeepsOneMarker) {
  auto watchdog = Make(/*max_markers_per_stream=*/1024, /*max_events=*/2);
  auto stream = context_.CreateStream(false);  // scripted stream 1
  ASSERT_THAT(stream, IsOk());
  for (int i = 0; i < 5; ++i) Launch(*watchdog, 0, nullptr, "default");
  EXPECT_EQ(context_.events_created(), 2);
  // A stream with nothing pending always gets a marker, past the pool's bound.
  Launch(*watchdog, 5, stream->get(), "other");
  Launch(*watchdog, 5, stream->get(), "other");
  EXPECT_EQ(context_.events_created(), 3);
  EXPECT_EQ(watchdog->pending_markers(), 3u);
  context_.Complete(0, 5);
  watchdog->PollOnce();
  Advance(kTimeoutMs + 1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("other", kTimeoutMs)));
}

TEST_F(WatchdogTest, AStickyFaultIsNotATimeout) {
  auto watchdog = Make();
  Launch(*watchdog, 0, nullptr, "faulty");
  context_.set_query_status(absl::AbortedError("cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS"));
  Advance(kTimeoutMs + 1);
  watchdog->PollOnce();
  EXPECT_FALSE(watchdog->watching());
  Advance(10 * kTimeoutMs);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), IsEmpty());
  // Nor are launches after it watched.
  Launch(*watchdog, 0, nullptr, "after");
  EXPECT_EQ(watchdog->pending_markers(), 1u);
}

TEST_F(WatchdogTest, AStickyFaultOnRecordStopsWatching) {
  auto watchdog = Make();
  context_.set_record_status(absl::AbortedError("cuEventRecord: CUDA_ERROR_LAUNCH_FAILED"));
  Launch(*watchdog, 0, nullptr, "faulty");
  EXPECT_FALSE(watchdog->watching());
  EXPECT_EQ(watchdog->pending_markers(), 0u);
}

TEST_F(WatchdogTest, AFailedRecordLeavesTheKernelToTheNextMarker) {
  auto watchdog = Make();
  context_.set_record_status(absl::InternalError("cuEventRecord: CUDA_ERROR_UNKNOWN"));
  Launch(*watchdog, 0, nullptr, "unmarked");
  EXPECT_TRUE(watchdog->watching());
  EXPECT_EQ(watchdog->pending_markers(), 0u);
  context_.set_record_status(absl::OkStatus());
  Launch(*watchdog, 0, nullptr, "marked");  // its marker completes after both
  context_.Complete(0, 1);
  Advance(kTimeoutMs + 1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("marked", kTimeoutMs)));
}

TEST_F(WatchdogTest, ADestroyedStreamsWorkStaysWatchedAndItsEntryGoesWhenDone) {
  auto watchdog = Make();
  auto stream = context_.CreateStream(false);  // scripted stream 1
  ASSERT_THAT(stream, IsOk());
  Launch(*watchdog, 9, stream->get(), "orphan");
  Launch(*watchdog, 9, stream->get(), "orphan2");
  stream->reset();  // the session destroyed the stream; its queued work still runs
  Advance(kTimeoutMs / 2);
  context_.Complete(1, 1);
  watchdog->PollOnce();
  EXPECT_EQ(watchdog->streams_tracked(), 1u);
  context_.Complete(1, 1);
  watchdog->PollOnce();
  EXPECT_EQ(watchdog->streams_tracked(), 0u);

  auto hung = context_.CreateStream(false);  // scripted stream 2
  ASSERT_THAT(hung, IsOk());
  Launch(*watchdog, 10, hung->get(), "hung");
  hung->reset();
  Advance(kTimeoutMs + 1);
  watchdog->PollOnce();
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("hung", kTimeoutMs)));
}

TEST_F(WatchdogTest, TheThreadPollsAndFires) {
  Watchdog::Options options;
  options.timeout_ms = 20;
  options.poll_interval = absl::Milliseconds(5);
  Watchdog watchdog(&context_, std::move(options), fired_.callback());
  Launch(watchdog, 0, nullptr, "forever");
  ASSERT_TRUE(fired_.WaitForFirst());
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("forever", 20)));
}

TEST_F(WatchdogTest, TheThreadStopsWithTheWatchdog) {
  Watchdog::Options options;
  options.timeout_ms = 60 * 60 * 1000;
  options.poll_interval = absl::Milliseconds(1);
  auto watchdog = std::make_unique<Watchdog>(&context_, std::move(options), fired_.callback());
  Launch(*watchdog, 0, nullptr, "running");
  watchdog.reset();  // joins the thread
  EXPECT_THAT(fired_.messages(), IsEmpty());
  EXPECT_EQ(context_.events_alive(), 0);
}

// The session's side: Bind starts it, and every launch path reports to it.
class SessionWatchdogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto context = std::make_unique<ScriptedContext>();
    context_ = context.get();
    context_->DefineKernel("hang", {});
    context_->DefineKernel("quick", {});
    session_ = std::make_unique<Session>(std::move(context), nullptr,
                                         absl::UnavailableError("no NVRTC in this test"),
                                         fired_.callback());
  }

  uint64_t Function(const std::string& name) {
    auto module = session_->LoadModule("scripted image");
    EXPECT_THAT(module, IsOk());
    if (!module.ok()) return 0;
    auto function = session_->GetFunction(*module, name);
    EXPECT_THAT(function, IsOk());
    return function.ok() ? function->function_id() : 0;
  }

  static v1::LaunchCommand LaunchOf(uint64_t function_id, uint64_t stream_id = 0) {
    v1::LaunchCommand launch;
    launch.set_function_id(function_id);
    for (v1::Dim3* dim : {launch.mutable_grid(), launch.mutable_block()}) {
      dim->set_x(1);
      dim->set_y(1);
      dim->set_z(1);
    }
    launch.set_stream_id(stream_id);
    return launch;
  }

  Fired fired_;
  ScriptedContext* context_ = nullptr;
  std::unique_ptr<Session> session_;
};

TEST_F(SessionWatchdogTest, BindStartsItOnlyWithATimeout) {
  EXPECT_EQ(session_->watchdog(), nullptr);
  Session::Limits limits;
  ASSERT_THAT(session_->Bind("tenant", limits), IsOk());
  EXPECT_EQ(session_->watchdog(), nullptr);
  ASSERT_THAT(session_->Launch(LaunchOf(Function("quick"))), IsOk());
  EXPECT_EQ(context_->events_created(), 0);  // no watchdog: no marker
}

TEST_F(SessionWatchdogTest, AUnaryLaunchIsWatched) {
  Session::Limits limits;
  limits.kernel_timeout_ms = 100;
  ASSERT_THAT(session_->Bind("tenant", limits), IsOk());
  ASSERT_NE(session_->watchdog(), nullptr);
  ASSERT_THAT(session_->Launch(LaunchOf(Function("hang"))), IsOk());
  ASSERT_TRUE(fired_.WaitForFirst());
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("hang", 100)));
}

TEST_F(SessionWatchdogTest, ALaunchInACommandBatchIsWatched) {
  Session::Limits limits;
  limits.kernel_timeout_ms = 100;
  ASSERT_THAT(session_->Bind("tenant", limits), IsOk());
  const uint64_t quick = Function("quick");
  const uint64_t hang = Function("hang");
  v1::CommandBatch batch;
  v1::Command* first = batch.add_commands();
  first->set_sequence(1);
  *first->mutable_launch() = LaunchOf(quick);
  v1::Command* second = batch.add_commands();
  second->set_sequence(2);
  *second->mutable_launch() = LaunchOf(hang);
  uint64_t last_sequence = 0;
  v1::CommandReply reply;
  ASSERT_THAT(session_->RunBatch(batch, &last_sequence, &reply), IsOk());
  ASSERT_FALSE(reply.has_error()) << reply.error().message();
  context_->Complete(0, 1);  // `quick` finishes; `hang` never does
  ASSERT_TRUE(fired_.WaitForFirst());
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("hang", 100)));
  EXPECT_EQ(context_->records(), 2);
}

TEST_F(SessionWatchdogTest, AKernelOnADestroyedStreamIsStillWatched) {
  Session::Limits limits;
  limits.kernel_timeout_ms = 100;
  ASSERT_THAT(session_->Bind("tenant", limits), IsOk());
  auto stream = session_->CreateStream(false);
  ASSERT_THAT(stream, IsOk());
  ASSERT_THAT(session_->Launch(LaunchOf(Function("hang"), *stream)), IsOk());
  ASSERT_THAT(session_->DestroyStream(*stream), IsOk());
  ASSERT_TRUE(fired_.WaitForFirst());
  EXPECT_THAT(fired_.messages(), ElementsAre(KernelTimeoutMessage("hang", 100)));
}

TEST_F(SessionWatchdogTest, TheSessionStopsItsWatchdogAndFreesItsEvents) {
  Session::Limits limits;
  limits.kernel_timeout_ms = 60 * 60 * 1000;
  ASSERT_THAT(session_->Bind("tenant", limits), IsOk());
  for (int i = 0; i < 100; ++i) ASSERT_THAT(session_->Launch(LaunchOf(Function("quick"))), IsOk());
  EXPECT_THAT(context_->events_created(), Le(100));
  EXPECT_GT(context_->events_alive(), 0);
  // The context dies with the session, and its events must have gone before it.
  int events_alive_at_context_end = -1;
  context_->ReportEventsAliveAtDestruction(&events_alive_at_context_end);
  session_.reset();
  EXPECT_EQ(events_alive_at_context_end, 0);
  EXPECT_THAT(fired_.messages(), IsEmpty());
}

}  // namespace
}  // namespace gpurpc::worker
