// The MLP's activation `silu(gate) * up` on the CPU, for the fused decode
// layer (decode_layer.cpp) and as an MLX op for prefill-sized rows.
//
// Why an op: MLX's CPU `sigmoid` runs `exp` one lane at a time (its simd
// layer has no x86 vectors; each lane calls libm's fmaf) and `gate *
// sigmoid(gate) * up` makes three passes over [T, inter] float32 arrays.
// With prefill products on AMX, those passes were ~18% of a 512-token
// prefill of Qwen2.5-1.5B (perf); here one pass of 16-lane exponentials.

#include <cmath>
#include <exception>
#include <memory>
#include <stdexcept>

#include "cpu_kernels.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "row_op.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace {

#if defined(__x86_64__)
// The first n - n % 16 elements of one row; returns how many it did.
__attribute__((target("avx512f"))) int swiglu_avx512(
    const float* gate,
    const float* up,
    int n,
    float* a) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    // e^-g overflows to inf for g < -88: silu is then -0, as the scalar
    // form gives.
    const __m512 e = mlxhost_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
  return i;
}
#endif

} // namespace

namespace mlxhost_cpu {

void swiglu(const float* gu, int R, int inter, float* act) {
  parallel_for_range(R, 1, [&](int r0, int r1) {
    for (int r = r0; r < r1; r++) {
      const float* gate = gu + size_t(r) * 2 * inter;
      const float* up = gate + inter;
      float* a = act + size_t(r) * inter;
      int i = 0;
#if defined(__x86_64__)
      if (has_avx512())
        i = swiglu_avx512(gate, up, inter, a);
#endif
      for (; i < inter; i++)
        a[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
}

} // namespace mlxhost_cpu

// Builds the op lazily: `out` gets [R, I] float32 for gu [R, 2 I] (the gate
// product's I columns, then the up product's; cast to float32 and made
// row-contiguous first, no-ops when it already is). CPU stream only.
// Returns 0, or 1 with the error reported through mlx-c's error handler.
extern "C" int mlxhost_swiglu_rows(mlx_array* out, const mlx_array gu) {
  try {
    const auto& ga = mlx_array_get_(gu);
    if (ga.ndim() != 2 || ga.shape(1) % 2 != 0)
      throw std::invalid_argument("swiglu rows: gu must be [R, 2 I]");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<mlxhost_cpu::CpuRowOp>(
        stream, "MlxhostSwiGluRows", [](const mx::array& x, mx::array& y) {
          mlxhost_cpu::swiglu(x.data<float>(), x.shape(0), x.shape(1) / 2, y.data<float>());
        });
    mlx_array_set_(
        *out,
        mx::array(
            {ga.shape(0), ga.shape(1) / 2},
            mx::float32,
            prim,
            {mlxhost_cpu::row_contiguous_f32(ga, stream)}));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
