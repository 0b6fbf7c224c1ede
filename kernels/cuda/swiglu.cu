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
      float av[N], uv[N], bav[N], buv[N];
      load_pack(a + r * sa + c, av);
      load_pack(u + r * su + c, uv);
      if (ba) load_pack(ba + c, bav);
      if (bu) load_pack(bu + c, buv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float z = av[j] + (ba ? bav[j] : 0.f);
        av[j] = z * sigmoid(z) * (uv[j] + (bu ? buv[j] : 0.f));
      }
      store_pack(y + i, av);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count()) {
    const i64 r = i / cols, c = i % cols;
    const float z = to_float(a[r * sa + c]) + (ba ? to_float(ba[c]) : 0.f);
    const float v = to_float(u[r * su + c]) + (bu ? to_float(bu[c]) : 0.f);
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
      float gv[N], av[N], uv[N], bav[N], buv[N];
      load_pack(g + i, gv);
      load_pack(a + r * sa + c, av);
      load_pack(u + r * su + c, uv);
      if (ba) load_pack(ba + c, bav);
      if (bu) load_pack(bu + c, buv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float z = av[j] + (ba ? bav[j] : 0.f), v = uv[j] + (bu ? buv[j] : 0.f), s = sigmoid(z);
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
    const float z = to_float(a[r * sa + c]) + (ba ? to_float(ba[c]) : 0.f);
    const float v = to_float(u[r * su + c]) + (bu ? to_float(bu[c]) : 0.f);
    const float s = sigmoid(z), gi = to_float(g[i]);
    da[i] = from_float<T>(gi * v * s * (1.f + z * (1.f - s)));
    du[i] = from_float<T>(gi * z * s);
  }
}
