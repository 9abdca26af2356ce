// Decode attention for mlxhost's CPU ops, every row's positions split in
// chunks over the kernel pool (each chunk's softmax max and sum kept, the
// chunks merged at the end, as in flash-decoding), so a row with fewer KV
// heads than threads (batch 1: SmolLM2 has 3, Qwen2.5-0.5B 2) still keeps
// every thread busy: over float32 caches (`float_attention`, the fused
// decode layer, decode_layer.cpp) and over quantized ones
// (`kv_quant_attention`, `--kv-bits`: the fused layer and the per-layer
// decode op, decode_attention.cpp), with the row quantizer the fused layer
// writes new keys and values with. Declared in cpu_kernels.h.
//
// Quantized row layout (the host's `cache::quant`): one position's keys
// (or values) of one KV head are P uint32 words: D * bits / 32 words of
// packed values (MLX's affine layout: element i of a word at bits * i from
// the low end), then D / group float32 scales, then as many float32 biases,
// as bit patterns; element = scale * q + bias.
//
// Why a quantized kernel of its own: at long contexts decode attention is
// bound by the bytes it reads, and a quantized row is 3.6x (8 bits) to 6.4x
// (4 bits) smaller than a float32 one. That becomes speed only if
// dequantizing costs less than the bytes saved, so rows are unpacked 16
// lanes at a time, 16 positions at once into an L1 scratch that every
// query head of the KV head then reads, and each group's scale and bias is
// applied once per dot product and weight, not per element.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "simd_math.h"

namespace mlxhost_cpu {

namespace {

// Positions per block: the unit of conversion (one L1 scratch).
constexpr int kBlock = 16;

struct Layout {
  int dim, bits, group, groups, words;
  size_t row_words;
};

Layout layout(int dim, int bits, int group) {
  const int words = dim * bits / 32;
  return {dim, bits, group, dim / group, words, size_t(words) + 2 * size_t(dim / group)};
}

inline float scale_of(const uint32_t* row, const Layout& lay, int g) {
  float x;
  std::memcpy(&x, row + lay.words + g, sizeof(float));
  return x;
}

inline float bias_of(const uint32_t* row, const Layout& lay, int g) {
  float x;
  std::memcpy(&x, row + lay.words + lay.groups + g, sizeof(float));
  return x;
}

// Softmax numerators in place: s[i] = e^(s[i] - max); returns (max, sum).
std::pair<float, float> softmax_numerators(float* s, int n) {
  float best = -INFINITY;
  for (int i = 0; i < n; i++)
    best = std::max(best, s[i]);
  return {best, float(exp_shifted_sum(s, n, best, s))};
}

// ---- Portable path: each row dequantized to floats in element order.

void dequant_row(const uint32_t* row, const Layout& lay, float* out) {
  const int per_word = 32 / lay.bits;
  const uint32_t mask = (1u << lay.bits) - 1;
  for (int i = 0; i < lay.dim; i++) {
    const uint32_t w = row[i / per_word];
    const float q = float((w >> (lay.bits * (i % per_word))) & mask);
    out[i] = q * scale_of(row, lay, i / lay.group) + bias_of(row, lay, i / lay.group);
  }
}

// One chunk, positions [j0, j1): per head the chunk's max score m[h], the
// sum of e^(s - m) l[h] and acc[h] = sum e^(s - m) V (D floats, element
// order).
void chunk_plain(const KvQuantJob& job, const Layout& lay, int j0, int j1, float* m, float* l, float* acc) {
  const int n = j1 - j0, D = lay.dim;
  thread_local std::vector<float> scores, row;
  scores.resize(size_t(job.heads) * n);
  row.resize(D);
  for (int j = j0; j < j1; j++) {
    dequant_row(job.keys + size_t(j) * lay.row_words, lay, row.data());
    for (int h = 0; h < job.heads; h++) {
      const float* qh = job.q + size_t(h) * D;
      float dot = 0;
      for (int d = 0; d < D; d++)
        dot += qh[d] * row[d];
      scores[size_t(h) * n + (j - j0)] = job.scale * dot;
    }
  }
  for (int h = 0; h < job.heads; h++)
    std::tie(m[h], l[h]) = softmax_numerators(scores.data() + size_t(h) * n, n);
  std::fill(acc, acc + size_t(job.heads) * D, 0.0f);
  for (int j = j0; j < j1; j++) {
    dequant_row(job.values + size_t(j) * lay.row_words, lay, row.data());
    for (int h = 0; h < job.heads; h++) {
      const float p = scores[size_t(h) * n + (j - j0)];
      float* a = acc + size_t(h) * D;
      for (int d = 0; d < D; d++)
        a[d] += p * row[d];
    }
  }
}

// Element index of code-order slot i (4 bits; identity for 8; the
// AVX-512 path below).
inline int element_of_slot(int i, int bits) {
  if (bits == 8)
    return i;
  const int p = i % 32;
  return i - p + (p < 16 ? 2 * p : 2 * (p - 16) + 1);
}

#if defined(__x86_64__)
// ---- AVX-512 path (D a multiple of 32). Rows are converted to their raw
// codes as floats, unscaled, in "code order": element order for 8 bits;
// for 4 bits, per 32 elements (16 bytes), the 16 low nibbles (elements 0,
// 2, ..., 30) then the 16 high ones (1, 3, ..., 31), which makes a byte
// load, a zero-extend, a mask and a shift the whole unpacking. The query
// is permuted into the same order once per job, and a group's scale and
// bias are applied to the dot products and weights instead of every
// element: q . (s c + b) = s (q . c) + b sum(q), and
// sum_j p_j (s_j c_j + b_j) = sum_j (p_j s_j) c_j + sum_j p_j b_j.

template <int BITS>
__attribute__((target("avx512f"))) void codes_avx512(const uint32_t* row, int dim, float* out) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  if constexpr (BITS == 8) {
    for (int v = 0; v < dim / 16; v++)
      _mm512_storeu_ps(
          out + 16 * v,
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(bytes + 16 * v)))));
  } else {
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int b = 0; b < dim / 32; b++) {
      const __m512i x = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * b)));
      _mm512_storeu_ps(out + 32 * b, _mm512_cvtepi32_ps(_mm512_and_si512(x, low)));
      _mm512_storeu_ps(out + 32 * b + 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)));
    }
  }
}

