// One Llama-family decoder layer for R decoding rows (one new token each),
// as one MLX CPU primitive (mlxhost's quantized CPU decode path).
//
// Why: MLX's CPU backend costs tens of microseconds per op (graph walk,
// allocation, a hand-off to the stream's thread), and a decode step through
// MLX ops is about 25 ops per layer: on SmolLM2 (30 layers) that overhead
// alone was larger than the matrix products from 4-bit weights. This op
// runs the whole layer in C++ on the calling stream thread, its matrix
// products on mlxhost's quantized kernel and thread pool (cpu_kernels.h):
//
//   x = rms_norm(h) * input_norm
//   q, k, v = split(x @ Wqkv^T + b_qkv)      (fused q/k/v projection; the
//                                            bias is zero for Llama, Qwen2's own)
//   q, k = rope(q, k) at each row's position (half-split, base theta)
//   K[pos], V[pos] = k, v                    (the row's cache, in place)
//   a = softmax(q K^T / sqrt(D)) V           (grouped-query heads)
//   h = h + a @ Wo^T
//   x = rms_norm(h) * post_attention_norm
//   g, u = split(x @ Wgate_up^T)
//   h = h + (silu(g) * u) @ Wdown^T
//
// The same math as `Llama::forward` (host/src/model/llama.rs; mlx-lm's
// models/llama.py), which the host's tests compare it with.
//
// Precondition (the host's, as for decode_attention.cpp): each row owns its
// cache buffers exclusively, so writing in place is invisible to others.
//
// Inputs:  h [R, E] float32; input_norm, post_norm [E] float32; then for
//          qkv, o, gate_up, down: w [N, K * bits / 32] uint32, scales and
//          biases [N, K / group] float32 (or the packed layout of
//          packed_matmul.cpp and two unused placeholders: the VNNI
//          kernel); then the q/k/v bias [q + 2 kv]
//          float32; then K_0, V_0, ..., K_{R-1},
//          V_{R-1}: [1, H_kv, cap_r, D] float32 (row-contiguous, cap_r > pos_r);
//          then the step's LoRA pairs (A, B float16; see `LoraSlot`).
// Outputs: h' [R, E] float32, then K'_0, V'_0, ...: the cache buffers.
// CPU only: on a GPU stream the host never builds this op (eval_gpu throws).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "cpu_kernels.h"
#include "simd_math.h"

namespace mx = mlx::core;
#if defined(__x86_64__)
using mlxhost_cpu::has_avx512;
#endif

namespace {

struct Shape {
  int heads, kv_heads, head_dim, inter;
  float eps, rope_theta;
  int variant[4]; // per product: qkv, o, gate_up, down
  int bits[4], group[4];
  // Per product: the weight is in the packed layout (packed_matmul.cpp;
  // its scales and biases inputs are then unused placeholders), and that
  // layout's scales are float16.
  bool packed[4], f16[4];
  // The KV cache's scheme: 0 = float32 rows of D; else `kv_bits` (4 or 8)
  // quantized rows of `kv_group` (chunked_attention.cpp).
  int kv_bits, kv_group;
};

void rms_norm(const float* x, const float* w, float eps, int n, float* out) {
  double ss = 0;
  for (int i = 0; i < n; i++)
    ss += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(ss / n) + eps);
  for (int i = 0; i < n; i++)
    out[i] = x[i] * inv * w[i];
}

// Half-split RoPE (MLX `fast::rope`, traditional = false) of `heads` heads of
// width D, in place; cs holds cos(theta_j) then sin(theta_j) for j < D / 2
// (`rope_table`: one table per row serves its query and key heads).
void rope(float* x, int heads, int D, const float* cs) {
  const int half = D / 2;
  for (int h = 0; h < heads; h++) {
    float* v = x + size_t(h) * D;
    for (int j = 0; j < half; j++) {
      const float c = cs[j], s = cs[half + j];
      const float a = v[j], b = v[j + half];
      v[j] = a * c - b * s;
      v[j + half] = a * s + b * c;
    }
  }
}

