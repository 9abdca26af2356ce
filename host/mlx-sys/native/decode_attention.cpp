// Batched decode attention over ragged per-row KV caches, as one MLX CPU
// primitive per layer (mlxhost's continuous-batching step).
//
// Rows of a batch each own their KV cache (`[1, H_kv, capacity, D]`, valid
// positions `[0, pos]` after this step). MLX's CPU backend costs tens of
// microseconds per op, and the per-row path (two `slice_update`s and one
// `scaled_dot_product_attention` per row per layer, the SDPA itself several
// ops on the CPU) made a 16-row decode step spend more time in op overhead
// than in the weights' matrix products. This primitive computes, for every
// row in one op, softmax(q K^T * scale) V over positions `[0, pos]` of the
// row's own (already updated) cache, with grouped-query heads (query head h
// reads KV head h / (H / H_kv)). The caches are only read: the new key and
// value are written by MLX's own `slice_update` (which writes in place only
// when no one else holds the buffer, e.g. the prompt cache).
//
// Inputs:  q [R, H, 1, D] (any strides), then K_0, V_0, ..., K_{R-1},
//          V_{R-1} [1, H_kv, cap_i, D] (any strides, cap_i > pos_i);
//          float32, float16 or bfloat16, all the same dtype.
// Output:  [R, H, 1, D] (q's dtype).
// CPU only: on a GPU stream the host never builds this op (eval_gpu throws).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace {

// Element (i0, i1, i2, i3) of a 4-d array through its strides.
template <typename T>
inline float at(const T* p, const mx::Strides& st, int64_t a, int64_t b, int64_t c, int64_t d) {
  return static_cast<float>(p[a * st[0] + b * st[1] + c * st[2] + d * st[3]]);
}

template <typename T>
inline void store(T* p, float x) {
  *p = static_cast<T>(x);
}

// Dot product of two float vectors of length n (independent accumulators
// so the compiler vectorizes it).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++)
      acc[k] += a[i + k] * b[i + k];
  float s = 0;
  for (; i < n; i++)
    s += a[i] * b[i];
  for (int k = 0; k < 8; k++)
    s += acc[k];
  return s;
}

template <typename T>
void run(const std::vector<mx::array>& inputs, mx::array& out, const std::vector<int>& positions, float scale) {
  const auto& q = inputs[0];
  const int rows = q.shape(0), heads = q.shape(1), dim = q.shape(3);
  T* o = out.data<T>();
  std::vector<float> qrow(dim), acc(dim), keyf, valf, scores;
  for (int r = 0; r < rows; r++) {
    const int len = positions[r] + 1;
    const auto& kc = inputs[1 + 2 * r];
    const auto& vc = inputs[2 + 2 * r];
    const int kv_heads = kc.shape(1);
    const int group = heads / kv_heads;
    const T* kd = kc.data<T>();
    const T* vd = vc.data<T>();
    const auto& ks = kc.strides();
    const auto& vs = vc.strides();
    keyf.resize(size_t(len) * dim);
    valf.resize(size_t(len) * dim);
    scores.resize(len);
    for (int g = 0; g < kv_heads; g++) {
      // This KV head's keys and values as float, once for its query heads.
      for (int j = 0; j < len; j++)
        for (int d = 0; d < dim; d++) {
          keyf[size_t(j) * dim + d] = at(kd, ks, 0, g, j, d);
          valf[size_t(j) * dim + d] = at(vd, vs, 0, g, j, d);
        }
      for (int hq = g * group; hq < (g + 1) * group; hq++) {
        for (int d = 0; d < dim; d++)
          qrow[d] = at(q.data<T>(), q.strides(), r, hq, 0, d);
        float mx_score = -INFINITY;
        for (int j = 0; j < len; j++) {
          scores[j] = scale * dot(qrow.data(), &keyf[size_t(j) * dim], dim);
          mx_score = std::max(mx_score, scores[j]);
        }
        float total = 0;
        for (int j = 0; j < len; j++) {
          scores[j] = std::exp(scores[j] - mx_score);
          total += scores[j];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int j = 0; j < len; j++) {
          const float p = scores[j] / total;
          const float* vr = &valf[size_t(j) * dim];
          for (int d = 0; d < dim; d++)
            acc[d] += p * vr[d];
        }
        T* orow = o + (int64_t(r) * heads + hq) * dim;
        for (int d = 0; d < dim; d++)
          store(&orow[d], acc[d]);
      }
    }
  }
}

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream s, std::vector<int> positions, float scale)
      : mx::Primitive(s), positions_(std::move(positions)), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Allocated here, synchronously, as MLX's own CPU ops do (later ops'
    // eval reads the buffer before this op's task has run).
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs)
      enc.set_input_array(a);
    enc.set_output_array(out);
    // The task holds the arrays (by value) until it has run.
    enc.dispatch([inputs, out, positions = positions_, scale = scale_]() mutable {
      switch (inputs[0].dtype()) {
        case mx::float16:
          run<mx::float16_t>(inputs, out, positions, scale);
          break;
        case mx::bfloat16:
          run<mx::bfloat16_t>(inputs, out, positions, scale);
          break;
        default:
          run<float>(inputs, out, positions, scale);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost DecodeAttention has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostDecodeAttention";
  }

 private:
  std::vector<int> positions_;
  float scale_;
};

} // namespace

// Builds the op (lazily, nothing is evaluated): `out` gets [R, H, 1, D].
// Returns 0, or 1 with the error reported through mlx-c's error handler.
extern "C" int mlxhost_decode_attention(
    mlx_array* out,
    const mlx_array q,
    const mlx_array* keys,
    const mlx_array* values,
    const int* positions,
    int rows,
    float scale) {
  try {
    const auto& qa = mlx_array_get_(q);
    if (qa.ndim() != 4 || qa.shape(0) != rows || qa.shape(2) != 1) {
      throw std::invalid_argument("decode attention: q must be [R, H, 1, D]");
    }
    std::vector<mx::array> inputs = {qa};
    std::vector<int> pos(positions, positions + rows);
    for (int r = 0; r < rows; r++) {
      const auto& kc = mlx_array_get_(keys[r]);
      const auto& vc = mlx_array_get_(values[r]);
      if (kc.ndim() != 4 || kc.shape() != vc.shape() || kc.shape(1) == 0 ||
          qa.shape(1) % kc.shape(1) != 0 || kc.shape(3) != qa.shape(3) || pos[r] < 0 ||
          pos[r] >= kc.shape(2) || kc.dtype() != qa.dtype() || vc.dtype() != qa.dtype()) {
        throw std::invalid_argument("decode attention: a cache buffer does not fit its row");
      }
      inputs.push_back(kc);
      inputs.push_back(vc);
    }
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<DecodeAttention>(stream, std::move(pos), scale);
    mlx_array_set_(*out, mx::array(qa.shape(), qa.dtype(), prim, std::move(inputs)));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}
