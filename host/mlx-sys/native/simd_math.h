// Vector math shared by mlxhost's CPU kernels (decode_layer.cpp,
// logsumexp.cpp, top_p.cpp, categorical.cpp). MLX's own CPU ops run their
// exponentials one lane at a time on x86 (its simd layer has no x86
// vectors), which made the vocab-wide ones a visible share of a decode step.
#pragma once

#include <cmath>
#include <limits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>

namespace mlxhost_cpu {

// e^x, 16 lanes: Cephes' expf (x = n ln2 + r, a degree-6 polynomial for
// e^r, scaled by 2^n); within ~2 ulp of expf. Inputs below -87.3 give
// e^-87.3 (~1e-38: 0 for softmax terms), large ones overflow to inf.
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// q[i] = e^(x[i] - m) for the first n - n % 16 elements of x; returns how
// many (the caller finishes the tail).
__attribute__((target("avx512f"))) inline int exp_shifted_avx512(
    const float* x,
    int n,
    float m,
    float* q) {
  const __m512 mb = _mm512_set1_ps(m);
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(q + i, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mb)));
  return i;
}

// r[l] = sum of the 16 lanes of v[l], for 16 vectors at once: pairs within
// 128-bit lanes (unpack), then quads (shuffle), then across the four
// 128-bit lanes (shuffle_f32x4); 45 instructions for 16 sums.
__attribute__((target("avx512f"))) inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_ps(
        _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // t[i], per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] (a = v[2i], b = v[2i+1]).
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_ps(
        _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // u[i], per 128-bit lane k: the lane-k sums of v[4i .. 4i + 3].
  const __m512 x01 = _mm512_add_ps(
      _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
      _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_add_ps(
      _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
      _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(
      _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
      _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[j] = e^(s[j] - max) for j < n (n >= 1, every s finite), 16 lanes at
// a time; returns (max, sum of the numerators): a softmax's numerators and
// denominator (decode_layer.cpp, chunked_attention.cpp).
__attribute__((target("avx512f"))) inline std::pair<float, float> softmax_numerators_avx512(float* s, int n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 16 <= n; j += 16)
    mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const __mmask16 tail = __mmask16((1u << (n - j)) - 1);
  mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + j));
  const float best = _mm512_reduce_max_ps(mx);
  const __m512 bv = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), bv));
    _mm512_storeu_ps(s + j, e);
    total = _mm512_add_ps(total, e);
  }
  if (j < n) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), bv));
    _mm512_mask_storeu_ps(s + j, tail, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
  }
  return {best, _mm512_reduce_add_ps(total)};
}

inline bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

} // namespace mlxhost_cpu
#endif

namespace mlxhost_cpu {

// q[j] = e^(x[j] - m) for j < n (0 where x[j] is -inf), 16 lanes where the
// CPU has AVX-512; returns their sum in float64. m: the row's finite max.
inline double exp_shifted_sum(const float* x, int n, float m, float* q) {
  int j = 0;
#if defined(__x86_64__)
  if (has_avx512())
    j = exp_shifted_avx512(x, n, m, q);
#endif
  for (int i = j; i < n; i++)
    q[i] = std::exp(x[i] - m);
  double total = 0;
  for (int i = 0; i < n; i++) {
    // exp512 gives ~1e-38 for -inf: count it as nothing.
    if (x[i] == -std::numeric_limits<float>::infinity())
      q[i] = 0;
    total += q[i];
  }
  return total;
}

} // namespace mlxhost_cpu
