// Quantized mat-vec on CUDA: y = x W^T for a few rows of x and MLX's affine
// 4- or 8-bit weights (`mx.quantize`: W [O, K*BITS/32] uint32, value j of a
// word at bits BITS*j; scales and biases [O, K/GS] in the activation dtype;
// w = scale * q + bias). Used by host/src/model/cuda_qmv.rs and
// benches/device/qmv_kernel.py; the kernel body MLX compiles is one call of
// `mlxhost_qmv::matvec`.
//
// Layout of the work: each warp owns R consecutive output rows and walks
// them in 16-byte chunks of packed weights (32 values at 4 bits, 16 at 8),
// lane l taking chunks l, l+32, ...; a chunk lies inside one quantization
// group (GS >= 32), so it needs one scale and one bias per row. Per chunk
// and activation row the lane forms sum(q*x) and sum(x) in float32 and adds
// scale*sum(q*x) + bias*sum(x) (the affine form, as MLX's own qmv), so the
// bias costs one multiply per chunk rather than per value. Weights are read
// once for all NR activation rows and bypass L1 (they are streamed once);
// the activations stay in L1, shared by every warp. The warp's partial sums
// meet through shuffles at the end.
//
// Integers to float32: a byte b placed under the exponent of 2^23
// (0x4b0000bb) is the float 2^23 + b, so one byte permute and one subtract
// give b exactly, without the slower integer-to-float conversion.
#pragma once

namespace mlxhost_qmv {

// 16 bytes of weights through the read-only path, not allocated in L1.
__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Byte i of u as an exact float32.
__device__ __forceinline__ float byte_to_float(uint32_t u, int i) {
  return __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7540u | i)) - 8388608.0f;
}

// The 8 four-bit values of a word, in order.
__device__ __forceinline__ void unpack4(uint32_t u, float* q) {
  const uint32_t lo = u & 0x0f0f0f0fu;         // values 0, 2, 4, 6
  const uint32_t hi = (u >> 4) & 0x0f0f0f0fu;  // values 1, 3, 5, 7
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[2 * i] = byte_to_float(lo, i);
    q[2 * i + 1] = byte_to_float(hi, i);
  }
}

// The 4 eight-bit values of a word, in order.
__device__ __forceinline__ void unpack8(uint32_t u, float* q) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[i] = byte_to_float(u, i);
  }
}

// 8 activations (16 bytes of float16 or bfloat16) as float32.
template <bool BF16>
__device__ __forceinline__ void activations8(uint4 v, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t u = word_of(v, i);
    if (BF16) {
      f[2 * i] = __uint_as_float(u << 16);
      f[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
    } else {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&u));
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

// y [NR, O] = x [NR, K] W^T. Launch: blocks of WARPS warps, ceil(O / (R *
// WARPS)) blocks; each lane loads U chunks of each of its R rows at a
// time. K a multiple of GS, GS of 32, 64 or 128.
template <typename T, int BITS, int GS, int NR, int R, int U, int WARPS, bool BF16>
__device__ __forceinline__ void matvec(const T* x, const uint32_t* w, const T* scales,
                                       const T* biases, T* y, int K, int O) {
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit weights");
  static_assert(GS % (128 / BITS) == 0, "a chunk lies inside one group");
  constexpr int V = 128 / BITS;  // values per 16-byte chunk
  constexpr int PARTS = V / 8;   // 8-value parts per chunk
  const int chunks = K / V;
  const int groups = K / GS;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
  if (row0 >= O) {
    return;  // the whole warp: row0 is the same in every lane
  }
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  long long row_of[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    row_of[r] = min(row0 + r, O - 1);
  }
  float acc[NR][R];
#pragma unroll
  for (int n = 0; n < NR; ++n) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[n][r] = 0.0f;
    }
  }
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    // All U * R loads of this step are issued before any is used, so each
    // lane keeps U * R * 16 bytes in flight.
    uint4 q[U][R];
    float s[U][R];
    float b[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + 32 * u, chunks - 1);
      const int g = (c * V) / GS;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        q[u][r] = load_streamed(w4 + row_of[r] * chunks + c);
        s[u][r] = static_cast<float>(scales[row_of[r] * groups + g]);
        b[u][r] = static_cast<float>(biases[row_of[r] * groups + g]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (u > 0 && c >= chunks) {
        break;  // the clamped loads above are not used
      }
      float dot[NR][R];
      float xsum[NR];
#pragma unroll
      for (int n = 0; n < NR; ++n) {
        xsum[n] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          dot[n][r] = 0.0f;
        }
      }
#pragma unroll
      for (int part = 0; part < PARTS; ++part) {
        float qf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (BITS == 4) {
            unpack4(word_of(q[u][r], part), qf[r]);
          } else {
            unpack8(word_of(q[u][r], 2 * part), qf[r]);
            unpack8(word_of(q[u][r], 2 * part + 1), qf[r] + 4);
          }
        }
#pragma unroll
        for (int n = 0; n < NR; ++n) {
          const uint4* xp =
              reinterpret_cast<const uint4*>(x + (long long)n * K + (long long)c * V) + part;
          float xf[8];
          activations8<BF16>(__ldg(xp), xf);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            xsum[n] += xf[j];
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              dot[n][r] = fmaf(qf[r][j], xf[j], dot[n][r]);
            }
          }
        }
      }
#pragma unroll
      for (int n = 0; n < NR; ++n) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[n][r] = fmaf(s[u][r], dot[n][r], fmaf(b[u][r], xsum[n], acc[n][r]));
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NR; ++n) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[n][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
      }
      if (lane == 0 && row0 + r < O) {
        y[(long long)n * O + row0 + r] = static_cast<T>(v);
      }
    }
  }
}

}  // namespace mlxhost_qmv
