// y = gelu(x + b), tanh or erf form, and its backward dx = g * gelu'(x + b).
// x, g, y, dx: [n / cols, cols] contiguous; b: [cols] or null. With `vec` (cols and the pointers
// 16-byte divisible) each thread moves one 16-byte pack per access.

__device__ __forceinline__ float gelu_value(float u, int tanh_form) {
  if (tanh_form) {
    const float t = tanhf(0.7978845608028654f * (u + 0.044715f * u * u * u));
    return 0.5f * u * (1.f + t);
  }
  return 0.5f * u * (1.f + erff(u * 0.7071067811865476f));
}

__device__ __forceinline__ float gelu_slope(float u, int tanh_form) {
  if (tanh_form) {
    const float k = 0.7978845608028654f, u2 = u * u;
    const float t = tanhf(k * (u + 0.044715f * u * u2));
    return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * k * (1.f + 3.f * 0.044715f * u2);
  }
  return 0.5f * (1.f + erff(u * 0.7071067811865476f)) + u * 0.3989422804014327f * expf(-0.5f * u * u);
}

template <typename T>
__global__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y, i64 n,
                              i64 cols, int tanh_form, int vec) {
  const int N = Pack<T>::N;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      float u[N];
      load_biased(x + i, b, i % cols, u);
#pragma unroll
      for (int j = 0; j < N; ++j) u[j] = gelu_value(u[j], tanh_form);
      store_pack(y + i, u);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count())
    y[i] = from_float<T>(gelu_value(biased(x + i, b, i % cols), tanh_form));
}

template <typename T>
__global__ void bias_gelu_bwd(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ b,
                              T* __restrict__ dx, i64 n, i64 cols, int tanh_form, int vec) {
  const int N = Pack<T>::N;
  if (vec) {
    for (i64 i = thread_index() * N; i < n; i += thread_count() * N) {
      float gv[N], u[N];
      load_pack(g + i, gv);
      load_biased(x + i, b, i % cols, u);
#pragma unroll
      for (int j = 0; j < N; ++j) gv[j] *= gelu_slope(u[j], tanh_form);
      store_pack(dx + i, gv);
    }
    return;
  }
  for (i64 i = thread_index(); i < n; i += thread_count())
    dx[i] = from_float<T>(to_float(g[i]) * gelu_slope(biased(x + i, b, i % cols), tanh_form));
}
