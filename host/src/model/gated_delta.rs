//! The gated delta rule (gated DeltaNet's linear attention: Qwen3.5,
//! Qwen3-Next), in the two forms a server needs, plus the causal conv1d
//! in front of it.
//!
//! Per value head, with the state `S: [D_v, D_k]` (float32), a decay
//! `g_t = exp(-exp(A_log) · softplus(a_t + dt_bias))` and a write
//! strength `β_t = sigmoid(b_t)` (mlx-lm 0.32.2's `gated_delta.py`):
//!
//! ```text
//! S ← g_t · S
//! S ← S + β_t (v_t − S k_t) k_tᵀ
//! y_t = S q_t
//! ```
//!
//! - [`recurrent`]: that loop one token at a time, as mlx-lm's
//!   `_gated_delta_step_ops` computes it (decode; every decoding row of a
//!   step at once, `[B, ...]`).
//! - [`chunked`]: the same result for a prompt chunk in blocks of
//!   [`CHUNK`] tokens (the WY form of Yang et al., "Gated Delta Networks",
//!   as Hugging Face's `torch_chunk_gated_delta_rule` and flash-linear-
//!   attention compute it): inside a block, matrix products; across
//!   blocks, one state update each. The block's `(I + A)⁻¹` (`A` strictly
//!   lower triangular, so nilpotent) is the product
//!   `(I − A)(I + A²)(I + A⁴)…`: log₂(block) matrix products instead of a
//!   row-by-row substitution.
//!
//! Queries and keys arrive L2-normalised with the `D_k^-½` readout scale
//! folded into the queries (mlx-lm's `normalize_qk`), so neither form
//! scales anything.

use mlx_rs::{
    ops::{self, indexing::IndexOp},
    Array, Dtype,
};

use super::error::Result;

/// Tokens per block of [`chunked`] (flash-linear-attention's and Hugging
/// Face's choice).
pub const CHUNK: usize = 64;

/// `x · sigmoid(x)`.
pub fn silu(x: &Array) -> Result<Array> {
    Ok(ops::multiply(x, ops::sigmoid(x)?)?)
}

/// The depthwise causal conv1d (`weight: [C, K, 1]`, MLX's `Conv1d`
/// layout with `groups = C`) over `x: [B, T, C]` continuing from `state:
/// [B, K - 1, C]` (the previous `K - 1` inputs; zeros at the start),
/// followed by SiLU. Returns the output `[B, T, C]` and the new state (the
/// last `K - 1` inputs).
pub fn causal_conv(x: &Array, state: &Array, weight: &Array) -> Result<(Array, Array)> {
    let t = x.shape()[1];
    let channels = weight.shape()[0];
    let input = ops::concatenate(&[state, x], 1)?;
    let out = ops::conv1d(&input, weight, 1, 0, 1, channels)?;
    let new_state = input.index((.., t.., ..));
    Ok((silu(&out)?, new_state))
}

/// `log g = -exp(A_log) · softplus(a + dt_bias)` in float32 (`a: [..., H_v]`
/// in the activation dtype; `neg_a: -exp(A_log)`, `[H_v]` float32).
pub fn log_decay(a: &Array, dt_bias: &Array, neg_a: &Array) -> Result<Array> {
    let x = ops::add(a, dt_bias)?;
    let softplus = ops::logaddexp(&x, Array::from_f32(0.0).as_dtype(x.dtype())?)?;
    Ok(ops::multiply(neg_a, softplus.as_dtype(Dtype::Float32)?)?)
}

/// Repeats each of `H_k` heads `H_v / H_k` times along axis `axis`
/// (`[h0, h0, h1, h1, …]`: value head `j` reads key head `j / (H_v /
/// H_k)`, as mlx-lm's `mx.repeat` and its kernels pair them).
pub fn repeat_heads(x: &Array, factor: i32, axis: i32) -> Result<Array> {
    if factor == 1 {
        return Ok(x.clone());
    }
    Ok(Array::repeat_axis::<f32>(x.clone(), factor, axis)?)
}

