//! Top-k alternatives over the last axis, shared by scoring, generation
//! (`top_logprobs`) and the plugins' `read-top`.

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
