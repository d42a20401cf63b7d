// The front end's framed unary channels (server/frontend/unary_channels.h) against a worker
// played by the test on socketpairs: calls answered in turn on reused channels, the bound on
// open channels, answers completed on the calling thread when they come within its wait (and
// by the channel's thread when not, or when no waiting slot is free), and a worker that breaks
// the protocol (an answer that does not parse, an oversized length, an answer to no call, a
// close mid-call or while idle) ending the channel with the call in flight answered
// UNAVAILABLE, not as the worker's answer.
#include "server/frontend/unary_channels.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gpurpc/internal/v1/worker_control.pb.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "tests/testing/raw_call.h"

namespace gpurpc::frontend {
namespace {

using ::gpurpc::testing::ByteBufferToString;
using ::testing::HasSubstr;

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string Header(uint32_t prefix) {
  std::string header(kFrameHeaderBytes, '\0');
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    header[i] = static_cast<char>((prefix >> (8 * i)) & 0xff);
  }
  return header;
}

// How one call ended.
struct Ended {
  UnaryChannels::Outcome outcome = UnaryChannels::Outcome::kBroken;
  grpc::Status status;
  std::string response;
  std::thread::id thread;  // where the call was completed
  bool answered_by_worker() const { return outcome == UnaryChannels::Outcome::kAnswered; }
};

// Collects the calls' ends.
class Ends {
 public:
  UnaryChannels::Done Next() {
    return [this](UnaryChannels::Outcome outcome, grpc::Status status, grpc::ByteBuffer response) {
      absl::MutexLock lock(&mu_);
      ends_.push_back(Ended{outcome, std::move(status), ByteBufferToString(response),
                            std::this_thread::get_id()});
    };
  }
  // Waits for the `n`th end (from 1).
  Ended Wait(size_t n) {
    absl::MutexLock lock(&mu_);
    auto arrived = [this, n] { return ends_.size() >= n; };
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Seconds(10)));
    return ends_.size() >= n ? ends_[n - 1] : Ended{};
  }
  size_t count() {
    absl::MutexLock lock(&mu_);
    return ends_.size();
  }

 private:
  absl::Mutex mu_;
  std::deque<Ended> ends_;
};

