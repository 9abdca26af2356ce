// `y = x @ W^T` from affine 4/8-bit weights repacked for integer dot
// products (mlxhost's CPU decode path on CPUs with AVX-512 VNNI).
//
// Why: with MLX's layout (one weight row after another) a batched decode
// step (8-16 rows) is bound by float FMAs: each block of 32 weights is
// dequantized to float32 and every row of x costs 2 FMAs of 16 lanes per
// block (`block_f512` in quantized_matmul.cpp ran at ~80% of the FMA peak).
// `vpdpbusd` (AVX-512 VNNI) does 64 u8 x s8 multiply-adds per instruction at
// the FMA's rate. Integer products only pay if the float work per group
// (convert, scale, bias) is shared by many outputs, so the weights are
// repacked at load with 16 output rows side by side: one 32-bit lane per
// output row, x broadcast. A group's integer sum for 16 output rows is then
// one register, scaled once.
//
// Precision: x is rounded per weight group to 24-bit integers (step
// d = max|x| / 8355711, float32's own resolution), split into three int8
// digits, one vpdpbusd each (21 multiply-adds per instruction, against 16
// for a float FMA). Fewer bits were measured and rejected: llama.cpp's int8
// activations (per block of 32) moved SmolLM2's logprobs by up to 0.33 nats
// against mlx-lm; int16 per group (two digits, 32 per instruction) by
// ~0.004 nats, which made the fused decode layer and the per-op graph,
// whose inputs differ only in float rounding, disagree by 0.006 nats
// (tests/tests/model.rs allows 0.005). With 24 bits the kernel equals the
// float product to ~1e-6 relative. The bias term uses the float sum of x.
//
// Packed layout (`mlxhost_pack_quantized`): tiles of 16 output rows (the
// last one padded with zero rows), each tile's groups in order; a group is
// its weight chunks, then 16 scales, then 16 biases (float16 when every
// scale and bias of the weight is exactly a float16, as GGUF's Q4_0, Q4_1
// and Q8_0 are: 4 bytes per 32 weights less to stream; else float32). A
// chunk is 64 bytes, one little-endian 32-bit word per output row:
//   4-bit: word r = elements e0..e7 of row r, element e_i in bits [4i, 4i+4)
//          (8 consecutive elements of the group; 4 chunks per 32 elements);
//   8-bit: word r = elements e0..e3, e_i in bits [8i, 8i + 8).
// A 4-bit chunk unpacks with an AND and a shift into two u8 vectors (the
// low nibbles: elements 0, 2, 4, 6 of each word; the high ones: 1, 3, 5, 7);
// an 8-bit chunk is used as it is. x's digits are stored in that order
// (`prepare_x`).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "packed_simd.h"

