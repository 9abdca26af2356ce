// Causal attention of a prefill chunk over one row's KV cache, as one MLX CPU
// primitive per layer: tiled, with an online softmax, so the `[H, T, L]`
// float32 scores are never materialised (FlashAttention's schedule, Dao et
// al. 2022, on AVX-512).
//
// Why: MLX's CPU `scaled_dot_product_attention` computes the scores, a causal
// mask and a softmax as separate whole-array ops. A 512-token chunk at a
// 19k-token offset makes `[14, 512, 19k]` float32 scores per layer (545 MB
// for Qwen2.5-0.5B), written and read back several times, with exponentials
// one lane at a time (MLX's simd layer has no x86 vectors). Prefill of Qwen
// 0.5B fell from 84.6 tok/s at 512 tokens to 30.6 at 4,096 (llama.cpp: 71.8
// and 70.5). Here each task keeps its query rows' running max, sum and
// output in registers and cache while it streams the key and value tiles
// once.
//
// Inputs:  q [1, H, T, D] (any strides), keys and values [1, H_kv, L, D]
//          with L = offset + T (a cache buffer's valid prefix: the last axis
//          contiguous, any other strides); float32; D a multiple of 16,
//          H % H_kv == 0.
// Output:  [T, H * D] float32, token-major (the output projection's input,
//          no transpose): query i (position offset + i) attends to keys
//          [0, offset + i] with weights softmax(scale * q k^T).
// CPU only, AVX-512F only (the host checks `mlxhost_prefill_attention_available`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/primitives.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace {

#if defined(__x86_64__)

// Queries per task and per head (a task takes these queries of every query
// head sharing one KV head, so each key and value tile it loads serves
// group x kQueries rows).
constexpr int kQueries = 16;
// Keys per tile: 4 vectors of 16 scores per query row.
constexpr int kKeys = 64;
// Query rows a score or output micro-kernel handles at once.
constexpr int kRowsPerPass = 4;

using Args = mlxhost_cpu::AttentionArgs;

