//! Two fused kernels for the Llama-family layer on CUDA
//! ([`super::cuda_kernel`]), each one launch where MLX's ops take several:
//!
//! - [`swiglu`]: `silu(gate) * up` from the fused gate/up product, one kernel
//!   for MLX's three (sigmoid, two products);
//! - [`add_rms_norm`]: the residual add and the next RMSNorm, one kernel for
//!   two, returning both the new residual stream and its normalized copy.
//!
//! On the H200 a SmolLM2 decode step is the host encoding ~15 kernels per
//! layer; these take 4 of them away per layer, yet measured slower there
//! (decode 3.5 vs 2.9 ms/token, graph build up too; docs/benchmarks.md,
//! "Fused layer kernels"), so they are opt-in: `MLXHOST_FUSED_KERNELS=on`.
//!
//! Same values as the ops they replace: every elementwise step is MLX's own
//! device functor (`Sigmoid`, `Multiply`, `Add` from MLX's
//! `backend/cuda/device/*_ops.cuh`) in the activation dtype, and the norm
//! follows MLX's `rms_norm.cu` (float32 sum of squares,
//! `rsqrt(sum / E + eps)`, `w * T(x * normalizer)`); only the order of the
//! float32 sum differs. (A SwiGLU through `mx.compile` was tried in run 5
//! and moved the converted model's scores by 0.03 nats: compiled kernels
//! keep intermediates in float32.) Each kernel is checked against MLX's ops
//! on random inputs at its first use per dtype ([`available`]); any
//! compile error or mismatch keeps MLX's ops.

use std::sync::OnceLock;

use mlx_rs::{error::Exception, fast, ops, ops::indexing::IndexOp, Array, Dtype};

use super::cuda_kernel::{
    float_bits, relative_diff, CudaKernel, SelfTestedGate, TemplateArg, ELEMENTWISE_HEADER,
};
use super::error::Result;

const SWIGLU_SOURCE: &str = r#"
  const int twice = gu_shape[1];
  const int I = twice / 2;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)gu_shape[0] * I) {
    return;
  }
  const long long row = idx / I;
  const int col = (int)(idx % I);
  const T g = gu[row * twice + col];
  const T u = gu[row * twice + I + col];
  out[idx] = Multiply{}(Multiply{}(g, Sigmoid{}(g)), u);
"#;

const ADD_RMS_NORM_SOURCE: &str = r#"
  constexpr int BLOCK = 256;
  const int row = blockIdx.y;
  const int E = h_shape[1];
  const long long base = (long long)row * E;
  float sq = 0.0f;
  for (int i = threadIdx.x; i < E; i += BLOCK) {
    const T s = Add{}(h[base + i], y[base + i]);
    sum[base + i] = s;
    const float t = static_cast<float>(s);
    sq += t * t;
  }
  for (int off = 16; off > 0; off >>= 1) {
    sq += __shfl_xor_sync(0xffffffff, sq, off);
  }
  __shared__ float part[BLOCK / 32];
  if ((threadIdx.x & 31) == 0) {
    part[threadIdx.x >> 5] = sq;
  }
  __syncthreads();
  float total = 0.0f;
  for (int k = 0; k < BLOCK / 32; ++k) {
    total += part[k];
  }
  const float normalizer = rsqrt(total / E + __int_as_float(EPS_BITS));
  for (int i = threadIdx.x; i < E; i += BLOCK) {
    const float v = static_cast<float>(sum[base + i]) * normalizer;
    normed[base + i] = Multiply{}(w[i], static_cast<T>(v));
  }
"#;

/// Threads per block of both kernels.
const BLOCK: i32 = 256;

fn swiglu_kernel() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_swiglu",
            &["gu"],
            &["out"],
            SWIGLU_SOURCE,
            ELEMENTWISE_HEADER,
        )
    })
}

fn add_rms_norm_kernel() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_add_rms_norm",
            &["h", "y", "w"],
            &["sum", "normed"],
            ADD_RMS_NORM_SOURCE,
            ELEMENTWISE_HEADER,
        )
    })
}

/// `silu(gate) * up` where `gu: [N, 2I]` is the gate and up products side
/// by side (gate first); returns `[N, I]` in `gu`'s dtype.
///
/// Errors: MLX's (no CUDA stream; `gu` not 2-D with an even width).
pub fn swiglu(gu: &Array) -> Result<Array> {
    let sh = gu.shape();
    if sh.len() != 2 || sh[1] % 2 != 0 {
        return Err(Exception::custom(format!("swiglu: expected [N, 2I], got {sh:?}")).into());
    }
    let (n, i) = (sh[0], sh[1] / 2);
    let mut out = swiglu_kernel().apply(
        "swiglu",
        &[gu],
        &[(&[n, i], gu.dtype())],
        (n * i, 1, 1),
        (BLOCK, 1, 1),
        &[TemplateArg::Dtype("T", gu.dtype())],
    )?;
    Ok(out.remove(0))
}

