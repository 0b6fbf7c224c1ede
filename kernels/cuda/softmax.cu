// Scaled masked softmax over the last dim of attention scores x [batch, heads, sq, sk] (rows =
// batch * heads * sq) and its backward. Masked keys: k > q + (sk - sq) when `causal` (the upper
// triangle), or mask[mb, q, k] != 0 with mask [1 or batch, sq, sk] (uint8) shared by the heads.
// A row with every key masked comes out zero. One block per row; the row is read from memory
// once and re-read from cache by the max, sum and write passes.

__device__ __forceinline__ bool masked(const unsigned char* mask, int mask_batched, int causal, i64 row, i64 k,
                                       i64 sq, i64 sk, i64 heads) {
  const i64 q = row % sq;
  if (causal && k > q + (sk - sq)) return true;
  if (!mask) return false;
  const i64 b = mask_batched ? row / (heads * sq) : 0;
  return mask[(b * sq + q) * sk + k] != 0;
}

template <typename T>
__global__ void scaled_masked_softmax_fwd(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                                          T* __restrict__ y, i64 rows, i64 sq, i64 sk, i64 heads, float scale,
                                          int causal, int mask_batched) {
  __shared__ float scratch[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * sk;
    T* yr = y + row * sk;
    float top = NEG_INF;
    for (i64 k = threadIdx.x; k < sk; k += blockDim.x)
      if (!masked(mask, mask_batched, causal, row, k, sq, sk, heads)) top = fmaxf(top, scale * to_float(xr[k]));
    top = block_max(top, scratch);
    float total = 0.f;
    if (top != NEG_INF)
      for (i64 k = threadIdx.x; k < sk; k += blockDim.x)
        if (!masked(mask, mask_batched, causal, row, k, sq, sk, heads)) total += expf(scale * to_float(xr[k]) - top);
    total = block_sum(total, scratch);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (i64 k = threadIdx.x; k < sk; k += blockDim.x) {
      const bool off = top == NEG_INF || masked(mask, mask_batched, causal, row, k, sq, sk, heads);
      yr[k] = from_float<T>(off ? 0.f : expf(scale * to_float(xr[k]) - top) * inv);
    }
  }
}

// dx = scale * y * (g - sum_k g y): masked keys have y = 0 and get zero gradient.
template <typename T>
__global__ void scaled_masked_softmax_bwd(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx,
                                          i64 rows, i64 sk, float scale) {
  __shared__ float scratch[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = g + row * sk;
    const T* yr = y + row * sk;
    float dot = 0.f;
    for (i64 k = threadIdx.x; k < sk; k += blockDim.x) dot += to_float(gr[k]) * to_float(yr[k]);
    dot = block_sum(dot, scratch);
    for (i64 k = threadIdx.x; k < sk; k += blockDim.x)
      dx[row * sk + k] = from_float<T>(scale * to_float(yr[k]) * (to_float(gr[k]) - dot));
  }
}