// s[r][0..64) = q_r . K^T for 4 query rows over one tile whose keys are
// transposed into kt[d * 64 + j]; rows past `rows` are not written.
__attribute__((target("avx512f"))) inline void scores_tile(
    const float* const* q,
    int rows,
    const float* kt,
    int dim,
    float* s) {
  __m512 acc[kRowsPerPass][4];
  for (int r = 0; r < kRowsPerPass; r++)
    for (int c = 0; c < 4; c++)
      acc[r][c] = _mm512_setzero_ps();
  for (int d = 0; d < dim; d++) {
    const float* col = kt + size_t(d) * kKeys;
    const __m512 k0 = _mm512_loadu_ps(col);
    const __m512 k1 = _mm512_loadu_ps(col + 16);
    const __m512 k2 = _mm512_loadu_ps(col + 32);
    const __m512 k3 = _mm512_loadu_ps(col + 48);
    for (int r = 0; r < kRowsPerPass; r++) {
      if (r >= rows)
        break;
      const __m512 qd = _mm512_set1_ps(q[r][d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qd, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qd, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < rows && r < kRowsPerPass; r++)
    for (int c = 0; c < 4; c++)
      _mm512_storeu_ps(s + size_t(r) * kKeys + 16 * c, acc[r][c]);
}

// o_r[d0..d0+64) += sum_j p_r[j] v_j[d0..d0+64) for 4 rows over `keys` keys.
__attribute__((target("avx512f"))) inline void values_tile(
    const float* p,
    int rows,
    const float* v,
    int64_t vs2,
    int keys,
    int d0,
    int width,
    float* const* o) {
  // width: 16, 32, 48 or 64 columns from d0.
  const int vecs = width / 16;
  __m512 acc[kRowsPerPass][4];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < vecs; c++)
      acc[r][c] = _mm512_loadu_ps(o[r] + d0 + 16 * c);
  for (int j = 0; j < keys; j++) {
    const float* vr = v + j * vs2 + d0;
    __m512 vv[4];
    for (int c = 0; c < vecs; c++)
      vv[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int r = 0; r < kRowsPerPass; r++) {
      if (r >= rows)
        break;
      const __m512 pj = _mm512_set1_ps(p[size_t(r) * kKeys + j]);
      for (int c = 0; c < vecs; c++)
        acc[r][c] = _mm512_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < vecs; c++)
      _mm512_storeu_ps(o[r] + d0 + 16 * c, acc[r][c]);
}

// One task: queries [i0, i1) of every query head of KV head g.
__attribute__((target("avx512f"))) void run_task(const Args& a, int g, int i0, int i1) {
  const int group = a.heads / a.kv_heads;
  const int nq = i1 - i0;
  const int rows = group * nq; // row r: head g * group + r / nq, query i0 + r % nq
  const int dim = a.dim;
  // Per-thread scratch, kept between calls.
  static thread_local std::vector<float> qbuf, obuf, mbuf, lbuf, kt, sbuf;
  qbuf.resize(size_t(rows) * dim);
  obuf.assign(size_t(rows) * dim, 0.0f);
  mbuf.assign(rows, -INFINITY);
  lbuf.assign(rows, 0.0f);
  kt.resize(size_t(dim) * kKeys);
  sbuf.resize(size_t(rows) * kKeys);
  for (int r = 0; r < rows; r++) {
    const int h = g * group + r / nq, i = i0 + r % nq;
    const float* src = a.q + h * a.qs1 + i * a.qs2;
    float* dst = &qbuf[size_t(r) * dim];
    // Scaled once here, so scores come out scaled.
    for (int d = 0; d < dim; d++)
      dst[d] = src[d] * a.scale;
  }
  const float* kg = a.k + g * a.ks1;
  const float* vg = a.v + g * a.vs1;
  // Keys any query of the block sees: [0, offset + i1).
  const int end = a.offset + i1;
  for (int j0 = 0; j0 < end; j0 += kKeys) {
    const int keys = std::min(kKeys, end - j0);
    // The tile's keys transposed (zero past `keys`): kt[d * 64 + j].
    for (int j = 0; j < kKeys; j++) {
      if (j < keys) {
        const float* kr = kg + (j0 + j) * a.ks2;
        for (int d = 0; d < dim; d++)
          kt[size_t(d) * kKeys + j] = kr[d];
      } else {
        for (int d = 0; d < dim; d++)
          kt[size_t(d) * kKeys + j] = 0.0f;
      }
    }
    // Whether some query of the block has a key of this tile in its future.
    const bool diagonal = j0 + kKeys > a.offset + i0;
    for (int r0 = 0; r0 < rows; r0 += kRowsPerPass) {
      const int n = std::min(kRowsPerPass, rows - r0);
      const float* qs[kRowsPerPass];
      float* os[kRowsPerPass];
      for (int r = 0; r < n; r++) {
        qs[r] = &qbuf[size_t(r0 + r) * dim];
        os[r] = &obuf[size_t(r0 + r) * dim];
      }
      float* s = &sbuf[size_t(r0) * kKeys];
      scores_tile(qs, n, kt.data(), dim, s);
      for (int r = 0; r < n; r++) {
        float* sr = s + size_t(r) * kKeys;
        // Keys this row sees in the tile: up to its own position.
        const int pos = a.offset + i0 + (r0 + r) % nq;
        const int seen = diagonal ? std::max(0, std::min(keys, pos - j0 + 1)) : keys;
        for (int j = seen; j < kKeys; j++)
          sr[j] = -INFINITY;
        float tile_max = -INFINITY;
        for (int j = 0; j < seen; j++)
          tile_max = std::max(tile_max, sr[j]);
        float& m = mbuf[r0 + r];
        float& l = lbuf[r0 + r];
        const float m_new = std::max(m, tile_max);
        if (m_new == -INFINITY) {
          // Nothing seen yet (cannot happen for key 0, kept for safety).
          for (int j = 0; j < kKeys; j++)
            sr[j] = 0.0f;
          continue;
        }
        const float corr = std::exp(m - m_new); // 0 on the first tile (m = -inf)
        m = m_new;
        const double sum = mlxhost_cpu::exp_shifted_sum(sr, kKeys, m_new, sr);
        l = l * corr + float(sum);
        if (corr != 1.0f) {
          float* o = os[r];
          const __m512 c = _mm512_set1_ps(corr);
          for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(c, _mm512_loadu_ps(o + d)));
        }
      }
      const float* vt = vg + int64_t(j0) * a.vs2;
      for (int d0 = 0; d0 < dim; d0 += 64)
        values_tile(s, n, vt, a.vs2, keys, d0, std::min(64, dim - d0), os);
    }
  }
  // Normalise and scatter to the token-major output.
  for (int r = 0; r < rows; r++) {
    const int h = g * group + r / nq, i = i0 + r % nq;
    const float inv = lbuf[r] > 0 ? 1.0f / lbuf[r] : 0.0f;
    const float* src = &obuf[size_t(r) * dim];
    float* dst = a.out + (int64_t(i) * a.heads + h) * dim;
    for (int d = 0; d < dim; d++)
      dst[d] = src[d] * inv;
  }
}

// Whether a chunk attends on AMX tiles: `precision` 2, or 0 (the default)
// where prefill products are bfloat16 (`prefill_products`) and
// `MLXHOST_PREFILL_ATTENTION` is not `f32` (`bf16` forces it).
bool use_amx(int precision) {
  if (precision != 0)
    return precision == 2;
  static const int forced = [] {
    const char* env = std::getenv("MLXHOST_PREFILL_ATTENTION");
    const std::string v = env ? env : "";
    if (!v.empty() && v != "f32" && v != "bf16" && v != "mlx")
      std::fprintf(
          stderr, "mlxhost: MLXHOST_PREFILL_ATTENTION=%s ignored (mlx, f32 or bf16)\n", v.c_str());
    return v == "f32" ? 1 : v == "bf16" ? 2 : 0;
  }();
  if (forced != 0)
    return forced == 2;
  return mlxhost_cpu::prefill_products() == mlxhost_cpu::kPrefillBf16;
}

void run(const Args& a, int precision) {
  if (use_amx(precision) && mlxhost_cpu::prefill_attention_amx(a))
    return;
  const int blocks = (a.t + kQueries - 1) / kQueries;
  const int tasks = a.kv_heads * blocks;
  // Later query blocks see more keys: hand them out first so the last tasks
  // to run are short ones.
  mlxhost_cpu::parallel_for(tasks, [&](int task) {
    const int g = task % a.kv_heads;
    const int b = blocks - 1 - task / a.kv_heads;
    const int i0 = b * kQueries;
    run_task(a, g, i0, std::min(a.t, i0 + kQueries));
  });
}

class PrefillAttention : public mx::Primitive {
 public:
  PrefillAttention(mx::Stream s, int offset, float scale, int precision)
      : mx::Primitive(s), offset_(offset), scale_(scale), precision_(precision) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& x : inputs)
      enc.set_input_array(x);
    enc.set_output_array(outputs[0]);
    // The kernels read the last axis as contiguous (strides are known only
    // now, at evaluation).
    for (const auto& a : inputs) {
      if (a.strides()[3] != 1)
        throw std::runtime_error("prefill attention: an input's last axis is not contiguous");
    }
    enc.dispatch([inputs,
                  out = outputs[0],
                  offset = offset_,
                  scale = scale_,
                  precision = precision_]() mutable {
      const auto& q = inputs[0];
      const auto& k = inputs[1];
      const auto& v = inputs[2];
      Args a;
      a.q = q.data<float>();
      a.qs1 = q.strides()[1];
      a.qs2 = q.strides()[2];
      a.k = k.data<float>();
      a.ks1 = k.strides()[1];
      a.ks2 = k.strides()[2];
      a.v = v.data<float>();
      a.vs1 = v.strides()[1];
      a.vs2 = v.strides()[2];
      a.out = out.data<float>();
      a.heads = q.shape(1);
      a.kv_heads = k.shape(1);
      a.t = q.shape(2);
      a.dim = q.shape(3);
      a.offset = offset;
      a.scale = scale;
      run(a, precision);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost PrefillAttention has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostPrefillAttention";
  }

 private:
  int offset_;
  float scale_;
  int precision_;
};

#endif // __x86_64__

} // namespace

// Whether this CPU runs the op (x86-64 with AVX-512F).
extern "C" int mlxhost_prefill_attention_available() {
#if defined(__x86_64__)
  return mlxhost_cpu::has_avx512() ? 1 : 0;
#else
  return 0;
#endif
}

// Builds the op (lazily). `out` gets [T, H * D] float32. `precision`: 0 the
// process's choice (see `use_amx`), 1 the float32 kernel, 2 AMX bfloat16
// where the CPU has it. Returns 0, or 1 with the error reported through
// mlx-c's error handler.
extern "C" int mlxhost_prefill_attention(
    mlx_array* out,
    const mlx_array q,
    const mlx_array keys,
    const mlx_array values,
    int offset,
    float scale,
    int precision) {
  try {
#if defined(__x86_64__)
    const auto& qa = mlx_array_get_(q);
    const auto& ka = mlx_array_get_(keys);
    const auto& va = mlx_array_get_(values);
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || qa.shape(0) != 1 ||
        ka.shape(0) != 1 || ka.shape() != va.shape() || ka.shape(1) == 0 ||
        qa.shape(1) % ka.shape(1) != 0 || qa.shape(3) != ka.shape(3) ||
        qa.shape(3) % 16 != 0 || offset < 0 || ka.shape(2) != offset + qa.shape(2)) {
      throw std::invalid_argument(
          "prefill attention: q must be [1, H, T, D], keys and values [1, H_kv, offset + T, D], "
          "D a multiple of 16");
    }
    if (qa.dtype() != mx::float32 || ka.dtype() != mx::float32 || va.dtype() != mx::float32)
      throw std::invalid_argument("prefill attention: float32 only");
    if (!mlxhost_cpu::has_avx512())
      throw std::invalid_argument("prefill attention: this CPU has no AVX-512F");
    std::vector<mx::array> inputs = {qa, ka, va};
    const int t = qa.shape(2), h = qa.shape(1), d = qa.shape(3);
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<PrefillAttention>(stream, offset, scale, precision);
    auto outs = mx::array::make_arrays({mx::Shape{t, h * d}}, {mx::float32}, prim, inputs);
    mlx_array_set_(*out, outs[0]);
#else
    (void)out;
    (void)q;
    (void)keys;
    (void)values;
    (void)offset;
    (void)scale;
    (void)precision;
    throw std::invalid_argument("prefill attention: x86-64 only");
#endif
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
