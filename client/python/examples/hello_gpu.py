"""Hello GPU: PyCUDA's classic first program, with ``pycuda`` replaced by ``gpurpc``.

Run against a daemon: ``GPURPC_ADDRESS=host:port python3 hello_gpu.py``. The In/Out call
uploads a and b, launches and downloads dest in one round trip.
"""
import numpy

import gpurpc.autoinit  # noqa: F401  (opens a session on device 0)
import gpurpc.driver as drv
from gpurpc.compiler import SourceModule

mod = SourceModule("""
__global__ void multiply_them(float *dest, float *a, float *b)
{
  const int i = threadIdx.x;
  dest[i] = a[i] * b[i];
}
""")

multiply_them = mod.get_function("multiply_them")

a = numpy.random.randn(400).astype(numpy.float32)
b = numpy.random.randn(400).astype(numpy.float32)

dest = numpy.zeros_like(a)
multiply_them(drv.Out(dest), drv.In(a), drv.In(b), block=(400, 1, 1), grid=(1, 1))

error = numpy.abs(dest - a * b).max()
print(f"hello from {drv.Context.get_device().name()}: max |dest - a*b| = {error}")
assert error == 0, "the GPU computed something else"
