// gpurpc C++ client: RAII handles over the gpurpc.v1 API.
//
//   auto client = gpurpc::Client::Connect(gpurpc::ConnectOptions());  // see "Connecting"
//   auto session = client->OpenSession(/*device_ordinal=*/0);
//   auto buffer = session->Allocate(1 << 20);
//   buffer->Upload(bytes);                        // any size: streamed in 1 MiB chunks
//   gpurpc::CompileOptions compile;
//   compile.source = kSaxpy;
//   auto compiled = session->Compile(compile);    // compiled->log(), compiled->success()
//   auto saxpy = compiled->module.GetFunction("saxpy");
//   gpurpc::LaunchConfig launch;
//   launch.grid = {n / 256, 1, 1};
//   launch.block = {256, 1, 1};
//   saxpy->LaunchAsync(launch, 2.0f, *x, *y, n);  // through the command stream
//   session->Synchronize();                       // execution errors surface here
//
// Ownership: Session, Buffer, Module, Stream, Event, Graph and GraphExec are move-only
// owners; destroying one releases the remote object and never throws (failures are logged to
// stderr when GPURPC_CLIENT_DEBUG is set). Every handle keeps its session's connection alive;
// handles that outlive their Session become inert (the daemon already freed them).
// Function is a cheap copyable value that keeps its module loaded.
//
// Errors: absl::Status with the daemon's code and message (DESIGN §3): INVALID_ARGUMENT
// for bad input, NOT_FOUND for unknown handles, RESOURCE_EXHAUSTED for memory, ABORTED for
// the call that observes a kernel fault, FAILED_PRECONDITION for every call on a FAULTED
// session afterwards (DEADLINE_EXCEEDED instead when the daemon's kernel watchdog ended
// it), DEADLINE_EXCEEDED naming the call and the timeout when a call's own deadline passed.
//
// Deadlines. Every call that waits for the daemon has one: the call timeout
// (ConnectOptions::call_timeout, else $GPURPC_TIMEOUT, else 5 minutes; per session
// Session::set_call_timeout; per call Session/Stream/Event::Synchronize(timeout)). A unary
// call gets it as its gRPC deadline, and returns at it also when the daemon takes no bytes
// (stopped, wedged: the call is cancelled and abandoned then). The command stream lives as long as
// the session and has none as a whole; each write of a batch (which blocks while the daemon takes
// no bytes) and each wait for the daemon's answer (Synchronize, and the wait for queued commands
// before a unary call) has one. A streamed transfer (Upload/Download above 1 MiB) has no deadline
// as a whole, its size being unbounded; each step (every 1 MiB chunk, the final answer) must make
// progress within the call timeout, else it is cancelled. A deadline on a synchronising call
// does not cancel GPU work: the kernel runs on, and the session stays usable (a later
// Synchronize waits for it; the daemon's kernel watchdog, not the client, ends kernels that
// run too long). Close and KeepAlive use short bounds of their own (5 s and 10 s, or the call
// timeout when shorter); handle destructors' cleanup calls at most 10 s.
//
// Liveness and faults. A Session holds one WatchSession stream open while it exists (served by
// one background thread per process, which waits on the network only while the process makes
// no call, so that every call's own thread reads its answer with no hand-over between threads;
// no thread is parked per session). It is the daemon's proof that the
// client lives: a session whose client dies or disconnects is reclaimed after the daemon's
// grace (--session-grace, default 10 s), and a session that is merely idle is kept however
// long. A broken stream (connection lost, daemon restarting) is re-opened with a backoff of
// 50 ms doubling up to a quarter of the grace (at most 2 s) while the Session exists, so a
// network drop shorter than the grace keeps the session. The stream delivers faults: once it
// reports the session FAULTED (or gone: NOT_FOUND), every call returns that status at once,
// without a round trip, and Session::state()/fault() say so.
//
// Daemon restarts. Every session-scoped call sends the daemon instance from OpenSession as
// "gpurpc-instance" metadata; a session of an earlier run of the daemon answers NOT_FOUND
// with a message that says the daemon restarted, returned as is (also by every later call,
// once the watch has seen it). The Client needs nothing: its channel reconnects by itself,
// and Client::OpenSession opens a new session on the new daemon right away (a client call
// that finds the channel disconnected reconnects at once and tries again, waiting at most
// 10 s for the connection).
//
// Thread safety: a Session and its handles may be used from several threads; commands
// enqueued from different threads are ordered by when they were enqueued.
//
// Connecting (ConnectOptions). Where: an explicit address, else $GPURPC_ADDRESS, else the
// first daemon socket that exists of $XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock,
// /run/gpurpc/gpurpcd.sock and /tmp/gpurpc-<uid>/gpurpcd.sock (where gpurpcd puts its socket
// by default), else UNAVAILABLE naming every place looked at. Who: on a Unix socket the
// daemon knows the caller from the kernel (its uid is the tenant) and needs no credentials;
// over TCP every call needs a bearer token (ConnectOptions::token, else $GPURPC_TOKEN, else
// the file named by $GPURPC_TOKEN_FILE) and/or a TLS client certificate whose common name
// is the tenant. Without valid credentials every call fails with UNAUTHENTICATED. The token
// is never logged and never put in a status message.
#ifndef GPURPC_CLIENT_CPP_INCLUDE_GPURPC_CLIENT_H_
#define GPURPC_CLIENT_CPP_INCLUDE_GPURPC_CLIENT_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpurpc/v1/admin_service.pb.h"
#include "gpurpc/v1/device_service.pb.h"
#include "gpurpc/v1/execution_service.pb.h"
#include "gpurpc/v1/memory_service.pb.h"
#include "gpurpc/v1/module_service.pb.h"
#include "gpurpc/v1/session_service.pb.h"

namespace grpc {
class Channel;
}

namespace gpurpc {

class Session;
class Buffer;
class Module;
class Function;
class Stream;
class Event;
class Graph;
class GraphExec;
class KernelArg;

namespace internal {
class SessionCore;
struct ModuleHandle;
class Daemons;
struct TargetSpec;
struct ChannelFactory;
// Session::Allocate's call, for the client's own temporary buffers (Array::Upload).
absl::StatusOr<Buffer> AllocateBuffer(const std::shared_ptr<SessionCore>& core,
                                      uint64_t size_bytes);
}  // namespace internal

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
};

