//! Quantized keys and values (`--kv-bits 8|4`, `--kv-group-size`): MLX's
//! affine quantization along the head dimension, as mlx-lm's
//! `QuantizedKVCache` stores them (`mlx_lm/models/cache.py`): per
//! position and head, `D * bits / 32` packed `uint32` words plus one scale
//! and one bias per `group_size` elements.
//!
//! One buffer per layer instead of mlx-lm's three: a position's packed
//! words, scales and biases sit side by side in one `uint32` row
//! (`[1, H_kv, T, P]`, `P = D * bits / 32 + 2 * D / group_size`, scales and
//! biases stored as float32 bit patterns). Positions stay on axis 2, so
//! everything the float cache does with its buffers (grow in steps, write
//! in place, trim, compact, join the prompt cache, save to and restore from
//! the SSD tier) works unchanged on a quantized one, and the CPU decode op
//! reads one contiguous row per position.
//!
//! Values are `scale * q + bias` with `q` in `[0, 2^bits)`; the quantization
//! itself is MLX's `quantize` op (the same numbers mlx-lm stores).

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Dtype};

use crate::model::error::{ModelError, Result};

/// A KV quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvQuant {
    /// Bits per element: 4 or 8.
    pub bits: u32,
    /// Elements sharing one scale and bias, along the head dimension: 32,
    /// 64 or 128.
    pub group_size: u32,
}

/// A scheme the flags cannot make.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvQuantError {
    /// `--kv-bits` other than 4 or 8.
    #[error("--kv-bits {0}: only 8 and 4 are supported")]
    Bits(u32),
    /// `--kv-group-size` other than 32, 64 or 128.
    #[error("--kv-group-size {0}: only 32, 64 and 128 are supported")]
    GroupSize(u32),
    /// The model's head dimension is not a multiple of the group size.
    #[error("--kv-group-size {group_size}: the model's head dimension {head_dim} is not a multiple of it")]
    HeadDim {
        /// The group size asked for.
        group_size: u32,
        /// The model's head dimension.
        head_dim: usize,
    },
}

impl KvQuant {
    /// The scheme for `--kv-bits bits --kv-group-size group_size`.
    ///
    /// Errors: [`KvQuantError`] naming the flag.
    pub fn new(bits: u32, group_size: u32) -> std::result::Result<Self, KvQuantError> {
        if !matches!(bits, 4 | 8) {
            return Err(KvQuantError::Bits(bits));
        }
        if !matches!(group_size, 32 | 64 | 128) {
            return Err(KvQuantError::GroupSize(group_size));
        }
        Ok(KvQuant { bits, group_size })
    }

    /// Checks a model's head dimension against the group size.
    ///
    /// Errors: [`KvQuantError::HeadDim`].
    pub fn check_head_dim(&self, head_dim: usize) -> std::result::Result<(), KvQuantError> {
        if head_dim == 0 || !head_dim.is_multiple_of(self.group_size as usize) {
            return Err(KvQuantError::HeadDim {
                group_size: self.group_size,
                head_dim,
            });
        }
        Ok(())
    }

    /// The scheme's name in cache keys and SSD headers: `q8g64`.
    pub fn name(&self) -> String {
        format!("q{}g{}", self.bits, self.group_size)
    }

    /// `uint32` words of packed values per position and head.
    pub fn packed_words(&self, head_dim: usize) -> usize {
        head_dim * self.bits as usize / 32
    }

    /// Groups (scales, and biases) per position and head.
    pub fn groups(&self, head_dim: usize) -> usize {
        head_dim / self.group_size as usize
    }

    /// `P`: `uint32` words per position and head (packed values, scales,
    /// biases).
    pub fn row_words(&self, head_dim: usize) -> usize {
        self.packed_words(head_dim) + 2 * self.groups(head_dim)
    }

    /// The head dimension `D` whose rows are `row_words` wide (the
    /// inverse of [`KvQuant::row_words`]).
    pub fn head_dim_of(&self, row_words: usize) -> usize {
        let (b, g) = (self.bits as usize, self.group_size as usize);
        row_words * 32 * g / (b * g + 64)
    }

    /// Bytes per cached token per layer of `kv_heads` heads (keys and
    /// values).
    pub fn bytes_per_token(&self, kv_heads: usize, head_dim: usize) -> usize {
        2 * kv_heads * self.row_words(head_dim) * 4
    }

    /// Quantizes `x: [..., D]` (any float dtype) into packed rows
    /// `[..., P]` `uint32` (lazy).
    ///
    /// Errors: MLX errors (`D` not a multiple of the group size).
    pub fn pack(&self, x: &Array) -> Result<Array> {
        let x = x.as_dtype(Dtype::Float32)?;
        let (w, scales, biases) = ops::quantize(&x, self.group_size as i32, self.bits as i32)?;
        Ok(ops::concatenate(
            &[
                w,
                scales.view_dtype(Dtype::Uint32)?,
                biases.view_dtype(Dtype::Uint32)?,
            ],
            -1,
        )?)
    }

