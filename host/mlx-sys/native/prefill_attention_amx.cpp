// Causal attention of a prefill chunk on Intel AMX (bfloat16 tiles, float32
// sums and softmax): the same operation and schedule as
// prefill_attention.cpp's AVX-512 kernel (FlashAttention's online softmax,
// scores never materialised), with both products on tiles.
//
// Why: at long prompts attention is most of a prefill (a 19k-token prompt
// of Qwen2.5-1.5B: ~1.5e13 multiply-adds in attention against ~2.5e13 in
// the projections), and the float32 kernel reached ~11 G multiply-adds/s
// per core. `tdpbf16ps` does 16 x 16 x 32 per instruction.
//
// Transposed form: each task computes S^T = K Q^T and O^T = V^T P^T, so the
// scores of one key are a vector of 16 queries. The softmax then runs
// across vectors (max, exponentials and sums lane by lane, no horizontal
// reductions), rescaling O^T is one multiply per row of D, and the
// operands' layouts come cheaply: keys are AMX's A operand as they are
// (rows of D, converted to bfloat16), P^T becomes the B operand by
// interleaving two keys' rows; only V is transposed, once per key tile.
//
// Numerics: q (scaled) and k are each split into two bfloat16 parts (hi +
// lo, ~16 significant bits) and the scores summed from three products
// (hi hi, hi lo, lo hi): with q and k rounded to one bfloat16 each, Gemma
// 3's scores moved logprobs by ~5e-3 nats against the float32 decode path.
// v and the probabilities are rounded to bfloat16 (relative error <= 2^-9
// each; they only weight an average); the softmax and the sums are float32. Used where the prefill products are bfloat16 too
// (`prefill_products`: GGUF K-quants, whose reference llama.cpp rounds
// activations to int8).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

#include "cpu_kernels.h"
#include "simd_math.h"

namespace mlxhost_cpu {

#if defined(MLXHOST_AMX)
namespace {

constexpr int kTileRows = 16;
constexpr int kKeys = 64; // keys per key tile: 4 score tiles, 2 product steps
constexpr int kBlockQueries = 32; // queries per head in one task: 2 query tiles

// r[i] <- column i of the 16 x 16 matrix whose rows are r[0..16).
__attribute__((target("avx512f"))) inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // r[4 g + c], 128-bit lane L: column 4 L + c of rows 4 g .. 4 g + 3.
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// 32 floats (a, then b) as bfloat16 pairs hi + lo: hi = bf16(x), lo =
// bf16(x - hi), so hi + lo carries ~16 significant bits.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void split_bf16(
    __m512 a,
    __m512 b,
    __m512i& hi,
    __m512i& lo) {
  hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  // bfloat16 -> float32 is a 16-bit shift left.
  const __m512 a_hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
  const __m512 b_hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, b_hi), _mm512_sub_ps(a, a_hi));
}

// Per-thread buffers of one task (kept between calls).
struct Scratch {
  std::vector<uint16_t> qb, qb_lo; // per query tile: Q^T as B, [D / 2][16 x 2]
  std::vector<float> ot; // per query tile: O^T, [D][16]
  std::vector<float> m, l; // per query tile: running max and sum, [16]
  std::vector<uint16_t> kb, kb_lo; // keys as A: [64][D]
  std::vector<uint16_t> vt; // V^T as A: [D][64]
  std::vector<float> st; // scores, then probabilities, of one query tile: [64][16]
  std::vector<uint16_t> pb; // P^T as B: [32][16 x 2]
};

