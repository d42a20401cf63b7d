// The front end's own services: devices (answered from the inventory taken at start) and
// sessions (open, close, keepalive). Callback API; blocking work (starting or ending a
// worker process) runs off the gRPC threads.
#ifndef GPURPC_SERVER_FRONTEND_SERVICES_H_
#define GPURPC_SERVER_FRONTEND_SERVICES_H_

#include "gpurpc/v1/device_service.grpc.pb.h"
#include "gpurpc/v1/session_service.grpc.pb.h"
#include "server/frontend/session_manager.h"

namespace gpurpc::frontend {

class DeviceServiceImpl final : public v1::DeviceService::CallbackService {
 public:
  explicit DeviceServiceImpl(SessionManager* sessions) : sessions_(sessions) {}
  grpc::ServerUnaryReactor* ListDevices(grpc::CallbackServerContext* context,
                                        const v1::ListDevicesRequest* request,
                                        v1::ListDevicesResponse* response) override;
  grpc::ServerUnaryReactor* GetDevice(grpc::CallbackServerContext* context,
                                      const v1::GetDeviceRequest* request,
                                      v1::GetDeviceResponse* response) override;

 private:
  SessionManager* sessions_;
};

class SessionServiceImpl final : public v1::SessionService::CallbackService {
 public:
  explicit SessionServiceImpl(SessionManager* sessions) : sessions_(sessions) {}
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* context,
                                      const v1::KeepAliveRequest* request,
                                      v1::KeepAliveResponse* response) override;

 private:
  SessionManager* sessions_;
};

}  // namespace gpurpc::frontend

#endif  // GPURPC_SERVER_FRONTEND_SERVICES_H_