struct LaunchConfig {
  Dim3 grid;
  Dim3 block;
  uint32_t shared_memory_bytes = 0;
  const Stream* stream = nullptr;  // nullptr = the session's default stream
};

struct MemInfo {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};

// How to reach a gpurpcd and what to prove to it. Every field left empty falls back to the
// environment variable named beside it (unless use_environment is false), then to the
// default given.
struct ConnectOptions {
  // gRPC target: "host:port", "dns:///host:port", "unix:/path/to.sock" or an absolute socket
  // path. Empty: $GPURPC_ADDRESS, else the first existing default socket (see
  // DefaultSocketPaths()), else Connect fails with UNAVAILABLE naming the places looked at.
  //
  // Several daemons: a comma-separated list of targets ("gpu1:50051,gpu2:50051"), and a
  // "dns:///NAME:PORT" target (a Kubernetes headless Service) stands for every address NAME
  // resolves to, resolved anew whenever a session is placed; over TLS the daemons'
  // certificates are then checked against NAME unless server_name_override says otherwise.
  // Addresses that reach one daemon (same daemon_instance) count once. See "Several daemons"
  // at Client.
  std::string address;

  // Bearer token, sent as "authorization: Bearer <token>" metadata on every call the client
  // makes (the command stream and calls through channel() included); harmless on a Unix
  // socket. Empty: read from token_file, else $GPURPC_TOKEN, else the file named by
  // $GPURPC_TOKEN_FILE. A token file holds the token alone; surrounding whitespace is
  // stripped; a missing, unreadable or empty file fails Connect with its path (never its
  // contents). No token at all is fine for Unix sockets and mutual TLS.
  std::string token;
  std::string token_file;

  // TLS for the connection: on when tls is true, when $GPURPC_TLS is "1"/"true"/"yes", or
  // when any certificate below (or its environment variable) is given. TLS settings from
  // the environment are not applied to Unix-socket targets (the daemon's Unix socket is
  // plain; the kernel vouches for the peer); explicit ones are.
  bool tls = false;
  // Roots that verify the daemon's certificate, as PEM text or a PEM file ($GPURPC_TLS_CA).
  // Neither: the system's default roots.
  std::string root_certs_pem;
  std::string root_certs_file;
  // Client certificate chain and private key for mutual TLS, PEM text or files
  // ($GPURPC_TLS_CERT, $GPURPC_TLS_KEY); give both or neither. The daemon takes the
  // certificate's common name as the tenant.
  std::string client_cert_pem;
  std::string client_cert_file;
  std::string client_key_pem;
  std::string client_key_file;
  // The name the daemon's certificate must carry when it differs from the host in address
  // (an IP address, a test certificate): gRPC's grpc.ssl_target_name_override
  // ($GPURPC_TLS_SERVER_NAME).
  std::string server_name_override;

  // How long Connect waits for the daemon to answer.
  absl::Duration timeout = absl::Seconds(10);
  // The deadline of every call the client and its sessions make (see "Deadlines" above).
  // Zero: $GPURPC_TIMEOUT (seconds, e.g. "90", or a duration, e.g. "90s", "10m", "1h";
  // anything else fails Connect with INVALID_ARGUMENT), else 5 minutes.
  // absl::InfiniteDuration(): no deadline at all (a hung daemon then hangs the caller).
  absl::Duration call_timeout = absl::ZeroDuration();
  // Connections to the daemon a large streamed transfer (Upload or Download of 16 MiB and
  // more) is split over, in parts of at least 8 MiB moved at once, each on its own
  // connection and thread ($GPURPC_TRANSFER_CONNECTIONS overrides it; 1 to
  // kMaxTransferConnections). One connection carries one message at a time per stream
  // through gRPC's per-connection work, which bounds a transfer to a few GB/s; parts on
  // several connections add up. 1: every transfer on the session's one connection. With
  // several daemons every transfer keeps to the session's connection. The extra connections
  // are opened when a transfer first needs them.
  int transfer_connections = 4;
  // False: ignore every GPURPC_* variable (only what is set here counts).
  bool use_environment = true;
};

// The most connections ConnectOptions::transfer_connections may name.
inline constexpr int kMaxTransferConnections = 16;

// The default daemon socket paths, in the order they are tried:
// $XDG_RUNTIME_DIR/gpurpc/gpurpcd.sock (when XDG_RUNTIME_DIR is set),
// /run/gpurpc/gpurpcd.sock, /tmp/gpurpc-<uid>/gpurpcd.sock.
std::vector<std::string> DefaultSocketPaths();

// The gRPC target Connect would use for `address` (see ConnectOptions::address); an
// absolute path becomes "unix:PATH". UNAVAILABLE when nothing is given and no default socket
// exists.
absl::StatusOr<std::string> ResolveAddress(const std::string& address = "",
                                           bool use_environment = true);

// Client::OpenSession's device_ordinal for "place the session": on the device, of any of the
// client's daemons, with the most free memory and then the fewest sessions.
inline constexpr int kAnyDevice = -1;

// One daemon of a Client as Client::Daemons() found it.
struct DaemonStatus {
  // The gRPC target (a dns:/// name's addresses become "ipv4:A.B.C.D:PORT"/"ipv6:[..]:PORT").
  std::string target;
  // OK when it answered ListDevices; else why not (down, refused the credentials, ...).
  absl::Status status;
  // Its devices with their load, daemon_instance and accepting_sessions (when it answered).
  v1::ListDevicesResponse devices;
};

