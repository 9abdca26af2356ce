// A draw from softmax(x) for one row of logits, by inverse CDF, as one MLX
// CPU primitive: with u uniform in [0, 1), the token is the first j whose
// cumulative e^(x - max) exceeds u times the total.
//
// Why: MLX's `random::categorical` draws by Gumbel-max, one threefry hash
// and two logarithms per vocabulary entry, one lane at a time on x86
// (~1 ms per row per step at 49k entries). Inverse CDF needs one uniform
// per row and 16-lane exponentials. Both are exact draws from softmax(x);
// they map a given seed to different tokens, so CPU and GPU backends
// (which keep MLX's draw) do not repeat each other's sampled tokens.
//
// Input:  x [V] float32 (row-contiguous: the builder makes it so), u.
// Output: [] uint32. -inf entries are never drawn; a row holding NaN, or
//         with no finite entry, gives its argmax (the first maximum; 0 for
//         an all -inf row).
// CPU only: on a GPU stream the host uses MLX's draw (eval_gpu throws).

#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

#include "row_op.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace {

uint32_t draw(const float* x, int n, double u) {
  float m = -std::numeric_limits<float>::infinity();
  uint32_t best = 0;
  bool nan = false;
  for (int j = 0; j < n; j++) {
    nan |= std::isnan(x[j]);
    if (x[j] > m) {
      m = x[j];
      best = uint32_t(j);
    }
  }
  if (nan || !std::isfinite(m))
    return best;
  std::vector<float> q(n);
  const double total = mlxhost_cpu::exp_shifted_sum(x, n, m, q.data());
  const double target = u * total;
  double cum = 0;
  uint32_t last = best;
  for (int j = 0; j < n; j++) {
    if (q[j] == 0)
      continue;
    cum += q[j];
    last = uint32_t(j);
    if (cum > target)
      return last;
  }
  // Rounding left the target at the total: the last drawable token.
  return last;
}

} // namespace

// Builds the op lazily: `out` gets a [] uint32 token drawn from softmax(x)
// for x [V] (cast to float32 and made row-contiguous first) at uniform `u`.
// Returns 0, or 1 with the error reported through mlx-c's error handler (x
// not 1-D or empty, u outside [0, 1)).
extern "C" int mlxhost_categorical(mlx_array* out, const mlx_array x, double u) {
  try {
    const auto& xa = mlx_array_get_(x);
    if (xa.ndim() != 1 || xa.size() == 0)
      throw std::invalid_argument("categorical: x must be [V] with V > 0");
    if (!(u >= 0.0 && u < 1.0))
      throw std::invalid_argument("categorical: u must be in [0, 1)");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<mlxhost_cpu::CpuRowOp>(
        stream, "MlxhostCategorical", [u](const mx::array& x, mx::array& out) {
          *out.data<uint32_t>() = draw(x.data<float>(), int(x.size()), u);
        });
    mlx_array_set_(
        *out, mx::array(mx::Shape{}, mx::uint32, prim, {mlxhost_cpu::row_contiguous_f32(xa, stream)}));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