/// One token of the recurrence for `B` rows at once: `q, k: [B, H, D_k]`,
/// `v: [B, H, D_v]`, `g, beta: [B, H]` (float32 decay, not its log),
/// `state: [B, H, D_v, D_k]` float32. Returns `y: [B, H, D_v]` (float32)
/// and the new state. Op for op mlx-lm's `_gated_delta_step_ops`.
pub fn recurrent(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let decay = g.expand_dims(-1)?.expand_dims(-1)?;
    let state = ops::multiply(state, &decay)?;
    let k_row = k.expand_dims(-2)?;
    let kv_mem = ops::multiply(&state, &k_row)?.sum_axis(-1, false)?;
    let delta = ops::multiply(ops::subtract(v, &kv_mem)?, beta.expand_dims(-1)?)?;
    let state = ops::add(&state, ops::multiply(&k_row, delta.expand_dims(-1)?)?)?;
    let y = ops::multiply(&state, q.expand_dims(-2)?)?.sum_axis(-1, false)?;
    Ok((y, state))
}

/// The recurrence over `T` tokens of one row in blocks of at most
/// [`CHUNK`]: `q, k: [T, H, D_k]`, `v: [T, H, D_v]`, `log_g, beta: [T, H]`
/// (float32 log-decay), `state: [H, D_v, D_k]` float32. Returns `y: [T, H,
/// D_v]` (float32) and the state after the last token.
pub fn chunked(
    q: &Array,
    k: &Array,
    v: &Array,
    log_g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let f32 = Dtype::Float32;
    let t = q.shape()[0];
    let (h, dk, dv) = (q.shape()[1], q.shape()[2], v.shape()[2]);
    let c = t.min(CHUNK as i32);
    let nc = (t + c - 1) / c;
    let pad = nc * c - t;
    // Head-major, padded to whole blocks: a padded token has k = v = β =
    // 0 and log g = 0, so it writes nothing and decays nothing.
    let prep = |x: &Array, width: Option<i32>| -> Result<Array> {
        let x = x.as_dtype(f32)?;
        let x = match width {
            Some(d) => x.transpose_axes(&[1, 0, 2])?.reshape(&[h, t, d])?,
            None => x.transpose_axes(&[1, 0])?,
        };
        let x = if pad > 0 {
            let mut shape = x.shape().to_vec();
            shape[1] = pad;
            ops::concatenate(&[x, ops::zeros::<f32>(&shape)?], 1)?
        } else {
            x
        };
        Ok(match width {
            Some(d) => x.reshape(&[h, nc, c, d])?,
            None => x.reshape(&[h, nc, c])?,
        })
    };
    let q = prep(q, Some(dk))?;
    let k = prep(k, Some(dk))?;
    let v = prep(v, Some(dv))?;
    let beta = prep(beta, None)?;
    // Cumulative log-decay inside each block.
    let cum = ops::cumsum(&prep(log_g, None)?, -1, None, None)?;
    let idx: Vec<i32> = (0..c).collect();
    let row = Array::from_slice(&idx, &[c, 1]);
    let col = Array::from_slice(&idx, &[1, c]);
    let lower = ops::ge(&row, &col)?;
    let strict = ops::gt(&row, &col)?;
    // decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0.
    let diff = ops::subtract(cum.expand_dims(-1)?, cum.expand_dims(-2)?)?;
    let neg_inf = Array::from_f32(f32::NEG_INFINITY);
    let decay = ops::exp(ops::select(&lower, &diff, &neg_inf)?)?;
    let beta_col = beta.expand_dims(-1)?;
    let k_beta = ops::multiply(&k, &beta_col)?;
    let v_beta = ops::multiply(&v, &beta_col)?;
    let k_t = k.swap_axes(-1, -2)?;
    // A = strictly-lower (β k kᵀ ⊙ decay); T = (I + A)⁻¹ = Σ (-A)ⁿ.
    let zero = Array::from_f32(0.0);
    let neg_a = ops::negative(ops::select(
        &strict,
        ops::multiply(ops::matmul(&k_beta, &k_t)?, &decay)?,
        &zero,
    )?)?;
    let eye = ops::eye::<f32>(c, None, None)?;
    let mut inv = ops::add(&eye, &neg_a)?;
    let mut power = neg_a;
    let mut covered = 2;
    while covered < c {
        power = ops::matmul(&power, &power)?;
        inv = ops::add(&inv, ops::matmul(&inv, &power)?)?;
        covered *= 2;
    }
    let u = ops::matmul(&inv, &v_beta)?;
    let w = ops::matmul(
        &inv,
        ops::multiply(&k_beta, ops::exp(&cum)?.expand_dims(-1)?)?,
    )?;
    let attn = ops::multiply(ops::matmul(&q, &k_t)?, &decay)?;
    let q_decayed = ops::multiply(&q, ops::exp(&cum)?.expand_dims(-1)?)?;
    let last = cum.index((.., .., c - 1..c)); // [h, nc, 1]
    let k_to_end = ops::multiply(&k, ops::exp(ops::subtract(&last, &cum)?)?.expand_dims(-1)?)?
        .swap_axes(-1, -2)?; // [h, nc, dk, c]
                             // [h, nc, 1, 1]
    let block_decay = ops::exp(&last)?.expand_dims(-1)?;
    // The state as [h, D_k, D_v] (keys by values) through the blocks.
    let mut s = state.as_dtype(f32)?.swap_axes(-1, -2)?;
    let mut outs = Vec::with_capacity(nc as usize);
    for i in 0..nc {
        let at = |x: &Array| x.index((.., i));
        let v_new = ops::subtract(at(&u), ops::matmul(at(&w), &s)?)?;
        let inter = ops::matmul(at(&q_decayed), &s)?;
        outs.push(ops::add(&inter, ops::matmul(at(&attn), &v_new)?)?);
        s = ops::add(
            ops::multiply(&s, at(&block_decay))?,
            ops::matmul(at(&k_to_end), &v_new)?,
        )?;
    }
    let y = if outs.len() == 1 {
        outs.remove(0)
    } else {
        ops::concatenate(&outs, 1)?
    }; // [h, nc * c, dv]
    let y = y.index((.., ..t, ..)).transpose_axes(&[1, 0, 2])?;
    Ok((y, s.swap_axes(-1, -2)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn normal(shape: &[i32], key: u64) -> Array {
        let k = random::key(key).expect("key");
        random::normal::<f32>(shape, None, 1.0, &k).expect("normal")
    }

    fn l2norm(x: &Array) -> Array {
        let n = ops::sqrt(ops::multiply(x, x).unwrap().sum_axis(-1, true).unwrap()).unwrap();
        ops::divide(x, &n).unwrap()
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        ops::abs(ops::subtract(a, b).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .item_exact::<f32>()
    }

    /// The chunked form over whole blocks, a padded tail and a block
    /// shorter than [`CHUNK`] equals the token-by-token recurrence, from a
    /// zero state and from a state carried in.
    #[test]
    fn chunked_equals_the_recurrence() -> Result<()> {
        let (h, dk, dv) = (3, 16, 8);
        for (t, seed) in [(1, 1), (7, 2), (64, 3), (150, 4)] {
            let q = ops::multiply(l2norm(&normal(&[t, h, dk], seed)), Array::from_f32(0.25))?;
            let k = l2norm(&normal(&[t, h, dk], seed + 10));
            let v = normal(&[t, h, dv], seed + 20);
            let log_g =
                ops::multiply(ops::abs(normal(&[t, h], seed + 30))?, Array::from_f32(-0.3))?;
            let beta = ops::sigmoid(normal(&[t, h], seed + 40))?;
            let s0 = ops::multiply(normal(&[h, dv, dk], seed + 50), Array::from_f32(0.1))?;
            let (y, s) = chunked(&q, &k, &v, &log_g, &beta, &s0)?;
            let g = ops::exp(&log_g)?;
            let mut state = s0.expand_dims(0)?;
            let mut ys = Vec::new();
            for i in 0..t {
                let at = |x: &Array| x.index(i..i + 1);
                let (yi, si) = recurrent(&at(&q), &at(&k), &at(&v), &at(&g), &at(&beta), &state)?;
                ys.push(yi);
                state = si;
            }
            let want = ops::concatenate(&ys, 0)?;
            let dy = max_diff(&y, &want);
            let ds = max_diff(&s, &state.index(0));
            assert!(dy < 1e-4 && ds < 1e-4, "T={t}: y {dy:e}, state {ds:e}");
        }
        Ok(())
    }

    #[test]
    fn conv_carries_its_state_across_calls() -> Result<()> {
        let (c, kk, t) = (6, 4, 9);
        let w = normal(&[c, kk, 1], 5);
        let x = normal(&[1, t, c], 6);
        let zero = ops::zeros::<f32>(&[1, kk - 1, c])?;
        let (whole, end) = causal_conv(&x, &zero, &w)?;
        let (first, mid) = causal_conv(&x.index((.., ..4, ..)), &zero, &w)?;
        let (rest, end2) = causal_conv(&x.index((.., 4.., ..)), &mid, &w)?;
        let split = ops::concatenate(&[first, rest], 1)?;
        assert!(max_diff(&whole, &split) < 1e-6);
        assert!(max_diff(&end, &end2) < 1e-6);
        Ok(())
    }
}
