// Moves 1 GiB up and down through gpurpcd (TCP and unix socket) and through direct driver
// calls in the same process, and prints the bandwidths and their ratios.
#include <cstring>
#include <vector>

#include "tests/benchmarks/bench_common.h"

namespace gpurpc::bench {
namespace {

constexpr uint64_t kBytes = 1ull << 30;
constexpr int kRepeats = 3;

struct Row {
  std::string path;
  double up_gbps = 0;
  double down_gbps = 0;
};

Row MeasureDaemon(const std::string& label, const std::string& address,
                  std::vector<uint8_t>& host) {
  auto client = Client::Connect(address);
  Check(client.status(), "connect");
  auto session = client->OpenSession(0, "bench_memory");
  Check(session.status(), "open session");
  auto buffer = session->Allocate(kBytes);
  Check(buffer.status(), "allocate 1 GiB");
  Row row{label};
  for (int i = 0; i < kRepeats; ++i) {
    auto start = std::chrono::steady_clock::now();
    Check(buffer->Upload(host), "upload");
    row.up_gbps = std::max(row.up_gbps, kBytes / Seconds(start) / 1e9);
    start = std::chrono::steady_clock::now();
    Check(session->DownloadInto(buffer->at(0), absl::MakeSpan(host)), "download");
    row.down_gbps = std::max(row.down_gbps, kBytes / Seconds(start) / 1e9);
  }
  return row;
}

Row MeasureDirect(const backend::cuda::DriverApi* api, void* host, const char* label) {
  CUdeviceptr device;
  BENCH_CHECK_CU(api, api->cuMemAlloc(&device, kBytes));
  Row row{label};
  for (int i = 0; i < kRepeats; ++i) {
    auto start = std::chrono::steady_clock::now();
    BENCH_CHECK_CU(api, api->cuMemcpyHtoDAsync(device, host, kBytes, nullptr));
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
    row.up_gbps = std::max(row.up_gbps, kBytes / Seconds(start) / 1e9);
    start = std::chrono::steady_clock::now();
    BENCH_CHECK_CU(api, api->cuMemcpyDtoHAsync(host, device, kBytes, nullptr));
    BENCH_CHECK_CU(api, api->cuStreamSynchronize(nullptr));
    row.down_gbps = std::max(row.down_gbps, kBytes / Seconds(start) / 1e9);
  }
  BENCH_CHECK_CU(api, api->cuMemFree(device));
  return row;
}

int Main(int argc, char** argv) {
  DaemonUnderTest daemon = StartDaemon(argc, argv);
  const backend::cuda::DriverApi* api = DriverWithContext();

  std::vector<uint8_t> pageable(kBytes);
  for (uint64_t i = 0; i < kBytes; i += 4096) pageable[i] = static_cast<uint8_t>(i >> 12);
  void* pinned = nullptr;
  BENCH_CHECK_CU(api, api->cuMemHostAlloc(&pinned, kBytes, 0));
  std::memcpy(pinned, pageable.data(), kBytes);

  std::vector<Row> rows;
  rows.push_back(MeasureDirect(api, pinned, "direct driver, pinned host memory"));
  rows.push_back(MeasureDirect(api, pageable.data(), "direct driver, pageable host memory"));
  if (!daemon.unix_address.empty()) {
    rows.push_back(MeasureDaemon("gpurpcd over a unix socket", daemon.unix_address, pageable));
  }
  rows.push_back(MeasureDaemon("gpurpcd over TCP loopback", daemon.tcp_address, pageable));

  std::printf("\n1 GiB transfers, best of %d (GB/s = 1e9 bytes/s)\n", kRepeats);
  std::printf("%-40s %10s %10s %14s %14s\n", "path", "H2D GB/s", "D2H GB/s", "H2D vs pinned",
              "D2H vs pinned");
  for (const Row& row : rows) {
    std::printf("%-40s %10.2f %10.2f %13.3fx %13.3fx\n", row.path.c_str(), row.up_gbps,
                row.down_gbps, row.up_gbps / rows[0].up_gbps, row.down_gbps / rows[0].down_gbps);
  }
  api->cuMemFreeHost(pinned);
  return 0;
}

}  // namespace
}  // namespace gpurpc::bench

int main(int argc, char** argv) { return gpurpc::bench::Main(argc, argv); }