// A connection to one gpurpcd, or to several. Copyable (copies share the channels).
//
// Several daemons (ConnectOptions::address lists several, or a dns:/// name resolves to
// several addresses): Connect succeeds when at least one daemon answers. OpenSession
// (kAnyDevice) places each new session: it asks every daemon for its devices' load at once
// (ListDevices, at most 5 s), passes over daemons that do not answer or are draining, and
// opens the session on the device with the most free memory (in steps of 256 MiB), then the
// fewest sessions, then the first in order; when that open fails with UNAVAILABLE,
// RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED it tries the next device, and any other error is
// returned at once. OpenSession(n) with n >= 0 numbers the devices of all answering daemons
// in one list: the daemons in the order given (a dns:/// name's addresses sorted), each
// daemon's devices in ordinal order. A session stays on the daemon that holds it: all of its
// calls go there. ListDevices, GetServerInfo and the admin calls go to the first daemon
// that answered at Connect (target()); Daemons() reports every daemon.
class Client {
 public:
  // Resolves the address and the credentials, connects, and checks with ListDevices that the
  // daemon answers and accepts the credentials. Errors: UNAVAILABLE when it cannot be
  // reached within options.timeout (with gRPC's reason, e.g. a TLS handshake failure);
  // UNAUTHENTICATED when it refuses the credentials; INVALID_ARGUMENT for unusable options
  // (unreadable token or certificate files, a client certificate without its key).
  static absl::StatusOr<Client> Connect(const ConnectOptions& options);
  // The same with options.address = address and options.timeout = timeout (credentials and
  // the call timeout from the environment).
  static absl::StatusOr<Client> Connect(const std::string& address,
                                        absl::Duration timeout = absl::Seconds(10));

  absl::StatusOr<v1::ListDevicesResponse> ListDevices() const;
  // Opens a session (one worker process with one context) on a device; its calls use this
  // client's call timeout. kAnyDevice places it (see "Several daemons" above; with one daemon
  // among its devices). Errors: NOT_FOUND for an ordinal no daemon serves; UNAVAILABLE when
  // no daemon answers or accepts sessions (naming each and why).
  absl::StatusOr<Session> OpenSession(int device_ordinal = 0,
                                      const std::string& client_label = "") const;
  // Every daemon of the client, in order, each with its devices and their load or why it did
  // not answer (at most min(call timeout, 5 s)); a dns:/// name is resolved anew, and a
  // daemon reached again under another address is listed once.
  std::vector<DaemonStatus> Daemons() const;
  // The daemon as the caller sees it: tenant, how it was authenticated, admin or not,
  // quota and current use, compile sandbox.
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo() const;

  // AdminService (admin tenants only; others get PERMISSION_DENIED).
  // Every open session of every tenant, or of `tenant` only when it is not empty.
  absl::StatusOr<v1::ListSessionsResponse> AdminListSessions(const std::string& tenant = "") const;
  // Closes any tenant's session; NOT_FOUND for an unknown id.
  absl::StatusOr<v1::AdminCloseSessionResponse> AdminCloseSession(uint64_t session_id) const;

  // The gRPC target connected to (after resolution); with several daemons, the first that
  // answered at Connect.
  const std::string& target() const { return target_; }
  // True when the client has several daemons (see "Several daemons" above).
  bool multi_daemon() const { return daemons_ != nullptr; }
  // The deadline of this client's calls and of its sessions' (ConnectOptions::call_timeout).
  absl::Duration call_timeout() const { return call_timeout_; }
  // The channel, for calling the proto API directly; it adds the token to every call.
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  Client(std::shared_ptr<grpc::Channel> channel, std::string target, absl::Duration call_timeout,
         std::shared_ptr<internal::Daemons> daemons = nullptr)
      : channel_(std::move(channel)),
        target_(std::move(target)),
        call_timeout_(call_timeout),
        daemons_(std::move(daemons)) {}
  static absl::StatusOr<Client> ConnectSeveral(std::vector<internal::TargetSpec> specs,
                                               internal::ChannelFactory factory,
                                               absl::Duration timeout, absl::Duration call_timeout,
                                               bool tls, bool has_credentials);
  absl::StatusOr<Session> OpenSessionOn(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& target, int device_ordinal,
                                        const std::string& client_label) const;
  std::shared_ptr<grpc::Channel> channel_;
  std::string target_;
  absl::Duration call_timeout_;
  std::shared_ptr<internal::Daemons> daemons_;  // null with one daemon
  // Makes a session's further transfer connections (ConnectOptions::transfer_connections);
  // null with several daemons, or when transfers keep to one connection.
  std::shared_ptr<const internal::ChannelFactory> transfer_factory_;
  int transfer_connections_ = 1;
};

// Where device memory is addressed: a buffer plus an offset, or a raw address inside a
// buffer of the session (pointer arithmetic).
struct DeviceRef {
  uint64_t buffer_id = 0;       // 0: a raw address, resolved by the daemon
  uint64_t offset_bytes = 0;    // offset into buffer_id
  uint64_t device_address = 0;  // the address of the byte referred to
  static DeviceRef Address(uint64_t address) { return DeviceRef{0, 0, address}; }
};

namespace internal {
// What every handle to an object of a session (Buffer, Array, Stream, Event, HostRegion,
// Graph, GraphExec) holds: the session and the object's id, and what follows from them,
// written once here. Move-only: a move hands the object over and the source holds none
// (id 0). Destruction, and assigning another handle over this one, release the object
// remotely with Derived::Release (bounded by the session's call timeout and
// kCleanupTimeout; a failure is written to stderr only when $GPURPC_CLIENT_DEBUG is set),
// unless the session is closed, faulted or lost (the daemon frees a session's objects with
// it). ReleaseNow is the explicit form (Free, Destroy, Unregister): a handle whose release
// fails keeps its object, so a later call, or destruction, tries again. Derived declares
// `static absl::Status Release(SessionCore&, uint64_t id, absl::Duration timeout)` and
// `static constexpr char kKind[]` (its name in cleanup messages). Member definitions:
// client/cpp/src/session_object.h.
template <typename Derived>
class SessionObject {
 public:
  uint64_t id() const { return id_; }

 protected:
  SessionObject() = default;
  SessionObject(SessionObject&& other) noexcept;
  SessionObject& operator=(SessionObject&& other) noexcept;
  ~SessionObject();
  // Releases now within the call timeout; NOT_FOUND `none_message` when it holds none.
  absl::Status ReleaseNow(const char* none_message);

  std::shared_ptr<SessionCore> core_;
  uint64_t id_ = 0;