void rope_table(int pos, const std::vector<float>& inv_freq, float* cs) {
  const int half = int(inv_freq.size());
  for (int j = 0; j < half; j++) {
    const float theta = float(pos) * inv_freq[j];
    cs[j] = std::cos(theta);
    cs[half + j] = std::sin(theta);
  }
}

// y [M, N] = x [M, K] @ W^T for product `l` (weights at inputs first..first+2).
void product(
    const std::vector<mx::array>& in,
    int first,
    const float* x,
    float* y,
    int M,
    const Shape& sh,
    int l,
    int N,
    int K) {
  if (sh.packed[l]) {
    mlxhost_cpu::PackedProblem p;
    p.x = x;
    p.packed = in[first].data<uint8_t>();
    p.y = y;
    p.M = M;
    p.N = N;
    p.K = K;
    p.bits = sh.bits[l];
    p.group = sh.group[l];
    p.f16_scales = sh.f16[l];
    mlxhost_cpu::compute_packed(p, mlxhost_cpu::kPackedSimd);
    return;
  }
  mlxhost_cpu::Problem p;
  p.x = x;
  p.w = reinterpret_cast<const uint8_t*>(in[first].data<uint32_t>());
  p.scales = in[first + 1].data<float>();
  p.biases = in[first + 2].data<float>();
  p.y = y;
  p.M = M;
  p.N = N;
  p.K = K;
  p.bits = sh.bits[l];
  p.group = sh.group[l];
  mlxhost_cpu::compute(p, sh.variant[l]);
}

// LoRA deltas. An adapter's pair for one product, as the host stores it for
// this op: float16 (half the bytes of float32: a batch-1 step is bound by
// the bytes it reads) and no zero blocks (the fused q/k/v and gate/up
// products' parts are kept apart, so an adapter of q alone reads no k/v
// columns). A [K, rs]: the parts' A side by side (rs = the sum of their
// ranks); B: each part's [r, w] row-major, one after another. Part p adds
// scale_p * (x @ A[:, ro_p : ro_p + r_p]) @ B_p to the output columns
// [no_p, no_p + w_p). Sums are float32.
constexpr int kLoraParts = 3;

struct LoraPart {
  int rank_off, rank, out_off, width;
  float scale;
};

// One adapter's pair for one product: inputs[input] is A, inputs[input + 1]
// B; input < 0: the adapter does not adapt the product.
struct LoraSlot {
  int input = -1;
  int rs = 0;
  int parts = 0;
  LoraPart part[kLoraParts];
};

