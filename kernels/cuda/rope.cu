// Rotary position embedding in the rotate-half form (GPT-NeoX, Llama):
//   y = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]  (halves of the last dim)
// and its backward dx = g * cos + [g2 * sin2, -g1 * sin1] (rotate_half transposed).
// x, y: [batch, heads, seq, dim] contiguous; cos, sin: [1 or batch, seq, dim] fp32, shared by the
// heads. `inverse` runs the backward (same pass with sin negated on the partner's side).

template <typename T>
__global__ void rope_apply(const T* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                           T* __restrict__ y, i64 batch, i64 heads, i64 seq, i64 dim, int table_batched,
                           int inverse) {
  const i64 n = batch * heads * seq * dim, half = dim / 2;
  for (i64 i = thread_index(); i < n; i += thread_count()) {
    const i64 d = i % dim, s = (i / dim) % seq, b = i / (dim * seq * heads);
    const i64 t = ((table_batched ? b : 0) * seq + s) * dim;
    const i64 partner = d < half ? i + half : i - half;
    const float sign = d < half ? -1.f : 1.f;
    // forward: y_d = x_d cos_d + sign * x_partner sin_d; backward: dx_d = g_d cos_d - sign * g_partner sin_partner
    const float other = inverse ? -sign * to_float(x[partner]) * sin_t[t + (d < half ? d + half : d - half)]
                                : sign * to_float(x[partner]) * sin_t[t + d];
    y[i] = from_float<T>(to_float(x[i]) * cos_t[t + d] + other);
  }
}
