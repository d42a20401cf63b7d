"""CUDA sources shared by the tests.

``FAKE_KERNELS`` defines, as real CUDA, the kernels that the daemon's fake backend implements
on the host (selected by name, with these exact signatures), so the same tests run on the
fake backend in CI and on a real GPU.
"""

FAKE_KERNELS = r"""
__global__ void multiply_them(float *dest, const float *a, const float *b)
{
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  dest[i] = a[i] * b[i];
}

__global__ void axpy_f32(float a, const float *x, float *y, unsigned long long n)
{
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    y[i] += a * x[i];
}

__global__ void fill_u32(unsigned *out, unsigned value, unsigned long long n)
{
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    out[i] = value;
}

__global__ void add_one_f32(float *data, unsigned long long n)
{
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    data[i] += 1.0f;
}

__global__ void copy_bytes(char *dst, const char *src, unsigned long long n)
{
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

__global__ void fault_illegal_address()
{
  *(volatile int *)8 = 1;
}

__global__ void spin_us(unsigned long long us)
{
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < us * 1000ULL);
  }
}

__device__ float device_table[16];
__constant__ int constant_coeffs[4];
"""
