//! The MLP's activation `silu(gate) * up` on the CPU backend as one MLX op
//! (`mlxhost_swiglu_rows`, `host/mlx-sys/native/swiglu.cpp`): one pass of
//! 16-lane exponentials over the fused gate/up product. MLX's CPU `sigmoid`
//! exponentiates one lane at a time and the three-op form makes three
//! passes over `[T, I]`; with prefill products on AMX that was ~18% of a
//! 512-token prefill of Qwen2.5-1.5B.
//!
//! Chosen on the CPU backend for float32 activations; elsewhere (GPU, or
//! float16 compute) MLX's ops run.

use mlx_rs::{error::Exception, Array, Dtype};

use super::error::Result;

/// Whether `gu` (the fused gate/up product) can take the op: CPU backend,
/// float32, `[R, 2 I]`.
pub fn applies(gu: &Array) -> bool {
    !crate::runtime::gpu_available()
        && gu.dtype() == Dtype::Float32
        && gu.ndim() == 2
        && gu.shape()[1] % 2 == 0
}

/// `silu(gu[:, :I]) * gu[:, I:]` for `gu: [R, 2 I]` float32 (the gate
/// product's columns, then the up product's) -> `[R, I]` float32 (lazy);
/// `silu(g) = g / (1 + e^-g)`, exponentials within ~2 ulp of `expf`.
///
/// Errors: `gu` not two-dimensional with an even last axis.
pub fn swiglu_rows(gu: &Array) -> Result<Array> {
    // SAFETY: `mlx_array_new` makes an empty handle the call fills (or
    // leaves empty); it is wrapped right after, which frees it on drop. The
    // input handle is borrowed for the call; the op keeps a reference.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_swiglu_rows(&mut out, gu.as_ptr());
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "swiglu rows: gu must be [R, 2 I] (got {:?})",
            gu.shape()
        ))
        .into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops;

    /// Equal to MLX's `gate * sigmoid(gate) * up` to a few float32 ulps,
    /// including large negative and positive gates (e^-g overflowing) and a
    /// width that is not a multiple of 16 (the scalar tail).
    #[test]
    fn swiglu_rows_matches_mlx_ops() -> Result<()> {
        mlx_rs::random::seed(3)?;
        for (rows, inter) in [(1, 16), (5, 37), (33, 160)] {
            let gu = ops::multiply(
                &mlx_rs::random::normal::<f32>(&[rows, 2 * inter], None, None, None)?,
                Array::from_f32(30.0),
            )?;
            let got = swiglu_rows(&gu)?;
            let parts = ops::split_equal(&gu, 2, -1)?;
            let (gate, up) = (&parts[0], &parts[1]);
            let want = ops::multiply(&ops::multiply(gate, &ops::sigmoid(gate)?)?, up)?;
            assert_eq!(got.shape(), &[rows, inter]);
            let err = ops::abs(&ops::subtract(&got, &want)?)?;
            let tol = ops::add(
                &ops::multiply(&ops::abs(&want)?, Array::from_f32(1e-5))?,
                Array::from_f32(1e-6),
            )?;
            let bad = ops::gt(&err, &tol)?.any(None)?.item_exact::<bool>();
            assert!(!bad, "[{rows}x{inter}]: swiglu differs from MLX's ops");
        }
        Ok(())
    }

    #[test]
    fn odd_width_is_an_error() {
        // Built by an mlx-rs op, which installs mlx-rs's error handler
        // (MLX's default one exits), as every caller's graph has.
        let gu = ops::zeros::<f32>(&[1, 3]).unwrap();
        assert!(swiglu_rows(&gu).is_err());
    }
}
