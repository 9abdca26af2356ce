// mlxhost's CPU kernels shared by its MLX primitives (quantized_matmul.cpp
// defines them; decode_layer.cpp uses them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace mlxhost_cpu {

// `y = x @ W^T` from MLX affine-quantized weights (layout: see
// quantized_matmul.cpp).
struct Problem {
  const float* x; // [M, K]
  const uint8_t* w; // [N, K * bits / 8] bytes
  const float* scales; // [N, K / group]
  const float* biases; // [N, K / group]
  float* y; // [M, N]
  int M, N, K, bits, group;
};

// Computes `p` (variant: 0 int8-rounded activations, 1 portable float,
// 2 AVX2 float; see quantized_matmul.cpp) on the thread pool.
void compute(const Problem& p, int variant);

// Runs fn(i) for every i in [0, n) on the pool (the caller included).
void parallel_for(int n, const std::function<void(int)>& fn);

// Threads of the pool (the caller included).
int threads();

// Runs body(a, b) over [0, n) split into ranges of at least `min` items on
// the pool.
void parallel_for_range(int n, int min, const std::function<void(int, int)>& body);

// act[r] = silu(gate[r]) * up[r] for R rows of gu [R, 2 * inter] (gate, then
// up) into act [R, inter]; silu(g) = g / (1 + e^-g) (MLX's `nn.silu`). Rows
// split over the pool; 16 lanes at a time with AVX-512 (swiglu.cpp).
void swiglu(const float* gu, int R, int inter, float* act);

// One query row's attention over one KV head's cache rows
// (chunked_attention.cpp): `heads` query heads (q: [heads, D] float32,
// consecutive), positions [0, len) of `keys` and `values`, weights
// softmax(scale q k^T); writes out [heads, D]. A position's row: D float32
// (`Row` float) or one quantized row of D * bits / 32 + 2 * D / group words
// (`Row` uint32_t; layout in chunked_attention.cpp).
template <typename Row>
struct AttentionJob {
  const float* q;
  int heads;
  const Row* keys;
  const Row* values;
  int len;
  float scale;
  float* out;
};
using KvQuantJob = AttentionJob<uint32_t>;
using FloatAttentionJob = AttentionJob<float>;

// Writes D floats of `x` as one quantized row (MLX's affine `quantize`,
// bit for bit) at `row`. bits 4 or 8; group 32, 64 or 128 dividing D.
void kv_quantize_row(const float* x, int dim, int bits, int group, uint32_t* row);

// Runs `count` jobs on the pool, their positions split in chunks so every
// thread has work (softmax partials merged per job): over quantized rows,
// and over float32 rows (the fused decode layer's float cache).
void kv_quant_attention(const KvQuantJob* jobs, int count, int dim, int bits, int group);
void float_attention(const FloatAttentionJob* jobs, int count, int dim);

// Causal attention of a prefill chunk over one row's KV cache
// (prefill_attention.cpp): q [1, H, T, D], keys and values [1, H_kv, offset
// + T, D] float32 (last axis contiguous), out [T, H * D] token-major; query
// i (position offset + i) attends keys [0, offset + i], weights
// softmax(scale q k^T).
struct AttentionArgs {
  const float* q; // q[h * qs1 + i * qs2 + d]
  int64_t qs1, qs2;
  const float* k; // k[g * ks1 + j * ks2 + d]
  int64_t ks1, ks2;
  const float* v;
  int64_t vs1, vs2;
  float* out; // out[i * H * D + h * D + d]
  int heads, kv_heads, t, dim, offset;
  float scale;
};

// The attention on AMX tiles (prefill_attention_amx.cpp; bfloat16 operands,
// float32 scores, softmax and sums). False, with nothing computed, where
// AMX is missing or D is not a multiple of 32.
bool prefill_attention_amx(const AttentionArgs& a);

// ---------------------------------------------------------------------------
// The packed layout for integer dot products (packed_matmul.cpp): tiles of
// 16 output rows side by side.
struct PackedProblem {
  const float* x; // [M, K]
  const uint8_t* packed; // `pack`'s output
  float* y; // [M, N]
  int M, N, K, bits, group;
  bool f16_scales;
};