namespace mlxhost_cpu {

namespace {

constexpr int kTile = 16;
// How far ahead tile_vnni prefetches weights, in groups (~2.5 KB for a
// 4-bit group of 32: a few hundred cycles of products, about one
// memory latency).
constexpr size_t kPrefetchGroups = 8;

// float16 conversions in plain C++ (no F16C needed; not on a hot path: the
// kernel converts with vcvtph2ps). `f32_to_f16_bits` rounds to nearest;
// exact for every float16 value, which is all `pack` stores.
inline uint16_t f32_to_f16_bits(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const float a = std::fabs(f);
  if (std::isnan(a))
    return sign | 0x7E00;
  if (a == 0)
    return sign;
  const int e = std::ilogb(a);
  if (e > 15)
    return sign | 0x7C00;
  if (e < -14) // subnormal: units of 2^-24
    return sign | uint16_t(std::lrint(std::ldexp(a, 24)));
  // (e + 15) << 10 plus the rounded 10-bit mantissa; a mantissa that rounds
  // up to 1024 carries into the exponent.
  const long mant = std::lrint((std::ldexp(a, -e) - 1.0f) * 1024.0f);
  const long bits = (long(e + 15) << 10) + mant;
  return sign | uint16_t(std::min(bits, 0x7C00L));
}

inline float f16_bits_to_f32(uint16_t b) {
  const float sign = (b & 0x8000) ? -1.0f : 1.0f;
  const int e = (b >> 10) & 0x1F, mant = b & 0x3FF;
  if (e == 0)
    return sign * std::ldexp(float(mant), -24);
  if (e == 31)
    return mant ? NAN : sign * INFINITY;
  return sign * std::ldexp(float(1024 + mant), e - 25);
}

// Bytes of one group of one tile.
inline size_t group_bytes(int bits, int group, bool f16) {
  return size_t(group) * kTile * bits / 8 + 2 * kTile * (f16 ? 2 : 4);
}

// Element `k` of row `n` of MLX's layout (see quantized_matmul.cpp).
inline int code_at(const uint8_t* w, int K, int bits, int n, int k) {
  const uint8_t* row = w + size_t(n) * K * bits / 8;
  if (bits == 4)
    return (row[k / 2] >> (4 * (k % 2))) & 0x0F;
  return row[k];
}

} // namespace

bool packed_available() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

size_t packed_bytes(int N, int K, int bits, int group, bool f16) {
  const size_t tiles = (size_t(N) + kTile - 1) / kTile;
  return tiles * size_t(K / group) * group_bytes(bits, group, f16);
}

size_t packed_group_bytes(int bits, int group, bool f16) {
  return group_bytes(bits, group, f16);
}

bool scales_fit_f16(const float* scales, const float* biases, size_t count) {
  for (size_t i = 0; i < count; i++) {
    for (float v : {scales[i], biases[i]}) {
      if (!std::isfinite(v) || f16_bits_to_f32(f32_to_f16_bits(v)) != v)
        return false;
    }
  }
  return true;
}

void pack(
    const uint8_t* w,
    const float* scales,
    const float* biases,
    int N,
    int K,
    int bits,
    int group,
    bool f16,
    uint8_t* out) {
  const int groups = K / group;
  const int tiles = (N + kTile - 1) / kTile;
  const int per_word = 32 / bits; // elements per 32-bit word
  const size_t gbytes = group_bytes(bits, group, f16);
  std::memset(out, 0, packed_bytes(N, K, bits, group, f16));
  for (int t = 0; t < tiles; t++) {
    for (int g = 0; g < groups; g++) {
      uint8_t* dst = out + (size_t(t) * groups + g) * gbytes;
      const int chunks = group / per_word;
      for (int c = 0; c < chunks; c++) {
        for (int r = 0; r < kTile; r++) {
          const int n = t * kTile + r;
          if (n >= N)
            continue;
          uint32_t word = 0;
          for (int i = 0; i < per_word; i++) {
            const int k = g * group + c * per_word + i;
            word |= uint32_t(code_at(w, K, bits, n, k)) << (bits * i);
          }
          std::memcpy(dst + (size_t(c) * kTile + r) * 4, &word, 4);
        }
      }
      uint8_t* sb = dst + size_t(chunks) * kTile * 4;
      for (int r = 0; r < kTile; r++) {
        const int n = t * kTile + r;
        const float s = n < N ? scales[size_t(n) * groups + g] : 0.0f;
        const float b = n < N ? biases[size_t(n) * groups + g] : 0.0f;
        if (f16) {
          const uint16_t hs = f32_to_f16_bits(s), hb = f32_to_f16_bits(b);
          std::memcpy(sb + r * 2, &hs, 2);
          std::memcpy(sb + kTile * 2 + r * 2, &hb, 2);
        } else {
          std::memcpy(sb + r * 4, &s, 4);
          std::memcpy(sb + kTile * 4 + r * 4, &b, 4);
        }
      }
    }
  }
}

void unpack(
    const uint8_t* in,
    int N,
    int K,
    int bits,
    int group,
    bool f16,
    uint32_t* w,
    float* scales,
    float* biases) {
  const int groups = K / group;
  const int tiles = (N + kTile - 1) / kTile;
  const int per_word = 32 / bits;
  const int chunks = group / per_word;
  const int row_words = K / per_word;
  const size_t gbytes = group_bytes(bits, group, f16);
  for (int t = 0; t < tiles; t++) {
    for (int g = 0; g < groups; g++) {
      const uint8_t* src = in + (size_t(t) * groups + g) * gbytes;
      for (int r = 0; r < kTile; r++) {
        const int n = t * kTile + r;
        if (n >= N)
          break;
        // A chunk's word r is row r's word of MLX's layout (see `pack`).
        for (int c = 0; c < chunks; c++)
          std::memcpy(w + size_t(n) * row_words + size_t(g) * chunks + c,
                      src + (size_t(c) * kTile + r) * 4, 4);
        const uint8_t* sb = src + size_t(chunks) * kTile * 4;
        float s, b;
        if (f16) {
          uint16_t hs, hb;
          std::memcpy(&hs, sb + r * 2, 2);
          std::memcpy(&hb, sb + kTile * 2 + r * 2, 2);
          s = f16_bits_to_f32(hs);
          b = f16_bits_to_f32(hb);
        } else {
          std::memcpy(&s, sb + r * 4, 4);
          std::memcpy(&b, sb + kTile * 4 + r * 4, 4);
        }
        scales[size_t(n) * groups + g] = s;
        biases[size_t(n) * groups + g] = b;
      }
    }
  }
}

namespace {

// x [M, K] rounded per weight group to integers X of 24 bits
// (|X| <= kXMax, step d = max|x| / kXMax: float32's own precision), each X
// split into three balanced int8 digits X = 65536 a + 256 b + c (a, b, c in
// [-128, 127]), so `vpdpbusd` (u8 weights x s8 digits, 4 per 32-bit lane)
// computes each digit's integer sum and the group's sum is rebuilt in float.
// q[m] holds, per position (one 32-bit word of 4 elements per digit), the
// three digits' words: [pos][digit]. d[m, g] the step, sum[m, g] the float
// sum of the group's x (the bias term).
constexpr int kXMax = 127 * 65536 + 127 * 256 + 127; // 8355711

struct PackedX {
  std::vector<int32_t> q;
  std::vector<float> d, sum;
};

// Element offsets (within a block of 8 for 4-bit, 4 for 8-bit weights) of
// the 4 bytes a vector lane multiplies: 4-bit chunks unpack into the low
// nibbles (elements 0, 2, 4, 6 of the word) and the high ones (1, 3, 5, 7);
// an 8-bit word is its elements 0..3.
inline int lane_element(int bits, int vec, int byte) {
  return bits == 4 ? 2 * byte + vec : byte;
}

#if defined(__x86_64__)
// One group of x (a multiple of 32 elements) rounded and split as in
// `prepare_x`, 16 elements at a time; the same integers as the scalar loop
// (cvtps2dq rounds to nearest even, as lrint does). Returns amax and the sum.
__attribute__((target("avx512f,avx512bw"))) void prepare_group_avx512(
    const float* xg,
    int group,
    int bits,
    float* d_out,
    float* sum_out,
    int32_t* out) {
  __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  for (int i = 0; i < group; i += 16) {
    const __m512 v = _mm512_loadu_ps(xg + i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    sum = _mm512_add_ps(sum, v);
  }
  const float am = _mm512_reduce_max_ps(amax);
  *sum_out = _mm512_reduce_add_ps(sum);
  *d_out = am / float(kXMax);
  const __m512 inv = _mm512_set1_ps(am > 0 ? float(kXMax) / am : 0.0f);
  const __m512i lim = _mm512_set1_epi32(kXMax), c128 = _mm512_set1_epi32(128),
                c255 = _mm512_set1_epi32(255);
  // Byte order of 16 elements' digits in lane order: 4-bit words hold the
  // even elements in one vector and the odd ones in the other.
  const __m128i order = bits == 4
      ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
      : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < group; i += 16, out += 12) {
    __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
    x = _mm512_max_epi32(_mm512_min_epi32(x, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    const __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(x, c128), c255), c128);
    x = _mm512_srai_epi32(_mm512_sub_epi32(x, c), 8);
    const __m512i b = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(x, c128), c255), c128);
    const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(x, b), 8);
    alignas(16) int32_t w[3][4];
    _mm_store_si128(reinterpret_cast<__m128i*>(w[0]), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(a), order));
    _mm_store_si128(reinterpret_cast<__m128i*>(w[1]), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(b), order));
    _mm_store_si128(reinterpret_cast<__m128i*>(w[2]), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(c), order));
    for (int pos = 0; pos < 4; pos++)
      for (int k = 0; k < 3; k++)
        out[pos * 3 + k] = w[k][pos];
  }
}
#endif

