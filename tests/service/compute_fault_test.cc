// Faults: a faulting kernel ends only its own session (its own worker process), and a faulted
// session refuses further work. Shared fixture and helpers: compute_fixture.h.
#include "tests/service/compute_fixture.h"
#include "tests/testing/eventually.h"

namespace gpurpc::compute_test {
namespace {

// ------------------------------------------------------------------------------ faults

// A daemon of its own with no warm workers, so that its children are exactly the sessions'
// workers.
class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(daemon_, TestDaemon::Start(NoWarmWorkers()));
    ASSERT_OK_AND_ASSIGN(Client client, Client::Connect(daemon_->address()));
    client_.emplace(std::move(client));
  }

  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      const std::string log = daemon_->Log();
      std::cerr << "---- gpurpcd log (last 8000 bytes) ----\n"
                << log.substr(log.size() > 8000 ? log.size() - 8000 : 0)
                << "---- end of gpurpcd log ----\n";
    }
  }

  // Opens a session and returns it with its worker's pid.
  absl::StatusOr<std::pair<Session, pid_t>> OpenSessionWithPid() {
    const std::vector<pid_t> before = daemon_->WorkerPids();
    absl::StatusOr<Session> session = client_->OpenSession();
    if (!session.ok()) return session.status();
    for (pid_t pid : daemon_->WorkerPids()) {
      if (std::find(before.begin(), before.end(), pid) == before.end()) {
        return std::make_pair(*std::move(session), pid);
      }
    }
    return absl::InternalError("no new worker process appeared for the session");
  }

  bool WorkerGone(pid_t pid, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const std::vector<pid_t> pids = daemon_->WorkerPids();
      if (std::find(pids.begin(), pids.end(), pid) == pids.end()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::optional<Client> client_;
};

TEST_F(FaultTest, FaultingKernelFaultsOnlyItsSession) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  ASSERT_OK_AND_ASSIGN(auto b, OpenSessionWithPid());
  Session& session_a = a.first;
  Session& session_b = b.first;
  ASSERT_NE(a.second, b.second);

  ASSERT_OK_AND_ASSIGN(Module module_a, CompileFakeKernels(session_a));
  ASSERT_OK_AND_ASSIGN(Function fault, module_a.GetFunction("fault_illegal_address"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer_a, session_a.Allocate(64));
  ASSERT_OK_AND_ASSIGN(Module module_b, CompileFakeKernels(session_b));
  ASSERT_OK_AND_ASSIGN(Function add_one_b, module_b.GetFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer_b, session_b.Allocate(64 * sizeof(float)));
  ASSERT_OK(buffer_b.Upload(ToBytes(std::vector<float>(64, 0.0f))));

  // Session B works throughout, concurrently with A's fault.
  std::atomic<int> b_iterations{0};
  std::atomic<int> b_failures{0};
  std::string b_first_failure;
  std::thread b_thread([&] {
    for (int i = 1; i <= 200; ++i) {
      absl::Status status = add_one_b.Launch(Linear(1, 64), buffer_b, uint64_t{64});
      absl::StatusOr<std::vector<uint8_t>> bytes =
          status.ok() ? buffer_b.Download() : absl::StatusOr<std::vector<uint8_t>>(status);
      if (!bytes.ok() || FromBytes<float>(*bytes) != std::vector<float>(64, float(i))) {
        if (b_failures.fetch_add(1) == 0) {
          b_first_failure = absl::StrCat("iteration ", i, ": ",
                                         bytes.ok() ? "wrong values" : bytes.status().ToString());
        }
      }
      b_iterations.store(i);
    }
  });
  // B is well under way (bounded: a failed wait still joins the thread below).
  EXPECT_TRUE(::gpurpc::testing::Eventually([&] { return b_iterations.load() >= 20; }))
      << "session B made only " << b_iterations.load() << " iterations";

  // Asynchronous, like CUDA: the launch itself succeeds, the fault surfaces at the sync.
  EXPECT_OK(fault.Launch({}));
  EXPECT_THAT(session_a.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  b_thread.join();
  EXPECT_EQ(b_failures.load(), 0) << b_first_failure;

  // Every later call on A: FAILED_PRECONDITION naming the cause.
  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_THAT(session_a.Allocate(64), faulted);
  EXPECT_THAT(buffer_a.Download(), faulted);
  EXPECT_THAT(session_a.GetMemInfo(), faulted);
  EXPECT_THAT(session_a.Compile(Source(kFakeKernels)), faulted);
  EXPECT_THAT(module_a.GetFunction("axpy_f32"), faulted);
  EXPECT_THAT(session_a.CreateStream(), faulted);
  EXPECT_THAT(fault.Launch({}), faulted);
  ASSERT_OK_AND_ASSIGN(v1::KeepAliveResponse state, session_a.KeepAlive());
  EXPECT_EQ(state.state(), v1::SESSION_STATE_FAULTED);
  EXPECT_THAT(state.fault_cause(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));

  // A's worker process is gone; B's is not, and B still answers correctly.
  EXPECT_TRUE(WorkerGone(a.second, absl::Seconds(10)));
  EXPECT_THAT(daemon_->WorkerPids(), Contains(b.second));
  ASSERT_OK(add_one_b.Launch(Linear(1, 64), buffer_b, uint64_t{64}));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, buffer_b.Download());
  EXPECT_THAT(FromBytes<float>(bytes), Each(201.0f));
}

TEST_F(FaultTest, LaunchAndSynchronizeAnswersItsKernelsFault) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fault, module.GetFunction("fault_illegal_address"));
  EXPECT_THAT(fault.LaunchAndSynchronize({}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_THAT(session.Allocate(64), faulted);
  EXPECT_THAT(fault.LaunchAndSynchronize({}), faulted);
}

TEST_F(FaultTest, FaultedSessionRefusesAsyncWorkAndSynchronize) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fault, module.GetFunction("fault_illegal_address"));
  ASSERT_OK_AND_ASSIGN(Function add_one, module.GetFunction("add_one_f32"));
  ASSERT_OK_AND_ASSIGN(Buffer buffer, session.Allocate(64));
  ASSERT_OK(fault.LaunchAsync({}));
  ASSERT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));

  const auto faulted =
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_THAT(session.Synchronize(), faulted);
  // Enqueueing may or may not report it at once; the next sync must.
  const absl::Status enqueued = add_one.LaunchAsync(Linear(1, 16), buffer, uint64_t{16});
  if (!enqueued.ok()) {
    EXPECT_THAT(enqueued, faulted);
  }
  EXPECT_THAT(session.Synchronize(), faulted);
  absl::Status memset = session.MemsetAsync(buffer.at(), 0, 4, 16);
  if (memset.ok()) memset = session.Synchronize();
  EXPECT_THAT(memset, faulted);
}

