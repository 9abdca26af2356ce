//! Decode attention over the decode slab ([`crate::cache::slab`]) as one
//! CUDA kernel of ours, JIT-compiled by MLX (`mlx::core::fast::cuda_kernel`,
//! NVRTC). With several rows, MLX's fused SDPA on CUDA (`sdpa_vector`) takes
//! no mask, so a masked call falls back to unfused ops (scale, two matrix
//! products, the mask, softmax: several kernels per layer); on a GPU each
//! kernel costs the host ~5 µs to encode and launch, more than the work.
//! This kernel reads each row's own length instead of a mask: one launch
//! per layer for all rows.
//!
//! Algorithm: one thread block per (query head, row), 4 warps; each warp
//! walks every 4th key with an online softmax (running max and sum, as in
//! FlashAttention, Dao et al. 2022, and MLX's `sdpa_vector`), each lane
//! holding `D / 32` of the head dimension; the warps' partial results are
//! merged through shared memory. Scores and sums in float32.
//!
//! Used only where [`available`] says so: a CUDA backend, and a first call
//! ([`self_test`]) that compiled and matched MLX's masked SDPA on random
//! inputs; otherwise the slab keeps the masked SDPA.
//! `MLXHOST_SLAB_ATTENTION=sdpa` switches it off.

use std::sync::OnceLock;

use mlx_rs::{Array, Dtype};

use super::cuda_kernel::{float_bits, CudaKernel, SelfTestedGate, TemplateArg};
use super::error::Result;

const WARPS: i32 = 4;

/// The kernel body (MLX writes the signature: `q`, `keys`, `values`,
/// `lens` in, `out` out; `T`, `D` and `SCALE_BITS`, the score scale's
/// float32 bits, are template constants).
const SOURCE: &str = r#"
  constexpr int WARPS = 4;
  constexpr int PER = D / 32;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int h = blockIdx.x;
  const int r = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int H = q_shape[1];
  const int Hkv = keys_shape[1];
  const int cap = keys_shape[2];
  const int kvh = h / (H / Hkv);
  const int n = min(lens[r] + 1, cap);
  const float sc = __int_as_float(SCALE_BITS);
  const T* qp = q + ((long long)r * H + h) * D;
  const long long base = ((long long)r * Hkv + kvh) * (long long)cap * D;
  const T* kp = keys + base;
  const T* vp = values + base;
  float qv[PER];
  float o[PER];
  for (int i = 0; i < PER; ++i) {
    qv[i] = static_cast<float>(qp[lane * PER + i]) * sc;
    o[i] = 0.0f;
  }
  float m = NEG_INF;
  float s = 0.0f;
  for (int j = w; j < n; j += WARPS) {
    const T* kj = kp + (long long)j * D;
    float dot = 0.0f;
    for (int i = 0; i < PER; ++i) {
      dot += qv[i] * static_cast<float>(kj[lane * PER + i]);
    }
    for (int off = 16; off > 0; off >>= 1) {
      dot += __shfl_xor_sync(0xffffffff, dot, off);
    }
    const float m_new = fmaxf(m, dot);
    const float corr = expf(m - m_new);
    const float p = expf(dot - m_new);
    s = s * corr + p;
    const T* vj = vp + (long long)j * D;
    for (int i = 0; i < PER; ++i) {
      o[i] = o[i] * corr + p * static_cast<float>(vj[lane * PER + i]);
    }
    m = m_new;
  }
  __shared__ float sm_m[WARPS];
  __shared__ float sm_s[WARPS];
  __shared__ float sm_o[WARPS][D];
  if (lane == 0) {
    sm_m[w] = m;
    sm_s[w] = s;
  }
  for (int i = 0; i < PER; ++i) {
    sm_o[w][lane * PER + i] = o[i];
  }
  __syncthreads();
  if (w == 0) {
    float M = NEG_INF;
    for (int k = 0; k < WARPS; ++k) {
      M = fmaxf(M, sm_m[k]);
    }
    float S = 0.0f;
    float acc[PER];
    for (int i = 0; i < PER; ++i) {
      acc[i] = 0.0f;
    }
    for (int k = 0; k < WARPS; ++k) {
      const float c = (sm_m[k] == NEG_INF) ? 0.0f : expf(sm_m[k] - M);
      S += sm_s[k] * c;
      for (int i = 0; i < PER; ++i) {
        acc[i] += sm_o[k][lane * PER + i] * c;
      }
    }
    T* op = out + ((long long)r * H + h) * D;
    for (int i = 0; i < PER; ++i) {
      op[lane * PER + i] = static_cast<T>(acc[i] / S);
    }
  }
