// Shared by every kernel: fp32 / fp16 / bf16 storage with fp32 arithmetic, 16-byte vector access,
// warp and block reductions. No CUDA headers, so NVRTC compiles it without an include path. The
// three PTX conversions have host equivalents (kernels/cpu/cuda_on_cpu.h) for the CPU executor;
// __CUDA_ARCH__ is defined in every GPU compilation, so the GPU build is unchanged.
typedef long long i64;
#define NEG_INF __int_as_float(0xff800000)
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#else
  return emu::half_bits_to_float(x.bits);
#endif
}
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 h;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = emu::float_to_half_bits(x);
#endif
  return h;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
  bf16 h;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#else
  h.bits = emu::float_to_bf16_bits(x);
#endif
  return h;
}

// One 16-byte access: 4 floats or 8 halves. Callers check alignment and divisibility on the host
// and pass `vec`; every kernel keeps a scalar path for the rest.
template <typename T> struct Pack {
  static const int N = 16 / sizeof(T);
  union { uint4 raw; T v[16 / sizeof(T)]; };
};

template <typename T> __device__ __forceinline__ void load_pack(const T* p, float* out) {
  Pack<T> k;
  k.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int j = 0; j < Pack<T>::N; ++j) out[j] = to_float(k.v[j]);
}

template <typename T> __device__ __forceinline__ void store_pack(T* p, const float* in) {
  Pack<T> k;
#pragma unroll
  for (int j = 0; j < Pack<T>::N; ++j) k.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<uint4*>(p) = k.raw;
}

// x plus a bias read at `bi` (the column; none when b is null), as the torch reference adds it:
// a pack of N values, and one value for the scalar paths.
template <typename T> __device__ __forceinline__ void load_biased(const T* x, const T* b, i64 bi, float* out) {
  float bv[Pack<T>::N];
  load_pack(x, out);
  if (b) load_pack(b + bi, bv);
#pragma unroll
  for (int j = 0; j < Pack<T>::N; ++j) out[j] += b ? bv[j] : 0.f;
}

template <typename T> __device__ __forceinline__ float biased(const T* x, const T* b, i64 bi) {
  return to_float(*x) + (b ? to_float(b[bi]) : 0.f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions; blockDim.x is a multiple of 32. `scratch`: 32 floats of shared memory.
// Every warp reduces the per-warp partials itself, so every thread returns the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();                    // the previous reduction's readers are done with scratch
  if (lane == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : NEG_INF);
}

__device__ __forceinline__ i64 thread_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 thread_count() { return (i64)gridDim.x * blockDim.x; }