TEST_F(FaultTest, OutOfBoundsFakeKernelFaultsTheSession) {
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer small, session.Allocate(16 * sizeof(uint32_t)));
  // 1024 threads and n = 1024 over a buffer of 16 elements.
  EXPECT_OK(fill.Launch(Linear(4, 256), small, 7u, uint64_t{1024}));
  EXPECT_THAT(session.Synchronize(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_THAT(session.Allocate(64), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS")));
  EXPECT_TRUE(WorkerGone(a.second, absl::Seconds(10)));
}

TEST_F(FaultTest, InBoundsFillIsNotAFault) {
  // The control for the test above: the same launch with n inside the buffer.
  ASSERT_OK_AND_ASSIGN(auto a, OpenSessionWithPid());
  Session& session = a.first;
  ASSERT_OK_AND_ASSIGN(Module module, CompileFakeKernels(session));
  ASSERT_OK_AND_ASSIGN(Function fill, module.GetFunction("fill_u32"));
  ASSERT_OK_AND_ASSIGN(Buffer small, session.Allocate(16 * sizeof(uint32_t)));
  EXPECT_OK(fill.Launch(Linear(4, 256), small, 7u, uint64_t{16}));
  EXPECT_OK(session.Synchronize());
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes, small.Download());
  EXPECT_THAT(FromBytes<uint32_t>(bytes), Each(7u));
}

}  // namespace
}  // namespace gpurpc::compute_test