// `vector`: use the AVX-512 loop where the CPU has it (the portable variant
// runs the scalar loop, so the tests compare the two).
void prepare_x(const PackedProblem& p, PackedX& px, bool vector) {
  const int groups = p.K / p.group;
  const int per_word = 32 / p.bits; // elements per packed word (8 or 4)
  const int vecs = p.bits == 4 ? 2 : 1; // vectors per packed word
  px.q.resize(size_t(p.M) * p.K / 4 * 3);
  px.d.resize(size_t(p.M) * groups);
  px.sum.resize(size_t(p.M) * groups);
  std::vector<int32_t> X(p.group);
#if defined(__x86_64__)
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool simd = vector && has;
#else
  (void)vector;
#endif
  for (int m = 0; m < p.M; m++) {
    const float* xr = p.x + size_t(m) * p.K;
    for (int g = 0; g < groups; g++) {
      const float* xg = xr + size_t(g) * p.group;
#if defined(__x86_64__)
      if (simd) {
        prepare_group_avx512(
            xg,
            p.group,
            p.bits,
            &px.d[size_t(m) * groups + g],
            &px.sum[size_t(m) * groups + g],
            px.q.data() + (size_t(m) * p.K + size_t(g) * p.group) / 4 * 3);
        continue;
      }
#endif
      float amax = 0, sum = 0;
      for (int i = 0; i < p.group; i++) {
        amax = std::max(amax, std::fabs(xg[i]));
        sum += xg[i];
      }
      const float inv = amax > 0 ? float(kXMax) / amax : 0.0f;
      px.d[size_t(m) * groups + g] = amax / float(kXMax);
      px.sum[size_t(m) * groups + g] = sum;
      for (int i = 0; i < p.group; i++)
        X[i] = int32_t(std::clamp(std::lrint(xg[i] * inv), -long(kXMax), long(kXMax)));
      // Positions of this group: words in chunk order, vectors within.
      int32_t* out = px.q.data() + (size_t(m) * p.K + size_t(g) * p.group) / 4 * 3;
      for (int w = 0; w < p.group / per_word; w++) {
        for (int v = 0; v < vecs; v++, out += 3) {
          uint32_t dig[3] = {0, 0, 0};
          for (int byte = 0; byte < 4; byte++) {
            int32_t x = X[w * per_word + lane_element(p.bits, v, byte)];
            const int32_t c = ((x + 128) & 255) - 128;
            x = (x - c) / 256;
            const int32_t bd = ((x + 128) & 255) - 128;
            const int32_t a = (x - bd) / 256;
            dig[0] |= uint32_t(uint8_t(int8_t(a))) << (8 * byte);
            dig[1] |= uint32_t(uint8_t(int8_t(bd))) << (8 * byte);
            dig[2] |= uint32_t(uint8_t(int8_t(c))) << (8 * byte);
          }
          for (int k = 0; k < 3; k++)
            out[k] = int32_t(dig[k]);
        }
      }
    }
  }
}