/// `h + y` and `rms_norm(h + y) * w`: `h`, `y: [N, E]`, `w: [E]`, all of
/// one dtype (MLX's ops would promote mixed dtypes; callers keep those on
/// MLX's ops), epsilon `eps`. Returns `(sum, normed)`, both `[N, E]`.
///
/// Errors: MLX's (no CUDA stream); shapes or dtypes that do not fit.
pub fn add_rms_norm(h: &Array, y: &Array, w: &Array, eps: f32) -> Result<(Array, Array)> {
    let sh = h.shape().to_vec();
    let dtype = h.dtype();
    if sh.len() != 2
        || y.shape() != sh.as_slice()
        || w.shape() != [sh[1]]
        || y.dtype() != dtype
        || w.dtype() != dtype
    {
        return Err(Exception::custom(format!(
            "add_rms_norm: h {sh:?} {dtype:?}, y {:?} {:?}, w {:?} {:?}",
            y.shape(),
            y.dtype(),
            w.shape(),
            w.dtype()
        ))
        .into());
    }
    let mut out = add_rms_norm_kernel().apply(
        "add_rms_norm",
        &[h, y, w],
        &[(&sh, dtype), (&sh, dtype)],
        (BLOCK, sh[0], 1),
        (BLOCK, 1, 1),
        &[
            TemplateArg::Dtype("T", dtype),
            TemplateArg::Int("EPS_BITS", float_bits(eps)),
        ],
    )?;
    let normed = out.remove(1);
    Ok((out.remove(0), normed))
}

/// Whether [`swiglu`] and [`add_rms_norm`] replace MLX's ops for
/// activations of `dtype`: a CUDA backend, switched on
/// (`MLXHOST_FUSED_KERNELS=on`), and [`self_test`] passed in that dtype
/// (checked once per dtype, at its first use).
pub fn available(dtype: Dtype) -> bool {
    static GATE: SelfTestedGate =
        SelfTestedGate::new("fused SwiGLU and add+RMSNorm CUDA kernels", "MLX's ops");
    GATE.allows(
        dtype,
        || std::env::var("MLXHOST_FUSED_KERNELS").as_deref() == Ok("on"),
        self_test,
        tolerance,
    )
}

/// Largest relative difference the self-test accepts: two units in the
/// last place of `dtype` (the norm's float32 sum runs in another order).
fn tolerance(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => 2.0 * 2f32.powi(-10),
        Dtype::Bfloat16 => 2.0 * 2f32.powi(-7),
        _ => 1e-5,
    }
}

/// Runs both kernels on random `dtype` inputs (3 rows; widths 576 and 897,
/// one not a multiple of the block) against MLX's ops; returns the largest
/// relative difference ([`relative_diff`]). Uses its own random keys, so
/// the global generator is not advanced.
///
/// Errors: whatever a kernel or MLX raised.
pub fn self_test(dtype: Dtype) -> Result<f32> {
    use mlx_rs::random;
    let mut worst = 0f32;
    for (salt, e) in [(0u64, 576), (1, 897)] {
        let rnd = |shape: &[i32], k: u64, scale: f32| -> Result<Array> {
            let key = random::key(0xf05e + 16 * salt + k)?;
            let x = random::normal::<f32>(shape, None, None, &key)?;
            Ok(ops::multiply(&x, Array::from_f32(scale))?.as_dtype(dtype)?)
        };
        let gu = rnd(&[3, 2 * e], 1, 4.0)?;
        let gate = gu.index((.., ..e));
        let up = gu.index((.., e..));
        let want = ops::multiply(&ops::multiply(&gate, &ops::sigmoid(&gate)?)?, &up)?;
        worst = worst.max(relative_diff(&swiglu(&gu)?, &want)?);

        let h = rnd(&[3, e], 2, 20.0)?;
        let y = rnd(&[3, e], 3, 2.0)?;
        let w = rnd(&[e], 4, 1.0)?;
        let eps = 1e-5;
        let (sum, normed) = add_rms_norm(&h, &y, &w, eps)?;
        let want_sum = ops::add(&h, &y)?;
        let want_normed = fast::rms_norm(&want_sum, Some(&w), eps)?;
        worst = worst.max(relative_diff(&sum, &want_sum)?);
        worst = worst.max(relative_diff(&normed, &want_normed)?);
    }
    Ok(worst)
}