// Per product (qkv, o, gate_up, down), per adapter of the step.
using LoraSlots = std::array<std::vector<LoraSlot>, 4>;

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24.
    const float f = std::ldexp(float(man), -24);
    return sign ? -f : f;
  }
  if (exp == 31)
    bits = sign | 0x7f800000u | (man << 13);
  else
    bits = sign | ((exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void halves_plain(const uint16_t* s, float* d, int n) {
  for (int i = 0; i < n; i++)
    d[i] = half_to_float(s[i]);
}

// t [m, rs] += x [idx[i], k0 : k0 + kb] @ a [kb, rs] (a: rows k0.. of A,
// already float32).
#define MLXHOST_LORA_DOWN_BODY                                          \
  for (int k = 0; k < kb; k++) {                                        \
    const float* ak = a + size_t(k) * rs;                               \
    for (int i = 0; i < m; i++) {                                       \
      const float xv = x[size_t(idx[i]) * K + k0 + k];                  \
      float* ti = t + size_t(i) * rs;                                   \
      for (int j = 0; j < rs; j++)                                      \
        ti[j] += xv * ak[j];                                            \
    }                                                                   \
  }

// y [idx[i], 0 : w] += t [i, 0] * b [0 : w] (t strided by rs: one rank
// column of the rows' t; y already offset to the columns).
#define MLXHOST_LORA_UP_BODY                                            \
  for (int i = 0; i < m; i++) {                                         \
    const float tv = t[size_t(i) * rs];                                 \
    float* yi = y + size_t(idx[i]) * N;                                 \
    for (int n = 0; n < w; n++)                                         \
      yi[n] += tv * b[n];                                               \
  }

void down_plain(const float* x, const int* idx, int m, int K, int k0, int kb, const float* a,
                int rs, float* t) {
  MLXHOST_LORA_DOWN_BODY
}

void up_plain(const float* t, int rs, const int* idx, int m, float* y, int N, const float* b,
              int w) {
  MLXHOST_LORA_UP_BODY
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void halves_avx512(const uint16_t* s, float* d, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        d + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  for (; i < n; i++)
    d[i] = half_to_float(s[i]);
}

__attribute__((target("avx512f"))) void down_avx512(const float* x, const int* idx, int m,
                                                    int K, int k0, int kb, const float* a,
                                                    int rs, float* t) {
  MLXHOST_LORA_DOWN_BODY
}

__attribute__((target("avx512f"))) void up_avx512(const float* t, int rs, const int* idx, int m,
                                                  float* y, int N, const float* b, int w) {
  MLXHOST_LORA_UP_BODY
}
#endif

struct LoraKernels {
  void (*halves)(const uint16_t*, float*, int);
  void (*down)(const float*, const int*, int, int, int, int, const float*, int, float*);
  void (*up)(const float*, int, const int*, int, float*, int, const float*, int);
};

const LoraKernels& lora_kernels() {
  static const LoraKernels k = [] {
#if defined(__x86_64__)
    if (has_avx512())
      return LoraKernels{halves_avx512, down_avx512, up_avx512};
#endif
    return LoraKernels{halves_plain, down_plain, up_plain};
  }();
  return k;
}

// Rows of A converted to float32 at a time (a block stays in L1 while the
// rows' sums read it).
constexpr int kLoraBlock = 32;

// One adapter's delta for its `m` rows `idx`: y [idx[i]] += the parts'
// scale * (x [idx[i]] @ A_p) @ B_p. x [R, K], y [R, N]. On the calling
// thread: splitting it over the pool (x @ A by K, t @ B by column) added
// two pool hand-offs per product, 240 per SmolLM2 step, and on this
// 2-core machine shared with other work the hand-offs cost more than the
// second core's bandwidth gave back (benches/lora.sh, docs/lora.md).
void lora_one(const std::vector<mx::array>& in, const LoraSlot& s, const float* x, float* y,
              int N, int K, const int* idx, int m) {
  const auto& kern = lora_kernels();
  const uint16_t* a = reinterpret_cast<const uint16_t*>(in[s.input].data<mx::float16_t>());
  const uint16_t* b = reinterpret_cast<const uint16_t*>(in[s.input + 1].data<mx::float16_t>());
  const int rs = s.rs;
  thread_local std::vector<float> buf, t;
  t.assign(size_t(m) * rs, 0.0f);
  buf.resize(std::max(size_t(kLoraBlock) * rs, size_t(N)));
  for (int k0 = 0; k0 < K; k0 += kLoraBlock) {
    const int kb = std::min(kLoraBlock, K - k0);
    kern.halves(a + size_t(k0) * rs, buf.data(), kb * rs);
    kern.down(x, idx, m, K, k0, kb, buf.data(), rs, t.data());
  }
  size_t boff = 0;
  for (int p = 0; p < s.parts; p++) {
    const LoraPart& q = s.part[p];
    for (int i = 0; i < m; i++)
      for (int j = 0; j < q.rank; j++)
        t[size_t(i) * rs + q.rank_off + j] *= q.scale;
    for (int j = 0; j < q.rank; j++) {
      kern.halves(b + boff + size_t(j) * q.width, buf.data(), q.width);
      kern.up(t.data() + q.rank_off + j, rs, idx, m, y + q.out_off, N, buf.data(), q.width);
    }
    boff += size_t(q.rank) * q.width;
  }
}

// Product `l`'s LoRA deltas: the rows of adapter g (rows[i] == g) run
// slots[g]; rows[i] = -1: none.
void lora_add(const std::vector<mx::array>& in, const std::vector<LoraSlot>& slots,
              const float* x, float* y, int R, int N, int K, const std::vector<int>& rows) {
  std::vector<int> idx;
  for (size_t g = 0; g < slots.size(); g++) {
    if (slots[g].input < 0)
      continue;
    idx.clear();
    for (int i = 0; i < R; i++)
      if (rows[i] == int(g))
        idx.push_back(i);
    if (!idx.empty())
      lora_one(in, slots[g], x, y, N, K, idx.data(), int(idx.size()));
  }
}

// The inputs: h, the 15 weights, the rows' caches (K_0, V_0, ...), then
// each present LoRA pair (A, B).
constexpr int kCachesFirst = 16;

void run(
    const std::vector<mx::array>& in,
    std::vector<mx::array>& out,
    const std::vector<int>& positions,
    const std::vector<int>& lora_rows,
    const LoraSlots& lora,
    const Shape& sh) {
  const int R = in[0].shape(0), E = in[0].shape(1);
  const int H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const int qkv_n = (H + 2 * Hkv) * D;
  const int inter = sh.inter;
  const float* h = in[0].data<float>();
  float* h_out = out[0].data<float>();
  std::vector<float> x(size_t(R) * E), qkv(size_t(R) * qkv_n), attn(size_t(R) * H * D);
  std::vector<float> gu(size_t(R) * 2 * inter), act(size_t(R) * inter), proj(size_t(R) * E);
  std::vector<float> inv_freq(D / 2);
  for (int j = 0; j < D / 2; j++)
    inv_freq[j] = 1.0f / std::pow(sh.rope_theta, float(2 * j) / float(D));

  for (int r = 0; r < R; r++)
    rms_norm(h + size_t(r) * E, in[1].data<float>(), sh.eps, E, x.data() + size_t(r) * E);
  product(in, 3, x.data(), qkv.data(), R, sh, 0, qkv_n, E);
  lora_add(in, lora[0], x.data(), qkv.data(), R, qkv_n, E, lora_rows);
  const float* qkv_bias = in[15].data<float>();
  for (int r = 0; r < R; r++)
    for (int j = 0; j < qkv_n; j++)
      qkv[size_t(r) * qkv_n + j] += qkv_bias[j];

  // RoPE and the cache write, one task per (row, KV head), each leaving an
  // attention job; the jobs then run together, every row's positions split
  // in chunks over the pool (chunked_attention.cpp), so a row with fewer
  // KV heads than threads still uses them all.
  const bool quant_kv = sh.kv_bits != 0;
  const size_t row_words = quant_kv ? size_t(D) * sh.kv_bits / 32 + 2 * size_t(D / sh.kv_group) : 0;
  std::vector<mlxhost_cpu::KvQuantJob> jobs(quant_kv ? size_t(R) * Hkv : 0);
  std::vector<mlxhost_cpu::FloatAttentionJob> float_jobs(quant_kv ? 0 : size_t(R) * Hkv);
  mlxhost_cpu::parallel_for(R * Hkv, [&](int task) {
    const int r = task / Hkv, g = task % Hkv;
    const int pos = positions[r];
    float* row = qkv.data() + size_t(r) * qkv_n;
    float* q = row;
    float* k = row + size_t(H) * D;
    const float* v = row + size_t(H + Hkv) * D;
    const int group = H / Hkv;
    std::vector<float> cs(D);
    rope_table(pos, inv_freq, cs.data());
    rope(q + size_t(g) * group * D, group, D, cs.data());
    rope(k + size_t(g) * D, 1, D, cs.data());
    auto& kc = out[1 + 2 * r];
    auto& vc = out[2 + 2 * r];
    const int cap = kc.shape(2);
    const float scale = 1.0f / std::sqrt(float(D));
    if (quant_kv) {
      uint32_t* K = kc.data<uint32_t>() + size_t(g) * cap * row_words;
      uint32_t* V = vc.data<uint32_t>() + size_t(g) * cap * row_words;
      mlxhost_cpu::kv_quantize_row(k + size_t(g) * D, D, sh.kv_bits, sh.kv_group, K + size_t(pos) * row_words);
      mlxhost_cpu::kv_quantize_row(v + size_t(g) * D, D, sh.kv_bits, sh.kv_group, V + size_t(pos) * row_words);
      jobs[task] = {q + size_t(g) * group * D, group, K, V, pos + 1, scale,
                    attn.data() + (size_t(r) * H + size_t(g) * group) * D};
      return;
    }
    float* K = kc.data<float>() + size_t(g) * cap * D;
    float* V = vc.data<float>() + size_t(g) * cap * D;
    std::copy(k + size_t(g) * D, k + size_t(g + 1) * D, K + size_t(pos) * D);
    std::copy(v + size_t(g) * D, v + size_t(g + 1) * D, V + size_t(pos) * D);
    float_jobs[task] = {q + size_t(g) * group * D, group, K, V, pos + 1, scale,
                        attn.data() + (size_t(r) * H + size_t(g) * group) * D};
  });

  if (quant_kv)
    mlxhost_cpu::kv_quant_attention(jobs.data(), int(jobs.size()), D, sh.kv_bits, sh.kv_group);
  else
    mlxhost_cpu::float_attention(float_jobs.data(), int(float_jobs.size()), D);

  product(in, 6, attn.data(), proj.data(), R, sh, 1, E, H * D);
  lora_add(in, lora[1], attn.data(), proj.data(), R, E, H * D, lora_rows);
  for (size_t i = 0; i < size_t(R) * E; i++)
    h_out[i] = h[i] + proj[i];
  for (int r = 0; r < R; r++)
    rms_norm(h_out + size_t(r) * E, in[2].data<float>(), sh.eps, E, x.data() + size_t(r) * E);
  product(in, 9, x.data(), gu.data(), R, sh, 2, 2 * inter, E);
  lora_add(in, lora[2], x.data(), gu.data(), R, 2 * inter, E, lora_rows);
  mlxhost_cpu::swiglu(gu.data(), R, inter, act.data());
  product(in, 12, act.data(), proj.data(), R, sh, 3, E, inter);
  lora_add(in, lora[3], act.data(), proj.data(), R, E, inter, lora_rows);
  for (size_t i = 0; i < size_t(R) * E; i++)
    h_out[i] += proj[i];
}

class DecodeLayer : public mx::Primitive {
 public:
  DecodeLayer(
      mx::Stream s,
      std::vector<int> positions,
      std::vector<int> lora_rows,
      LoraSlots lora,
      Shape shape)
      : mx::Primitive(s),
        positions_(std::move(positions)),
        lora_rows_(std::move(lora_rows)),
        lora_(std::move(lora)),
        shape_(shape) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& a : inputs) {
      if (!a.flags().row_contiguous)
        throw std::runtime_error("decode layer: an input is not row-contiguous");
    }
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    for (size_t i = 1; i < outputs.size(); i++)
      outputs[i].copy_shared_buffer(inputs[i + kCachesFirst - 1]);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs)
      enc.set_input_array(a);
    for (auto& a : outputs)
      enc.set_output_array(a);
    enc.dispatch([inputs,
                  outputs,
                  positions = positions_,
                  lora_rows = lora_rows_,
                  lora = lora_,
                  shape = shape_]() mutable {
      run(inputs, outputs, positions, lora_rows, lora, shape);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost DecodeLayer has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostDecodeLayer";
  }

 private:
  std::vector<int> positions_;
  std::vector<int> lora_rows_;
  LoraSlots lora_;
  Shape shape_;
};

void require(bool ok, const char* what) {
  if (!ok)
    throw std::invalid_argument(what);
}

} // namespace

// Builds the op (lazily). `weights`: 15 arrays (input_norm, post_norm, then
// w/scales/biases of qkv, o, gate_up, down, then the q/k/v bias); `bits`,
// `groups`, `packed`, `f16`: 4 each (qkv, o, gate_up, down). A packed
// product's weight is `mlxhost_pack_quantized`'s array (its scales and
// biases slots are unused placeholders) and `f16` says whether that layout
// holds float16 scales. `intermediate`: the MLP width. `h_out` gets [R, E];
// `new_keys[r]` / `new_values[r]` get row r's cache buffers after the
// write. LoRA: `lora_adapters` (G) adapters; per product (qkv, o,
// gate_up, down) and adapter, l-major, `lora_spans` holds 3 parts of
// (rank offset, rank, output offset, width) and `lora_scales` their 3
// scales (rank 0: no such part; no part: the adapter does not adapt the
// product); `lora` holds A [K, sum of ranks] and B (the parts' [r, w]
// one after another, flat) float16 of each adapted (product, adapter), in
// that order; `lora_rows[r]` the adapter row r runs (-1: none). G = 0: no
// adapters (the LoRA pointers may be null). Returns 0, or 1 with the error
// reported through mlx-c's error handler.
extern "C" int mlxhost_decode_layer(
    mlx_array* h_out,
    mlx_array* new_keys,
    mlx_array* new_values,
    const mlx_array h,
    const mlx_array* weights,
    const int* bits,
    const int* groups,
    const int* packed,
    const int* f16,
    const mlx_array* keys,
    const mlx_array* values,
    const int* positions,
    const mlx_array* lora,
    const int* lora_spans,
    const float* lora_scales,
    int lora_adapters,
    const int* lora_rows,
    int rows,
    int heads,
    int kv_heads,
    int head_dim,
    int intermediate,
    float eps,
    float rope_theta,
    int kv_bits,
    int kv_group,
    int variant) {
  try {
    const auto& ha = mlx_array_get_(h);
    require(ha.ndim() == 2 && ha.shape(0) == rows && ha.dtype() == mx::float32,
            "decode layer: h must be [R, E] float32");
    require(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 2 == 0 &&
                intermediate > 0,
            "decode layer: heads must be a multiple of kv_heads, head_dim even");
    const int E = ha.shape(1);
    require(kv_bits == 0 || ((kv_bits == 4 || kv_bits == 8) &&
                              (kv_group == 32 || kv_group == 64 || kv_group == 128) &&
                              head_dim % kv_group == 0),
            "decode layer: the KV scheme must be float (0) or 4/8 bits in groups of 32, 64 or 128 "
            "dividing head_dim");
    Shape sh{heads, kv_heads, head_dim, intermediate, eps, rope_theta, {}, {}, {}, {}, {},
             kv_bits, kv_group};
    for (int l = 0; l < 4; l++)
      sh.variant[l] = variant;
    std::vector<mx::array> inputs = {ha};
    for (int i = 0; i < 15; i++)
      inputs.push_back(mlx_array_get_(weights[i]));
    require(inputs[1].size() == size_t(E) && inputs[2].size() == size_t(E),
            "decode layer: norms must be [E]");
    // (first input, expected input width, expected output rows)
    const int kv_width = kv_heads * head_dim, q_width = heads * head_dim;
    const int firsts[4] = {3, 6, 9, 12};
    const int in_widths[4] = {E, q_width, E, intermediate};
    const int out_rows[4] = {q_width + 2 * kv_width, E, 2 * intermediate, E};
    for (int l = 0; l < 4; l++) {
      const auto& w = inputs[firsts[l]];
      const auto& s = inputs[firsts[l] + 1];
      const auto& b = inputs[firsts[l] + 2];
      require(bits[l] == 4 || bits[l] == 8, "decode layer: bits must be 4 or 8");
      require(groups[l] > 0 && groups[l] % 32 == 0 && in_widths[l] % groups[l] == 0,
              "decode layer: group sizes must be multiples of 32 dividing the width");
      sh.bits[l] = bits[l];
      sh.group[l] = groups[l];
      sh.packed[l] = packed[l] != 0;
      sh.f16[l] = f16[l] != 0;
      if (sh.packed[l]) {
        require(groups[l] <= 128, "decode layer: packed groups are 32, 64 or 128");
        const size_t bytes =
            mlxhost_cpu::packed_bytes(out_rows[l], in_widths[l], bits[l], groups[l], sh.f16[l]);
        require(w.ndim() == 2 && w.dtype() == mx::uint8 &&
                    w.shape(0) == (out_rows[l] + 15) / 16 &&
                    size_t(w.shape(0)) * size_t(w.shape(1)) == bytes,
                "decode layer: a packed weight does not fit the layer's shape");
        continue;
      }
      require(w.ndim() == 2 && w.dtype() == mx::uint32 && w.shape(0) == out_rows[l] &&
                  int64_t(w.shape(1)) * 32 == int64_t(in_widths[l]) * bits[l],
              "decode layer: a weight does not fit the layer's shape");
      require(s.dtype() == mx::float32 && b.dtype() == mx::float32 && s.ndim() == 2 &&
                  b.ndim() == 2 && s.shape(0) == out_rows[l] && b.shape(0) == out_rows[l] &&
                  s.shape(1) == in_widths[l] / groups[l] && b.shape(1) == s.shape(1),
              "decode layer: scales/biases do not fit their weight");
    }
    require(inputs[15].dtype() == mx::float32 && inputs[15].ndim() == 1 &&
                inputs[15].shape(0) == out_rows[0],
            "decode layer: the q/k/v bias must be [q + 2 kv] float32");
    std::vector<mx::Shape> shapes = {ha.shape()};
    std::vector<mx::Dtype> dtypes = {mx::float32};
    std::vector<int> pos(positions, positions + rows);
    for (int r = 0; r < rows; r++) {
      const auto& kc = mlx_array_get_(keys[r]);
      const auto& vc = mlx_array_get_(values[r]);
      const mx::Dtype cache_dtype = kv_bits ? mx::uint32 : mx::float32;
      const int width = kv_bits ? head_dim * kv_bits / 32 + 2 * (head_dim / kv_group) : head_dim;
      require(kc.ndim() == 4 && kc.shape() == vc.shape() && kc.shape(1) == kv_heads &&
                  kc.shape(3) == width && pos[r] >= 0 && pos[r] < kc.shape(2) &&
                  kc.dtype() == cache_dtype && vc.dtype() == cache_dtype,
              "decode layer: a cache buffer does not fit its row");
      inputs.push_back(kc);
      inputs.push_back(vc);
      shapes.push_back(kc.shape());
      shapes.push_back(vc.shape());
      dtypes.push_back(cache_dtype);
      dtypes.push_back(cache_dtype);
    }
    // The LoRA pairs follow the caches.
    const int G = lora_adapters;
    require(G >= 0, "decode layer: a negative number of LoRA adapters");
    LoraSlots slots;
    std::vector<int> lrows(rows, -1);
    int next = 0;
    for (int l = 0; l < 4; l++) {
      slots[l].resize(G);
      for (int g = 0; g < G; g++) {
        LoraSlot& slot = slots[l][g];
        const int* sp = lora_spans + (size_t(l) * G + g) * 4 * kLoraParts;
        const float* sc = lora_scales + (size_t(l) * G + g) * kLoraParts;
        size_t b_size = 0;
        for (int p = 0; p < kLoraParts; p++) {
          const LoraPart part{sp[4 * p], sp[4 * p + 1], sp[4 * p + 2], sp[4 * p + 3], sc[p]};
          if (part.rank == 0)
            continue;
          require(part.rank > 0 && part.rank_off == slot.rs && part.width > 0 &&
                      part.out_off >= 0 && part.out_off + part.width <= out_rows[l] &&
                      std::isfinite(part.scale),
                  "decode layer: a LoRA part does not fit its product");
          slot.part[slot.parts++] = part;
          slot.rs += part.rank;
          b_size += size_t(part.rank) * part.width;
        }
        if (slot.parts == 0)
          continue;
        const auto& A = mlx_array_get_(lora[next]);
        const auto& B = mlx_array_get_(lora[next + 1]);
        require(A.dtype() == mx::float16 && B.dtype() == mx::float16 && A.ndim() == 2 &&
                    A.shape(0) == in_widths[l] && A.shape(1) == slot.rs && B.size() == b_size,
                "decode layer: a LoRA pair does not fit its product");
        slot.input = int(inputs.size());
        inputs.push_back(A);
        inputs.push_back(B);
        next += 2;
      }
    }
    for (int r = 0; r < rows && G > 0; r++) {
      require(lora_rows[r] >= -1 && lora_rows[r] < G,
              "decode layer: a row's LoRA adapter is out of range");
      lrows[r] = lora_rows[r];
    }
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<DecodeLayer>(
        stream, std::move(pos), std::move(lrows), std::move(slots), sh);
    auto outs = mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
    mlx_array_set_(*h_out, outs[0]);
    for (int r = 0; r < rows; r++) {
      mlx_array_set_(new_keys[r], outs[1 + 2 * r]);
      mlx_array_set_(new_values[r], outs[2 + 2 * r]);
    }
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
