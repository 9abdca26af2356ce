// log(sum(exp(x))) of every row of x [R, V] float32, as one MLX CPU
// primitive: what the engine step subtracts from a token's logit to get its
// log-probability (log_softmax(x)[i] = x[i] - logsumexp(x)).
//
// Why: MLX's CPU `logsumexp` computes its exponentials one lane at a time on
// x86 (its simd layer has no x86 vectors); over two [8, 49152] arrays per
// step (the raw and the sampled logits) that was ~15% of a served 8-row
// decode step. This op uses 16-lane exponentials (simd_math.h) and splits
// rows over mlxhost's thread pool.
//
// Math (as MLX's logsumexp): m = max(x); m + log(sum(exp(x - m))); float32
// accumulation in 16 lanes. A row whose max is +-inf gives that infinity
// (MLX: NaN for +inf); a row holding NaN gives NaN.
//
// Input:  x [R, V] float32, row-contiguous (the builder makes it so).
// Output: [R, 1] float32.
// CPU only: on a GPU stream the host uses MLX's logsumexp (eval_gpu throws).

#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

#include "cpu_kernels.h"
#include "row_op.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace {

float logsumexp_portable(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int i = 0; i < n; i++) {
    nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  if (nan)
    return std::numeric_limits<float>::quiet_NaN();
  if (std::isinf(m))
    return m;
  float s = 0;
  for (int i = 0; i < n; i++)
    s += std::exp(x[i] - m);
  return m + std::log(s);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float logsumexp_avx512(const float* x, int n) {
  const int full = n - n % 16;
  const __mmask16 tail = __mmask16((1u << (n % 16)) - 1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = neg_inf;
  __mmask16 nan = 0;
  for (int i = 0; i < full; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  if (tail) {
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail, x + full);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  if (nan)
    return std::numeric_limits<float>::quiet_NaN();
  const float m = _mm512_reduce_max_ps(mv);
  if (std::isinf(m))
    return m;
  const __m512 mb = _mm512_set1_ps(m);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= full; i += 32) {
    s0 = _mm512_add_ps(s0, mlxhost_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mb)));
    s1 = _mm512_add_ps(s1, mlxhost_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mb)));
  }
  for (; i < full; i += 16)
    s0 = _mm512_add_ps(s0, mlxhost_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mb)));
  if (tail) {
    // -inf lanes: exp512 gives ~1e-38, masked to 0 here.
    const __m512 e = mlxhost_cpu::exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(mb, tail, x + full), mb));
    s1 = _mm512_add_ps(s1, _mm512_maskz_mov_ps(tail, e));
  }
  return m + std::log(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
}
#endif

float logsumexp_row(const float* x, int n) {
#if defined(__x86_64__)
  if (mlxhost_cpu::has_avx512())
    return logsumexp_avx512(x, n);
#endif
  return logsumexp_portable(x, n);
}

} // namespace

// Builds the op lazily: `out` gets [R, 1] float32 for x [R, V] (cast to
// float32 and made row-contiguous first; no-ops when it already is). Returns
// 0, or 1 with the error reported through mlx-c's error handler.
extern "C" int mlxhost_logsumexp_rows(mlx_array* out, const mlx_array x) {
  try {
    const auto& xa = mlx_array_get_(x);
    if (xa.ndim() != 2 || xa.shape(1) == 0)
      throw std::invalid_argument("logsumexp rows: x must be [R, V] with V > 0");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<mlxhost_cpu::CpuRowOp>(
        stream, "MlxhostLogSumExpRows", [](const mx::array& x, mx::array& out) {
          const int rows = x.shape(0), n = x.shape(1);
          const float* xp = x.data<float>();
          float* op = out.data<float>();
          mlxhost_cpu::parallel_for(
              rows, [&](int r) { op[r] = logsumexp_row(xp + size_t(r) * n, n); });
        });
    mlx_array_set_(
        *out,
        mx::array(
            {xa.shape(0), 1}, mx::float32, prim, {mlxhost_cpu::row_contiguous_f32(xa, stream)}));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
