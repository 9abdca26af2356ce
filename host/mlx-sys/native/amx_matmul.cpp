// Prefill-sized `y = x @ W^T` from the packed layout (packed_matmul.cpp) on
// Intel AMX: bfloat16 tiles, float32 sums.
//
// Why: a prefill chunk multiplies hundreds of rows of x by every weight, so
// the product is bound by multiply-adds, not by streaming the weights. One
// `tdpbf16ps` does 16 x 16 x 32 multiply-adds (a 16-cycle instruction on
// Sapphire Rapids: 512 per cycle and core), against 64 u8 x s8 per
// `vpdpbusd` for the int8 VNNI kernel and 16 per float FMA for BLAS. The
// sums are float32 over the whole of K, so unlike the int8 kernel there is
// no per-group epilogue (convert, scale, bias for every group of 32): the
// weights' scale and bias are applied once, when a tile is dequantized.
//
// Numerics: x is rounded to bfloat16 (8 significant bits, relative error
// <= 2^-9 per element; no per-group step, so small channels beside an
// outlier keep their precision, unlike int8 per group), and each weight
// `scale * q + bias` is computed in float32 and rounded to bfloat16. The
// products and sums are float32. This is the precision of a bf16 model on
// a GPU; it is offered where int8 activations are (GGUF K-quants, whose
// reference llama.cpp rounds x to int8), see `prefill_products`.
//
// Data path for 32 output rows (two packed tiles) at a time: both tiles are
// dequantized into a per-thread buffer in AMX's B layout (K / 2 rows of
// 16 columns x 2 bfloat16: pairs of consecutive k side by side), x was
// converted to bfloat16 once per call (rows padded to a multiple of 32 with
// zeros), and every block of 32 rows of x is multiplied against the pair
// with four accumulator tiles (2 x 2 blocks of 16 x 16 float32).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_tiles.h"

#include "cpu_kernels.h"
#include "packed_simd.h"

namespace mlxhost_cpu {

#if defined(MLXHOST_AMX)
namespace {

constexpr int kTile = 16;
// Tile numbers: accumulators C[i][j] = 2 i + j, A (x) blocks 4 and 5, B
// (weights) blocks 6 and 7.
constexpr int kRowsPerBlock = 32; // x rows per accumulator block
constexpr int kKPerStep = 32; // bfloat16 elements of K per tile product

// Linux hands AMX's 8 KB tile state to a process only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel >= 5.16);
// without it the first tile instruction faults. Process-wide.
bool request_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tile `tile`'s weights (16 output rows, all of K) as AMX's B operand:
// out[kp * 32 + 2 r + j] = bfloat16(W[n0 + r, 2 kp + j]), kp in [0, K / 2).
// A packed chunk holds 32 / BITS consecutive elements of each row, one
// 32-bit word per row; elements (2i, 2i + 1) of every word become one B row.
template <int BITS, bool F16>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dequant_tile_bf16(
    const PackedProblem& p,
    const uint8_t* tile,
    uint16_t* out) {
  constexpr int kPerWord = 32 / BITS;
  const int groups = p.K / p.group;
  const int chunks = p.group / kPerWord;
  const size_t gbytes = packed_group_bytes(BITS, p.group, F16);
  // Scale and bias of rows 0..7 (resp. 8..15), each twice: one per element
  // of a pair.
  const __m512i first_half = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  for (int g = 0; g < groups; g++) {
    const uint8_t* gp = tile + size_t(g) * gbytes;
    const uint8_t* sb = gp + size_t(chunks) * 64;
    __m512 s, b;
    load_scales_biases<F16>(sb, s, b);
    const __m512 s_lo = _mm512_permutexvar_ps(first_half, s);
    const __m512 s_hi = _mm512_permutexvar_ps(second_half, s);
    const __m512 b_lo = _mm512_permutexvar_ps(first_half, b);
    const __m512 b_hi = _mm512_permutexvar_ps(second_half, b);
    for (int c = 0; c < chunks; c++) {
      const __m512i v = _mm512_loadu_si512(gp + size_t(c) * 64);
      for (int i = 0; i < kPerWord / 2; i++) {
        const __m512i t = _mm512_srli_epi32(v, 2 * i * BITS);
        const __m512i even = _mm512_and_si512(t, mask);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(t, BITS), mask);
        // 32 u16: row r's pair at 2r, 2r + 1.
        const __m512i pairs = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1));
        const __m512 f_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s_lo, b_lo);
        const __m512 f_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s_hi, b_hi);
        const int k = g * p.group + c * kPerWord + 2 * i;
        _mm512_storeu_si512(out + size_t(k / 2) * 32, (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo));
      }
    }
  }
}