// The worker's ends of the channels the front end opened.
class FakeWorker {
 public:
  ~FakeWorker() {
    for (int fd : fds_) close(fd);
  }
  UnaryChannels::Opener Opener() {
    return [this]() -> absl::StatusOr<int> {
      if (refuse_) return absl::UnavailableError("no worker");
      int pair[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        return absl::UnavailableError("socketpair");
      }
      // A test that breaks fails on a read that times out rather than hanging.
      const timeval timeout{10, 0};
      setsockopt(pair[1], SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
      absl::MutexLock lock(&mu_);
      fds_.push_back(pair[1]);
      return pair[0];
    };
  }
  int opened() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(fds_.size());
  }
  // Waits until channel `i` is open (the front end opens it on its first call).
  void WaitOpened(int i) {
    while (opened() <= i) absl::SleepFor(absl::Microseconds(100));
  }
  int fd(int i) {
    absl::MutexLock lock(&mu_);
    return fds_[static_cast<size_t>(i)];
  }
  // Reads one call from channel `i`.
  internal::v1::RelayedCall Read(int i) {
    const std::string header = ReadExactly(fd(i), kFrameHeaderBytes);
    uint32_t length = 0;
    for (size_t k = 0; k < kFrameHeaderBytes; ++k) {
      length |= uint32_t{static_cast<uint8_t>(header[k])} << (8 * k);
    }
    internal::v1::RelayedCall call;
    EXPECT_TRUE(call.ParseFromString(ReadExactly(fd(i), length)));
    return call;
  }
  void Write(int i, const std::string& bytes) {
    ASSERT_EQ(send(fd(i), bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  void Answer(int i, grpc::StatusCode code, const std::string& response) {
    internal::v1::RelayedAnswer answer;
    answer.set_code(code);
    answer.set_message(code == grpc::StatusCode::OK ? "" : "the worker says no");
    answer.set_response(response);
    const std::string body = answer.SerializeAsString();
    Write(i, Header(static_cast<uint32_t>(body.size())) + body);
  }
  bool refuse_ = false;

 private:
  static std::string ReadExactly(int fd, size_t size) {
    std::string out(size, '\0');
    size_t got = 0;
    while (got < size) {
      const ssize_t n = recv(fd, out.data() + got, size - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    EXPECT_EQ(got, size);
    return out;
  }
  absl::Mutex mu_;
  std::vector<int> fds_;
};

constexpr char kMethod[] = "/gpurpc.v1.ExecutionService/QueryStream";

TEST(UnaryChannelsTest, CallsAreAnsweredInTurnOnOneReusedChannel) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  for (int i = 1; i <= 5; ++i) {
    UnaryChannels::Done done = ends.Next();
    const std::string request = "request " + std::to_string(i);
    ASSERT_TRUE(channels.Call(kMethod, Buffer(request), done));
    const internal::v1::RelayedCall call = worker.Read(0);
    EXPECT_EQ(call.method(), kMethod);
    EXPECT_EQ(call.request(), request);
    worker.Answer(0, grpc::StatusCode::OK, "response " + std::to_string(i));
    const Ended ended = ends.Wait(static_cast<size_t>(i));
    EXPECT_TRUE(ended.status.ok()) << ended.status.error_message();
    EXPECT_TRUE(ended.answered_by_worker());
    EXPECT_EQ(ended.response, "response " + std::to_string(i));
  }
  EXPECT_EQ(worker.opened(), 1);
  EXPECT_EQ(channels.open(), 1);

  // The worker's error is its answer, with no response.
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("x"), done));
  worker.Read(0);
  worker.Answer(0, grpc::StatusCode::NOT_FOUND, "ignored");
  const Ended ended = ends.Wait(6);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ended.status.error_message(), "the worker says no");
  EXPECT_TRUE(ended.answered_by_worker());
  EXPECT_EQ(ended.response, "");
}

TEST(UnaryChannelsTest, AtMostTheBoundAreOpenAndABusySessionGoesByGrpc) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  for (int i = 0; i < UnaryChannels::kMaxUnaryChannels; ++i) {
    UnaryChannels::Done done = ends.Next();
    ASSERT_TRUE(channels.Call(kMethod, Buffer("busy"), done));
  }
  EXPECT_EQ(worker.opened(), UnaryChannels::kMaxUnaryChannels);
  // Every channel has a call in flight: the next is not taken, and its `done` is kept.
  UnaryChannels::Done extra = ends.Next();
  EXPECT_FALSE(channels.Call(kMethod, Buffer("extra"), extra));
  EXPECT_TRUE(static_cast<bool>(extra));
  EXPECT_EQ(worker.opened(), UnaryChannels::kMaxUnaryChannels);
  // One answer frees its channel for the next call.
  worker.Read(2);
  worker.Answer(2, grpc::StatusCode::OK, "done");
  ends.Wait(1);
  ASSERT_TRUE(channels.Call(kMethod, Buffer("again"), extra));
  EXPECT_EQ(worker.Read(2).request(), "again");
  EXPECT_EQ(worker.opened(), UnaryChannels::kMaxUnaryChannels);
}

TEST(UnaryChannelsTest, ALargeRequestOrNoWorkerGoesByGrpc) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  EXPECT_FALSE(channels.Call(kMethod, Buffer(std::string(kMaxRelayedRequestBytes + 1, 'x')), done));
  EXPECT_EQ(worker.opened(), 0);
  worker.refuse_ = true;
  EXPECT_FALSE(channels.Call(kMethod, Buffer("small"), done));
  worker.refuse_ = false;
  // The largest request that goes framed.
  ASSERT_TRUE(channels.Call(kMethod, Buffer(std::string(kMaxRelayedRequestBytes, 'y')), done));
  EXPECT_EQ(worker.Read(0).request().size(), kMaxRelayedRequestBytes);
}

// What a worker that breaks the protocol does to the call in flight and to the channel.
void ExpectBroken(const std::string& what_the_worker_sends, const std::string& reason) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  worker.Read(0);
  worker.Write(0, what_the_worker_sends);
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::UNAVAILABLE) << reason;
  EXPECT_THAT(ended.status.error_message(), HasSubstr(reason));
  EXPECT_FALSE(ended.answered_by_worker());
  // The channel is gone; the next call opens another.
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 2);
  EXPECT_EQ(worker.Read(1).request(), "next");
}

TEST(UnaryChannelsTest, AnAnswerThatDoesNotParseEndsTheChannel) {
  ExpectBroken(Header(4) + std::string("\xff\xff\xff\xff", 4), "does not parse");
}

TEST(UnaryChannelsTest, AnOversizedAnswerEndsTheChannelBeforeItIsRead) {
  ExpectBroken(Header(static_cast<uint32_t>(kMaxMessageBytes) + 1), "over the limit");
}

TEST(UnaryChannelsTest, AWorkerThatClosesMidAnswerEndsTheCall) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  worker.Read(0);
  worker.Write(0, Header(100) + "only part");
  shutdown(worker.fd(0), SHUT_RDWR);
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.status.error_message(), HasSubstr("closed mid-frame"));
  EXPECT_FALSE(ended.answered_by_worker());
}