void codes(const uint32_t* row, const Layout& lay, float* out) {
  if (lay.bits == 4)
    codes_avx512<4>(row, lay.dim, out);
  else
    codes_avx512<8>(row, lay.dim, out);
}

// raw[l] = q . cf[l] over the code-order slots [v0 * 16, v1 * 16), for the
// kBlock rows of cf: 16 partial sums reduced together (hsum16).
__attribute__((target("avx512f"))) void block_dots(const float* q, const float* cf, int dim, int v0, int v1, float* raw) {
  __m512 acc[kBlock];
  const __m512 q0 = _mm512_loadu_ps(q + 16 * v0);
  for (int l = 0; l < kBlock; l++)
    acc[l] = _mm512_mul_ps(q0, _mm512_loadu_ps(cf + size_t(l) * dim + 16 * v0));
  for (int v = v0 + 1; v < v1; v++) {
    const __m512 qv = _mm512_loadu_ps(q + 16 * v);
    for (int l = 0; l < kBlock; l++)
      acc[l] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(cf + size_t(l) * dim + 16 * v), acc[l]);
  }
  _mm512_storeu_ps(raw, hsum16(acc));
}

// a[slot] += sum_l w[group of slot][l] cf[l][slot] for the W vectors of
// slots from 16 * d0, over the block's cnt rows. W is a compile-time
// constant so the accumulators stay in registers (with a runtime width
// the compiler kept them, and the group pointers, on the stack and copied
// them with `rep movsq` per head and block: two thirds of this kernel's
// time at Qwen2.5-0.5B's 16k decode).
template <int W>
__attribute__((target("avx512f"), always_inline)) inline void weighted_span(
    const float* w,
    const float* cf,
    int cnt,
    const Layout& lay,
    int d0,
    float* a) {
  const float* wg[W];
  __m512 r[W];
  for (int u = 0; u < W; u++) {
    wg[u] = w + size_t((16 * (d0 + u)) / lay.group) * kBlock;
    r[u] = _mm512_loadu_ps(a + 16 * (d0 + u));
  }
  for (int i = 0; i < cnt; i++) {
    const float* row = cf + size_t(i) * lay.dim + 16 * d0;
    for (int u = 0; u < W; u++)
      r[u] = _mm512_fmadd_ps(_mm512_set1_ps(wg[u][i]), _mm512_loadu_ps(row + 16 * u), r[u]);
  }
  for (int u = 0; u < W; u++)
    _mm512_storeu_ps(a + 16 * (d0 + u), r[u]);
}