// Rows [m0, m1) of x [M, K] float32 as bfloat16 (round to nearest even) in
// xb [Mp, K]; rows past M are zero.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void convert_x_rows(
    const PackedProblem& p,
    uint16_t* xb,
    int m0,
    int m1) {
  for (int m = m0; m < m1; m++) {
    uint16_t* row = xb + size_t(m) * p.K;
    if (m >= p.M) {
      std::memset(row, 0, sizeof(uint16_t) * p.K);
      continue;
    }
    const float* xr = p.x + size_t(m) * p.K;
    for (int k = 0; k < p.K; k += 32) {
      const __m512 a = _mm512_loadu_ps(xr + k);
      const __m512 b = _mm512_loadu_ps(xr + k + 16);
      _mm512_storeu_si512(row + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// Stores accumulator tile T (rows m.., columns n..) into y, through a
// scratch tile where it overhangs y's last row or column.
#define MLXHOST_STORE_TILE(T, m, n)                                          \
  do {                                                                       \
    if ((m) < p.M && (n) < p.N) {                                            \
      if ((m) + kTile <= p.M && (n) + kTile <= p.N) {                        \
        _tile_stored(T, p.y + size_t(m) * p.N + (n), p.N * sizeof(float));  \
      } else {                                                               \
        _tile_stored(T, scratch, kTile * sizeof(float));                     \
        const int rows = std::min(kTile, p.M - (m));                         \
        const int cols = std::min(kTile, p.N - (n));                         \
        for (int r = 0; r < rows; r++)                                       \
          std::memcpy(                                                       \
              p.y + size_t((m) + r) * p.N + (n),                             \
              scratch + r * kTile,                                           \
              sizeof(float) * cols);                                         \
      }                                                                      \
    }                                                                        \
  } while (0)

// Pairs [a, b) of packed tiles (output rows 32 a .. 32 b).
template <int BITS, bool F16>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void amx_pairs(
    const PackedProblem& p,
    const uint16_t* xb,
    int Mp,
    int a,
    int b) {
  configure_tiles_16x64();
  const int tiles = (p.N + kTile - 1) / kTile;
  const size_t tbytes = size_t(p.K / p.group) * packed_group_bytes(BITS, p.group, F16);
  static thread_local std::vector<uint16_t> wbuf;
  const size_t per_tile = size_t(p.K) * kTile; // bfloat16 elements
  if (wbuf.size() < 2 * per_tile)
    wbuf.resize(2 * per_tile);
  uint16_t* w0 = wbuf.data();
  uint16_t* w1 = wbuf.data() + per_tile;
  alignas(64) float scratch[kTile * kTile];
  const size_t xstride = size_t(p.K) * sizeof(uint16_t);
  for (int pair = a; pair < b; pair++) {
    const int t0 = 2 * pair;
    dequant_tile_bf16<BITS, F16>(p, p.packed + size_t(t0) * tbytes, w0);
    if (t0 + 1 < tiles)
      dequant_tile_bf16<BITS, F16>(p, p.packed + size_t(t0 + 1) * tbytes, w1);
    else
      std::memset(w1, 0, per_tile * sizeof(uint16_t));
    const int n0 = t0 * kTile, n1 = n0 + kTile;
    for (int m = 0; m < Mp; m += kRowsPerBlock) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* x0 = xb + size_t(m) * p.K;
      const uint16_t* x1 = x0 + size_t(kTile) * p.K;
      for (int k = 0; k < p.K; k += kKPerStep) {
        _tile_loadd(4, x0 + k, xstride);
        _tile_loadd(5, x1 + k, xstride);
        _tile_loadd(6, w0 + size_t(k) * kTile, 64);
        _tile_loadd(7, w1 + size_t(k) * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      MLXHOST_STORE_TILE(0, m, n0);
      MLXHOST_STORE_TILE(1, m, n1);
      MLXHOST_STORE_TILE(2, m + kTile, n0);
      MLXHOST_STORE_TILE(3, m + kTile, n1);
    }
  }
  _tile_release();
}

#undef MLXHOST_STORE_TILE

} // namespace

bool amx_available() {
  static const bool ok = __builtin_cpu_supports("amx-tile") &&
      __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16") &&
      __builtin_cpu_supports("avx512bw") && request_tile_permission();
  return ok;
}

bool compute_packed_amx(const PackedProblem& p) {
  if (!amx_available() || p.K % kKPerStep != 0 || (p.bits != 4 && p.bits != 8) ||
      p.group % (32 / p.bits) != 0)
    return false;
  const int Mp = (p.M + kRowsPerBlock - 1) / kRowsPerBlock * kRowsPerBlock;
  static thread_local std::vector<uint16_t> xbuf;
  if (xbuf.size() < size_t(Mp) * p.K)
    xbuf.resize(size_t(Mp) * p.K);
  uint16_t* xw = xbuf.data();
  parallel_for_range(Mp, 16, [&](int m0, int m1) { convert_x_rows(p, xw, m0, m1); });
  const uint16_t* xb = xw;
  const int pairs = ((p.N + kTile - 1) / kTile + 1) / 2;
  parallel_for_range(pairs, 1, [&](int a, int b) {
    if (p.bits == 4) {
      if (p.f16_scales)
        amx_pairs<4, true>(p, xb, Mp, a, b);
      else
        amx_pairs<4, false>(p, xb, Mp, a, b);
    } else {
      if (p.f16_scales)
        amx_pairs<8, true>(p, xb, Mp, a, b);
      else
        amx_pairs<8, false>(p, xb, Mp, a, b);
    }
  });
  return true;
}

#else

bool amx_available() {
  return false;
}

bool compute_packed_amx(const PackedProblem&) {
  return false;
}

#endif

} // namespace mlxhost_cpu
