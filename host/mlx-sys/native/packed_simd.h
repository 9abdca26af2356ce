// AVX-512 pieces of the packed layout (packed_matmul.cpp) that its kernels
// share: packed_matmul.cpp's 24-bit and int8 tile kernels and
// amx_matmul.cpp's dequantization to bfloat16.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cpu_kernels.h"

namespace mlxhost_cpu {

// A packed group's 16 scales and 16 biases (after its weight chunks at `sb`),
// as float32 lanes: float16 or float32 as the weight was packed.
template <bool F16>
__attribute__((target("avx512f"))) inline void load_scales_biases(
    const uint8_t* sb,
    __m512& s,
    __m512& b) {
  if constexpr (F16) {
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
  } else {
    s = _mm512_loadu_ps(reinterpret_cast<const float*>(sb));
    b = _mm512_loadu_ps(reinterpret_cast<const float*>(sb + 64));
  }
}

// y[m0 + m, n0 .. n0 + 16) = acc[m] for m < MC, the lanes past y's last
// column (a padded last tile) left out.
template <int MC>
__attribute__((target("avx512f"))) inline void store_tile_rows(
    const PackedProblem& p,
    const __m512* acc,
    int m0,
    int n0) {
  const int valid = std::min(16, p.N - n0);
  const __mmask16 keep = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int m = 0; m < MC; m++)
    _mm512_mask_storeu_ps(p.y + size_t(m0 + m) * p.N + n0, keep, acc[m]);
}

} // namespace mlxhost_cpu
#endif
