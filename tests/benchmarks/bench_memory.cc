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
  double target_gbps = 0;  // 0: the network target (kTargetGbps)
};

// What the issue asks of a same-host region: PCIe speed, near the pinned ceiling.
constexpr double kRegionTargetGbps = 40.0;

// Copies between a same-host region (HostRegion: a memfd the worker pinned) and the device,
// each direction as one command plus a synchronise.
Row MeasureRegion(const std::string& label, const std::string& address) {
  auto client = Client::Connect(address);
  Check(client.status(), "connect");
  auto session = client->OpenSession(0, "bench_memory regions");
  Check(session.status(), "open session");
  auto buffer = session->Allocate(kBytes);
  Check(buffer.status(), "allocate 1 GiB");
  auto region = session->CreateHostRegion(kBytes);
  Check(region.status(), "create a 1 GiB region");
  for (uint64_t i = 0; i < kBytes; i += 4096) region->data()[i] = static_cast<uint8_t>(i >> 12);
  Row row{label};
  row.target_gbps = kRegionTargetGbps;
  for (int i = 0; i < kRepeats; ++i) {
    auto start = std::chrono::steady_clock::now();
    Check(region->CopyToDevice(buffer->at(0), 0, kBytes), "region to device");
    Check(session->Synchronize(), "synchronize");
    row.up_gbps = std::max(row.up_gbps, kBytes / Seconds(start) / 1e9);
    start = std::chrono::steady_clock::now();
    Check(region->CopyFromDevice(buffer->at(0), 0, kBytes), "device to region");
    Check(session->Synchronize(), "synchronize");
    row.down_gbps = std::max(row.down_gbps, kBytes / Seconds(start) / 1e9);
  }
  return row;
}

// Streamed transfers of the host's pageable bytes through the daemon, the C++ client split
// over `connections` (ConnectOptions::transfer_connections; 0: its default;
// $GPURPC_TRANSFER_CONNECTIONS, when set, overrides either).
Row MeasureDaemon(const std::string& label, const std::string& address, std::vector<uint8_t>& host,
                  int connections = 0) {
  ConnectOptions options;
  options.address = address;
  if (connections > 0) options.transfer_connections = connections;
  auto client = Client::Connect(options);
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

// What the issue asks of the network path: 1 GiB each way at this rate or better.
constexpr double kTargetGbps = 3.0;

int Main(int argc, char** argv) {
  DaemonUnderTest daemon = StartDaemon(argc, argv);

  std::vector<uint8_t> pageable(kBytes);
  for (uint64_t i = 0; i < kBytes; i += 4096) pageable[i] = static_cast<uint8_t>(i >> 12);

  // The direct driver's pinned copies are the physical ceiling (not on the fake backend).
  std::vector<Row> rows;
  if (!daemon.fake()) {
    const backend::cuda::DriverApi* api = DriverWithContext();
    void* pinned = nullptr;
    BENCH_CHECK_CU(api, api->cuMemHostAlloc(&pinned, kBytes, 0));
    std::memcpy(pinned, pageable.data(), kBytes);
    rows.push_back(MeasureDirect(api, pinned, "direct driver, pinned host memory"));
    rows.push_back(MeasureDirect(api, pageable.data(), "direct driver, pageable host memory"));
    api->cuMemFreeHost(pinned);
  }
  const size_t first_daemon_row = rows.size();
  if (!daemon.unix_address.empty()) {
    rows.push_back(MeasureRegion("gpurpcd same-host region (memfd, pinned)", daemon.unix_address));
  }
  // Each path twice: on the client's default transfer connections, and on one (what a
  // transfer got before it was split; the ratio is what the split buys).
  if (!daemon.unix_address.empty()) {
    rows.push_back(MeasureDaemon("gpurpcd over a unix socket", daemon.unix_address, pageable));
    rows.push_back(MeasureDaemon("  the same on 1 connection", daemon.unix_address, pageable, 1));
  }
  if (!daemon.tcp_address.empty()) {
    rows.push_back(MeasureDaemon("gpurpcd over TCP loopback", daemon.tcp_address, pageable));
    rows.push_back(MeasureDaemon("  the same on 1 connection", daemon.tcp_address, pageable, 1));
  }

  std::printf("\n1 GiB transfers, %s backend, best of %d (GB/s = 1e9 bytes/s)\n",
              daemon.backend.c_str(), kRepeats);
  std::printf("%-40s %10s %10s %14s %14s %12s %12s\n", "path", "H2D GB/s", "D2H GB/s",
              "H2D vs pinned", "D2H vs pinned", "H2D/target", "D2H/target");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const bool daemon_row = i >= first_daemon_row;
    char vs_pinned[2][32] = {"-", "-"};
    if (!daemon.fake()) {
      std::snprintf(vs_pinned[0], sizeof(vs_pinned[0]), "%.3fx", row.up_gbps / rows[0].up_gbps);
      std::snprintf(vs_pinned[1], sizeof(vs_pinned[1]), "%.3fx", row.down_gbps / rows[0].down_gbps);
    }
    char vs_target[2][32] = {"-", "-"};
    if (daemon_row) {
      const double target = row.target_gbps > 0 ? row.target_gbps : kTargetGbps;
      std::snprintf(vs_target[0], sizeof(vs_target[0]), "%.2fx", row.up_gbps / target);
      std::snprintf(vs_target[1], sizeof(vs_target[1]), "%.2fx", row.down_gbps / target);
    }
    std::printf("%-40s %10.2f %10.2f %14s %14s %12s %12s\n", row.path.c_str(), row.up_gbps,
                row.down_gbps, vs_pinned[0], vs_pinned[1], vs_target[0], vs_target[1]);
  }
  std::printf(
      "target: >= %.0f GB/s each way from a same-host region, >= %.0f GB/s over TCP "
      "loopback and the unix socket (x >= 1.00)%s\n",
      kRegionTargetGbps, kTargetGbps,
      daemon.fake() ? "; on the fake backend the device side is a host memcpy" : "");
  return 0;
}

}  // namespace
}  // namespace gpurpc::bench

int main(int argc, char** argv) { return gpurpc::bench::Main(argc, argv); }
