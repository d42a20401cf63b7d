// The front end's own services: devices (answered from the inventory taken at start, plus
// the caller's view of the server), sessions (open, close, keepalive) and administration.
// Every call is authenticated first (auth.h); sessions are found only for their own tenant.
// Callback API; blocking work (starting or ending a worker process) runs off the gRPC
// threads.
#ifndef GPURPC_SERVER_FRONTEND_SERVICES_H_
#define GPURPC_SERVER_FRONTEND_SERVICES_H_

#include "gpurpc/v1/admin_service.grpc.pb.h"
#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "server/frontend/auth.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class DeviceServiceImpl final : public v1::DeviceService::CallbackService {
 public:
  using grpc::Service::GetHandler;  // served through a ParseCheckedService
  DeviceServiceImpl(SessionManager* sessions, const Authenticator* auth)
      : sessions_(sessions), auth_(auth) {}
  grpc::ServerUnaryReactor* ListDevices(grpc::CallbackServerContext* context,
                                        const v1::ListDevicesRequest* request,
                                        v1::ListDevicesResponse* response) override;
  grpc::ServerUnaryReactor* GetDevice(grpc::CallbackServerContext* context,
                                      const v1::GetDeviceRequest* request,
                                      v1::GetDeviceResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;

 private:
  SessionManager* sessions_;
  const Authenticator* auth_;
};

class SessionServiceImpl final : public v1::SessionService::CallbackService {
 public:
  using grpc::Service::GetHandler;  // served through a ParseCheckedService
  SessionServiceImpl(SessionManager* sessions, const Authenticator* auth)
      : sessions_(sessions), auth_(auth) {}
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* context,
                                      const v1::KeepAliveRequest* request,
                                      v1::KeepAliveResponse* response) override;
  grpc::ServerWriteReactor<v1::SessionEvent>* WatchSession(
      grpc::CallbackServerContext* context, const v1::WatchSessionRequest* request) override;
  // CUDA IPC between sessions of one tenant (ipc_registry.h): each asks the session's
  // worker through WorkerControl, off the gRPC threads.
  grpc::ServerUnaryReactor* ExportMemory(grpc::CallbackServerContext* context,
                                         const v1::ExportMemoryRequest* request,
                                         v1::ExportMemoryResponse* response) override;
  grpc::ServerUnaryReactor* OpenMemoryHandle(grpc::CallbackServerContext* context,
                                             const v1::OpenMemoryHandleRequest* request,
                                             v1::OpenMemoryHandleResponse* response) override;
  grpc::ServerUnaryReactor* ExportEvent(grpc::CallbackServerContext* context,
                                        const v1::ExportEventRequest* request,
                                        v1::ExportEventResponse* response) override;
  grpc::ServerUnaryReactor* OpenEventHandle(grpc::CallbackServerContext* context,
                                            const v1::OpenEventHandleRequest* request,
                                            v1::OpenEventHandleResponse* response) override;

 private:
  SessionManager* sessions_;
  const Authenticator* auth_;
};

// Admin tenants only (DaemonOptions::admin_tenants); everyone else PERMISSION_DENIED.
class AdminServiceImpl final : public v1::AdminService::CallbackService {
 public:
  using grpc::Service::GetHandler;  // served through a ParseCheckedService
  AdminServiceImpl(SessionManager* sessions, const Authenticator* auth)
      : sessions_(sessions), auth_(auth) {}
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::AdminCloseSessionRequest* request,
                                         v1::AdminCloseSessionResponse* response) override;

 private:
  SessionManager* sessions_;
  const Authenticator* auth_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_SERVICES_H_
