// The part of CUDA that kernels/cuda/ uses, defined for a host C++ compiler (g++ >= 9, C++17), so
// the same sources run on the CPU. executor.cpp runs each block's threads as cooperative fibers:
// a thread runs until it reaches __syncthreads (a block barrier) or __shfl_xor_sync (a warp
// exchange), and the scheduler decides who runs next. Shared memory is a function-local static:
// blocks run one after another, so it is per block. Nothing here changes the GPU build: the
// sources see this header only on the host (cpu_executor/build.py puts it in front).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct alignas(16) uint4 { unsigned x, y, z, w; };     // 16-byte aligned, as CUDA declares it
struct emu_dim3 { unsigned x, y, z; };

namespace emu {
// The running fiber's indices: executor.cpp sets them before it resumes a thread. Kernels read
// them after every barrier or exchange (calls into another translation unit), so they are fresh.
extern emu_dim3 thread_idx, block_idx, block_dim, grid_dim;
void syncthreads(const char* file, int line);
unsigned shfl_xor(unsigned mask, unsigned bits, int lane_mask, const char* file, int line);

inline float bits_to_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned float_to_bits(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// The three inline-PTX conversions of common.cuh, exactly: round to nearest even, and a NaN comes
// out as the canonical NaN (0x7fff for f16 and bf16, 0x7fffffff for f32).
inline float half_bits_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return bits_to_float(m ? 0x7fffffffu : (sign | 0x7f800000u));
  if (e == 0) {                                           // zero or subnormal: m * 2^-24, exact in fp32
    const float v = std::ldexp((float)m, -24);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));      // rebias 15 -> 127
}

inline unsigned short float_to_half_bits(float f) {
  const unsigned x = float_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fff;                   // NaN
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);   // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                               // a normal half (>= 2^-14)
    const unsigned m = ax & 0x7fffffu, rest = m & 0x1fffu;
    unsigned r = ((((ax >> 23) - 112u) << 10) | (m >> 13));
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;        // a carry moves into the exponent
    return (unsigned short)(sign | r);
  }
  // a subnormal half (or zero): the value in units of 2^-24, rounded to nearest even
  const unsigned e = ax >> 23, shift = 126u - e;
  if (e == 0 || shift > 31) return (unsigned short)sign;
  const unsigned mm = (ax & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1), rest = mm & ((1u << shift) - 1u);
  unsigned r = mm >> shift;
  if (rest > half || (rest == half && (r & 1u))) ++r;
  return (unsigned short)(sign | r);
}

inline unsigned short float_to_bf16_bits(float f) {
  const unsigned x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;   // NaN
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
}  // namespace emu

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
// The empty asm with a memory clobber: the compiler may not keep shared memory (a static it sees
// no one else take the address of) in registers across the switch to other threads.
inline void emu_fence() { asm volatile("" ::: "memory"); }
#define __syncthreads() (emu_fence(), ::emu::syncthreads(__FILE__, __LINE__), emu_fence())

inline float __int_as_float(int i) { return ::emu::bits_to_float((unsigned)i); }
inline float __uint_as_float(unsigned u) { return ::emu::bits_to_float(u); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

// Full-mask exchange within a warp (the only form the kernels use; a partial mask is reported).
inline unsigned emu_exchange(unsigned mask, unsigned bits, int lane_mask, const char* file, int line) {
  emu_fence();
  const unsigned out = ::emu::shfl_xor(mask, bits, lane_mask, file, line);
  emu_fence();
  return out;
}
inline float emu_shfl_xor(unsigned mask, float v, int lane_mask, const char* file, int line) {
  return ::emu::bits_to_float(emu_exchange(mask, ::emu::float_to_bits(v), lane_mask, file, line));
}
inline int emu_shfl_xor(unsigned mask, int v, int lane_mask, const char* file, int line) {
  return (int)emu_exchange(mask, (unsigned)v, lane_mask, file, line);
}
inline unsigned emu_shfl_xor(unsigned mask, unsigned v, int lane_mask, const char* file, int line) {
  return emu_exchange(mask, v, lane_mask, file, line);
}
#define __shfl_xor_sync(mask, v, lane_mask) emu_shfl_xor((mask), (v), (lane_mask), __FILE__, __LINE__)

// ---- registration: each kernel instantiation, its parameter list and a thunk that calls it with
// the arguments as cuLaunchKernel takes them (an array of pointers to each argument's bytes).
#include <type_traits>
#include <utility>

namespace emu {
using Thunk = void (*)(void** args);
// kind: 'c' pointer to const (read only), 'p' pointer the kernel may write, 'f' floating point, 'i' integer
struct Param { int size; char kind; };
void register_kernel(const char* name, Thunk thunk, const Param* params, int arity);

template <typename A> constexpr char kind_of() {
  if constexpr (std::is_pointer_v<A>) return std::is_const_v<std::remove_pointer_t<A>> ? 'c' : 'p';
  else return std::is_floating_point_v<A> ? 'f' : 'i';
}
template <typename A> constexpr Param param_of() { return {(int)sizeof(A), kind_of<A>()}; }

template <typename Sig, Sig F> struct Entry;
template <typename... A, void (*F)(A...)> struct Entry<void (*)(A...), F> {
  template <std::size_t... I> static void call(void** a, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(a[I])...);
  }
  static void run(void** a) { call(a, std::index_sequence_for<A...>{}); }
  static constexpr Param params[sizeof...(A)] = {param_of<A>()...};
  static constexpr int arity = sizeof...(A);
};

struct Registrar {
  Registrar(const char* name, Thunk thunk, const Param* params, int arity) {
    register_kernel(name, thunk, params, arity);
  }
};
}  // namespace emu

#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
// EMU_KERNEL(bias_gelu_fwd, f16): registers bias_gelu_fwd<f16> under the name "bias_gelu_fwd<f16>"
#define EMU_KERNEL(kernel, T)                                                                            \
  static ::emu::Registrar EMU_CAT(emu_registrar_, __COUNTER__)(                                          \
      #kernel "<" #T ">", &::emu::Entry<decltype(&kernel<T>), &kernel<T>>::run,                          \
      ::emu::Entry<decltype(&kernel<T>), &kernel<T>>::params, ::emu::Entry<decltype(&kernel<T>), &kernel<T>>::arity);