// Queries [i0, i1) (at most kBlockQueries) of every query head sharing KV
// head g.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void run_task_amx(
    const AttentionArgs& a,
    int g,
    int i0,
    int i1) {
  const int group = a.heads / a.kv_heads;
  const int D = a.dim;
  const int nq = i1 - i0;
  const int qtiles_per_head = (nq + kTileRows - 1) / kTileRows;
  const int qtiles = group * qtiles_per_head;
  static thread_local Scratch s;
  s.qb.assign(size_t(qtiles) * D * kTileRows, 0);
  s.qb_lo.assign(size_t(qtiles) * D * kTileRows, 0);
  s.ot.assign(size_t(qtiles) * D * kTileRows, 0.0f);
  s.m.assign(size_t(qtiles) * kTileRows, -INFINITY);
  s.l.assign(size_t(qtiles) * kTileRows, 0.0f);
  s.kb.resize(size_t(kKeys) * D);
  s.kb_lo.resize(size_t(kKeys) * D);
  s.vt.resize(size_t(D) * kKeys);
  s.st.resize(size_t(kKeys) * kTileRows);
  s.pb.resize(size_t(kKeys) * kTileRows);

  // Q^T as the B operand: qb[dp * 32 + 2 q + j] = bf16(scale * q[2 dp + j]),
  // i.e. the 32-bit word dp of query q's bfloat16 row goes to word
  // dp * 16 + q.
  // Both halves of the split (`split_bf16`) are laid out so.
  std::vector<uint16_t> row(D), row_lo(D);
  for (int qt = 0; qt < qtiles; qt++) {
    const int h = g * group + qt / qtiles_per_head;
    uint32_t* dst = reinterpret_cast<uint32_t*>(s.qb.data() + size_t(qt) * D * kTileRows);
    uint32_t* dst_lo = reinterpret_cast<uint32_t*>(s.qb_lo.data() + size_t(qt) * D * kTileRows);
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int q = 0; q < kTileRows; q++) {
      const int i = i0 + (qt % qtiles_per_head) * kTileRows + q;
      if (i >= i1)
        break;
      const float* src = a.q + h * a.qs1 + int64_t(i) * a.qs2;
      for (int d = 0; d < D; d += 32) {
        __m512i hi, lo;
        split_bf16(
            _mm512_mul_ps(scale, _mm512_loadu_ps(src + d)),
            _mm512_mul_ps(scale, _mm512_loadu_ps(src + d + 16)),
            hi,
            lo);
        _mm512_storeu_si512(row.data() + d, hi);
        _mm512_storeu_si512(row_lo.data() + d, lo);
      }
      const uint32_t* words = reinterpret_cast<const uint32_t*>(row.data());
      const uint32_t* words_lo = reinterpret_cast<const uint32_t*>(row_lo.data());
      for (int dp = 0; dp < D / 2; dp++) {
        dst[dp * kTileRows + q] = words[dp];
        dst_lo[dp * kTileRows + q] = words_lo[dp];
      }
    }
  }

  configure_tiles_16x64();

  const float* kg = a.k + g * a.ks1;
  const float* vg = a.v + g * a.vs1;
  const int end = a.offset + i1; // keys any query of the block sees
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // P^T rows 2 kp and 2 kp + 1 interleaved: [a0, b0, a1, b1, ...].
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int j0 = 0; j0 < end; j0 += kKeys) {
    const int keys = std::min(kKeys, end - j0);
    // Keys as split bfloat16 rows (zero past `keys`).
    for (int j = 0; j < kKeys; j++) {
      uint16_t* dst = s.kb.data() + size_t(j) * D;
      uint16_t* dst_lo = s.kb_lo.data() + size_t(j) * D;
      if (j >= keys) {
        std::memset(dst, 0, sizeof(uint16_t) * D);
        std::memset(dst_lo, 0, sizeof(uint16_t) * D);
        continue;
      }
      const float* src = kg + int64_t(j0 + j) * a.ks2;
      for (int d = 0; d < D; d += 32) {
        __m512i hi, lo;
        split_bf16(_mm512_loadu_ps(src + d), _mm512_loadu_ps(src + d + 16), hi, lo);
        _mm512_storeu_si512(dst + d, hi);
        _mm512_storeu_si512(dst_lo + d, lo);
      }
    }
    // V^T: vt[d * 64 + j] = bf16(v[j0 + j][d]), 16 x 16 blocks.
    for (int jb = 0; jb < kKeys; jb += 16) {
      for (int db = 0; db < D; db += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; j++)
          r[j] = jb + j < keys ? _mm512_loadu_ps(vg + int64_t(j0 + jb + j) * a.vs2 + db)
                               : _mm512_setzero_ps();
        transpose16(r);
        for (int d = 0; d < 16; d++)
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(s.vt.data() + size_t(db + d) * kKeys + jb),
              (__m256i)_mm512_cvtneps_pbh(r[d]));
      }
    }
    for (int qt = 0; qt < qtiles; qt++) {
      const int qpos0 = a.offset + i0 + (qt % qtiles_per_head) * kTileRows;
      if (j0 > qpos0 + kTileRows - 1)
        continue; // every key of the tile is in these queries' future
      // S^T = K Q^T: C0..C3 = keys 0-15, 16-31, 32-47, 48-63 x 16 queries,
      // as k_hi q_hi + k_hi q_lo + k_lo q_hi (the lo x lo term is below
      // float32's resolution of the sum).
      const uint16_t* qb = s.qb.data() + size_t(qt) * D * kTileRows;
      const uint16_t* qb_lo = s.qb_lo.data() + size_t(qt) * D * kTileRows;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const size_t kstride = size_t(D) * sizeof(uint16_t);
#define MLXHOST_SCORES(C, row)                                              \
  _tile_loadd(4, s.kb.data() + size_t(row) * D + d0, kstride);              \
  _tile_dpbf16ps(C, 4, 5);                                                  \
  _tile_dpbf16ps(C, 4, 7);                                                  \
  _tile_loadd(6, s.kb_lo.data() + size_t(row) * D + d0, kstride);           \
  _tile_dpbf16ps(C, 6, 5);
      for (int d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(5, qb + size_t(d0) * kTileRows, 64);
        _tile_loadd(7, qb_lo + size_t(d0) * kTileRows, 64);
        MLXHOST_SCORES(0, 0)
        MLXHOST_SCORES(1, 16)
        MLXHOST_SCORES(2, 32)
        MLXHOST_SCORES(3, 48)
      }
#undef MLXHOST_SCORES
      float* st = s.st.data();
      _tile_stored(0, st, 64);
      _tile_stored(1, st + 16 * 16, 64);
      _tile_stored(2, st + 32 * 16, 64);
      _tile_stored(3, st + 48 * 16, 64);

      // Online softmax, one query per lane.
      const __m512i qpos = _mm512_add_epi32(_mm512_set1_epi32(qpos0), iota);
      __mmask16 seen[kKeys];
      __m512 tile_max = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < kKeys; j++) {
        seen[j] = j < keys ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(j0 + j), qpos, _MM_CMPINT_LE)
                           : __mmask16(0);
        tile_max = _mm512_mask_max_ps(tile_max, seen[j], tile_max, _mm512_loadu_ps(st + j * 16));
      }
      float* mp = s.m.data() + size_t(qt) * kTileRows;
      float* lp = s.l.data() + size_t(qt) * kTileRows;
      const __m512 m_old = _mm512_loadu_ps(mp);
      const __m512 m_new = _mm512_max_ps(m_old, tile_max);
      // Lanes that have seen no key yet (m_new = -inf) keep corr 1 and
      // get p = 0 below (their `seen` masks are empty).
      const __mmask16 live = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 corr = _mm512_mask_blend_ps(
          live, _mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(m_old, m_new)));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kKeys; j++) {
        const __m512 p =
            _mm512_maskz_mov_ps(seen[j], exp512(_mm512_sub_ps(_mm512_loadu_ps(st + j * 16), m_new)));
        sum = _mm512_add_ps(sum, p);
        _mm512_storeu_ps(st + j * 16, p);
      }
      _mm512_storeu_ps(lp, _mm512_fmadd_ps(_mm512_loadu_ps(lp), corr, sum));
      _mm512_storeu_ps(mp, m_new);
      float* ot = s.ot.data() + size_t(qt) * D * kTileRows;
      if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0) {
        for (int d = 0; d < D; d++)
          _mm512_storeu_ps(ot + d * 16, _mm512_mul_ps(corr, _mm512_loadu_ps(ot + d * 16)));
      }
      // P^T as B: pb[kp * 32 + 2 q + j] = p[2 kp + j][q].
      for (int kp = 0; kp < kKeys / 2; kp++) {
        const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_loadu_ps(st + (2 * kp + 1) * 16), _mm512_loadu_ps(st + 2 * kp * 16));
        _mm512_storeu_si512(s.pb.data() + kp * 32, _mm512_permutexvar_epi16(interleave, two));
      }
      // O^T += V^T P^T, 16 rows of D at a time.
      const int steps = keys > 32 ? 2 : 1;
      for (int d0 = 0; d0 < D; d0 += 16) {
        _tile_loadd(0, ot + size_t(d0) * 16, 64);
        for (int ks = 0; ks < steps; ks++) {
          _tile_loadd(4, s.vt.data() + size_t(d0) * kKeys + ks * 32, kKeys * sizeof(uint16_t));
          _tile_loadd(5, s.pb.data() + size_t(ks) * 16 * 32, 64);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, ot + size_t(d0) * 16, 64);
      }
    }
  }
  _tile_release();

  // Normalise and scatter to the token-major output.
  for (int qt = 0; qt < qtiles; qt++) {
    const int h = g * group + qt / qtiles_per_head;
    const float* ot = s.ot.data() + size_t(qt) * D * kTileRows;
    const float* lp = s.l.data() + size_t(qt) * kTileRows;
    for (int q = 0; q < kTileRows; q++) {
      const int i = i0 + (qt % qtiles_per_head) * kTileRows + q;
      if (i >= i1)
        break;
      const float inv = lp[q] > 0 ? 1.0f / lp[q] : 0.0f;
      float* dst = a.out + (int64_t(i) * a.heads + h) * D;
      for (int d = 0; d < D; d++)
        dst[d] = ot[d * 16 + q] * inv;
    }
  }
}

} // namespace

bool prefill_attention_amx(const AttentionArgs& a) {
  if (!amx_available() || a.dim % 32 != 0)
    return false;
  const int blocks = (a.t + kBlockQueries - 1) / kBlockQueries;
  const int tasks = a.kv_heads * blocks;
  // Later query blocks see more keys: hand them out first so the last tasks
  // to run are short ones.
  parallel_for(tasks, [&](int task) {
    const int g = task % a.kv_heads;
    const int b = blocks - 1 - task / a.kv_heads;
    const int i0 = b * kBlockQueries;
    run_task_amx(a, g, i0, std::min(a.t, i0 + kBlockQueries));
  });
  return true;
}

#else

bool prefill_attention_amx(const AttentionArgs&) {
  return false;
}

#endif

} // namespace mlxhost_cpu
