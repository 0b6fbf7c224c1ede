// LayerNorm and RMSNorm over the last dim of x [rows, cols] (contiguous), fp32 statistics.
// Forward writes y and, per row, mean (zero for RMSNorm) and rstd = 1 / sqrt(var + eps) with
// var = mean((x - mean)^2), or mean(x^2) for RMSNorm. One block per row; the row is read from
// memory once and re-read from cache.
// Backward writes dx and, for the weight and bias gradients, per-block partial sums
// dw_part / db_part [gridDim.x, cols] (each column owned by one thread of the block, so no
// atomics); the caller sums them over blocks.

template <typename T>
__global__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                         T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, i64 rows,
                         i64 cols, float eps, int rms) {
  __shared__ float scratch[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    float s = 0.f;
    if (!rms)
      for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += to_float(xr[c]);
    const float mean = rms ? 0.f : block_sum(s, scratch) / cols;
    float v = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float d = to_float(xr[c]) - mean;
      v += d * d;
    }
    const float rstd = rsqrtf(block_sum(v, scratch) / cols + eps);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      float o = (to_float(xr[c]) - mean) * rstd;
      if (w) o *= to_float(w[c]);
      if (b) o += to_float(b[c]);
      y[row * cols + c] = from_float<T>(o);
    }
    if (threadIdx.x == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// With xhat = (x - mean) * rstd and gw = g * w:
//   LayerNorm: dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))
//   RMSNorm:   dx = rstd * (gw - xhat * mean(gw * xhat))
template <typename T>
__global__ void norm_bwd(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                         const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* __restrict__ dx,
                         float* __restrict__ dw_part, float* __restrict__ db_part, i64 rows, i64 cols, int rms) {
  __shared__ float scratch[32];
  float* dw = dw_part + blockIdx.x * cols;
  float* db = db_part ? db_part + blockIdx.x * cols : nullptr;
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
    dw[c] = 0.f;
    if (db) db[c] = 0.f;
  }
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = g + row * cols;
    const T* xr = x + row * cols;
    const float mean = mean_in[row], rstd = rstd_in[row];
    float s1 = 0.f, s2 = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float gi = to_float(gr[c]), xh = (to_float(xr[c]) - mean) * rstd;
      const float gw = gi * (w ? to_float(w[c]) : 1.f);
      s1 += gw;
      s2 += gw * xh;
      dw[c] += gi * xh;
      if (db) db[c] += gi;
    }
    const float m1 = rms ? 0.f : block_sum(s1, scratch) / cols;
    const float m2 = block_sum(s2, scratch) / cols;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const float xh = (to_float(xr[c]) - mean) * rstd;
      const float gw = to_float(gr[c]) * (w ? to_float(w[c]) : 1.f);
      dx[row * cols + c] = from_float<T>(rstd * (gw - m1 - xh * m2));
    }
  }
}