#if defined(__x86_64__)
// One tile (16 output rows) against rows [m0, m0 + MC) of the prepared x:
// per group, three integer sums per row (one per digit; NA partial sums
// when MC is small, so consecutive vpdpbusd do not wait on each other),
// rebuilt as 65536 A + 256 B + C in float, then y += s * d * sum + b * sum(x).
template <int BITS, int MC, bool F16>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(
    const PackedProblem& p,
    const PackedX& px,
    const uint8_t* tile,
    int m0,
    int n0) {
  constexpr int NA = MC == 1 ? 2 : 1;
  constexpr int VEC = BITS == 4 ? 2 : 1; // vectors per chunk
  const int groups = p.K / p.group;
  const int chunks = p.group * BITS / 32; // per group
  const size_t gbytes = group_bytes(BITS, p.group, F16);
  const int32_t* xq[MC];
  for (int m = 0; m < MC; m++)
    xq[m] = px.q.data() + size_t(m0 + m) * p.K / 4 * 3;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 accf[MC];
  for (int m = 0; m < MC; m++)
    accf[m] = _mm512_setzero_ps();
  for (int g = 0; g < groups; g++) {
    const uint8_t* gp = tile + size_t(g) * gbytes;
    // The first block of rows streams the weights from memory: ask for
    // the group kPrefetchGroups ahead (the next tile's, past the last
    // group; past the buffer's end a prefetch is a no-op).
    if (m0 == 0)
      for (size_t line = 0; line < gbytes; line += 64)
        _mm_prefetch(
            reinterpret_cast<const char*>(gp + kPrefetchGroups * gbytes + line), _MM_HINT_T0);
    __m512i acc[MC][3][NA];
    for (int m = 0; m < MC; m++)
      for (int k = 0; k < 3; k++)
        for (int a = 0; a < NA; a++)
          acc[m][k][a] = _mm512_setzero_si512();
    const int32_t* xg[MC];
    for (int m = 0; m < MC; m++)
      xg[m] = xq[m] + size_t(g) * p.group / 4 * 3;
    for (int c = 0; c < chunks; c++) {
      const __m512i v = _mm512_loadu_si512(gp + size_t(c) * 64);
      __m512i w[VEC];
      if constexpr (BITS == 4) {
        w[0] = _mm512_and_si512(v, nib);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      } else {
        w[0] = v;
      }
      for (int t = 0; t < VEC; t++) {
        const int pos = c * VEC + t;
        for (int m = 0; m < MC; m++)
          for (int k = 0; k < 3; k++)
            acc[m][k][pos % NA] = _mm512_dpbusd_epi32(
                acc[m][k][pos % NA], w[t], _mm512_set1_epi32(xg[m][pos * 3 + k]));
      }
    }
    const uint8_t* sb = gp + size_t(chunks) * 64;
    __m512 s, b;
    load_scales_biases<F16>(sb, s, b);
    for (int m = 0; m < MC; m++) {
      __m512i sum[3];
      for (int k = 0; k < 3; k++) {
        sum[k] = acc[m][k][0];
        for (int a = 1; a < NA; a++)
          sum[k] = _mm512_add_epi32(sum[k], acc[m][k][a]);
      }
      // 65536 A and 256 B are exact in float (|A| < 2^24 / 65536).
      __m512 dot = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(sum[0]), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(sum[2]));
      dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[1]), _mm512_set1_ps(256.0f), dot);
      const size_t gi = size_t(m0 + m) * groups + g;
      dot = _mm512_mul_ps(dot, _mm512_set1_ps(px.d[gi]));
      accf[m] = _mm512_fmadd_ps(dot, s, accf[m]);
      accf[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(px.sum[gi]), accf[m]);
    }
  }
  store_tile_rows<MC>(p, accf, m0, n0);
}

