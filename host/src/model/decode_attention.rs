//! Batched decode attention for the rows of a step that decode one token:
//! one MLX op per layer (`mlxhost_decode_attention`, a CPU primitive in
//! `host/mlx-sys/native/decode_attention.cpp`) attends every row over its
//! own cache buffer, instead of one `scaled_dot_product_attention` per row
//! (several ops each on the CPU). MLX's CPU backend costs tens of
//! microseconds per op, so at 16 rows x 30 layers the per-row path spent
//! more time in op overhead than in the weights' matrix products. The new
//! keys and values are still written per row by MLX's `slice_update`, which
//! writes in place only when no one else (the prompt cache) holds a buffer.
//!
//! Chosen only on the CPU backend (GPU backends keep MLX's own kernels) and
//! unless `MLXHOST_DECODE_ATTENTION=per-row` (a benchmarking switch).

use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array};

use super::error::Result;

/// Whether decode rows use the batched op (CPU backend, not switched off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !crate::runtime::gpu_available()
            && std::env::var("MLXHOST_DECODE_ATTENTION").as_deref() != Ok("per-row")
    })
}

/// Attention for `R` decode rows. `q: [R, H, 1, D]` (RoPE applied),
/// `caches[r]`: row r's key and value buffers `[1, H_kv, capacity, D]`,
/// already holding the new token at `positions[r] < capacity`. Returns
/// `[R, H, 1, D]` (lazy).
///
/// Errors: shapes or dtypes that do not fit.
pub fn decode_attention(
    q: &Array,
    caches: &[(Array, Array)],
    positions: &[i32],
    scale: f32,
) -> Result<Array> {
    let rows = positions.len();
    if caches.len() != rows || q.shape().first() != Some(&(rows as i32)) {
        return Err(Exception::custom(format!(
            "decode attention: {rows} positions, {} caches, q of shape {:?}",
            caches.len(),
            q.shape()
        ))
        .into());
    }
    let keys: Vec<mlx_sys::mlx_array> = caches.iter().map(|(k, _)| k.as_ptr()).collect();
    let values: Vec<mlx_sys::mlx_array> = caches.iter().map(|(_, v)| v.as_ptr()).collect();
    // SAFETY: `mlx_array_new` makes an empty handle the call fills (or
    // leaves empty); it is wrapped in an `Array` right after, which frees it
    // on drop. The input handles stay alive (borrowed from `q` and `caches`)
    // for the whole call; the op keeps its own references.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_decode_attention(
            &mut out,
            q.as_ptr(),
            keys.as_ptr(),
            values.as_ptr(),
            positions.as_ptr(),
            rows as i32,
            scale,
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(
            "decode attention: the batched op rejected its inputs (shapes, dtypes or positions)",
        )
        .into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{fast, ops, transforms::eval};

    /// Against MLX's own SDPA over the same caches, for rows of different
    /// lengths, grouped-query heads, float32 and float16.
    #[test]
    fn matches_per_row_sdpa() -> Result<()> {
        use mlx_rs::ops::indexing::IndexOp;
        let (h, hkv, d, cap) = (6, 2, 8, 16);
        let positions = [0i32, 5, 15];
        let rows = positions.len() as i32;
        mlx_rs::random::seed(3)?;
        for (dtype, tol) in [
            (mlx_rs::Dtype::Float32, 1e-5f32),
            (mlx_rs::Dtype::Float16, 2e-3),
        ] {
            let q = mlx_rs::random::normal::<f32>(&[rows, h, 1, d], None, None, None)?
                .as_dtype(dtype)?;
            let caches: Vec<(Array, Array)> = (0..rows)
                .map(|_| {
                    Ok((
                        mlx_rs::random::normal::<f32>(&[1, hkv, cap, d], None, None, None)?
                            .as_dtype(dtype)?,
                        mlx_rs::random::normal::<f32>(&[1, hkv, cap, d], None, None, None)?
                            .as_dtype(dtype)?,
                    ))
                })
                .collect::<Result<_>>()?;
            let out = decode_attention(&q, &caches, &positions, 0.3)?;
            eval([&out])?;
            for (r, &p) in positions.iter().enumerate() {
                let (kc, vc) = &caches[r];
                let r = r as i32;
                let want = fast::scaled_dot_product_attention(
                    q.index(r..r + 1).as_dtype(mlx_rs::Dtype::Float32)?,
                    kc.index((.., .., ..p + 1, ..))
                        .as_dtype(mlx_rs::Dtype::Float32)?,
                    vc.index((.., .., ..p + 1, ..))
                        .as_dtype(mlx_rs::Dtype::Float32)?,
                    0.3,
                    None,
                    None,
                )?;
                let got = out.index(r..r + 1).as_dtype(mlx_rs::Dtype::Float32)?;
                let err = ops::abs(&ops::subtract(&got, &want)?)?
                    .max(None)?
                    .item_exact::<f32>();
                assert!(err < tol, "{dtype:?} row {r}: max error {err}");
            }
        }
        Ok(())
    }
}