 private:
  void ReleaseQuietly();
};
}  // namespace internal

// A device buffer. Move-only; freed remotely on destruction.
class Buffer : public internal::SessionObject<Buffer> {
 public:
  Buffer() = default;
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;
  ~Buffer();

  // 0 once the handle holds no buffer (freed or moved from), so that no copy of its old
  // address reaches memory that another handle now owns.
  uint64_t device_address() const { return id_ == 0 ? 0 : device_address_; }
  uint64_t size_bytes() const { return id_ == 0 ? 0 : size_bytes_; }
  // A reference to byte `offset_bytes` of this buffer (an empty one once it holds none).
  DeviceRef at(uint64_t offset_bytes = 0) const {
    if (id_ == 0) return DeviceRef{};
    return DeviceRef{id_, offset_bytes, device_address_ + offset_bytes};
  }

  // Synchronous copies of any size (chunked streams above 1 MiB).
  absl::Status Upload(absl::Span<const uint8_t> data, uint64_t offset_bytes = 0) const;
  absl::StatusOr<std::vector<uint8_t>> Download(uint64_t offset_bytes, uint64_t size_bytes) const;
  absl::StatusOr<std::vector<uint8_t>> Download() const { return Download(0, size_bytes_); }
  // Frees now; NOT_FOUND when already freed.
  absl::Status Free();

 private:
  friend class Session;
  friend absl::StatusOr<Buffer> internal::AllocateBuffer(
      const std::shared_ptr<internal::SessionCore>& core, uint64_t size_bytes);
  friend class internal::SessionObject<Buffer>;
  static constexpr char kKind[] = "buffer";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
  uint64_t device_address_ = 0;
  uint64_t size_bytes_ = 0;
};

// One side of Session::Copy3D: an array at (x_bytes, y, z), or linear device memory whose
// rows are pitch_bytes apart (0 = the copy's width) and slices `height` rows apart (0 = the
// copy's height). Array::at and Copy3DEnd::Linear make them.
struct Copy3DEnd {
  uint64_t array_id = 0;  // 0: linear memory at `device`
  DeviceRef device;
  uint64_t pitch_bytes = 0;
  uint64_t height = 0;
  uint64_t x_bytes = 0;
  uint64_t y = 0;
  uint64_t z = 0;
  static Copy3DEnd Linear(const DeviceRef& device, uint64_t pitch_bytes = 0, uint64_t height = 0) {
    Copy3DEnd end;
    end.device = device;
    end.pitch_bytes = pitch_bytes;
    end.height = height;
    return end;
  }
};

// A CUDA array (Session::AllocateArray): device memory in the driver's texture layout,
// which kernels cannot address; Session::Copy3D (and Upload/Download here) move bytes in and
// out. Move-only; freed remotely on destruction.
class Array : public internal::SessionObject<Array> {
 public:
  Array() = default;
  Array(Array&&) noexcept;
  Array& operator=(Array&&) noexcept;
  ~Array();

  const v1::ArrayDescriptor& descriptor() const { return descriptor_; }
  // What it is charged against the tenant's device memory (memory_service.proto).
  uint64_t charged_bytes() const { return charged_bytes_; }
  // Bytes of one row (width times the element's bytes), rows per slice and slices (at least 1).
  uint64_t row_bytes() const { return row_bytes_; }
  uint64_t rows() const { return descriptor_.height() == 0 ? 1 : descriptor_.height(); }
  uint64_t slices() const { return descriptor_.depth() == 0 ? 1 : descriptor_.depth(); }
  // Where a copy starts in this array: x in bytes, y in rows, z in slices.
  Copy3DEnd at(uint64_t x_bytes = 0, uint64_t y = 0, uint64_t z = 0) const {
    Copy3DEnd end;
    end.array_id = id_;
    end.x_bytes = x_bytes;
    end.y = y;
    end.z = z;
    return end;
  }
  // The whole array from or into packed host bytes (rows of row_bytes(), row after row,
  // slice after slice), synchronously, through a temporary device buffer of that size.
  absl::Status Upload(absl::Span<const uint8_t> data) const;
  absl::StatusOr<std::vector<uint8_t>> Download() const;
  // Frees now; NOT_FOUND when already freed.
  absl::Status Free();

 private:
  friend class Session;
  friend class internal::SessionObject<Array>;
  static constexpr char kKind[] = "array";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
  v1::ArrayDescriptor descriptor_;
  uint64_t charged_bytes_ = 0;
  uint64_t row_bytes_ = 0;
};

// A stream of the session. Move-only; destroyed remotely on destruction.
class Stream : public internal::SessionObject<Stream> {
 public:
  Stream() = default;
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  ~Stream();
  // Waits for the stream's work (flushing queued commands first), at most the call timeout
  // or `timeout`; a deadline that passes returns DEADLINE_EXCEEDED and does not cancel the
  // work (see "Deadlines").
  absl::Status Synchronize() const;
  absl::Status Synchronize(absl::Duration timeout) const;
  // Whether the stream's queued work is done (QueryStream), without waiting for it; what
  // the command stream holds is sent first. FAILED_PRECONDITION while the stream captures.
  absl::StatusOr<bool> Query() const;
  // Makes this stream wait for `event` (stream ordered, through the command stream).
  absl::Status WaitEvent(const Event& event) const;

  // CUDA graphs. BeginCapture starts recording this stream's work: kernel launches, memsets
  // and device-to-device copies enqueued on it until EndCapture do not run, they become the
  // nodes of the Graph that EndCapture returns (instantiate it and launch the GraphExec to
  // run them). Meanwhile the daemon refuses other work on this stream (uploads, downloads,
  // event records and waits, Synchronize) with FAILED_PRECONDITION and the capture goes on;
  // while a blocking stream captures, the default stream cannot be used at all (create the
  // capturing stream non_blocking to keep using it), nor Session::Synchronize while any
  // stream captures. Both calls first send the commands queued before them. `mode` is
  // accepted for CUDA's API; the daemon always captures in RELAXED mode
  // (execution_service.proto says why). Errors: INVALID_ARGUMENT for the default stream
  // (it cannot be captured); FAILED_PRECONDITION for a stream that already captures
  // (BeginCapture) or does not (EndCapture).
  absl::Status BeginCapture(v1::CaptureMode mode = v1::CAPTURE_MODE_RELAXED) const;
  absl::StatusOr<Graph> EndCapture() const;
  // Whether the stream captures (after sending the queued commands).
  absl::StatusOr<bool> IsCapturing() const;