template <int BITS, bool F16>
void tiles_vnni(const PackedProblem& p, const PackedX& px, int t0, int t1) {
  const size_t tbytes = size_t(p.K / p.group) * group_bytes(BITS, p.group, F16);
  for (int t = t0; t < t1; t++) {
    const uint8_t* tile = p.packed + size_t(t) * tbytes;
    // Rows of x in blocks of up to 4 (3 digit accumulators each stay in
    // registers; the tile stays in L1 between blocks).
    int m = 0;
    for (; m + 4 <= p.M; m += 4)
      tile_vnni<BITS, 4, F16>(p, px, tile, m, t * kTile);
    switch (p.M - m) {
      case 3:
        tile_vnni<BITS, 3, F16>(p, px, tile, m, t * kTile);
        break;
      case 2:
        tile_vnni<BITS, 2, F16>(p, px, tile, m, t * kTile);
        break;
      case 1:
        tile_vnni<BITS, 1, F16>(p, px, tile, m, t * kTile);
        break;
      default:
        break;
    }
  }
}
#endif

// ---------------------------------------------------------------------------
// Prefill-sized products with int8 activations (`MLXHOST_INT8_PREFILL=1`):
// x rounded per weight group to int8 (step d = max|x| / 127), one vpdpbusd
// per weight vector instead of three, as llama.cpp multiplies its K-quants
// (Q8 activations). Three times the 24-bit kernel's multiply-adds per
// instruction; the rounding moves logprobs by a few hundredths of a nat (the
// reason decode keeps 24 bits, see the file's head), so it is opt-in.
struct PackedX8 {
  std::vector<int32_t> q; // per row: K / 4 dwords, in the chunk/vector order
  std::vector<float> d, sum;
};

void prepare_x_int8(const PackedProblem& p, PackedX8& px) {
  const int groups = p.K / p.group;
  const int per_word = 32 / p.bits;
  const int vecs = p.bits == 4 ? 2 : 1;
  px.q.resize(size_t(p.M) * p.K / 4);
  px.d.resize(size_t(p.M) * groups);
  px.sum.resize(size_t(p.M) * groups);
  parallel_for_range(p.M, 8, [&](int m0, int m1) {
    std::vector<int32_t> X(p.group);
    for (int m = m0; m < m1; m++) {
      const float* xr = p.x + size_t(m) * p.K;
      for (int g = 0; g < groups; g++) {
        const float* xg = xr + size_t(g) * p.group;
        float amax = 0, sum = 0;
        for (int i = 0; i < p.group; i++) {
          amax = std::max(amax, std::fabs(xg[i]));
          sum += xg[i];
        }
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        px.d[size_t(m) * groups + g] = amax / 127.0f;
        px.sum[size_t(m) * groups + g] = sum;
        for (int i = 0; i < p.group; i++)
          X[i] = int32_t(std::nearbyint(std::clamp(xg[i] * inv, -127.0f, 127.0f)));
        int32_t* out = px.q.data() + (size_t(m) * p.K + size_t(g) * p.group) / 4;
        for (int w = 0; w < p.group / per_word; w++) {
          for (int v = 0; v < vecs; v++, out++) {
            uint32_t dig = 0;
            for (int byte = 0; byte < 4; byte++)
              dig |= uint32_t(uint8_t(int8_t(X[w * per_word + lane_element(p.bits, v, byte)])))
                  << (8 * byte);
            *out = int32_t(dig);
          }
        }
      }
    }
  });
}

