// The one-input, one-output CPU primitive behind mlxhost's vocabulary-wide
// ops (logsumexp.cpp, top_p.cpp, categorical.cpp): it runs its kernel on the
// CPU stream's thread over a row-contiguous input and a freshly allocated
// output. GPU streams never get one (the host keeps MLX's ops there).
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxhost_cpu {

class CpuRowOp : public mlx::core::Primitive {
 public:
  // kernel(input, output): both evaluated arrays, the output's buffer
  // allocated (its shape and dtype as the builder declared them).
  using Kernel = std::function<void(const mlx::core::array&, mlx::core::array&)>;

  CpuRowOp(mlx::core::Stream s, const char* name, Kernel kernel)
      : mlx::core::Primitive(s), name_(name), kernel_(std::move(kernel)) {}

  void eval_cpu(
      const std::vector<mlx::core::array>& inputs,
      std::vector<mlx::core::array>& outputs) override {
    if (!inputs[0].flags().row_contiguous)
      throw std::runtime_error(std::string(name_) + ": the input is not row-contiguous");
    outputs[0].set_data(mlx::core::allocator::malloc(outputs[0].nbytes()));
    auto& enc = mlx::core::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(outputs[0]);
    // The task holds the arrays (by value) until it has run.
    enc.dispatch([x = inputs[0], out = outputs[0], kernel = kernel_]() mutable { kernel(x, out); });
  }

  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string(name_) + " has no GPU implementation");
  }

  const char* name() const override {
    return name_;
  }

 private:
  const char* name_;
  Kernel kernel_;
};

// x as float32, row-contiguous, on the CPU stream `s` (no-ops when it
// already is): what a CpuRowOp's kernel reads.
inline mlx::core::array row_contiguous_f32(const mlx::core::array& x, mlx::core::Stream s) {
  return mlx::core::contiguous(mlx::core::astype(x, mlx::core::float32, s), false, s);
}

} // namespace mlxhost_cpu
