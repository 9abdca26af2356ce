// mlxhost's CPU kernels shared by its MLX primitives (quantized_matmul.cpp
// defines them; decode_layer.cpp uses them).
#pragma once

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

} // namespace mlxhost_cpu
