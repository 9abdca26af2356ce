//! Top-k alternatives over the last axis, shared by scoring, generation
//! (`top_logprobs`) and the plugins' `read-top`; the rows' logsumexp that
//! turns logits into log-probabilities.

use mlx_rs::{
    error::Exception,
    ops::{self, indexing::Ellipsis, indexing::IndexOp},
    Array, Dtype,
};

/// The `k` largest entries of `a` along its last axis (`[..., V]`), lazily:
/// `(ids [..., k] uint32, values [..., k])`, both contiguous, in no
/// particular order (`argpartition`). `k` must be in `1..=V`.
pub fn top_k(a: &Array, k: i32) -> Result<(Array, Array), Exception> {
    let idx = ops::argpartition_axis(&ops::negative(a)?, k - 1, -1)?
        .index((Ellipsis, ..k))
        .contiguous()?;
    let values = a.take_along_axis(&idx, -1)?.contiguous()?;
    Ok((idx.as_dtype(Dtype::Uint32)?, values))
}

/// `log(sum(exp(x)))` of every row of `x: [R, V]`, lazily: `[R, 1]`
/// float32 (log_softmax(x) = x - this).
///
/// On the CPU backend this is mlxhost's op (`mlxhost_logsumexp_rows`,
/// `host/mlx-sys/native/logsumexp.cpp`: MLX's CPU exponentials run one lane
/// at a time on x86, ~15% of a served 8-row decode step over two
/// vocab-wide rows each); elsewhere MLX's `logsumexp`. Same math (max
/// shift, float32 sums), equal to ~1e-6 relative.
///
/// Errors: `x` not 2-D or with no columns.
pub fn logsumexp_rows(x: &Array) -> Result<Array, Exception> {
    if crate::runtime::gpu_available() {
        return x.as_dtype(Dtype::Float32)?.logsumexp_axis(-1, true);
    }
    // SAFETY: `x` is borrowed for the whole call; the op keeps its own
    // reference.
    unsafe {
        crate::native_op::build_one(
            |out| mlx_sys::mlxhost_logsumexp_rows(out, x.as_ptr()),
            || {
                format!(
                    "logsumexp rows: x must be [R, V] with V > 0, got {:?}",
                    x.shape()
                )
            },
        )
    }
}

/// `(id, value)` pairs sorted by value descending, ties by ascending id.
pub fn sorted_pairs(ids: &[u32], values: &[f32]) -> Vec<(u32, f32)> {
    let mut out: Vec<(u32, f32)> = ids.iter().copied().zip(values.iter().copied()).collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logsumexp_rows_matches_mlx() -> Result<(), Exception> {
        // 3 rows of 37 (two full 16-lane blocks and a tail): spread
        // values, a masked entry (-inf) and a row with a large offset.
        let mut v: Vec<f32> = (0..111)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        v[5] = f32::NEG_INFINITY;
        for x in &mut v[74..] {
            *x += 1000.0;
        }
        let x = Array::from_slice(&v, &[3, 37]);
        let ours = logsumexp_rows(&x)?;
        let mlx = x.logsumexp_axis(-1, true)?;
        mlx_rs::transforms::eval([&ours, &mlx])?;
        assert_eq!(ours.shape(), &[3, 1]);
        for (a, b) in ours.as_slice::<f32>().iter().zip(mlx.as_slice::<f32>()) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        let bad = logsumexp_rows(&Array::from_slice(&[1.0f32, 2.0], &[2]));
        assert!(bad.is_err());
        Ok(())
    }

    #[test]
    fn finds_the_largest_per_row_sorted() -> Result<(), Exception> {
        let a = Array::from_slice(&[0.1f32, 0.9, 0.5, 0.7, 0.3, 0.2], &[2, 3]);
        let (ids, vals) = top_k(&a, 2)?;
        mlx_rs::transforms::eval([&ids, &vals])?;
        let (ids, vals) = (ids.as_slice::<u32>(), vals.as_slice::<f32>());
        assert_eq!(
            sorted_pairs(&ids[..2], &vals[..2]),
            vec![(1, 0.9), (2, 0.5)]
        );
        assert_eq!(
            sorted_pairs(&ids[2..], &vals[2..]),
            vec![(0, 0.7), (1, 0.3)]
        );
        Ok(())
    }
}