 private:
  friend class Session;
  friend class internal::SessionObject<Stream>;
  static constexpr char kKind[] = "stream";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
};

// An event of the session. Move-only.
class Event : public internal::SessionObject<Event> {
 public:
  Event() = default;
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  ~Event();
  // Records on a stream (nullptr = default), through the command stream.
  absl::Status Record(const Stream* stream = nullptr) const;
  // Waits for the event, at most the call timeout or `timeout` (as Stream::Synchronize).
  absl::Status Synchronize() const;
  absl::Status Synchronize(absl::Duration timeout) const;
  absl::StatusOr<bool> Query() const;
  // Milliseconds from `start` to this event.
  absl::StatusOr<float> ElapsedSince(const Event& start) const;

 private:
  friend class Session;
  friend class internal::SessionObject<Event>;
  static constexpr char kKind[] = "event";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
};

// A same-host region (proto/gpurpc/v1/host_region_service.proto): memory this process
// shares with its session's worker (a sealed memfd, mapped here and there) and that the
// worker has pinned, so that copies between it and device memory are DMA at PCIe speed with
// no bytes through gRPC. Only for a client on the daemon's host. Move-only; on destruction
// (or Unregister) the daemon waits for the session's queued work, unpins and unmaps it, and
// the local mapping goes.
//
// Copies are stream ordered and asynchronous, like cuMemcpy*Async on pinned memory: bytes
// copied to the device are read when the stream reaches the copy (do not change them
// before a synchronising call), bytes copied from the device are in data() after one
// (Stream/Session/Event::Synchronize). Each copy is one command of the command stream.
class HostRegion : public internal::SessionObject<HostRegion> {
 public:
  HostRegion() = default;
  HostRegion(HostRegion&&) noexcept;
  HostRegion& operator=(HostRegion&&) noexcept;
  ~HostRegion();

  uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  // Bytes [offset_bytes, offset_bytes + size_bytes) of the region, clamped to it.
  absl::Span<uint8_t> span(uint64_t offset_bytes, uint64_t size_bytes) const {
    return absl::Span<uint8_t>(data_, size_bytes_).subspan(offset_bytes, size_bytes);
  }
  absl::Span<uint8_t> span() const { return absl::Span<uint8_t>(data_, size_bytes_); }

  // Region bytes [region_offset_bytes, + size_bytes) to `dst`, or `src` to them. Range
  // errors (outside the region or the buffer, size 0) come back from the daemon, at the next
  // synchronising call like every queued command's.
  absl::Status CopyToDevice(const DeviceRef& dst, uint64_t region_offset_bytes, uint64_t size_bytes,
                            const Stream* stream = nullptr) const;
  absl::Status CopyFromDevice(const DeviceRef& src, uint64_t region_offset_bytes,
                              uint64_t size_bytes, const Stream* stream = nullptr) const;
  // Unregisters now; NOT_FOUND when already gone. The mapping stays until destruction.
  absl::Status Unregister();

 private:
  friend class Session;
  void Unmap();
  friend class internal::SessionObject<HostRegion>;
  static constexpr char kKind[] = "host region";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
  uint8_t* data_ = nullptr;
  uint64_t size_bytes_ = 0;
};

// A captured graph (Stream::EndCapture). Move-only; destroyed remotely on destruction
// (graph execs made from it stay usable).
class Graph : public internal::SessionObject<Graph> {
 public:
  Graph() = default;
  Graph(Graph&&) noexcept;
  Graph& operator=(Graph&&) noexcept;
  ~Graph();
  uint32_t node_count() const { return node_count_; }
  // An executable graph of it; RESOURCE_EXHAUSTED past the session's bound of graph execs.
  absl::StatusOr<GraphExec> Instantiate() const;
  // Its nodes in capture order: type, and for kernel nodes the function, its parameters and
  // its launch dimensions.
  absl::StatusOr<std::vector<v1::GraphNode>> Nodes() const;
  // Destroys now; NOT_FOUND when already destroyed.
  absl::Status Destroy();

 private:
  friend class Stream;
  friend class internal::SessionObject<Graph>;
  static constexpr char kKind[] = "graph";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
  uint32_t node_count_ = 0;
};

// An executable graph (Graph::Instantiate). Move-only; destroyed remotely on destruction
// (launches already enqueued still run).
class GraphExec : public internal::SessionObject<GraphExec> {
 public:
  GraphExec() = default;
  GraphExec(GraphExec&&) noexcept;
  GraphExec& operator=(GraphExec&&) noexcept;
  ~GraphExec();
  // Runs the graph's nodes in order on `stream` (nullptr = the default stream), through the
  // command stream like Function::LaunchAsync: one command for the whole graph; errors
  // surface at the next synchronising call.
  absl::Status Launch(const Stream* stream = nullptr) const;
  // Takes the parameters of `graph`, which must have the same nodes (count and types, in
  // order): FAILED_PRECONDITION naming the first difference otherwise, and nothing changes.
  absl::Status Update(const Graph& graph) const;
  // Sets kernel node `node_index` (Graph::Nodes' index) to launch `function` with `config`
  // (its stream is ignored) and `args`, for later launches. Checked like a launch: the
  // arguments against the kernel's parameters, the dimensions against the device.
  template <typename... Args>
  absl::Status SetKernelNodeArgs(uint32_t node_index, const Function& function,
                                 const LaunchConfig& config, const Args&... args) const;
  absl::Status SetKernelNodeArgsPacked(uint32_t node_index, const Function& function,
                                       const LaunchConfig& config,
                                       absl::Span<const KernelArg> args) const;
  // Destroys now; NOT_FOUND when already destroyed.
  absl::Status Destroy();