// `compute_packed`'s variants: x rounded to 24 bits with AVX-512 VNNI where the
// CPU has it (else the portable loop), the portable loop (tests).
constexpr int kPackedSimd = 0;
constexpr int kPackedPortable = 1;
// As kPackedSimd, but prefill-sized products (more than 16 rows) always take
// int8 activations (tests).
constexpr int kPackedInt8 = 2;
// As kPackedSimd, but prefill-sized products are bfloat16 on AMX where the
// CPU has it (else int8; tests).
constexpr int kPackedBf16 = 3;

// How prefill-sized products (more than 16 rows) of packed weights are
// computed: dequantized tiles into BLAS (exact float32), x rounded to int8
// per weight group (AVX-512 VNNI), or x and weights rounded to bfloat16
// (AMX).
constexpr int kPrefillFloat = 0;
constexpr int kPrefillInt8 = 1;
constexpr int kPrefillBf16 = 2;

// Whether this CPU runs the packed layout's SIMD kernel (AVX-512 F/BW/VNNI).
bool packed_available();

// Bytes of a packed [N, K] weight.
size_t packed_bytes(int N, int K, int bits, int group, bool f16);

// Bytes of one group of one packed tile (16 rows: codes, scales, biases).
size_t packed_group_bytes(int bits, int group, bool f16);

// Whether every scale and bias is a finite float exactly representable as
// float16 (the packed layout then stores them as float16, losslessly).
bool scales_fit_f16(const float* scales, const float* biases, size_t count);

// MLX's affine layout (w [N, K * bits / 8] bytes, scales/biases
// [N, K / group] float32) -> the packed layout (`packed_bytes` bytes).
void pack(
    const uint8_t* w,
    const float* scales,
    const float* biases,
    int N,
    int K,
    int bits,
    int group,
    bool f16,
    uint8_t* out);

// The inverse of `pack`: the packed layout back to MLX's affine layout
// (w [N, K * bits / 32] words, scales/biases [N, K / group] float32),
// exactly (float16 scales and biases widen losslessly).
void unpack(
    const uint8_t* in,
    int N,
    int K,
    int bits,
    int group,
    bool f16,
    uint32_t* w,
    float* scales,
    float* biases);

// Weight rows [n0, n1) of a packed weight dequantized into out
// ([n1 - n0, K] float32).
void dequant_packed_rows(const PackedProblem& p, int n0, int n1, float* out);

// Tiles [t0, t1) of a packed weight dequantized column-wise (W^T):
// out[k * ld + (t - t0) * 16 + r] = W[16 t + r, k] (zero for padding rows).
void dequant_packed_cols(const PackedProblem& p, int t0, int t1, float* out, int ld);

// Decode-sized product (any M; meant for M <= 16) on the pool.
void compute_packed_tiles(const PackedProblem& p, int variant);

// kPackedSimd's prefill products on this CPU: the loader's choice
// (`mlxhost_set_low_precision_prefill`: bf16, else float) or
// `MLXHOST_PREFILL_PRODUCTS`, stepped down to a kernel the CPU has.
int prefill_products();

// Prefill-sized product with int8 activations (llama.cpp's numerics).
void compute_packed_int8(const PackedProblem& p);

// Whether this CPU and kernel run AMX-BF16 tiles (amx_matmul.cpp; asks
// Linux for the tile state on first use).
bool amx_available();

// Prefill-sized product on AMX (x and weights rounded to bfloat16, float32
// sums; amx_matmul.cpp). False, with nothing computed, where AMX or the
// shape is not supported.
bool compute_packed_amx(const PackedProblem& p);

// Any M: decode-sized products through `compute_packed_tiles`, larger ones
// (prefill) through dequantized tiles and BLAS (exact in float32).
void compute_packed(const PackedProblem& p, int variant);

} // namespace mlxhost_cpu