    /// Splits packed rows `[..., P]` into MLX's three arrays: packed values
    /// `[..., D * bits / 32]` `uint32`, scales and biases `[..., D /
    /// group_size]` float32 (lazy views; MLX copies them where an op needs
    /// them contiguous).
    ///
    /// Errors: `P` does not fit `head_dim`.
    pub fn split(&self, packed: &Array, head_dim: usize) -> Result<(Array, Array, Array)> {
        let (w, g) = (
            self.packed_words(head_dim) as i32,
            self.groups(head_dim) as i32,
        );
        if packed.shape().last() != Some(&(w + 2 * g)) || packed.dtype() != Dtype::Uint32 {
            return Err(ModelError::Tensor {
                name: "quantized KV".into(),
                reason: format!(
                    "rows of shape {:?} ({:?}) are not {} with head dimension {head_dim}",
                    packed.shape(),
                    packed.dtype(),
                    self.name()
                ),
            });
        }
        let ell = ops::indexing::Ellipsis;
        let words = packed.index((ell, ..w));
        let scales = packed.index((ell, w..w + g)).view_dtype(Dtype::Float32)?;
        let biases = packed.index((ell, w + g..)).view_dtype(Dtype::Float32)?;
        Ok((words, scales, biases))
    }

    /// Packed rows `[..., P]` back to values `[..., D]` in `dtype` (lazy).
    ///
    /// Errors: as [`KvQuant::split`].
    pub fn unpack(&self, packed: &Array, head_dim: usize, dtype: Dtype) -> Result<Array> {
        let (w, s, b) = self.split(packed, head_dim)?;
        Ok(
            ops::dequantize(&w, &s, &b, self.group_size as i32, self.bits as i32)?
                .as_dtype(dtype)?,
        )
    }
}

/// Attention of `q: [1, H, T, D]` over quantized keys and values `[1,
/// H_kv, S, P]` (every key visible to every query: one decode token, or
/// the caller's chunk is not causal), as mlx-lm's
/// `quantized_scaled_dot_product_attention` computes it: two
/// `quantized_matmul`s that read the packed rows as they are, softmax in
/// float32 between them. Returns `[1, H, T, D]` in `q`'s dtype.
///
/// Errors: shapes that do not fit; MLX errors.
pub fn quantized_sdpa(
    quant: &KvQuant,
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
) -> Result<Array> {
    let (heads, t, d) = (q.shape()[1], q.shape()[2], q.shape()[3]);
    let kv_heads = keys.shape()[1];
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ModelError::Tensor {
            name: "quantized attention".into(),
            reason: format!("{heads} query heads over {kv_heads} KV heads"),
        });
    }
    let repeats = heads / kv_heads;
    let (kw, ks, kb) = row_contiguous_on_gpu(quant.split(keys, d as usize)?)?;
    let (vw, vs, vb) = row_contiguous_on_gpu(quant.split(values, d as usize)?)?;
    // Grouped-query heads: [1, H_kv, repeats, T, D] against [1, H_kv, 1, S, _].
    let q5 = ops::multiply(&q.as_dtype(Dtype::Float32)?, Array::from_f32(scale))?
        .reshape(&[1, kv_heads, repeats, t, d])?;
    let expand = |a: Array| -> Result<Array> { Ok(ops::expand_dims(&a, -3)?) };
    let (g, bits) = (quant.group_size as i32, quant.bits as i32);
    let scores = ops::quantized_matmul(&q5, expand(kw)?, expand(ks)?, &expand(kb)?, true, g, bits)?;
    let probs = ops::softmax_axis(&scores, -1, true)?;
    let out = ops::quantized_matmul(
        &probs,
        expand(vw)?,
        expand(vs)?,
        &expand(vb)?,
        false,
        g,
        bits,
    )?;
    Ok(out.reshape(&[1, heads, t, d])?.as_dtype(q.dtype())?)
}