// a[slot] += sum_l w[group of slot][l] cf[l][slot] over the block's cnt
// rows, four accumulator vectors at a time.
__attribute__((target("avx512f"))) void block_weighted_sum(
    const float* w,
    const float* cf,
    int cnt,
    const Layout& lay,
    float* a) {
  const int dv = lay.dim / 16;
  int d0 = 0;
  for (; d0 + 4 <= dv; d0 += 4)
    weighted_span<4>(w, cf, cnt, lay, d0, a);
  switch (dv - d0) {
    case 3:
      weighted_span<3>(w, cf, cnt, lay, d0, a);
      break;
    case 2:
      weighted_span<2>(w, cf, cnt, lay, d0, a);
      break;
    case 1:
      weighted_span<1>(w, cf, cnt, lay, d0, a);
      break;
    default:
      break;
  }
}

// For HB query heads of one KV head:
// acc[h * dim + c] += sum_i w[h * head_stride + i] * rows[i * row_stride + c]
// for the 64 columns c in [0, 64) (four vectors), over cnt rows. Each row's
// four vectors are loaded once for all HB heads and each head's weight
// broadcast once per row: with GQA (Qwen2.5-0.5B: 7 query heads per KV
// head) a per-head loop loads every value vector 7 times. Up to 6 heads: 24
// accumulators, 4 row vectors and a weight in 32 registers. Each sum runs
// over the rows in order, as a per-head loop's would.
template <int HB>
__attribute__((target("avx512f"), always_inline)) inline void weighted_rows_heads(
    const float* w,
    size_t head_stride,
    const float* rows,
    size_t row_stride,
    int cnt,
    int dim,
    float* acc) {
  const float* wh[HB];
  __m512 r[HB][4];
  for (int h = 0; h < HB; h++) {
    wh[h] = w + h * head_stride;
    for (int u = 0; u < 4; u++)
      r[h][u] = _mm512_loadu_ps(acc + size_t(h) * dim + 16 * u);
  }
  for (int i = 0; i < cnt; i++) {
    const float* row = rows + i * row_stride;
    const __m512 c0 = _mm512_loadu_ps(row), c1 = _mm512_loadu_ps(row + 16),
                 c2 = _mm512_loadu_ps(row + 32), c3 = _mm512_loadu_ps(row + 48);
    for (int h = 0; h < HB; h++) {
      const __m512 s = _mm512_set1_ps(wh[h][i]);
      r[h][0] = _mm512_fmadd_ps(s, c0, r[h][0]);
      r[h][1] = _mm512_fmadd_ps(s, c1, r[h][1]);
      r[h][2] = _mm512_fmadd_ps(s, c2, r[h][2]);
      r[h][3] = _mm512_fmadd_ps(s, c3, r[h][3]);
    }
  }
  for (int h = 0; h < HB; h++)
    for (int u = 0; u < 4; u++)
      _mm512_storeu_ps(acc + size_t(h) * dim + 16 * u, r[h][u]);
}

// weighted_rows_heads over `heads` heads, six at a time, for the 64
// columns at rows (and acc): acc[h][c] += sum_i w[h][i] rows[i][c].
__attribute__((target("avx512f"))) void weighted_span_all_heads(
    const float* w,
    size_t head_stride,
    const float* rows,
    size_t row_stride,
    int cnt,
    int dim,
    int heads,
    float* acc) {
  for (int h0 = 0; h0 < heads; h0 += 6) {
    const float* wp = w + size_t(h0) * head_stride;
    float* ap = acc + size_t(h0) * dim;
    switch (std::min(6, heads - h0)) {
      case 6:
        weighted_rows_heads<6>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
      case 5:
        weighted_rows_heads<5>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
      case 4:
        weighted_rows_heads<4>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
      case 3:
        weighted_rows_heads<3>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
      case 2:
        weighted_rows_heads<2>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
      default:
        weighted_rows_heads<1>(wp, head_stride, rows, row_stride, cnt, dim, ap);
        break;
    }
  }
}

