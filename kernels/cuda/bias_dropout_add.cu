// y = residual + dropout(x + b, p) and its backward dx = g * keep / (1 - p). The keep mask is not
// stored: both directions regenerate it from (seed, element index) with the counter-based hash
// below, which autoshard/kernels/ops.py reproduces bit for bit on the CPU.
// x, residual, y: [n / cols, cols] contiguous; b: [cols] or null.

__device__ __forceinline__ unsigned mix32(unsigned h) {      // "lowbias32" integer hash
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

__device__ __forceinline__ bool keep(unsigned seed, i64 i, float p) {
  const unsigned h = mix32(seed ^ mix32((unsigned)i + mix32((unsigned)(i >> 32))));
  return (float)(h >> 8) * (1.f / 16777216.f) >= p;        // uniform in [0, 1) from 24 bits
}

template <typename T>
__global__ void bias_dropout_add_fwd(const T* __restrict__ x, const T* __restrict__ b,
                                     const T* __restrict__ residual, T* __restrict__ y, i64 n, i64 cols, float p,
                                     unsigned seed, int vec) {
  const int N = Pack<T>::N;
  const float s = p < 1.f ? 1.f / (1.f - p) : 0.f;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      float xv[N], rv[N];
      load_biased(x + i, b, i % cols, xv);
      load_pack(residual + i, rv);
#pragma unroll
      for (int j = 0; j < N; ++j) rv[j] += keep(seed, i + j, p) ? xv[j] * s : 0.f;
      store_pack(y + i, rv);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count()) {
    const float v = biased(x + i, b, i % cols);
    y[i] = from_float<T>(to_float(residual[i]) + (keep(seed, i, p) ? v * s : 0.f));
  }
}

template <typename T>
__global__ void bias_dropout_add_bwd(const T* __restrict__ g, T* __restrict__ dx, i64 n, float p, unsigned seed,
                                     int vec) {
  const int N = Pack<T>::N;
  const float s = p < 1.f ? 1.f / (1.f - p) : 0.f;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      float gv[N];
      load_pack(g + i, gv);
#pragma unroll
      for (int j = 0; j < N; ++j) gv[j] = keep(seed, i + j, p) ? gv[j] * s : 0.f;
      store_pack(dx + i, gv);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count())
    dx[i] = from_float<T>(keep(seed, i, p) ? to_float(g[i]) * s : 0.f);
}
