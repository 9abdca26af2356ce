//! Batched decode attention for the rows of a step that decode one token:
//! one MLX op per layer (`mlxhost_decode_attention`, a CPU primitive in
//! `host/mlx-sys/native/decode_attention.cpp`) writes every row's new key and
//! value into that row's own cache buffer, in place, and attends over it,
//! instead of two `slice_update`s and one `scaled_dot_product_attention` per
//! row (several ops each on the CPU). MLX's CPU backend costs tens of
//! microseconds per op, so at 16 rows x 30 layers the per-row path spent
//! more time in op overhead than in the weights' matrix products.
//!
//! In place is safe because a decoding row owns its cache buffers
//! exclusively: buffers the row allocated itself are its own, and a prompt-
//! cache hit is copied when the row is admitted ([`KvCache::make_exclusive`]).
//!
//! [`KvCache::make_exclusive`]: crate::cache::KvCache::make_exclusive
//!
//! Chosen only on the CPU backend (GPU backends keep MLX's own kernels) and
//! unless `MLXHOST_DECODE_ATTENTION` is `per-row` (a benchmarking switch) or `slab` (the
//! decode slab, `cache::slab`, instead).

use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array};

use super::error::Result;

/// Whether decode rows use the batched op (CPU backend, not switched off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !crate::runtime::gpu_available()
            && !matches!(
                std::env::var("MLXHOST_DECODE_ATTENTION").as_deref(),
                Ok("per-row") | Ok("slab")
            )
    })
}

/// Attention for `R` decode rows. `q: [R, H, 1, D]`, `k`/`v: [R, H_kv, 1,
/// D]` (RoPE applied), `caches[r]`: row r's key and value buffers `[1, H_kv,
/// capacity, D]`, owned by that row alone, with `positions[r] < capacity`
/// (the new token's position). Returns `[R, H, 1, D]` and every row's
/// buffers after the write (lazy; the same storage).
///
/// Errors: shapes or dtypes that do not fit.
pub fn decode_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    caches: Vec<(Array, Array)>,
    positions: &[i32],
    scale: f32,
) -> Result<(Array, Vec<(Array, Array)>)> {
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
    let (status, out, new_k, new_v) = call_row_cache_op(rows, |out, new_k, new_v| {
        // SAFETY: the output handles come from `call_row_cache_op`; the
        // input handles stay alive (borrowed from `q`, `k`, `v` and
        // `caches`) for the whole call; the op keeps its own references.
        unsafe {
            mlx_sys::mlxhost_decode_attention(
                out,
                new_k,
                new_v,
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                keys.as_ptr(),
                values.as_ptr(),
                positions.as_ptr(),
                rows as i32,
                scale,
            )
        }
    });
    // The old handles go; the op's outputs are the buffers from now on.
    drop(caches);
    if status != 0 {
        return Err(Exception::custom(
            "decode attention: the batched op rejected its inputs (shapes, dtypes or positions)",
        )
        .into());
    }
    Ok((out, new_k.into_iter().zip(new_v).collect()))
}

/// [`decode_attention`] over quantized caches (`--kv-bits`): `k`/`v: [R,
/// H_kv, 1, D]` are quantized here (MLX's `quantize`, the numbers every
/// other path stores) and written as packed rows into `caches[r]`: `[1,
/// H_kv, capacity, P]` `uint32` of `quant` ([`crate::cache::quant`]); the
/// op attends by reading the packed rows. Returns `[R, H, 1, D]` and every
/// row's buffers after the write (lazy; the same storage).
///
/// Errors: shapes, dtypes or a scheme that do not fit.
pub fn decode_attention_quantized(
    quant: &crate::cache::KvQuant,
    q: &Array,
    k: &Array,
    v: &Array,
    caches: Vec<(Array, Array)>,
    positions: &[i32],
    scale: f32,
) -> Result<(Array, Vec<(Array, Array)>)> {
    let rows = positions.len();
    if caches.len() != rows || q.shape().first() != Some(&(rows as i32)) {
        return Err(Exception::custom(format!(
            "quantized decode attention: {rows} positions, {} caches, q of shape {:?}",
            caches.len(),
            q.shape()
        ))
        .into());
    }
    let (kp, vp) = (quant.pack(k)?, quant.pack(v)?);
    let keys: Vec<mlx_sys::mlx_array> = caches.iter().map(|(k, _)| k.as_ptr()).collect();
    let values: Vec<mlx_sys::mlx_array> = caches.iter().map(|(_, v)| v.as_ptr()).collect();
    let (status, out, new_k, new_v) = call_row_cache_op(rows, |out, new_k, new_v| {
        // SAFETY: as in `decode_attention`: fresh output handles, inputs
        // borrowed for the whole call.
        unsafe {
            mlx_sys::mlxhost_decode_attention_quant(
                out,
                new_k,
                new_v,
                q.as_ptr(),
                kp.as_ptr(),
                vp.as_ptr(),
                keys.as_ptr(),
                values.as_ptr(),
                positions.as_ptr(),
                rows as i32,
                scale,
                quant.bits as i32,
                quant.group_size as i32,
            )
        }
    });
    drop(caches);
    if status != 0 {
        return Err(Exception::custom(
            "quantized decode attention: the batched op rejected its inputs (shapes, dtypes, scheme or positions)",
        )
        .into());
    }
    Ok((out, new_k.into_iter().zip(new_v).collect()))
}

