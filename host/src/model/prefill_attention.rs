//! Causal attention of a prefill chunk over one row's KV cache on the CPU:
//! one MLX op per layer (`mlxhost_prefill_attention`, a CPU primitive in
//! `host/mlx-sys/native/prefill_attention.cpp`), tiled with an online
//! softmax so the `[H, T, L]` float32 scores are never materialised, with
//! 16-lane exponentials. MLX's CPU `scaled_dot_product_attention` writes
//! and rereads those scores (545 MB per layer for a 512-token chunk of
//! Qwen2.5-0.5B at a 19k-token offset) and exponentiates one lane at a
//! time, which made long prompts prefill at a third of short ones' speed.
//!
//! Chosen on the CPU backend where the CPU has AVX-512F, for float32
//! full-attention layers whose head dimension is a multiple of 16, unless
//! `MLXHOST_PREFILL_ATTENTION=mlx` (a benchmarking switch). Elsewhere MLX's
//! SDPA runs.

use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array, Dtype};

use super::error::Result;

/// Whether prefill chunks attend through the op (CPU backend with
/// AVX-512F, not switched off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        // SAFETY: a pure query of the CPU's features.
        let available = unsafe { mlx_sys::mlxhost_prefill_attention_available() } == 1;
        available
            && !crate::runtime::gpu_available()
            && std::env::var("MLXHOST_PREFILL_ATTENTION").as_deref() != Ok("mlx")
    })
}

/// Whether a chunk with these operands can use the op.
pub fn applies(q: &Array, keys: &Array) -> bool {
    let d = q.shape().last().copied().unwrap_or(0);
    enabled() && q.dtype() == Dtype::Float32 && keys.dtype() == Dtype::Float32 && d % 16 == 0
}

/// The operands' precision of [`prefill_attention_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPrecision {
    /// The process's choice: bfloat16 where prefill products are bfloat16
    /// (GGUF K-quants on a CPU with AMX, see
    /// [`super::cpu_quant::set_low_precision_prefill`]), else float32;
    /// `MLXHOST_PREFILL_ATTENTION=f32|bf16` overrides.
    Default,
    /// float32 throughout (16-lane FMAs).
    Float32,
    /// q, k, v and the probabilities rounded to bfloat16 (relative error
    /// <= 2^-9 each), float32 scores, softmax and sums, on AMX tiles
    /// (`native/prefill_attention_amx.cpp`); float32 on CPUs without AMX or
    /// where D is not a multiple of 32.
    Bfloat16,
}

/// Attention of `q: [1, H, T, D]` (RoPE applied) over `keys`/`values: [1,
/// H_kv, offset + T, D]` (the cache's valid positions, this chunk's
/// included): query i sees keys `[0, offset + i]`, weights
/// `softmax(scale · q kᵀ)`. Returns `[T, H · D]` float32, token-major
/// (lazy).
///
/// Errors: shapes or dtypes the op does not take (see [`applies`]).
pub fn prefill_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    offset: usize,
    scale: f32,
) -> Result<Array> {
    prefill_attention_with(q, keys, values, offset, scale, AttentionPrecision::Default)
}