 private:
  friend class Graph;
  friend class internal::SessionObject<GraphExec>;
  static constexpr char kKind[] = "graph exec";
  static absl::Status Release(internal::SessionCore& core, uint64_t id, absl::Duration timeout);
};

// One kernel argument, packed by value.
class KernelArg {
 public:
  // A buffer (its device address), optionally plus an offset.
  KernelArg(const Buffer& buffer) : KernelArg(buffer.device_address()) {}  // NOLINT
  KernelArg(const DeviceRef& ref) : KernelArg(ref.device_address) {}       // NOLINT
  // Any trivially copyable value (scalars, vector types, structs): its bytes.
  template <typename T,
            typename = std::enable_if_t<std::is_trivially_copyable_v<T> && !std::is_pointer_v<T>>>
  KernelArg(const T& value)  // NOLINT
      : bytes_(reinterpret_cast<const uint8_t*>(&value),
               reinterpret_cast<const uint8_t*>(&value) + sizeof(T)) {}
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// A kernel. Copyable; keeps its module loaded.
class Function {
 public:
  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  const std::vector<v1::ParamInfo>& params() const { return params_; }
  const v1::FunctionAttributes& attributes() const { return attributes_; }

  // Packs `args` at the parameter offsets. INVALID_ARGUMENT naming the parameter index with
  // expected and given sizes when they do not match the kernel's signature.
  absl::StatusOr<std::string> Pack(absl::Span<const KernelArg> args) const;

  // Enqueues through the command stream (no round trip); errors surface at the next
  // synchronising call.
  template <typename... Args>
  absl::Status LaunchAsync(const LaunchConfig& config, const Args&... args) const {
    const KernelArg packed[] = {KernelArg(args)..., KernelArg(0)};
    return LaunchPacked(config, absl::MakeSpan(packed, sizeof...(Args)), LaunchMode::kAsync);
  }
  // One unary RPC; returns once enqueued, with argument errors at once.
  template <typename... Args>
  absl::Status Launch(const LaunchConfig& config, const Args&... args) const {
    const KernelArg packed[] = {KernelArg(args)..., KernelArg(0)};
    return LaunchPacked(config, absl::MakeSpan(packed, sizeof...(Args)), LaunchMode::kUnary);
  }
  // One unary RPC that launches and then waits for config.stream (the default stream when
  // null), as Launch followed by Stream::Synchronize would, in one round trip: argument
  // errors, then what the wait answers (ABORTED for a kernel fault; FAILED_PRECONDITION,
  // with nothing launched, when the stream captures a graph), then the first error of
  // earlier asynchronous work since the last synchronising call. The call's deadline is
  // the call timeout; DEADLINE_EXCEEDED during the wait leaves the kernel running (a retry
  // launches it again) and may lose what it prints. Device printf output goes to the
  // session's handler when the call succeeds (an error answer carries none). Against a
  // daemon that predates the one-call form it sends the launch, then a Synchronize.
  template <typename... Args>
  absl::Status LaunchAndSynchronize(const LaunchConfig& config, const Args&... args) const {
    const KernelArg packed[] = {KernelArg(args)..., KernelArg(0)};
    return LaunchPacked(config, absl::MakeSpan(packed, sizeof...(Args)), LaunchMode::kSynchronize);
  }
  enum class LaunchMode {
    kAsync,        // LaunchAsync: a command of the command stream
    kUnary,        // Launch
    kSynchronize,  // LaunchAndSynchronize
  };
  absl::Status LaunchPacked(const LaunchConfig& config, absl::Span<const KernelArg> args,
                            LaunchMode mode) const;
  // Launches with a packed argument blob as is (PyCUDA style), through the command stream.
  absl::Status LaunchBlobAsync(const LaunchConfig& config, std::string packed_args) const;

  // ModuleService.SetFunctionAttribute (cuFuncSetAttribute): MAX_DYNAMIC_SHARED_SIZE_BYTES
  // (up to the device's opt-in maximum less the kernel's static shared memory) or
  // PREFERRED_SHARED_MEMORY_CARVEOUT (-1 to 100); attributes() then reports the new values.
  // INVALID_ARGUMENT for a read-only attribute or a value outside its bounds.
  absl::Status SetAttribute(v1::FunctionAttribute attribute, int64_t value);
  // ModuleService.SetFunctionCacheConfig (cuFuncSetCacheConfig).
  absl::Status SetCacheConfig(v1::CacheConfig config) const;

 private:
  friend class Module;
  std::shared_ptr<internal::SessionCore> core_;
  std::shared_ptr<internal::ModuleHandle> module_;
  uint64_t id_ = 0;
  std::string name_;
  std::vector<v1::ParamInfo> params_;
  v1::FunctionAttributes attributes_;
};

template <typename... Args>
absl::Status GraphExec::SetKernelNodeArgs(uint32_t node_index, const Function& function,
                                          const LaunchConfig& config, const Args&... args) const {
  const KernelArg packed[] = {KernelArg(args)..., KernelArg(0)};
  return SetKernelNodeArgsPacked(node_index, function, config,
                                 absl::MakeSpan(packed, sizeof...(Args)));
}

// A loaded module. Move-only; unloaded when it and every Function from it are gone.
class Module {
 public:
  Module() = default;
  uint64_t id() const;
  absl::StatusOr<Function> GetFunction(const std::string& name) const;
  struct Global {
    uint64_t device_address = 0;
    uint64_t size_bytes = 0;
    DeviceRef ref() const { return DeviceRef::Address(device_address); }
  };
  absl::StatusOr<Global> GetGlobal(const std::string& name) const;