/// The split parts as MLX's CUDA `quantized_matmul` takes them: it runs
/// only on weights, scales and biases whose last two dimensions are
/// row-contiguous, and [`KvQuant::split`]'s views over a packed row are
/// strided, so on a GPU they are copied first (MLX 0.32.2 raises "No
/// implementation for problem shape" otherwise). The CPU's product reads
/// the views as they are.
fn row_contiguous_on_gpu(parts: (Array, Array, Array)) -> Result<(Array, Array, Array)> {
    if !crate::runtime::gpu_available() {
        return Ok(parts);
    }
    let (w, s, b) = parts;
    Ok((w.contiguous()?, s.contiguous()?, b.contiguous()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast;

    fn normal(shape: &[i32]) -> Array {
        mlx_rs::random::normal::<f32>(shape, None, None, None).expect("normal")
    }

    fn max_abs(a: &Array, b: &Array) -> f32 {
        ops::abs(ops::subtract(a, b).expect("sub"))
            .and_then(|x| x.max(None))
            .expect("max")
            .item_exact::<f32>()
    }

    /// The fused decode op's own quantizer (`chunked_attention.cpp`)
    /// writes exactly the rows MLX's `quantize` does ([`KvQuant::pack`]),
    /// so a row's cache holds the same numbers whichever path wrote it:
    /// random rows, a constant one (its scale at the floor) and rows
    /// whose larger edge is negative or positive.
    #[test]
    fn the_fused_ops_quantizer_writes_what_mlx_quantize_does() {
        mlx_rs::random::seed(11).expect("seed");
        let d = 128usize;
        let mut rows: Vec<f32> = normal(&[6, d as i32]).as_slice::<f32>().to_vec();
        rows.extend(std::iter::repeat_n(0.25f32, d));
        rows.extend((0..d).map(|i| -3.0 + i as f32 * 0.01));
        rows.extend((0..d).map(|i| 3.0 - i as f32 * 0.02));
        let n = rows.len() / d;
        for bits in [8, 4] {
            for group in [32, 64, 128] {
                let q = KvQuant::new(bits, group).expect("a scheme");
                let x = Array::from_slice(&rows, &[n as i32, d as i32]);
                let want = q.pack(&x).expect("pack");
                let mut got = vec![0u32; n * q.row_words(d)];
                // SAFETY: `rows` holds n * d floats and `got` n rows of
                // `row_words` words, what the call reads and writes.
                unsafe {
                    mlx_sys::mlxhost_kv_quantize_rows(
                        rows.as_ptr(),
                        n as i32,
                        d as i32,
                        bits as i32,
                        group as i32,
                        got.as_mut_ptr(),
                    );
                }
                assert_eq!(
                    want.as_slice::<u32>(),
                    &got[..],
                    "{bits} bits, group {group}"
                );
            }
        }
    }

    #[test]
    fn flags_outside_the_schemes_are_named() {
        assert_eq!(KvQuant::new(3, 64), Err(KvQuantError::Bits(3)));
        assert_eq!(KvQuant::new(8, 48), Err(KvQuantError::GroupSize(48)));
        let q = KvQuant::new(4, 128).expect("a scheme");
        assert!(q.check_head_dim(64).is_err());
        assert!(q.check_head_dim(256).is_ok());
        assert!(KvQuant::new(8, 64)
            .expect("a scheme")
            .check_head_dim(64)
            .is_ok());
        assert!(KvQuant::new(5, 64)
            .unwrap_err()
            .to_string()
            .contains("--kv-bits"));
    }

    /// Packing keeps exactly MLX's three arrays, and unpacking gives
    /// MLX's dequantized values; the row width is what the docs say.
    #[test]
    fn pack_is_mlx_quantize_side_by_side() -> Result<()> {
        mlx_rs::random::seed(5)?;
        let x = normal(&[1, 2, 7, 64]);
        for (bits, g) in [(8, 64), (4, 64), (4, 32), (8, 32)] {
            let q = KvQuant::new(bits, g).expect("a scheme");
            let packed = q.pack(&x)?;
            assert_eq!(packed.shape(), &[1, 2, 7, q.row_words(64) as i32]);
            let (w, s, b) = ops::quantize(&x, g as i32, bits as i32)?;
            let (w2, s2, b2) = q.split(&packed, 64)?;
            let (wf, wf2) = (w.as_dtype(Dtype::Float32)?, w2.as_dtype(Dtype::Float32)?);
            assert_eq!(max_abs(&wf, &wf2), 0.0);
            assert_eq!(max_abs(&s, &s2), 0.0);
            assert_eq!(max_abs(&b, &b2), 0.0);
            let back = q.unpack(&packed, 64, Dtype::Float32)?;
            let want = ops::dequantize(&w, &s, &b, g as i32, bits as i32)?;
            assert_eq!(max_abs(&back, &want), 0.0);
            // Half a step of the coarsest group bounds the error.
            let err = max_abs(&back, &x);
            let bound = if bits == 8 { 0.05 } else { 0.7 };
            assert!(err < bound, "{bits} bits g{g}: error {err}");
        }
        Ok(())
    }

    /// The quantized attention equals float SDPA over the dequantized keys
    /// and values (the same numbers, read packed).
    #[test]
    fn quantized_sdpa_matches_sdpa_over_dequantized_kv() -> Result<()> {
        mlx_rs::random::seed(9)?;
        let (h, hkv, s, d) = (6, 2, 40, 64);
        let q = normal(&[1, h, 1, d]);
        let (k, v) = (normal(&[1, hkv, s, d]), normal(&[1, hkv, s, d]));
        for bits in [8, 4] {
            let quant = KvQuant::new(bits, 64).expect("a scheme");
            let (kp, vp) = (quant.pack(&k)?, quant.pack(&v)?);
            let got = quantized_sdpa(&quant, &q, &kp, &vp, 0.125)?;
            let want = fast::scaled_dot_product_attention(
                &q,
                quant.unpack(&kp, d as usize, Dtype::Float32)?,
                quant.unpack(&vp, d as usize, Dtype::Float32)?,
                0.125,
                None,
                None,
            )?;
            let err = max_abs(&got, &want);
            assert!(err < 1e-4, "{bits} bits: {err}");
        }
        Ok(())
    }
}