// Loads the block of cnt rows at `rows`: their codes into cf ([kBlock, D],
// code order) and their scales and biases, group-major, into sb:
// sb[g * kBlock + i] (scales) and sb[(G + g) * kBlock + i] (biases), 0
// past cnt.
void load_block(const uint32_t* rows, int cnt, const Layout& lay, float* cf, float* sb) {
  const int G = lay.groups;
  std::fill(sb, sb + size_t(2) * G * kBlock, 0.0f);
  for (int i = 0; i < cnt; i++) {
    const uint32_t* row = rows + size_t(i) * lay.row_words;
    codes(row, lay, cf + size_t(i) * lay.dim);
    for (int g = 0; g < G; g++) {
      sb[size_t(g) * kBlock + i] = scale_of(row, lay, g);
      sb[size_t(G + g) * kBlock + i] = bias_of(row, lay, g);
    }
  }
}

// As chunk_plain, from `q` in code order and `qsum[h * groups + g]` (the
// sum of head h's q over group g); acc in code order. Scores and weights
// are computed 16 positions (one block) at a time.
__attribute__((target("avx512f"))) void chunk_avx512(
    const KvQuantJob& job,
    const float* q,
    const float* qsum,
    const Layout& lay,
    int j0,
    int j1,
    float* m,
    float* l,
    float* acc) {
  const int n = j1 - j0, D = lay.dim, G = lay.groups, H = job.heads;
  thread_local std::vector<float> scores, cf, sb, w, bias_acc;
  // Scores padded to whole blocks (the tail block's extra lanes unused).
  const int padded = (n + kBlock - 1) / kBlock * kBlock;
  scores.resize(size_t(H) * padded);
  cf.assign(size_t(kBlock) * D, 0.0f);
  sb.resize(size_t(2) * G * kBlock);
  w.resize(size_t(H) * G * kBlock);
  // Per head and group, 16 lanes of sum_j p_j b_jg.
  bias_acc.assign(size_t(H) * G * kBlock, 0.0f);
  alignas(64) float raw[kBlock];
  for (int b = j0; b < j1; b += kBlock) {
    const int cnt = std::min(kBlock, j1 - b);
    load_block(job.keys + size_t(b) * lay.row_words, cnt, lay, cf.data(), sb.data());
    for (int h = 0; h < H; h++) {
      __m512 dot = _mm512_setzero_ps();
      for (int g = 0; g < G; g++) {
        block_dots(q + size_t(h) * D, cf.data(), D, g * lay.group / 16, (g + 1) * lay.group / 16, raw);
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(sb.data() + size_t(g) * kBlock), _mm512_load_ps(raw), dot);
        dot = _mm512_fmadd_ps(
            _mm512_loadu_ps(sb.data() + size_t(G + g) * kBlock), _mm512_set1_ps(qsum[size_t(h) * G + g]), dot);
      }
      _mm512_storeu_ps(
          scores.data() + size_t(h) * padded + (b - j0), _mm512_mul_ps(_mm512_set1_ps(job.scale), dot));
    }
  }
  for (int h = 0; h < H; h++) {
    float* sc = scores.data() + size_t(h) * padded;
    std::tie(m[h], l[h]) = softmax_numerators_avx512(sc, n);
    // Past n: weight 0 (the tail block's lanes past its rows).
    std::fill(sc + n, sc + padded, 0.0f);
  }
  std::fill(acc, acc + size_t(H) * D, 0.0f);
  for (int b = j0; b < j1; b += kBlock) {
    const int cnt = std::min(kBlock, j1 - b);
    load_block(job.values + size_t(b) * lay.row_words, cnt, lay, cf.data(), sb.data());
    // Each head's weights p_j s_jg ([H][G][kBlock]) and bias sums.
    for (int h = 0; h < H; h++) {
      const __m512 p = _mm512_loadu_ps(scores.data() + size_t(h) * padded + (b - j0));
      for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(
            w.data() + (size_t(h) * G + g) * kBlock,
            _mm512_mul_ps(p, _mm512_loadu_ps(sb.data() + size_t(g) * kBlock)));
        float* ba = bias_acc.data() + (size_t(h) * G + g) * kBlock;
        _mm512_storeu_ps(
            ba,
            _mm512_fmadd_ps(p, _mm512_loadu_ps(sb.data() + size_t(G + g) * kBlock), _mm512_loadu_ps(ba)));
      }
    }
    if (lay.group % 64 == 0) {
      // Code order keeps each 64 slots within one group (group % 64 == 0):
      // columns [64c, 64c + 64) take group 64c / group's weights.
      for (int c0 = 0; c0 < D; c0 += 64)
        weighted_span_all_heads(
            w.data() + size_t(c0 / lay.group) * kBlock, size_t(G) * kBlock, cf.data() + c0, size_t(D), cnt, D, H,
            acc + c0);
    } else {
      for (int h = 0; h < H; h++)
        block_weighted_sum(w.data() + size_t(h) * G * kBlock, cf.data(), cnt, lay, acc + size_t(h) * D);
    }
  }
  // The biases' share: every slot of group g gets sum_j p_j b_jg (code
  // order keeps each group's slots within the group's span).
  for (int h = 0; h < H; h++)
    for (int g = 0; g < G; g++) {
      const float share = _mm512_reduce_add_ps(_mm512_loadu_ps(bias_acc.data() + (size_t(h) * G + g) * kBlock));
      for (int i = g * lay.group; i < (g + 1) * lay.group; i++)
        acc[size_t(h) * D + i] += share;
    }
}
#endif

