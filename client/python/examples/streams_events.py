"""Streams and events: independent pipelines (upload, kernel, download) on several streams,
timed with events recorded on the server's GPU, checked against numpy."""
import numpy as np

import gpurpc.autoinit  # noqa: F401
import gpurpc.driver as drv
from gpurpc.compiler import SourceModule

mod = SourceModule("""
__global__ void polish(float *data, int n, int rounds)
{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = data[i];
  for (int r = 0; r < rounds; ++r)
    x = x * 0.5f + 1.0f;
  data[i] = x;
}
""")
polish = mod.get_function("polish").prepare("Pii")

n = 1 << 20
rounds = 2000
stream_count = 4
hosts = [np.random.rand(n).astype(np.float32) for _ in range(stream_count)]
results = [drv.pagelocked_empty_like(h) for h in hosts]
buffers = [drv.mem_alloc(h.nbytes) for h in hosts]
streams = [drv.Stream() for _ in range(stream_count)]
starts = [drv.Event() for _ in range(stream_count)]
ends = [drv.Event() for _ in range(stream_count)]

everything_start = drv.Event().record()
for host, result, buf, stream, start, end in zip(hosts, results, buffers, streams, starts, ends):
    start.record(stream)
    drv.memcpy_htod_async(buf, host, stream)
    polish.prepared_async_call(((n + 255) // 256, 1), (256, 1, 1), stream, buf, n, rounds)
    drv.memcpy_dtoh_async(result, buf, stream)
    end.record(stream)
everything_end = drv.Event().record()

for stream in streams:
    stream.synchronize()
everything_end.synchronize()

for i, (start, end) in enumerate(zip(starts, ends)):
    print(f"stream {i}: {end.time_since(start):8.3f} ms on the GPU (done: {streams[i].is_done()})")
print(f"all streams: {everything_end.time_since(everything_start):8.3f} ms")

for host, result in zip(hosts, results):
    sample = slice(0, 4096)  # the same iteration in numpy, on a sample
    expected = host[sample].copy()
    for _ in range(rounds):
        expected = expected * np.float32(0.5) + np.float32(1.0)
    assert np.allclose(result[sample], expected)
    assert np.allclose(result, 2.0)  # x -> x/2 + 1 converges to 2
print("results match numpy")