std::string EndFrame(grpc::StatusCode code, const std::string& message) {
  v1::CommandError error;
  error.set_code(code);
  error.set_message(message);
  const std::string body = error.SerializeAsString();
  return Header(static_cast<uint32_t>(body.size()) | kEndFrameBit) + body;
}

TEST(UnaryChannelsTest, AChannelTheWorkerRefusesHandsTheCallBackAndBacksOff) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  // The worker refuses the channel before it reads anything.
  worker.Write(0, EndFrame(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many channels"));
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.outcome, UnaryChannels::Outcome::kRefused);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ended.status.error_message(), "too many channels");
  // No channel is opened for a while: the next call goes by gRPC.
  UnaryChannels::Done next = ends.Next();
  EXPECT_FALSE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 1);
}

TEST(UnaryChannelsTest, AnEndFrameAfterAnAnswerIsTheWorkersAnswer) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done first = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("one"), first));
  worker.Read(0);
  worker.Answer(0, grpc::StatusCode::OK, "one");
  ends.Wait(1);
  UnaryChannels::Done second = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("two"), second));
  worker.Read(0);
  worker.Write(0, EndFrame(grpc::StatusCode::INVALID_ARGUMENT, "bad frame"));
  const Ended ended = ends.Wait(2);
  EXPECT_EQ(ended.outcome, UnaryChannels::Outcome::kAnswered);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The channel is gone; the next call opens another.
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 2);
}

TEST(UnaryChannelsTest, AWorkersStatusMessageIsCutToWhatGrpcWouldSend) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  worker.Read(0);
  internal::v1::RelayedAnswer answer;
  answer.set_code(grpc::StatusCode::ABORTED);
  answer.set_message(std::string(8 << 20, 'm'));
  const std::string body = answer.SerializeAsString();
  worker.Write(0, Header(static_cast<uint32_t>(body.size())) + body);
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_LE(ended.status.error_message().size(), 4096u + 64u);
  EXPECT_THAT(ended.status.error_message(), HasSubstr("truncated"));
}

TEST(UnaryChannelsTest, AnAnswerToNoCallEndsTheChannelWhenItIsNextTaken) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  worker.Read(0);
  worker.Answer(0, grpc::StatusCode::OK, "one");
  worker.Answer(0, grpc::StatusCode::OK, "two: to no call");
  EXPECT_EQ(ends.Wait(1).response, "one");
  // The next call finds the stray answer on the idle channel: that channel closes (its socket
  // reads the end), and the call goes on a new one, where it gets its own answer.
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 2);
  char byte;
  EXPECT_EQ(recv(worker.fd(0), &byte, 1, 0), 0);
  EXPECT_EQ(worker.Read(1).request(), "next");
  worker.Answer(1, grpc::StatusCode::OK, "next's");
  EXPECT_EQ(ends.Wait(2).response, "next's");
}

TEST(UnaryChannelsTest, AnIdleChannelTheWorkerClosedIsNotUsedAgain) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
  worker.Read(0);
  worker.Answer(0, grpc::StatusCode::OK, "one");
  ends.Wait(1);
  shutdown(worker.fd(0), SHUT_RDWR);
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 2);
  EXPECT_EQ(worker.Read(1).request(), "next");
  worker.Answer(1, grpc::StatusCode::OK, "two");
  const Ended ended = ends.Wait(2);
  EXPECT_TRUE(ended.status.ok()) << ended.status.error_message();
  EXPECT_EQ(ended.response, "two");
  EXPECT_EQ(ends.count(), 2u);
}

// The worker's side on a thread of its own: reads `calls` calls on channel `i` (once it is
// open) and answers each after `delay`.
class AnsweringWorker {
 public:
  AnsweringWorker(FakeWorker& worker, int calls, absl::Duration delay = absl::ZeroDuration(),
                  int i = 0)
      : thread_([&worker, calls, delay, i] {
          worker.WaitOpened(i);
          for (int k = 0; k < calls; ++k) {
            const internal::v1::RelayedCall call = worker.Read(i);
            absl::SleepFor(delay);
            worker.Answer(i, grpc::StatusCode::OK, "answer to " + call.request());
          }
        }) {}
  ~AnsweringWorker() { thread_.join(); }

 private:
  std::thread thread_;
};