#if defined(__x86_64__)
// One tile (16 output rows) against rows [m0, m0 + MC) of the int8 x.
template <int BITS, int MC, bool F16>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni_int8(
    const PackedProblem& p,
    const PackedX8& px,
    const uint8_t* tile,
    int m0,
    int n0) {
  constexpr int VEC = BITS == 4 ? 2 : 1;
  const int groups = p.K / p.group;
  const int chunks = p.group * BITS / 32;
  const size_t gbytes = group_bytes(BITS, p.group, F16);
  const int32_t* xq[MC];
  for (int m = 0; m < MC; m++)
    xq[m] = px.q.data() + size_t(m0 + m) * p.K / 4;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 accf[MC];
  for (int m = 0; m < MC; m++)
    accf[m] = _mm512_setzero_ps();
  for (int g = 0; g < groups; g++) {
    const uint8_t* gp = tile + size_t(g) * gbytes;
    __m512i acc[MC];
    for (int m = 0; m < MC; m++)
      acc[m] = _mm512_setzero_si512();
    const size_t xoff = size_t(g) * p.group / 4;
    for (int c = 0; c < chunks; c++) {
      const __m512i v = _mm512_loadu_si512(gp + size_t(c) * 64);
      __m512i w[VEC];
      if constexpr (BITS == 4) {
        w[0] = _mm512_and_si512(v, nib);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      } else {
        w[0] = v;
      }
      for (int t = 0; t < VEC; t++) {
        const int pos = c * VEC + t;
        for (int m = 0; m < MC; m++)
          acc[m] = _mm512_dpbusd_epi32(acc[m], w[t], _mm512_set1_epi32(xq[m][xoff + pos]));
      }
    }
    __m512 s, b;
    load_scales_biases<F16>(gp + size_t(chunks) * 64, s, b);
    for (int m = 0; m < MC; m++) {
      const size_t gi = size_t(m0 + m) * groups + g;
      const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(px.d[gi]));
      accf[m] = _mm512_fmadd_ps(dot, s, accf[m]);
      accf[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(px.sum[gi]), accf[m]);
    }
  }
  store_tile_rows<MC>(p, accf, m0, n0);
}

template <int BITS, bool F16>
void tiles_vnni_int8(const PackedProblem& p, const PackedX8& px, int t0, int t1) {
  const size_t tbytes = size_t(p.K / p.group) * group_bytes(BITS, p.group, F16);
  // Blocks of 64 x rows against each of the range's tiles, so a block of x
  // (64 x K bytes) stays in L2 while the tiles stream past it.
  for (int mb = 0; mb < p.M; mb += 64) {
    const int me = std::min(p.M, mb + 64);
    for (int t = t0; t < t1; t++) {
      const uint8_t* tile = p.packed + size_t(t) * tbytes;
      int m = mb;
      for (; m + 8 <= me; m += 8)
        tile_vnni_int8<BITS, 8, F16>(p, px, tile, m, t * kTile);
      for (; m < me; m++)
        tile_vnni_int8<BITS, 1, F16>(p, px, tile, m, t * kTile);
    }
  }
}
#endif

} // namespace

// Set by the model loader (`mlxhost_set_low_precision_prefill`: on for GGUF
// K-quants); `MLXHOST_PREFILL_PRODUCTS=float|int8|bf16` overrides.
static std::atomic<int> g_low_precision_prefill{0};

int prefill_products() {
  static const int forced = [] {
    const char* env = std::getenv("MLXHOST_PREFILL_PRODUCTS");
    if (!env)
      return -1;
    const std::string v = env;
    const int mode = v == "float" ? kPrefillFloat
        : v == "int8"             ? kPrefillInt8
        : v == "bf16"             ? kPrefillBf16
                                  : -1;
    if (mode < 0)
      std::fprintf(
          stderr, "mlxhost: MLXHOST_PREFILL_PRODUCTS=%s ignored (float, int8 or bf16)\n", env);
    return mode;
  }();
  int mode = forced;
  if (mode < 0)
    mode = g_low_precision_prefill.load(std::memory_order_relaxed) != 0 ? kPrefillBf16 : kPrefillFloat;
  // Where the CPU lacks a kernel, the next one down: bf16 needs AMX, int8
  // AVX-512 VNNI.
  if (mode == kPrefillBf16 && !amx_available())
    mode = kPrefillInt8;
  if (mode == kPrefillInt8 && !packed_available())
    mode = kPrefillFloat;
  return mode;
}

void compute_packed_int8(const PackedProblem& p) {
#if defined(__x86_64__)
  PackedX8 px;
  prepare_x_int8(p, px);
  const int tiles = (p.N + kTile - 1) / kTile;
  parallel_for_range(tiles, 4, [&](int t0, int t1) {
    if (p.bits == 4) {
      if (p.f16_scales)
        tiles_vnni_int8<4, true>(p, px, t0, t1);
      else
        tiles_vnni_int8<4, false>(p, px, t0, t1);
    } else {
      if (p.f16_scales)
        tiles_vnni_int8<8, true>(p, px, t0, t1);
      else
        tiles_vnni_int8<8, false>(p, px, t0, t1);
    }
  });
#else
  (void)p;
#endif
}

