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
// int8 activations (tests; `MLXHOST_INT8_PREFILL=1` makes kPackedSimd do so).
constexpr int kPackedInt8 = 2;

// Whether this CPU runs the packed layout's SIMD kernel (AVX-512 F/BW/VNNI).
bool packed_available();

// Bytes of a packed [N, K] weight.
size_t packed_bytes(int N, int K, int bits, int group, bool f16);

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

// Weight rows [n0, n1) of a packed weight dequantized into out
// ([n1 - n0, K] float32).
void dequant_packed_rows(const PackedProblem& p, int n0, int n1, float* out);

// Tiles [t0, t1) of a packed weight dequantized column-wise (W^T):
// out[k * ld + (t - t0) * 16 + r] = W[16 t + r, k] (zero for padding rows).
void dequant_packed_cols(const PackedProblem& p, int t0, int t1, float* out, int ld);

// Decode-sized product (any M; meant for M <= 16) on the pool.
void compute_packed_tiles(const PackedProblem& p, int variant);

// Whether prefill-sized packed products use int8 activations
// (`MLXHOST_INT8_PREFILL=1` on a CPU with AVX-512 VNNI).
bool int8_prefill_enabled();

// Prefill-sized product with int8 activations (llama.cpp's numerics).
void compute_packed_int8(const PackedProblem& p);

// Any M: decode-sized products through `compute_packed_tiles`, larger ones
// (prefill) through dequantized tiles and BLAS (exact in float32).
void compute_packed(const PackedProblem& p, int variant);

} // namespace mlxhost_cpu
