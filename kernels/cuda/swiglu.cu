// y = silu(a + ba) * (u + bu) and its backward. a, u: [rows, cols] with row strides sa, su (so
// Megatron's fused [rows, 2 cols] projection is read in place as two views); ba, bu: [cols] or
// null; y, da, du: [rows, cols] contiguous. `vec`: cols, strides and pointers 16-byte divisible.

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

template <typename T>
__global__ void swiglu_fwd(const T* __restrict__ a, const T* __restrict__ u, const T* __restrict__ ba,
                           const T* __restrict__ bu, T* __restrict__ y, i64 rows, i64 cols, i64 sa, i64 su,
                           int vec) {
  const int N = Pack<T>::N;
  const i64 n = rows * cols;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      const i64 r = i / cols, c = i % cols;
      float av[N], uv[N];
      load_biased(a + r * sa + c, ba, c, av);
      load_biased(u + r * su + c, bu, c, uv);
#pragma unroll
      for (int j = 0; j < N; ++j) av[j] = av[j] * sigmoid(av[j]) * uv[j];
      store_pack(y + i, av);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count()) {
    const i64 r = i / cols, c = i % cols;
    const float z = biased(a + r * sa + c, ba, c), v = biased(u + r * su + c, bu, c);
    y[i] = from_float<T>(z * sigmoid(z) * v);
  }
}

template <typename T>
__global__ void swiglu_bwd(const T* __restrict__ g, const T* __restrict__ a, const T* __restrict__ u,
                           const T* __restrict__ ba, const T* __restrict__ bu, T* __restrict__ da,
                           T* __restrict__ du, i64 rows, i64 cols, i64 sa, i64 su, int vec) {
  const int N = Pack<T>::N;
  const i64 n = rows * cols;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      const i64 r = i / cols, c = i % cols;
      float gv[N], av[N], uv[N];
      load_pack(g + i, gv);
      load_biased(a + r * sa + c, ba, c, av);
      load_biased(u + r * su + c, bu, c, uv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float z = av[j], v = uv[j], s = sigmoid(z);
        av[j] = gv[j] * v * s * (1.f + z * (1.f - s));
        uv[j] = gv[j] * z * s;
      }
      store_pack(da + i, av);
      store_pack(du + i, uv);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count()) {
    const i64 r = i / cols, c = i % cols;
    const float z = biased(a + r * sa + c, ba, c), v = biased(u + r * su + c, bu, c);
    const float s = sigmoid(z), gi = to_float(g[i]);
    da[i] = from_float<T>(gi * v * s * (1.f + z * (1.f - s)));
    du[i] = from_float<T>(gi * z * s);
  }
}