 private:
  friend class Session;
  std::shared_ptr<internal::SessionCore> core_;
  std::shared_ptr<internal::ModuleHandle> handle_;
};

struct CompileOptions {
  std::string source;
  std::string program_name = "kernel.cu";
  std::vector<std::string> options;
  std::vector<std::pair<std::string, std::string>> headers;  // name, content
  std::vector<std::string> name_expressions;
};

// The result of a compile: a failed compile is not an error, it has success() false and
// the log.
struct CompileResult {
  v1::CompileResponse response;
  Module module;  // loaded when response.success()
  bool success() const { return response.success(); }
  const std::string& log() const { return response.log(); }
  // The lowered name of a name expression, or "" if it was not requested.
  std::string LoweredName(const std::string& name_expression) const;
};

// What Session::Link links (ModuleService.LinkModule), in the order added. The adders return
// *this; nothing is checked before Link.
struct LinkOptions {
  // CUDA C++, compiled on the daemon as Compile compiles it, plus relocatable device code.
  LinkOptions& AddSource(const CompileOptions& source);
  // PTX or binary bytes (v1::LINK_INPUT_TYPE_PTX, _CUBIN, _FATBINARY, _OBJECT; _LIBRARY is
  // refused: send a library's objects, or name the daemon's own with AddStandardLibrary);
  // `name` appears in the linker's messages.
  LinkOptions& AddData(v1::LinkInputType type, std::string data, std::string name = "");
  // A standard library of the daemon's toolkit: "cudadevrt" (dynamic parallelism).
  LinkOptions& AddStandardLibrary(std::string name);
  // CU_JIT_LOG_VERBOSE.
  bool log_verbose = false;
  v1::LinkModuleRequest request;
};

// The result of a link: a source that fails to compile is not an error, it has success()
// false and the sources' logs in response.sources().
struct LinkResult {
  v1::LinkModuleResponse response;
  Module module;  // loaded when response.success()
  bool success() const { return response.success(); }
  // The linker's info log.
  const std::string& log() const { return response.log(); }
  // The lowered name of a name expression of any source, or "" if it was not requested.
  std::string LoweredName(const std::string& name_expression) const;
};

// A session: one worker process holding one context on one device. Move-only; closed on
// destruction. While the object exists its WatchSession stream keeps it alive and reports
// faults (see "Liveness and faults").
class Session {
 public:
  Session() = default;
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  ~Session();

  uint64_t id() const;
  const v1::DeviceInfo& device() const;
  // The daemon holding the session (its gRPC target); every call of the session goes there.
  const std::string& daemon_target() const;

  // Memory.
  absl::StatusOr<Buffer> Allocate(uint64_t size_bytes) const;
  // CUDA IPC between sessions of one tenant on one device (SessionService.ExportMemory and
  // OpenMemoryHandle, session_service.proto): ExportMemory answers an opaque handle (32
  // bytes) for `buffer`, which another session, in this process or another, opens as a
  // Buffer of its own over the same memory. Freeing the opened Buffer closes it; the
  // exporter cannot free its buffer while another session has it open, and when the
  // exporting session ends the buffers opened from it are closed. UNIMPLEMENTED on the fake
  // backend.
  absl::StatusOr<std::string> ExportMemory(const Buffer& buffer) const;
  absl::StatusOr<Buffer> OpenMemoryHandle(const std::string& handle) const;
  // A CUDA array of `descriptor`'s shape (memory_service.proto: bounds, what it is charged).
  absl::StatusOr<Array> AllocateArray(const v1::ArrayDescriptor& descriptor) const;
  // Copies depth slices of height rows of width_bytes between two ends (arrays or pitched
  // linear memory), stream ordered. Copy3D waits for it (and reports its error); Copy3DAsync
  // queues it on the command stream, its error reported at the next synchronising call.
  absl::Status Copy3D(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                      uint64_t height = 1, uint64_t depth = 1,
                      const Stream* stream = nullptr) const;
  absl::Status Copy3DAsync(const Copy3DEnd& dst, const Copy3DEnd& src, uint64_t width_bytes,
                           uint64_t height = 1, uint64_t depth = 1,
                           const Stream* stream = nullptr) const;
  absl::StatusOr<MemInfo> GetMemInfo() const;
  absl::Status Upload(const DeviceRef& dst, absl::Span<const uint8_t> data,
                      const Stream* stream = nullptr) const;
  absl::StatusOr<std::vector<uint8_t>> Download(const DeviceRef& src, uint64_t size_bytes,
                                                const Stream* stream = nullptr) const;
  // Download into caller memory (no extra copy for large transfers).
  absl::Status DownloadInto(const DeviceRef& src, absl::Span<uint8_t> out,
                            const Stream* stream = nullptr) const;
  // element_size_bytes 1, 2 or 4; count in elements. Unary (synchronous argument checks).
  absl::Status Memset(const DeviceRef& dst, uint32_t value, uint32_t element_size_bytes,
                      uint64_t count, const Stream* stream = nullptr) const;
  absl::Status CopyDeviceToDevice(const DeviceRef& dst, const DeviceRef& src, uint64_t size_bytes,
                                  const Stream* stream = nullptr) const;
  // Async forms through the command stream.
  absl::Status MemsetAsync(const DeviceRef& dst, uint32_t value, uint32_t element_size_bytes,
                           uint64_t count, const Stream* stream = nullptr) const;
  absl::Status CopyDeviceToDeviceAsync(const DeviceRef& dst, const DeviceRef& src,
                                       uint64_t size_bytes, const Stream* stream = nullptr) const;
  // ≤ 1 MiB, copied at the call.
  absl::Status UploadAsync(const DeviceRef& dst, absl::Span<const uint8_t> data,
                           const Stream* stream = nullptr) const;

  // Same-host regions (HostRegion). Creates a memfd of `size_bytes`, seals and maps it,
  // registers it with the session and attaches it on the daemon's region socket
  // ($GPURPC_REGION_SOCKET overrides the path the daemon names). FAILED_PRECONDITION when
  // the daemon serves no region socket; UNAVAILABLE when its region socket cannot be reached
  // (this client is not on the daemon's host); RESOURCE_EXHAUSTED past the session's or the
  // tenant's region limits. Nothing is left behind on failure.
  absl::StatusOr<HostRegion> CreateHostRegion(uint64_t size_bytes) const;
  // The direct path (HostRegionService.OpenDirectChannel): from now on ExecutionService
  // calls (launches, streams, events, synchronisation and the command stream with its
  // uploads, downloads and region copies) go straight to the session's worker over a
  // socketpair passed on the region socket, skipping the front end's relay; memory, module
  // and region calls still go through the front end. Same host only. Call it right after
  // OpenSession, before any stream-ordered work and before sharing the session between
  // threads (FAILED_PRECONDITION afterwards); errors as CreateHostRegion. Client::OpenSession
  // does it by itself when $GPURPC_DIRECT is "1" (and carries on without on failure). On
  // the direct path a worker that dies shows as UNAVAILABLE on the call in flight; the
  // session's fault comes from its watch, as always.
  absl::Status UseDirectChannel() const;
  bool direct() const;