/// As [`prefill_attention`], with the operands' precision named.
pub fn prefill_attention_with(
    q: &Array,
    keys: &Array,
    values: &Array,
    offset: usize,
    scale: f32,
    precision: AttentionPrecision,
) -> Result<Array> {
    // SAFETY: `mlx_array_new` makes an empty handle the call fills (or
    // leaves empty); it is wrapped right after, which frees it on drop. The
    // input handles are borrowed for the call; the op keeps references.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_prefill_attention(
            &mut out,
            q.as_ptr(),
            keys.as_ptr(),
            values.as_ptr(),
            offset as i32,
            scale,
            match precision {
                AttentionPrecision::Default => 0,
                AttentionPrecision::Float32 => 1,
                AttentionPrecision::Bfloat16 => 2,
            },
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "prefill attention: the op rejected q {:?} over keys {:?} at offset {offset}",
            q.shape(),
            keys.shape()
        ))
        .into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
    use mlx_rs::ops::{self, indexing::IndexOp};

    /// MLX's SDPA over the same keys: causal from `offset` (the chunk's
    /// queries see every cached key and the chunk's keys up to their own).
    fn reference(q: &Array, k: &Array, v: &Array, offset: usize, scale: f32) -> Array {
        let t = q.shape()[2];
        let l = k.shape()[2];
        // Query i (position offset + i) sees key j iff j <= offset + i.
        let rows = ops::arange::<_, i32>(offset as i32, offset as i32 + t, None)
            .unwrap()
            .reshape(&[t, 1])
            .unwrap();
        let cols = ops::arange::<_, i32>(0, l, None)
            .unwrap()
            .reshape(&[1, l])
            .unwrap();
        let mask = ops::ge(&rows, &cols).unwrap();
        let o = fast::scaled_dot_product_attention(
            q,
            k,
            v,
            scale,
            ScaledDotProductAttentionMask::Array(&mask),
            None,
        )
        .unwrap();
        let (h, d) = (q.shape()[1], q.shape()[3]);
        o.transpose_axes(&[0, 2, 1, 3])
            .unwrap()
            .reshape(&[t, h * d])
            .unwrap()
    }

    /// (H, H_kv, D, T, offset): grouped heads, D 16 to 128, chunks that are
    /// and are not multiples of the query blocks (16, 32) and 64-key tiles,
    /// offsets inside and at the edge of a tile, and a first chunk.
    const CASES: &[(i32, i32, i32, i32, usize)] = &[
        (14, 2, 64, 37, 0),
        (14, 2, 64, 64, 64),
        (9, 3, 64, 100, 131),
        (4, 4, 128, 17, 250),
        (12, 2, 128, 1, 5),
        (12, 2, 128, 200, 70),
        (2, 1, 16, 300, 1000),
        (2, 1, 32, 300, 1000),
    ];

    /// Random q `[1, H, T, D]` and keys and values `[1, H_kv, offset + T, D]`.
    fn operands(h: i32, hkv: i32, d: i32, t: i32, offset: usize) -> Result<(Array, Array, Array)> {
        let kv = [1, hkv, offset as i32 + t, d];
        Ok((
            mlx_rs::random::normal::<f32>(&[1, h, t, d], None, None, None)?,
            mlx_rs::random::normal::<f32>(&kv, None, None, None)?,
            mlx_rs::random::normal::<f32>(&kv, None, None, None)?,
        ))
    }

    #[test]
    fn matches_mlx_sdpa_across_offsets_heads_and_tiles() -> Result<()> {
        if !enabled() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return Ok(());
        }
        mlx_rs::random::seed(7)?;
        for &(h, hkv, d, t, offset) in CASES {
            let (q, k, v) = operands(h, hkv, d, t, offset)?;
            // Large scores test the running max's rescaling.
            let scale = 2.0 / (d as f32).sqrt();
            let got =
                prefill_attention_with(&q, &k, &v, offset, scale, AttentionPrecision::Float32)?;
            let want = reference(&q, &k, &v, offset, scale);
            let diff = ops::abs(&ops::subtract(&got, &want)?)?
                .max(None)?
                .item_exact::<f32>();
            assert!(
                diff < 1e-4,
                "(h {h}, kv {hkv}, d {d}, t {t}, offset {offset}): max diff {diff}"
            );
        }
        Ok(())
    }

    /// The AMX kernel: within bfloat16 probabilities' rounding of MLX's
    /// SDPA over the same q and k and bfloat16-rounded v, and within that
    /// rounding of the float32 result, across the shapes above
    /// (D 64 and 128; 32-query blocks and 64-key tiles cut anywhere).
    #[test]
    fn bfloat16_kernel_is_sdpa_over_rounded_operands() -> Result<()> {
        if !enabled() || !super::super::cpu_quant::amx_available() {
            eprintln!("skipped: this CPU has no AMX-BF16");
            return Ok(());
        }
        mlx_rs::random::seed(8)?;
        let bf = |a: &Array| -> Result<Array> {
            Ok(a.as_dtype(Dtype::Bfloat16)?.as_dtype(Dtype::Float32)?)
        };
        // The AMX kernel takes D a multiple of 32 (others run in float32).
        for &(h, hkv, d, t, offset) in CASES.iter().filter(|c| c.2 % 32 == 0) {
            let (q, k, v) = operands(h, hkv, d, t, offset)?;
            let scale = 2.0 / (d as f32).sqrt();
            let got =
                prefill_attention_with(&q, &k, &v, offset, scale, AttentionPrecision::Bfloat16)?;
            // q and k keep ~16 bits (split into two bfloat16 parts); v is
            // rounded to one.
            let rounded = reference(&q, &k, &bf(&v)?, offset, scale);
            let exact = reference(&q, &k, &v, offset, scale);
            let max = |a: &Array, b: &Array| -> Result<f32> {
                Ok(ops::abs(&ops::subtract(a, b)?)?
                    .max(None)?
                    .item_exact::<f32>())
            };
            let (to_rounded, to_exact) = (max(&got, &rounded)?, max(&got, &exact)?);
            let case = format!("(h {h}, kv {hkv}, d {d}, t {t}, offset {offset})");
            assert!(
                to_rounded < 1e-2,
                "{case}: {to_rounded} from SDPA on rounded values"
            );
            assert!(to_exact < 2e-2, "{case}: {to_exact} from float32 SDPA");
            assert!(to_exact > 1e-5, "{case}: suspiciously exact ({to_exact})");
        }
        Ok(())
    }

    #[test]
    fn reads_a_cache_buffer_view_and_strided_queries() -> Result<()> {
        if !enabled() {
            return Ok(());
        }
        // Keys as a prefix view of a larger buffer (the KV cache's capacity),
        // q as a transposed view (as the head split leaves it).
        let (h, hkv, d, t, offset) = (6, 2, 64, 20, 30);
        let buf_k = mlx_rs::random::normal::<f32>(&[1, hkv, 256, d], None, None, None)?;
        let buf_v = mlx_rs::random::normal::<f32>(&[1, hkv, 256, d], None, None, None)?;
        let l = offset as i32 + t;
        let k = buf_k.index((.., .., ..l, ..));
        let v = buf_v.index((.., .., ..l, ..));
        let q = mlx_rs::random::normal::<f32>(&[1, t, h, d], None, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let got = prefill_attention(&q, &k, &v, offset, 0.125)?;
        let want = reference(&q, &k, &v, offset, 0.125);
        let diff = ops::abs(&ops::subtract(&got, &want)?)?
            .max(None)?
            .item_exact::<f32>();
        assert!(diff < 1e-4, "max diff {diff}");
        Ok(())
    }

    #[test]
    fn rejects_what_it_cannot_take() {
        if !enabled() {
            return;
        }
        let q = ops::zeros::<f32>(&[1, 4, 3, 24]).unwrap(); // D not a multiple of 16
        let k = ops::zeros::<f32>(&[1, 2, 3, 24]).unwrap();
        assert!(prefill_attention(&q, &k, &k, 0, 1.0).is_err());
        let q = ops::zeros::<f32>(&[1, 4, 3, 16]).unwrap();
        let k = ops::zeros::<f32>(&[1, 2, 5, 16]).unwrap(); // offset + T != 5
        assert!(prefill_attention(&q, &k, &k, 0, 1.0).is_err());
    }
}
