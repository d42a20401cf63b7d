# The C++ client as a library others build against, in the same install prefix as the daemon:
#
#   DIR/include/gpurpc/client.h           the client's API (gpurpc::Client, Session, ...)
#   DIR/include/gpurpc/v1/*.pb.h          the generated gpurpc.v1 messages and stubs it uses
#   DIR/lib/libgpurpc_*.a                 the client and what it is made of (static, -fPIC)
#   DIR/lib/cmake/gpurpc/                 find_package(gpurpc CONFIG) -> gpurpc::client
#   DIR/lib/pkgconfig/gpurpc.pc           pkg-config --cflags --libs gpurpc
#
# A consumer needs gRPC, protobuf and Abseil development files of the same versions as the
# build machine (Debian 12's: libgrpc++-dev, libprotobuf-dev, libabsl-dev); the bundled
# shared libraries in lib/gpurpc serve the daemon only. tests/install/ builds and runs the
# README's C++ example against this, in CI.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

# Fixed, prefix-relative (the prefix is chosen at install time, as for the daemon).
set(GPURPC_CLIENT_LIBDIR "lib")
set(GPURPC_CLIENT_INCLUDEDIR "include")

set(GPURPC_CLIENT_TARGETS gpurpc_client gpurpc_proto gpurpc_common gpurpc_grpc_status
  gpurpc_fd_passing)
set_target_properties(gpurpc_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(gpurpc_common PROPERTIES EXPORT_NAME common)
set_target_properties(gpurpc_grpc_status PROPERTIES EXPORT_NAME grpc_status)
set_target_properties(gpurpc_fd_passing PROPERTIES EXPORT_NAME fd_passing)

install(TARGETS ${GPURPC_CLIENT_TARGETS} EXPORT gpurpcTargets
  ARCHIVE DESTINATION "${GPURPC_CLIENT_LIBDIR}" COMPONENT gpurpc)
install(FILES "${PROJECT_SOURCE_DIR}/client/cpp/include/gpurpc/client.h"
  DESTINATION "${GPURPC_CLIENT_INCLUDEDIR}/gpurpc" COMPONENT gpurpc)
install(DIRECTORY "${PROJECT_BINARY_DIR}/proto/gen/gpurpc/v1/"
  DESTINATION "${GPURPC_CLIENT_INCLUDEDIR}/gpurpc/v1" COMPONENT gpurpc
  FILES_MATCHING PATTERN "*.pb.h")

set(GPURPC_CMAKE_DIR "${GPURPC_CLIENT_LIBDIR}/cmake/gpurpc")
install(EXPORT gpurpcTargets NAMESPACE gpurpc:: FILE gpurpcTargets.cmake
  DESTINATION "${GPURPC_CMAKE_DIR}" COMPONENT gpurpc)
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/gpurpcConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/gpurpcConfig.cmake" INSTALL_DESTINATION "${GPURPC_CMAKE_DIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/gpurpcConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/gpurpcConfig.cmake"
  "${PROJECT_BINARY_DIR}/gpurpcConfigVersion.cmake"
  DESTINATION "${GPURPC_CMAKE_DIR}" COMPONENT gpurpc)

configure_file("${PROJECT_SOURCE_DIR}/cmake/gpurpc.pc.in" "${PROJECT_BINARY_DIR}/gpurpc.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/gpurpc.pc"
  DESTINATION "${GPURPC_CLIENT_LIBDIR}/pkgconfig" COMPONENT gpurpc)