TEST(UnaryChannelsTest, AnAnswerWithinTheWaitIsCompletedOnTheCallingThread) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  AnsweringWorker answering(worker, 3);
  for (int i = 1; i <= 3; ++i) {
    UnaryChannels::Done done = ends.Next();
    const std::string request = "call " + std::to_string(i);
    ASSERT_TRUE(channels.Call(kMethod, Buffer(request), done, absl::Seconds(30)));
    // Completed before Call returned, here.
    ASSERT_EQ(ends.count(), static_cast<size_t>(i));
    const Ended ended = ends.Wait(static_cast<size_t>(i));
    EXPECT_EQ(ended.response, "answer to " + request);
    EXPECT_EQ(ended.thread, std::this_thread::get_id());
  }
  EXPECT_EQ(worker.opened(), 1);
  EXPECT_EQ(UnaryChannels::inline_waiters(), 0);
}

TEST(UnaryChannelsTest, AnAnswerLaterThanTheWaitIsCompletedByTheChannelsThread) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("slow"), done, absl::Milliseconds(1)));
  EXPECT_EQ(ends.count(), 0u);  // the worker has not even read the call
  EXPECT_EQ(UnaryChannels::inline_waiters(), 0);
  EXPECT_EQ(worker.Read(0).request(), "slow");
  worker.Answer(0, grpc::StatusCode::OK, "late");
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.response, "late");
  EXPECT_NE(ended.thread, std::this_thread::get_id());
  // The channel serves the next call, which may wait again.
  AnsweringWorker answering(worker, 1);
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("quick"), next, absl::Seconds(30)));
  EXPECT_EQ(ends.Wait(2).response, "answer to quick");
  EXPECT_EQ(ends.Wait(2).thread, std::this_thread::get_id());
  EXPECT_EQ(worker.opened(), 1);
}

// Sets the process's bound on waiting calling threads for one test.
class WaitersBound {
 public:
  explicit WaitersBound(int max) : saved_(UnaryChannels::max_inline_waiters()) {
    UnaryChannels::set_max_inline_waiters_for_test(max);
  }
  ~WaitersBound() { UnaryChannels::set_max_inline_waiters_for_test(saved_); }

 private:
  const int saved_;
};

// Starts a call with a long wait on a thread of its own, whose worker does not answer yet,
// and returns that thread once the call waits.
std::thread CallThatWaits(UnaryChannels& channels, Ends& ends) {
  std::thread waiting([&channels, &ends] {
    UnaryChannels::Done done = ends.Next();
    EXPECT_TRUE(channels.Call(kMethod, Buffer("waits"), done, absl::Seconds(60)));
  });
  for (int i = 0; i < 10000 && UnaryChannels::inline_waiters() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return waiting;
}

TEST(UnaryChannelsTest, NoMoreThanTheBoundOfCallingThreadsWait) {
  WaitersBound bound(1);
  FakeWorker first_worker, second_worker;
  Ends ends;
  UnaryChannels first(first_worker.Opener()), second(second_worker.Opener());
  // One thread waits for an answer that does not come yet...
  std::thread waiting = CallThatWaits(first, ends);
  const std::thread::id waiting_id = waiting.get_id();
  EXPECT_EQ(UnaryChannels::inline_waiters(), 1);
  // ... so another call, of another session, does not wait, though its worker answers at
  // once: its channel's thread completes it.
  {
    AnsweringWorker answering(second_worker, 1);
    UnaryChannels::Done done = ends.Next();
    EXPECT_TRUE(second.Call(kMethod, Buffer("does not wait"), done, absl::Seconds(60)));
  }
  const Ended second_end = ends.Wait(1);
  EXPECT_EQ(second_end.response, "answer to does not wait");
  EXPECT_NE(second_end.thread, std::this_thread::get_id());
  // The waiting thread completes its own call.
  EXPECT_EQ(first_worker.Read(0).request(), "waits");
  first_worker.Answer(0, grpc::StatusCode::OK, "first");
  waiting.join();
  const Ended first_end = ends.Wait(2);
  EXPECT_EQ(first_end.response, "first");
  EXPECT_EQ(first_end.thread, waiting_id);
  EXPECT_EQ(UnaryChannels::inline_waiters(), 0);
}

TEST(UnaryChannelsTest, OneCallingThreadPerSessionWaits) {
  WaitersBound bound(4);
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  std::thread waiting = CallThatWaits(channels, ends);
  const std::thread::id waiting_id = waiting.get_id();
  EXPECT_EQ(UnaryChannels::inline_waiters(), 1);
  // The session's second call, on its second channel, does not wait though slots are free.
  {
    AnsweringWorker answering(worker, 1, absl::ZeroDuration(), 1);
    UnaryChannels::Done done = ends.Next();
    EXPECT_TRUE(channels.Call(kMethod, Buffer("second"), done, absl::Seconds(60)));
  }
  const Ended second_end = ends.Wait(1);
  EXPECT_EQ(second_end.response, "answer to second");
  EXPECT_NE(second_end.thread, std::this_thread::get_id());
  EXPECT_EQ(worker.Read(0).request(), "waits");
  worker.Answer(0, grpc::StatusCode::OK, "first");
  waiting.join();
  EXPECT_EQ(ends.Wait(2).thread, waiting_id);
  // Once it is done, the session's next call may wait again.
  AnsweringWorker answering(worker, 1);
  UnaryChannels::Done next = ends.Next();
  EXPECT_TRUE(channels.Call(kMethod, Buffer("third"), next, absl::Seconds(60)));
  EXPECT_EQ(ends.count(), 3u);
  EXPECT_EQ(ends.Wait(3).thread, std::this_thread::get_id());
}

TEST(UnaryChannelsTest, PartOfAFrameDoesNotHoldTheCallingThread) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  internal::v1::RelayedAnswer answer;
  answer.set_response("whole at last");
  const std::string body = answer.SerializeAsString();
  const std::string frame = Header(static_cast<uint32_t>(body.size())) + body;
  absl::Notification returned;
  std::thread trickling([&] {
    worker.WaitOpened(0);
    worker.Read(0);
    worker.Write(0, frame.substr(0, 6));
    // The rest comes once the call was handed over (or after 2 s, when the calling thread
    // wrongly reads on: then it completes the call itself, which the test sees).
    returned.WaitForNotificationWithTimeout(absl::Seconds(2));
    worker.Write(0, frame.substr(6));
  });
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done, absl::Seconds(30)));
  returned.Notify();
  trickling.join();
  const Ended ended = ends.Wait(1);
  EXPECT_TRUE(ended.status.ok()) << ended.status.error_message();
  EXPECT_EQ(ended.response, "whole at last");
  EXPECT_NE(ended.thread, std::this_thread::get_id());
  EXPECT_EQ(UnaryChannels::inline_waiters(), 0);
}