/// Runs an op of ours that returns one array plus every row's key and value
/// buffers (`call(out, new_keys, new_values)`, given `rows` fresh handles
/// each) and wraps what it filled. Returns the op's status, the array and
/// the rows' keys and values.
pub(super) fn call_row_cache_op(
    rows: usize,
    call: impl FnOnce(*mut mlx_sys::mlx_array, *mut mlx_sys::mlx_array, *mut mlx_sys::mlx_array) -> i32,
) -> (i32, Array, Vec<Array>, Vec<Array>) {
    // SAFETY: `mlx_array_new` makes empty handles that the call fills (or
    // leaves empty); each is wrapped in an `Array` right after, which frees
    // it on drop.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let mut new_k: Vec<_> = (0..rows).map(|_| mlx_sys::mlx_array_new()).collect();
        let mut new_v: Vec<_> = (0..rows).map(|_| mlx_sys::mlx_array_new()).collect();
        let status = call(&mut out, new_k.as_mut_ptr(), new_v.as_mut_ptr());
        let wrap = |handles: Vec<mlx_sys::mlx_array>| -> Vec<Array> {
            handles.into_iter().map(|a| Array::from_ptr(a)).collect()
        };
        (status, Array::from_ptr(out), wrap(new_k), wrap(new_v))
    }
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
            let k = mlx_rs::random::normal::<f32>(&[rows, hkv, 1, d], None, None, None)?
                .as_dtype(dtype)?;
            let v = mlx_rs::random::normal::<f32>(&[rows, hkv, 1, d], None, None, None)?
                .as_dtype(dtype)?;
            eval(caches.iter().flat_map(|(a, b)| [a, b]).chain([&q, &k, &v]))?;
            // What the caches must hold after the write: the per-row path.
            let mut want_caches = Vec::new();
            for (r, &p) in positions.iter().enumerate() {
                use mlx_rs::ops::indexing::TryIndexMutOp;
                let r = r as i32;
                let (mut kc, mut vc) = (
                    caches[r as usize].0.deep_clone(),
                    caches[r as usize].1.deep_clone(),
                );
                kc.try_index_mut((.., .., p..p + 1, ..), k.index(r..r + 1))?;
                vc.try_index_mut((.., .., p..p + 1, ..), v.index(r..r + 1))?;
                eval([&kc, &vc])?;
                want_caches.push((kc, vc));
            }
            let (out, new) = decode_attention(&q, &k, &v, caches, &positions, 0.3)?;
            eval(std::iter::once(&out).chain(new.iter().flat_map(|(a, b)| [a, b])))?;
            for (r, &p) in positions.iter().enumerate() {
                let (kc, vc) = &want_caches[r];
                let (nk, nv) = &new[r];
                let same = |a: &Array, b: &Array| -> Result<f32> {
                    Ok(ops::abs(&ops::subtract(
                        &a.as_dtype(mlx_rs::Dtype::Float32)?,
                        &b.as_dtype(mlx_rs::Dtype::Float32)?,
                    )?)?
                    .max(None)?
                    .item_exact::<f32>())
                };
                assert_eq!(
                    same(nk, kc)?,
                    0.0,
                    "{dtype:?} row {r}: keys written wrongly"
                );
                assert_eq!(
                    same(nv, vc)?,
                    0.0,
                    "{dtype:?} row {r}: values written wrongly"
                );
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
                let err = same(&got, &want)?;
                assert!(err < tol, "{dtype:?} row {r}: max error {err}");
            }
        }
        Ok(())
    }

    /// The quantized op writes MLX's packed rows of the new keys and values
    /// at each row's position and attends like mlx-lm's quantized SDPA
    /// over the same packed caches: short rows, and rows long enough to
    /// be split into several position chunks (merged softmax partials)
    /// with several scale groups per head.
    #[test]
    fn quantized_op_matches_quantized_sdpa() -> Result<()> {
        quantized_op_case(64, 24, &[0, 9, 23], &[32])?;
        quantized_op_case(128, 1200, &[0, 700, 1199], &[32, 64, 128])
    }

    fn quantized_op_case(d: i32, cap: i32, positions: &[i32], groups: &[u32]) -> Result<()> {
        use crate::cache::{quant::quantized_sdpa, KvQuant};
        use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
        // 7 query heads per KV head (Qwen2.5-0.5B's grouping): the kernel's
        // value sums take heads six at a time, so both a full and a partial
        // set of heads run.
        let (h, hkv) = (14, 2);
        let rows = positions.len() as i32;
        mlx_rs::random::seed(4)?;
        let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None);
        for (bits, group) in [8, 4]
            .into_iter()
            .flat_map(|b| groups.iter().map(move |&g| (b, g)))
        {
            let quant = KvQuant::new(bits, group).expect("a scheme");
            let p = quant.row_words(d as usize) as i32;
            let q = normal(&[rows, h, 1, d])?;
            let (k, v) = (normal(&[rows, hkv, 1, d])?, normal(&[rows, hkv, 1, d])?);
            let caches: Vec<(Array, Array)> = (0..rows)
                .map(|_| {
                    Ok((
                        quant.pack(&normal(&[1, hkv, cap, d])?)?,
                        quant.pack(&normal(&[1, hkv, cap, d])?)?,
                    ))
                })
                .collect::<Result<_>>()?;
            eval(caches.iter().flat_map(|(a, b)| [a, b]).chain([&q, &k, &v]))?;
            let mut want = Vec::new();
            for (r, &pos) in positions.iter().enumerate() {
                let ri = r as i32;
                let (mut kc, mut vc) = (caches[r].0.deep_clone(), caches[r].1.deep_clone());
                kc.try_index_mut(
                    (.., .., pos..pos + 1, ..),
                    quant.pack(&k.index(ri..ri + 1))?,
                )?;
                vc.try_index_mut(
                    (.., .., pos..pos + 1, ..),
                    quant.pack(&v.index(ri..ri + 1))?,
                )?;
                let o = quantized_sdpa(
                    &quant,
                    &q.index(ri..ri + 1),
                    &kc.index((.., .., ..pos + 1, ..)),
                    &vc.index((.., .., ..pos + 1, ..)),
                    0.125,
                )?;
                eval([&kc, &vc, &o])?;
                want.push((kc, vc, o));
            }
            let (out, new) =
                decode_attention_quantized(&quant, &q, &k, &v, caches, positions, 0.125)?;
            eval(std::iter::once(&out).chain(new.iter().flat_map(|(a, b)| [a, b])))?;
            for (r, (kc, vc, o)) in want.iter().enumerate() {
                assert_eq!(new[r].0.shape(), &[1, hkv, cap, p]);
                let same = |a: &Array, b: &Array| -> Result<bool> { Ok(a.eq_values(b)?) };
                assert!(
                    same(&new[r].0, kc)?,
                    "{bits} bits row {r}: keys written wrongly"
                );
                assert!(
                    same(&new[r].1, vc)?,
                    "{bits} bits row {r}: values written wrongly"
                );
                let ri = r as i32;
                let err = ops::abs(&ops::subtract(out.index(ri..ri + 1), o)?)?
                    .max(None)?
                    .item_exact::<f32>();
                assert!(
                    err < 2e-5,
                    "{bits} bits, group {group}, row {r}: max error {err}"
                );
            }
        }
        Ok(())
    }
}