namespace {

// Portable reference of the same arithmetic (x rounded to the same 24-bit
// integers, exact integer sums per group): what the tests compare the SIMD
// kernel with, and what runs where AVX-512 VNNI is missing.
void tiles_portable(const PackedProblem& p, const PackedX& px, int t0, int t1) {
  const int groups = p.K / p.group;
  const int per_word = 32 / p.bits;
  const int vecs = p.bits == 4 ? 2 : 1;
  const int chunks = p.group / per_word;
  const size_t gbytes = group_bytes(p.bits, p.group, p.f16_scales);
  const size_t tbytes = size_t(groups) * gbytes;
  const uint32_t mask = p.bits == 4 ? 0x0F : 0xFF;
  for (int t = t0; t < t1; t++) {
    const uint8_t* tile = p.packed + size_t(t) * tbytes;
    for (int m = 0; m < p.M; m++) {
      const int32_t* xq = px.q.data() + size_t(m) * p.K / 4 * 3;
      float acc[kTile] = {};
      for (int g = 0; g < groups; g++) {
        const uint8_t* gp = tile + size_t(g) * gbytes;
        const int32_t* xg = xq + size_t(g) * p.group / 4 * 3;
        int64_t isum[kTile] = {};
        for (int c = 0; c < chunks; c++) {
          for (int r = 0; r < kTile; r++) {
            uint32_t word;
            std::memcpy(&word, gp + (size_t(c) * kTile + r) * 4, 4);
            for (int v = 0; v < vecs; v++) {
              const int32_t* dw = xg + size_t(c * vecs + v) * 3;
              for (int byte = 0; byte < 4; byte++) {
                const int e = lane_element(p.bits, v, byte);
                const int64_t code = (word >> (p.bits * e)) & mask;
                const int64_t x = int64_t(int8_t(uint32_t(dw[0]) >> (8 * byte))) * 65536 +
                    int64_t(int8_t(uint32_t(dw[1]) >> (8 * byte))) * 256 +
                    int64_t(int8_t(uint32_t(dw[2]) >> (8 * byte)));
                isum[r] += code * x;
              }
            }
          }
        }
        const uint8_t* sb = gp + size_t(chunks) * 64;
        const size_t gi = size_t(m) * groups + g;
        for (int r = 0; r < kTile; r++) {
          float s, b;
          if (p.f16_scales) {
            uint16_t hs, hb;
            std::memcpy(&hs, sb + r * 2, 2);
            std::memcpy(&hb, sb + 32 + r * 2, 2);
            s = f16_bits_to_f32(hs);
            b = f16_bits_to_f32(hb);
          } else {
            std::memcpy(&s, sb + r * 4, 4);
            std::memcpy(&b, sb + 64 + r * 4, 4);
          }
          acc[r] += float(isum[r]) * px.d[gi] * s + b * px.sum[gi];
        }
      }
      for (int r = 0; r < kTile && t * kTile + r < p.N; r++)
        p.y[size_t(m) * p.N + t * kTile + r] = acc[r];
    }
  }
}

} // namespace

void dequant_packed_rows(const PackedProblem& p, int n0, int n1, float* out) {
  const int groups = p.K / p.group;
  const int per_word = 32 / p.bits;
  const int chunks = p.group / per_word;
  const size_t gbytes = group_bytes(p.bits, p.group, p.f16_scales);
  const size_t tbytes = size_t(groups) * gbytes;
  const uint32_t mask = p.bits == 4 ? 0x0F : 0xFF;
  for (int n = n0; n < n1; n++) {
    const int t = n / kTile, r = n % kTile;
    const uint8_t* tile = p.packed + size_t(t) * tbytes;
    float* o = out + size_t(n - n0) * p.K;
    for (int g = 0; g < groups; g++) {
      const uint8_t* gp = tile + size_t(g) * gbytes;
      const uint8_t* sb = gp + size_t(chunks) * 64;
      float s, b;
      if (p.f16_scales) {
        uint16_t hs, hb;
        std::memcpy(&hs, sb + r * 2, 2);
        std::memcpy(&hb, sb + 32 + r * 2, 2);
        s = f16_bits_to_f32(hs);
        b = f16_bits_to_f32(hb);
      } else {
        std::memcpy(&s, sb + r * 4, 4);
        std::memcpy(&b, sb + 64 + r * 4, 4);
      }
      for (int c = 0; c < chunks; c++) {
        uint32_t word;
        std::memcpy(&word, gp + (size_t(c) * kTile + r) * 4, 4);
        float* oc = o + size_t(g) * p.group + size_t(c) * per_word;
        for (int i = 0; i < per_word; i++)
          oc[i] = s * float((word >> (p.bits * i)) & mask) + b;
      }
    }
  }
}

