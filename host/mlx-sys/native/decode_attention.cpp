// Batched decode attention over ragged per-row KV caches, as one MLX CPU
// primitive per layer (mlxhost's continuous-batching step).
//
// Rows of a batch each own their KV cache (`[1, H_kv, capacity, D]`, valid
// positions `[0, pos]` after this step). MLX's CPU backend costs tens of
// microseconds per op, and the per-row path (two `slice_update`s and one
// `scaled_dot_product_attention` per row per layer, the SDPA itself several
// ops on the CPU) made a 16-row decode step spend more time in op overhead
// than in the weights' matrix products. This primitive does, for every row
// in one op: write the row's new key and value at `pos` into the row's cache
// buffer, in place, then softmax(q K^T * scale) V over positions `[0, pos]`,
// with grouped-query heads (query head h reads KV head h / (H / H_kv)).
//
// Precondition (the host's, `cache::kv`): a decoding row owns its cache
// buffers exclusively (nothing else, e.g. the prompt cache, holds them), so
// writing in place is invisible to anyone else. MLX's `is_donatable` cannot
// say so here: every output of a multi-output op holds the op's inputs.
//
// Inputs:  q [R, H, 1, D], k [R, H_kv, 1, D], v [R, H_kv, 1, D] (any
//          strides), then K_0, V_0, ..., K_{R-1}, V_{R-1} [1, H_kv, cap_i, D]
//          (row-contiguous, cap_i > pos_i); float32, float16 or bfloat16,
//          all the same dtype.
// Outputs: [R, H, 1, D] (q's dtype), then K'_0, V'_0, ...: the cache buffers
//          (the same storage) holding the new keys and values.
// CPU only: on a GPU stream the host never builds this op (eval_gpu throws).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "mlx/c/error.h"
#include "mlx/c/private/array.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "cpu_kernels.h"

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
void run(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const std::vector<int>& positions,
    float scale) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const int rows = q.shape(0), heads = q.shape(1), dim = q.shape(3);
  T* o = outputs[0].data<T>();
  std::vector<float> qrow(dim), acc(dim), keyf, valf, scores;
  for (int r = 0; r < rows; r++) {
    const int pos = positions[r];
    const int len = pos + 1;
    auto& kc = outputs[1 + 2 * r];
    auto& vc = outputs[2 + 2 * r];
    const int kv_heads = kc.shape(1);
    const int group = heads / kv_heads;
    const int cap = kc.shape(2);
    T* kw = kc.data<T>();
    T* vw = vc.data<T>();
    // The new key and value at `pos` (buffers are row-contiguous).
    for (int h = 0; h < kv_heads; h++)
      for (int d = 0; d < dim; d++) {
        store(&kw[(int64_t(h) * cap + pos) * dim + d], at(k.data<T>(), k.strides(), r, h, 0, d));
        store(&vw[(int64_t(h) * cap + pos) * dim + d], at(v.data<T>(), v.strides(), r, h, 0, d));
      }
    const T* kd = kw;
    const T* vd = vw;
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
    // Buffers are set here, synchronously, as MLX's own CPU ops do (later
    // ops' eval reads them before this op's task has run). The caches are
    // written in place (see the precondition above).
    for (size_t i = 3; i < inputs.size(); i++) {
      if (!inputs[i].flags().row_contiguous)
        throw std::runtime_error("decode attention: a cache buffer is not row-contiguous");
    }
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    for (size_t i = 1; i < outputs.size(); i++)
      outputs[i].copy_shared_buffer(inputs[i + 2]);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs)
      enc.set_input_array(a);
    for (auto& a : outputs)
      enc.set_output_array(a);
    // The task holds the arrays (by value) until it has run.
    enc.dispatch([inputs, outputs, positions = positions_, scale = scale_]() mutable {
      switch (inputs[0].dtype()) {
        case mx::float16:
          run<mx::float16_t>(inputs, outputs, positions, scale);
          break;
        case mx::bfloat16:
          run<mx::bfloat16_t>(inputs, outputs, positions, scale);
          break;
        default:
          run<float>(inputs, outputs, positions, scale);
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

// Builds the op (lazily, nothing is evaluated). `out` gets [R, H, 1, D];
// `new_keys[r]` / `new_values[r]` get row r's cache buffers after the write
// (each an initialised mlx_array, overwritten). Returns 0, or 1 with the
// error reported through mlx-c's error handler.
extern "C" int mlxhost_decode_attention(
    mlx_array* out,
    mlx_array* new_keys,
    mlx_array* new_values,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    const mlx_array* keys,
    const mlx_array* values,
    const int* positions,
    int rows,
    float scale) {
  try {
    const auto& qa = mlx_array_get_(q);
    const auto& ka = mlx_array_get_(k);
    const auto& va = mlx_array_get_(v);
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || qa.shape(0) != rows ||
        ka.shape(0) != rows || va.shape(0) != rows || qa.shape(2) != 1 || ka.shape(1) == 0 ||
        qa.shape(1) % ka.shape(1) != 0 || ka.dtype() != qa.dtype() || va.dtype() != qa.dtype()) {
      throw std::invalid_argument("decode attention: q/k/v must be [R, H, 1, D] with H % H_kv == 0");
    }
    std::vector<mx::array> inputs = {qa, ka, va};
    std::vector<mx::Shape> shapes = {qa.shape()};
    std::vector<mx::Dtype> dtypes = {qa.dtype()};
    std::vector<int> pos(positions, positions + rows);
    for (int r = 0; r < rows; r++) {
      const auto& kc = mlx_array_get_(keys[r]);
      const auto& vc = mlx_array_get_(values[r]);
      if (kc.ndim() != 4 || kc.shape() != vc.shape() || kc.shape(1) != ka.shape(1) ||
          kc.shape(3) != qa.shape(3) || pos[r] < 0 || pos[r] >= kc.shape(2) ||
          kc.dtype() != qa.dtype() || vc.dtype() != qa.dtype()) {
        throw std::invalid_argument("decode attention: a cache buffer does not fit its row");
      }
      inputs.push_back(kc);
      inputs.push_back(vc);
      shapes.push_back(kc.shape());
      shapes.push_back(vc.shape());
      dtypes.push_back(kc.dtype());
      dtypes.push_back(vc.dtype());
    }
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<DecodeAttention>(stream, std::move(pos), scale);
    auto outs = mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
    mlx_array_set_(*out, outs[0]);
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

// ---------------------------------------------------------------------------
// The same op over quantized caches (`--kv-bits`, the host's `cache::quant`;
// the row layout and the attention kernel: chunked_attention.cpp). The
// row's new key and value arrive already packed (MLX's `quantize`, so every
// path stores the same numbers); the op copies them in at `pos`, in place,
// and attends over the packed rows: no dequantized copy of the cache.
//
// Inputs:  q [R, H, 1, D] (float32, float16 or bfloat16; any strides), k, v
//          [R, H_kv, 1, P] uint32 (any strides), then K_0, V_0, ... [1,
//          H_kv, cap_i, P] uint32 (row-contiguous, cap_i > pos_i).
// Outputs: [R, H, 1, D] (q's dtype), then the cache buffers after the write.

namespace {

template <typename T>
void run_quant(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    const std::vector<int>& positions,
    float scale,
    int bits,
    int group_size) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const int rows = q.shape(0), heads = q.shape(1), dim = q.shape(3);
  const int words = k.shape(3);
  // q as float32 and the output before its cast, [R, H, D] each.
  std::vector<float> qf(size_t(rows) * heads * dim), of(qf.size());
  std::vector<mlxhost_cpu::KvQuantJob> jobs;
  for (int r = 0; r < rows; r++) {
    const int pos = positions[r];
    auto& kc = outputs[1 + 2 * r];
    auto& vc = outputs[2 + 2 * r];
    const int kv_heads = kc.shape(1);
    const int group = heads / kv_heads;
    const int cap = kc.shape(2);
    uint32_t* kw = kc.data<uint32_t>();
    uint32_t* vw = vc.data<uint32_t>();
    const uint32_t* kn = k.data<uint32_t>();
    const uint32_t* vn = v.data<uint32_t>();
    const auto& kst = k.strides();
    const auto& vst = v.strides();
    for (int h = 0; h < kv_heads; h++)
      for (int w = 0; w < words; w++) {
        kw[(int64_t(h) * cap + pos) * words + w] = kn[r * kst[0] + h * kst[1] + w * kst[3]];
        vw[(int64_t(h) * cap + pos) * words + w] = vn[r * vst[0] + h * vst[1] + w * vst[3]];
      }
    for (int h = 0; h < heads; h++)
      for (int d = 0; d < dim; d++)
        qf[(size_t(r) * heads + h) * dim + d] = at(q.data<T>(), q.strides(), r, h, 0, d);
    for (int g = 0; g < kv_heads; g++) {
      const size_t first = (size_t(r) * heads + size_t(g) * group) * dim;
      jobs.push_back({qf.data() + first, group, kw + int64_t(g) * cap * words,
                      vw + int64_t(g) * cap * words, pos + 1, scale, of.data() + first});
    }
  }
  mlxhost_cpu::kv_quant_attention(jobs.data(), int(jobs.size()), dim, bits, group_size);
  T* o = outputs[0].data<T>();
  for (size_t i = 0; i < of.size(); i++)
    store(&o[i], of[i]);
}

class QuantDecodeAttention : public mx::Primitive {
 public:
  QuantDecodeAttention(mx::Stream s, std::vector<int> positions, float scale, int bits, int group_size)
      : mx::Primitive(s),
        positions_(std::move(positions)),
        scale_(scale),
        bits_(bits),
        group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // As DecodeAttention: buffers set synchronously, caches written in place.
    for (size_t i = 3; i < inputs.size(); i++) {
      if (!inputs[i].flags().row_contiguous)
        throw std::runtime_error("quantized decode attention: a cache buffer is not row-contiguous");
    }
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    for (size_t i = 1; i < outputs.size(); i++)
      outputs[i].copy_shared_buffer(inputs[i + 2]);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs)
      enc.set_input_array(a);
    for (auto& a : outputs)
      enc.set_output_array(a);
    enc.dispatch([inputs,
                  outputs,
                  positions = positions_,
                  scale = scale_,
                  bits = bits_,
                  group_size = group_size_]() mutable {
      switch (inputs[0].dtype()) {
        case mx::float16:
          run_quant<mx::float16_t>(inputs, outputs, positions, scale, bits, group_size);
          break;
        case mx::bfloat16:
          run_quant<mx::bfloat16_t>(inputs, outputs, positions, scale, bits, group_size);
          break;
        default:
          run_quant<float>(inputs, outputs, positions, scale, bits, group_size);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxhost QuantDecodeAttention has no GPU implementation");
  }

  const char* name() const override {
    return "MlxhostQuantDecodeAttention";
  }

 private:
  std::vector<int> positions_;
  float scale_;
  int bits_;
  int group_size_;
};

} // namespace

// Builds the quantized op (lazily). As `mlxhost_decode_attention`, with k, v
// and the caches packed rows of `bits` (4 or 8) and `group_size`.
extern "C" int mlxhost_decode_attention_quant(
    mlx_array* out,
    mlx_array* new_keys,
    mlx_array* new_values,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    const mlx_array* keys,
    const mlx_array* values,
    const int* positions,
    int rows,
    float scale,
    int bits,
    int group_size) {
  try {
    const auto& qa = mlx_array_get_(q);
    const auto& ka = mlx_array_get_(k);
    const auto& va = mlx_array_get_(v);
    if (bits != 4 && bits != 8)
      throw std::invalid_argument("quantized decode attention: bits must be 4 or 8");
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || qa.shape(0) != rows ||
        ka.shape(0) != rows || va.shape(0) != rows || qa.shape(2) != 1 || ka.shape(1) == 0 ||
        qa.shape(1) % ka.shape(1) != 0 || ka.shape() != va.shape() || ka.dtype() != mx::uint32 ||
        va.dtype() != mx::uint32 || group_size <= 0 || qa.shape(3) % group_size != 0 ||
        ka.shape(3) != qa.shape(3) * bits / 32 + 2 * (qa.shape(3) / group_size)) {
      throw std::invalid_argument(
          "quantized decode attention: q must be [R, H, 1, D], k/v [R, H_kv, 1, P] uint32 packed rows");
    }
    std::vector<mx::array> inputs = {qa, ka, va};
    std::vector<mx::Shape> shapes = {qa.shape()};
    std::vector<mx::Dtype> dtypes = {qa.dtype()};
    std::vector<int> pos(positions, positions + rows);
    for (int r = 0; r < rows; r++) {
      const auto& kc = mlx_array_get_(keys[r]);
      const auto& vc = mlx_array_get_(values[r]);
      if (kc.ndim() != 4 || kc.shape() != vc.shape() || kc.shape(1) != ka.shape(1) ||
          kc.shape(3) != ka.shape(3) || pos[r] < 0 || pos[r] >= kc.shape(2) ||
          kc.dtype() != mx::uint32 || vc.dtype() != mx::uint32) {
        throw std::invalid_argument("quantized decode attention: a cache buffer does not fit its row");
      }
      inputs.push_back(kc);
      inputs.push_back(vc);
      shapes.push_back(kc.shape());
      shapes.push_back(vc.shape());
      dtypes.push_back(kc.dtype());
      dtypes.push_back(vc.dtype());
    }
    auto stream = mx::default_stream(mx::Device::cpu);
    auto prim = std::make_shared<QuantDecodeAttention>(stream, std::move(pos), scale, bits, group_size);
    auto outs = mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
    mlx_array_set_(*out, outs[0]);
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
