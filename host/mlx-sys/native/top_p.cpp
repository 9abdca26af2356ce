// mlx-lm's top-p (nucleus) filter of one row of logits, as one MLX CPU
// primitive: keep the most likely tokens whose mass above them (exclusive)
// is below p of the total, and every token tied with the least likely one
// kept; the rest become -inf. The definition is `apply_top_p` in mlx-lm's
// mlx_lm/sample_utils.py, as host/src/plugin/device_ops.rs computes it with
// MLX ops (the tests compare this with those, and with the definition
// computed in float64).
//
// Why: those MLX ops sort the whole vocabulary (a merge sort of 49k-152k
// floats per row per step) and compute their exponentials one lane at a
// time on x86: with `top_p` set, the sort alone was ~30% of a served 8-row
// decode step (perf). This op needs no full sort: one pass for the max, one
// for e^(x - max) and their total (16 lanes), one that sums the mass of
// quarter-nat buckets of x below the max; the bucket where the mass from the
// top reaches p of the total holds the boundary token, and only that bucket
// is sorted. Masses are summed in float64 (the MLX ops: float32 cumsum), so
// a token whose mass above lies within float32 rounding of the boundary may
// fall on the other side.
//
// Input:  x [V] float32 (row-contiguous: the builder makes it so), p in
//         (0, 1) (the host checks).
// Output: [V] float32. A row holding NaN, or whose max is not finite, is
//         returned unchanged (the MLX ops keep it too).
// CPU only: on a GPU stream the host uses the MLX ops (eval_gpu throws).

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

#include "row_op.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace {

// Buckets of x below the max, kBucketsPerNat per nat; the last one also
// holds everything further down (and -inf).
constexpr int kBucketsPerNat = 4;
constexpr int kBuckets = 64 * kBucketsPerNat + 1;

void top_p_row(const float* x, int n, float p, float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; j++) {
    if (std::isnan(x[j])) {
      std::copy(x, x + n, out);
      return;
    }
    m = std::max(m, x[j]);
  }
  if (!std::isfinite(m)) {
    std::copy(x, x + n, out);
    return;
  }
  std::vector<float> q(n);
  const double target = double(p) * mlxhost_cpu::exp_shifted_sum(x, n, m, q.data());
  auto bucket = [&](float v) {
    const float below = (m - v) * float(kBucketsPerNat);
    return below < float(kBuckets - 1) ? int(below) : kBuckets - 1;
  };
  std::vector<double> mass(kBuckets, 0.0);
  for (int j = 0; j < n; j++)
    mass[bucket(x[j])] += q[j];
  // The first bucket (from the top) where the mass through it reaches the
  // target: every token of a later bucket has at least that much above it.
  double above = 0;
  int b = 0;
  for (; b < kBuckets - 1 && above + mass[b] < target; b++)
    above += mass[b];
  std::vector<std::pair<float, float>> cands; // (x, q), bucket b
  for (int j = 0; j < n; j++)
    if (bucket(x[j]) == b)
      cands.emplace_back(x[j], q[j]);
  std::sort(cands.begin(), cands.end(), [](const auto& a, const auto& c) {
    return a.first > c.first;
  });
  // Walk down: a token is kept while the mass above it is below the target;
  // the last kept one is the threshold (bucket b's first token always is:
  // the mass above it is that of the earlier buckets, below the target).
  float threshold = m;
  for (const auto& [v, e] : cands) {
    if (above >= target)
      break;
    threshold = v;
    above += e;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; j++)
    out[j] = x[j] >= threshold ? x[j] : neg_inf;
}

} // namespace

// Builds the op lazily: `out` gets x [V] filtered (cast to float32 and made
// row-contiguous first; no-ops when it already is). Returns 0, or 1 with the
// error reported through mlx-c's error handler (x not 1-D or empty, p
// outside (0, 1)).
extern "C" int mlxhost_top_p(mlx_array* out, const mlx_array x, float p) {
  try {
    const auto& xa = mlx_array_get_(x);
    if (xa.ndim() != 1 || xa.size() == 0)
      throw std::invalid_argument("top-p: x must be [V] with V > 0");
    if (!(p > 0.0f && p < 1.0f))
      throw std::invalid_argument("top-p: p must be in (0, 1)");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<mlxhost_cpu::CpuRowOp>(
        stream, "MlxhostTopP", [p](const mx::array& x, mx::array& out) {
          top_p_row(x.data<float>(), int(x.size()), p, out.data<float>());
        });
    mlx_array_set_(
        *out, mx::array(xa.shape(), mx::float32, prim, {mlxhost_cpu::row_contiguous_f32(xa, stream)}));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