namespace {

#if defined(__x86_64__)
// Tiles [t0, t1) dequantized column-wise: out[k * ld + (t - t0) * 16 + r] =
// weight (16 t + r, k). One vector per element position holds the 16 rows
// of a tile, so the packed layout dequantizes with no shuffles.
template <int BITS, bool F16>
__attribute__((target("avx512f,avx512bw"))) void
cols_avx512(const PackedProblem& p, int t0, int t1, float* out, int ld) {
  const int groups = p.K / p.group;
  constexpr int PER = 32 / BITS; // elements per 32-bit word
  const int chunks = p.group / PER;
  const size_t gbytes = group_bytes(BITS, p.group, F16);
  const __m512i mask = _mm512_set1_epi32(BITS == 4 ? 0x0F : 0xFF);
  for (int t = t0; t < t1; t++) {
    const uint8_t* tile = p.packed + size_t(t) * groups * gbytes;
    float* col = out + size_t(t - t0) * kTile;
    for (int g = 0; g < groups; g++) {
      const uint8_t* gp = tile + size_t(g) * gbytes;
      const uint8_t* sb = gp + size_t(chunks) * 64;
      __m512 s, b;
      load_scales_biases<F16>(sb, s, b);
      for (int c = 0; c < chunks; c++) {
        const __m512i v = _mm512_loadu_si512(gp + size_t(c) * 64);
        float* o = col + (size_t(g) * p.group + size_t(c) * PER) * ld;
        for (int i = 0; i < PER; i++) {
          const __m512 q = _mm512_cvtepi32_ps(
              _mm512_and_si512(_mm512_srli_epi32(v, unsigned(BITS * i)), mask));
          // s * q + b rounded twice, as the MLX-layout dequantization and
          // MLX's `dequantize` (the *_round forms are never contracted into
          // an FMA by the compiler).
          _mm512_storeu_ps(
              o + size_t(i) * ld,
              _mm512_add_round_ps(
                  _mm512_mul_round_ps(q, s, _MM_FROUND_CUR_DIRECTION), b,
                  _MM_FROUND_CUR_DIRECTION));
        }
      }
    }
  }
}
#endif

} // namespace

void dequant_packed_cols(const PackedProblem& p, int t0, int t1, float* out, int ld) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    if (p.bits == 4)
      p.f16_scales ? cols_avx512<4, true>(p, t0, t1, out, ld)
                   : cols_avx512<4, false>(p, t0, t1, out, ld);
    else
      p.f16_scales ? cols_avx512<8, true>(p, t0, t1, out, ld)
                   : cols_avx512<8, false>(p, t0, t1, out, ld);
    return;
  }
#endif
  std::vector<float> row(p.K);
  for (int t = t0; t < t1; t++) {
    for (int r = 0; r < kTile; r++) {
      const int n = t * kTile + r;
      if (n < p.N)
        dequant_packed_rows(p, n, n + 1, row.data());
      else
        std::fill(row.begin(), row.end(), 0.0f);
      for (int k = 0; k < p.K; k++)
        out[size_t(k) * ld + size_t(t - t0) * kTile + r] = row[k];
    }
  }
}

void compute_packed_tiles(const PackedProblem& p, int variant) {
  PackedX px;
  prepare_x(p, px, variant != kPackedPortable);
  const int tiles = (p.N + kTile - 1) / kTile;
  const bool simd = variant != kPackedPortable && packed_available();
  parallel_for_range(tiles, 2, [&](int t0, int t1) {
#if defined(__x86_64__)
    if (simd) {
      if (p.bits == 4) {
        if (p.f16_scales)
          tiles_vnni<4, true>(p, px, t0, t1);
        else
          tiles_vnni<4, false>(p, px, t0, t1);
      } else {
        if (p.f16_scales)
          tiles_vnni<8, true>(p, px, t0, t1);
        else
          tiles_vnni<8, false>(p, px, t0, t1);
      }
      return;
    }
#endif
    (void)simd;
    tiles_portable(p, px, t0, t1);
  });
}

} // namespace mlxhost_cpu

extern "C" void mlxhost_set_low_precision_prefill(int on) {
  mlxhost_cpu::g_low_precision_prefill.store(on ? 1 : 0, std::memory_order_relaxed);
}

extern "C" int mlxhost_amx_available() {
  return mlxhost_cpu::amx_available() ? 1 : 0;
}