bool use_avx512(int dim) {
#if defined(__x86_64__)
  return dim % 32 == 0 && has_avx512();
#else
  (void)dim;
  return false;
#endif
}

} // namespace

void kv_quantize_row(const float* x, int dim, int bits, int group, uint32_t* row) {
  // MLX's affine quantization (`mx::quantize`, CPU): per group, the scale
  // spans [min, max] over 2^bits - 1 steps; the edge of larger magnitude is
  // represented exactly (scale re-derived from it); values rounded to
  // nearest, clamped. Bit-for-bit what `quantize` stores (the host's tests
  // compare), so every path writes the same rows.
  const float n_bins = float((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits;
  const int words = dim * bits / 32;
  const int groups = dim / group;
  for (int g = 0; g < groups; g++) {
    const float* w = x + size_t(g) * group;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < group; j++) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool low_edge = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = low_edge ? scale : -scale;
    const float edge = low_edge ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    for (int wd = 0; wd < group / per_word; wd++) {
      uint32_t packed = 0;
      for (int k = 0; k < per_word; k++) {
        float q = std::rint((w[wd * per_word + k] - bias) / scale);
        q = std::min(std::max(q, 0.0f), n_bins);
        packed |= uint32_t(q) << (k * bits);
      }
      row[(g * group) / per_word + wd] = packed;
    }
    std::memcpy(row + words + g, &scale, sizeof(float));
    std::memcpy(row + words + groups + g, &bias, sizeof(float));
  }
}

namespace {

// Splits every job's positions [0, len) into chunks over the pool, runs
// chunk(job index, j0, j1, m, l, acc) for each (per head: the chunk's max
// score, sum of e^(s - max), and acc = sum e^(s - max) V in slot order),
// then merges each job's chunks per head (out = sum_c e^(m_c - M) acc_c /
// sum_c e^(m_c - M) l_c) and writes slot s to out[element_of(s)].
template <typename Job, typename Chunk, typename Element>
void run_chunked(const Job* jobs, int count, int dim, const Chunk& chunk, const Element& element_of) {
  // Chunks: enough for every thread to have several (uneven KV heads and
  // lengths balance out), none shorter than 256 positions (the merge and
  // the per-chunk setup stay small next to the work).
  size_t total = 0;
  int max_heads = 0;
  for (int i = 0; i < count; i++) {
    total += size_t(jobs[i].len);
    max_heads = std::max(max_heads, jobs[i].heads);
  }
  const size_t target = size_t(std::max(8 * threads(), count));
  int chunk_len = int(std::max<size_t>(256, (total + target - 1) / target));
  chunk_len = (chunk_len + kBlock - 1) / kBlock * kBlock;
  struct Task {
    int job, j0, j1;
  };
  std::vector<Task> tasks;
  std::vector<int> first(count + 1);
  for (int i = 0; i < count; i++) {
    first[i] = int(tasks.size());
    for (int j = 0; j < jobs[i].len; j += chunk_len)
      tasks.push_back({i, j, std::min(jobs[i].len, j + chunk_len)});
  }
  first[count] = int(tasks.size());
  // Per task and head: max, sum, then D accumulators.
  const size_t stride = size_t(max_heads) * (dim + 2);
  std::vector<float> parts(tasks.size() * stride);
  parallel_for(int(tasks.size()), [&](int t) {
    const Task& tk = tasks[t];
    const int heads = jobs[tk.job].heads;
    float* p = parts.data() + size_t(t) * stride;
    chunk(tk.job, tk.j0, tk.j1, p, p + heads, p + 2 * heads);
  });
  std::vector<float> merged(dim);
  for (int i = 0; i < count; i++) {
    const Job& job = jobs[i];
    for (int h = 0; h < job.heads; h++) {
      float best = -INFINITY;
      for (int t = first[i]; t < first[i + 1]; t++)
        best = std::max(best, parts[size_t(t) * stride + h]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      double denom = 0;
      for (int t = first[i]; t < first[i + 1]; t++) {
        const float* p = parts.data() + size_t(t) * stride;
        const float w = std::exp(p[h] - best);
        denom += double(w) * p[job.heads + h];
        const float* a = p + 2 * job.heads + size_t(h) * dim;
        for (int d = 0; d < dim; d++)
          merged[d] += w * a[d];
      }
      const float inv = float(1.0 / denom);
      float* o = job.out + size_t(h) * dim;
      for (int s = 0; s < dim; s++)
        o[element_of(s)] = merged[s] * inv;
    }
  }
}

// ---- Float32 rows (the fused layer's float cache).

// As chunk_plain over float rows [len, D].
void float_chunk_plain(const FloatAttentionJob& job, int dim, int j0, int j1, float* m, float* l, float* acc) {
  const int n = j1 - j0;
  thread_local std::vector<float> scores;
  scores.resize(size_t(job.heads) * n);
  for (int h = 0; h < job.heads; h++) {
    const float* qh = job.q + size_t(h) * dim;
    float* sc = scores.data() + size_t(h) * n;
    for (int j = j0; j < j1; j++) {
      const float* kr = job.keys + size_t(j) * dim;
      float dot = 0;
      for (int d = 0; d < dim; d++)
        dot += qh[d] * kr[d];
      sc[j - j0] = job.scale * dot;
    }
    std::tie(m[h], l[h]) = softmax_numerators(sc, n);
    float* a = acc + size_t(h) * dim;
    std::fill(a, a + dim, 0.0f);
    for (int j = j0; j < j1; j++) {
      const float p = sc[j - j0];
      const float* vr = job.values + size_t(j) * dim;
      for (int d = 0; d < dim; d++)
        a[d] += p * vr[d];
    }
  }
}

#if defined(__x86_64__)
// As float_chunk_plain, 16 lanes (D a multiple of 16): each block of 16 key
// rows read once for every head of the group and reduced together
// (hsum16); values accumulated four vectors at a time in registers.
__attribute__((target("avx512f"))) void float_chunk_avx512(
    const FloatAttentionJob& job,
    int dim,
    int j0,
    int j1,
    float* m,
    float* l,
    float* acc) {
  const int n = j1 - j0, dv = dim / 16;
  thread_local std::vector<float> scores;
  scores.resize(size_t(job.heads) * n);
  int b = j0;
  for (; b + kBlock <= j1; b += kBlock)
    for (int h = 0; h < job.heads; h++)
      block_dots(job.q + size_t(h) * dim, job.keys + size_t(b) * dim, dim, 0, dv, scores.data() + size_t(h) * n + (b - j0));
  for (int j = b; j < j1; j++) {
    const float* kr = job.keys + size_t(j) * dim;
    for (int h = 0; h < job.heads; h++) {
      const float* qh = job.q + size_t(h) * dim;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
      for (int d = 1; d < dv; d++)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * d), _mm512_loadu_ps(kr + 16 * d), a);
      scores[size_t(h) * n + (j - j0)] = _mm512_reduce_add_ps(a);
    }
  }
  for (int h = 0; h < job.heads; h++) {
    float* sc = scores.data() + size_t(h) * n;
    for (int i = 0; i < n; i++)
      sc[i] *= job.scale;
    std::tie(m[h], l[h]) = softmax_numerators_avx512(sc, n);
  }
  if (dim % 64 == 0) {
    // Every head of the group at once, each value row loaded once.
    std::fill(acc, acc + size_t(job.heads) * dim, 0.0f);
    for (int c0 = 0; c0 < dim; c0 += 64)
      weighted_span_all_heads(
          scores.data(), size_t(n), job.values + size_t(j0) * dim + c0, size_t(dim), n, dim, job.heads, acc + c0);
    return;
  }
  for (int h = 0; h < job.heads; h++) {
    const float* sc = scores.data() + size_t(h) * n;
    float* a = acc + size_t(h) * dim;
    for (int d0 = 0; d0 < dv; d0 += 4) {
      const int width = std::min(4, dv - d0);
      __m512 r[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int j = j0; j < j1; j++) {
        const __m512 p = _mm512_set1_ps(sc[j - j0]);
        const float* vr = job.values + size_t(j) * dim + 16 * d0;
        for (int u = 0; u < width; u++)
          r[u] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * u), r[u]);
      }
      for (int u = 0; u < width; u++)
        _mm512_storeu_ps(a + 16 * (d0 + u), r[u]);
    }
  }
}
#endif

} // namespace