TEST(UnaryChannelsTest, AFrameThatBreaksTheChannelIsCompletedByTheChannelsThread) {
  // Completing a broken call may wait for the worker's exit: never on the calling thread.
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  std::thread breaking([&] {
    worker.WaitOpened(0);
    worker.Read(0);
    worker.Write(0, Header(4) + std::string("\xff\xff\xff\xff", 4));
  });
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done, absl::Seconds(30)));
  breaking.join();
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ended.status.error_message(), HasSubstr("does not parse"));
  EXPECT_NE(ended.thread, std::this_thread::get_id());
}

TEST(UnaryChannelsTest, ARefusalWithinTheWaitHandsTheCallBackOnTheCallingThread) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  std::thread refusing([&] {
    worker.WaitOpened(0);
    worker.Read(0);
    worker.Write(0, EndFrame(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many channels"));
  });
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done, absl::Seconds(30)));
  refusing.join();
  ASSERT_EQ(ends.count(), 1u);
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.outcome, UnaryChannels::Outcome::kRefused);
  EXPECT_EQ(ended.status.error_message(), "too many channels");
  EXPECT_EQ(ended.thread, std::this_thread::get_id());
}

TEST(UnaryChannelsTest, AWorkerThatClosesTheChannelDuringTheWaitEndsTheCall) {
  FakeWorker worker;
  Ends ends;
  UnaryChannels channels(worker.Opener());
  std::thread breaking([&] {
    worker.WaitOpened(0);
    worker.Read(0);
    shutdown(worker.fd(0), SHUT_RDWR);
  });
  UnaryChannels::Done done = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done, absl::Seconds(30)));
  breaking.join();
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(ended.answered_by_worker());
  EXPECT_NE(ended.thread, std::this_thread::get_id());
  // The next call opens another channel.
  UnaryChannels::Done next = ends.Next();
  ASSERT_TRUE(channels.Call(kMethod, Buffer("next"), next));
  EXPECT_EQ(worker.opened(), 2);
}

TEST(UnaryChannelsTest, ClosingTheChannelsAnswersTheCallInFlight) {
  FakeWorker worker;
  Ends ends;
  {
    UnaryChannels channels(worker.Opener());
    UnaryChannels::Done done = ends.Next();
    ASSERT_TRUE(channels.Call(kMethod, Buffer("call"), done));
    worker.Read(0);
  }
  const Ended ended = ends.Wait(1);
  EXPECT_EQ(ended.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(ended.answered_by_worker());
}

}  // namespace
}  // namespace gpurpc::frontend