  // Modules.
  absl::StatusOr<CompileResult> Compile(const CompileOptions& options) const;
  absl::StatusOr<Module> LoadModule(const std::string& image) const;
  // Links sources, data and standard libraries into one loaded module (LinkModule in
  // module_service.proto: codes and bounds). Link errors (undefined or duplicate symbols)
  // are INVALID_ARGUMENT with the linker's log; a missing standard library is
  // FAILED_PRECONDITION. Implemented in linker.cc.
  absl::StatusOr<LinkResult> Link(const LinkOptions& options) const;

  // Streams and events.
  absl::StatusOr<Stream> CreateStream(bool non_blocking = false) const;
  absl::StatusOr<Event> CreateEvent(bool disable_timing = false) const;
  // CUDA IPC of events between sessions of one tenant on one device (SessionService.
  // ExportEvent and OpenEventHandle): CreateInterprocessEvent makes an event that can be
  // exported (it has no timing); ExportEvent answers an opaque 32-byte handle for it, which
  // another session opens as an Event of its own. Its streams may then wait on work this
  // session records, or the other way round. Destroying the opened Event closes it. The
  // exporter may destroy its event at any time: the daemon keeps the driver's event until
  // the exporting session ends (no new opens after the destroy), and then closes the events
  // opened from it. On the fake backend CreateInterprocessEvent answers UNIMPLEMENTED.
  // ExportEvent answers RESOURCE_EXHAUSTED once the session has exported 4096 events.
  absl::StatusOr<Event> CreateInterprocessEvent() const;
  absl::StatusOr<std::string> ExportEvent(const Event& event) const;
  absl::StatusOr<Event> OpenEventHandle(const std::string& handle) const;

  // Sends queued commands without waiting.
  absl::Status Flush() const;
  // Waits for everything the session has queued. The first asynchronous error since the
  // last synchronising call is returned here (with its command's sequence number). Waits at
  // most the call timeout, or `timeout`: give a long kernel a longer one here rather than
  // raising every call's. A deadline that passes returns DEADLINE_EXCEEDED naming the call
  // and the timeout; it does not cancel the GPU work, which goes on (the next synchronising
  // call waits for it and reports its errors).
  absl::Status Synchronize() const;
  absl::Status Synchronize(absl::Duration timeout) const;

  // Context limits (cuCtxSetLimit/cuCtxGetLimit through ModuleService.SetContextLimit):
  // SetLimit returns the value the driver reports after the change. The stack (per thread,
  // reserved for every resident thread), printf FIFO and malloc heap are device memory charged
  // to the tenant's quota (RESOURCE_EXHAUSTED naming it when they do not fit) and bounded
  // (module_service.proto lists every bound; INVALID_ARGUMENT beyond).
  absl::StatusOr<uint64_t> SetLimit(v1::ContextLimit limit, uint64_t value) const;
  absl::StatusOr<uint64_t> GetLimit(v1::ContextLimit limit) const;
  // The context's L1/shared memory preference (cuCtxSetCacheConfig/cuCtxGetCacheConfig).
  absl::Status SetCacheConfig(v1::CacheConfig config) const;
  // Starts or stops profile collection in the session's worker (cuProfilerStart/Stop, for
  // a profiler attached to the daemon); whether it was on before.
  absl::StatusOr<bool> SetProfiling(bool enabled) const;
  absl::StatusOr<v1::CacheConfig> GetCacheConfig() const;

  // The deadline of this session's calls (from Client::call_timeout()); changing it affects
  // calls made afterwards, from any thread. absl::InfiniteDuration(): none.
  absl::Duration call_timeout() const;
  void set_call_timeout(absl::Duration timeout);

  // Where the device printf output of this session's kernels goes. The daemon returns it
  // with the answer of each synchronisation (Session/Stream/Event::Synchronize, and the
  // waits of Download and the other synchronous calls that end in one); `handler` gets each
  // non-empty chunk, on the client's background thread or the calling thread, before that
  // call returns. Default: written to stdout and flushed. nullptr: dropped. Only this
  // session's kernels' output ever arrives here. From any thread. The handler must not call
  // this session's methods: it may run while the call that received the output holds the
  // session's internal locks (absl's deadlock detection would end the process).
  void SetDeviceOutputHandler(std::function<void(absl::string_view)> handler);

  // What the session's watch knows, without a round trip: ACTIVE, FAULTED, or UNSPECIFIED
  // once the session is closed or gone (closed or reclaimed by the daemon, or the daemon
  // restarted).
  v1::SessionState state() const;
  // OK while the session is usable as far as the watch knows; else the status every call on
  // it returns now: the fault's code (FAILED_PRECONDITION, or DEADLINE_EXCEEDED after the
  // kernel watchdog) with its cause, the daemon's NOT_FOUND for a lost session (its message
  // says when the daemon restarted), FAILED_PRECONDITION once closed.
  absl::Status fault() const;

  // The session's state from the daemon (also a bare front-end round trip); at most 10 s.
  // Not needed to keep the session alive (the watch does).
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive() const;
  // Closes now; later calls fail. Idempotent. Never waits long: stops the watch and the
  // command stream at once (commands queued and not yet synchronised are dropped; closing
  // frees everything anyway), then sends CloseSession with a deadline of 5 s (or the call
  // timeout when shorter). Returns that call's status: UNAVAILABLE or DEADLINE_EXCEEDED
  // when the daemon is gone or stopped (the daemon then reclaims the session after its
  // grace), NOT_FOUND when the session was already gone.
  absl::Status Close();

 private:
  friend class Client;
  std::shared_ptr<internal::SessionCore> core_;
};

}  // namespace gpurpc

#endif  // GPURPC_CLIENT_CPP_INCLUDE_GPURPC_CLIENT_H_