void kv_quant_attention(const KvQuantJob* jobs, int count, int dim, int bits, int group) {
  if (count <= 0)
    return;
  const Layout lay = layout(dim, bits, group);
  const bool simd = use_avx512(dim);
  int max_heads = 0;
  for (int i = 0; i < count; i++)
    max_heads = std::max(max_heads, jobs[i].heads);
  // The SIMD path's per-job query in code order and its per-group sums.
  std::vector<float> qcode, qsum;
  if (simd) {
    qcode.resize(size_t(count) * max_heads * dim);
    qsum.assign(size_t(count) * max_heads * lay.groups, 0.0f);
    for (int i = 0; i < count; i++)
      for (int h = 0; h < jobs[i].heads; h++) {
        const float* src = jobs[i].q + size_t(h) * dim;
        float* dst = qcode.data() + (size_t(i) * max_heads + h) * dim;
        float* sums = qsum.data() + (size_t(i) * max_heads + h) * lay.groups;
        for (int s = 0; s < dim; s++) {
          const int e = element_of_slot(s, bits);
          dst[s] = src[e];
          sums[e / group] += src[e];
        }
      }
  }
  run_chunked(
      jobs,
      count,
      dim,
      [&](int i, int j0, int j1, float* m, float* l, float* acc) {
#if defined(__x86_64__)
        if (simd) {
          const size_t first_head = size_t(i) * max_heads;
          chunk_avx512(
              jobs[i], qcode.data() + first_head * dim, qsum.data() + first_head * lay.groups, lay, j0, j1, m,
              l, acc);
          return;
        }
#endif
        chunk_plain(jobs[i], lay, j0, j1, m, l, acc);
      },
      [&](int s) { return simd ? element_of_slot(s, bits) : s; });
}

void float_attention(const FloatAttentionJob* jobs, int count, int dim) {
  if (count <= 0)
    return;
#if defined(__x86_64__)
  const bool simd = dim % 16 == 0 && has_avx512();
#endif
  run_chunked(
      jobs,
      count,
      dim,
      [&](int i, int j0, int j1, float* m, float* l, float* acc) {
#if defined(__x86_64__)
        if (simd) {
          float_chunk_avx512(jobs[i], dim, j0, j1, m, l, acc);
          return;
        }
#endif
        float_chunk_plain(jobs[i], dim, j0, j1, m, l, acc);
      },
      [](int s) { return s; });
}

} // namespace mlxhost_cpu

// `rows` rows of D floats -> packed rows (kv_quantize_row), for the host's
// tests that hold it to MLX's `quantize` bit for bit.
extern "C" void mlxhost_kv_quantize_rows(
    const float* x,
    int rows,
    int dim,
    int bits,
    int group,
    uint32_t* out) {
  const size_t row_words = size_t(dim) * bits / 32 + 2 * size_t(dim / group);
  for (int r = 0; r < rows; r++)
    mlxhost_cpu::kv_quantize_row(x + size_t(r) * dim, dim, bits, group, out + size_t(r) * row_words);
}