"#;

fn kernel() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_slab_decode_attention",
            &["q", "keys", "values", "lens"],
            &["out"],
            SOURCE,
            "",
        )
    })
}

/// Attention for `R` decode rows over the slab: `q: [R, H, 1, D]`,
/// `keys`/`values: [R, H_kv, capacity, D]` (row-contiguous, the new token
/// already written), `lens: [R]` int32 (row r sees columns `0..=lens[r]`),
/// scores scaled by `scale`. Returns `[R, H, 1, D]` in `q`'s dtype.
///
/// Errors: MLX errors (a backend without CUDA, shapes that do not fit).
pub fn attend(q: &Array, keys: &Array, values: &Array, lens: &Array, scale: f32) -> Result<Array> {
    let (r, h, d) = (q.shape()[0], q.shape()[1], q.shape()[3]);
    let q = q.reshape(&[r, h, 1, d])?;
    let shape = [r, h, 1, d];
    let mut out = kernel().apply(
        "slab decode attention",
        &[&q, keys, values, lens],
        &[(&shape, q.dtype())],
        (h * 32 * WARPS, r, 1),
        (32 * WARPS, 1, 1),
        &[
            TemplateArg::Dtype("T", q.dtype()),
            TemplateArg::Int("D", d),
            TemplateArg::Int("SCALE_BITS", float_bits(scale)),
        ],
    )?;
    Ok(out.remove(0))
}

/// Whether the slab's multi-row attention uses [`attend`] for activations
/// of `dtype`: a CUDA backend, not switched off
/// (`MLXHOST_SLAB_ATTENTION=sdpa`), and [`self_test`] passed in that dtype
/// (checked once per dtype, at its first use).
pub fn available(dtype: Dtype) -> bool {
    static GATE: SelfTestedGate =
        SelfTestedGate::new("slab decode attention: CUDA kernel", "MLX's SDPA");
    GATE.allows(
        dtype,
        || std::env::var("MLXHOST_SLAB_ATTENTION").as_deref() != Ok("sdpa"),
        self_test,
        // Accepted below 0.02 (the gate accepts `<=`, so the next float down).
        |_| 2e-2f32.next_down(),
    )
}

/// Runs [`attend`] on random inputs of `dtype` (3 rows of different
/// lengths, grouped-query heads, head dims 64 and 128) against MLX's SDPA
/// under the equivalent mask; returns the largest absolute difference. Uses
/// its own random key, so the global generator is not advanced.
///
/// Errors: whatever the kernel or MLX raised.
pub fn self_test(dtype: Dtype) -> Result<f32> {
    use mlx_rs::{fast, ops, random};
    let mut worst = 0f32;
    for d in [64, 128] {
        let (r, h, hkv, cap) = (3, 6, 2, 40);
        let lens_host = [0i32, 17, 39];
        let rnd = |shape: &[i32], salt: u32| -> Result<Array> {
            let k = random::key(0x5eed + u64::from(salt) + d as u64)?;
            Ok(random::normal::<f32>(shape, None, None, &k)?.as_dtype(dtype)?)
        };
        let q = rnd(&[r, h, 1, d], 1)?;
        let k = rnd(&[r, hkv, cap, d], 2)?;
        let v = rnd(&[r, hkv, cap, d], 3)?;
        let lens = Array::from_slice(&lens_host, &[r]);
        let scale = 1.0 / (d as f32).sqrt();
        let got = attend(&q, &k, &v, &lens, scale)?;
        let bits: Vec<bool> = lens_host
            .iter()
            .flat_map(|&l| (0..cap).map(move |c| c <= l))
            .collect();
        let mask = Array::from_slice(&bits, &[r, 1, 1, cap]);
        let want = fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            scale,
            fast::ScaledDotProductAttentionMask::Array(&mask),
            None,
        )?;
        let diff = ops::abs(ops::subtract(
            &got.as_dtype(Dtype::Float32)?,
            &want.as_dtype(Dtype::Float32)?,
        )?)?;
        let diff = ops::max(&diff, None)?;
        mlx_rs::transforms::eval([&diff])?;
        let value = diff
            .as_slice::<f32>()
            .first()
            .copied()
            .unwrap_or(f32::INFINITY);
        worst = worst.max(if value.is_finite() {
            value
        } else {
            f32::INFINITY
        });
    }
    Ok(worst)
}
