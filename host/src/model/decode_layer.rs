//! A whole decoder layer for the rows of a step that all decode one token,
//! as one MLX op (`mlxhost_decode_layer`, a CPU primitive in
//! `host/mlx-sys/native/decode_layer.cpp`): RMSNorm, the fused q/k/v
//! product, RoPE, the in-place cache write, attention, the output
//! projection, RMSNorm, gate/up, SiLU and down, with the matrix products
//! on our quantized kernel ([`super::cpu_quant`]).
//!
//! Why: MLX's CPU backend costs tens of microseconds per op and a decode
//! layer through MLX ops is about 25 ops; from 4-bit weights that overhead
//! was larger than the products themselves (SmolLM2: ~25 of ~40 ms per
//! token). The op keeps the math of [`super::Llama::forward_ids`] (the tests
//! compare both paths) and the cache contract of
//! [`super::decode_attention`]: a decoding row owns its KV buffers.
//!
//! Chosen when every row of the step decodes one token, the model runs the
//! quantized compute path on the CPU backend, every linear of the layer is
//! quantized in a layout the kernel computes, q/k/v and gate/up are fused,
//! and `MLXHOST_DECODE_LAYER` is not `mlx` (a benchmarking switch back to
//! the per-op graph).

use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array, Dtype};

use super::config::QuantSpec;
use super::cpu_quant;
use super::decode_attention::call_row_cache_op;
use super::error::Result;
use super::linear::Linear;
use super::llama::{Layer, Mlp, Projections};
use super::lora::PackedPair;
use crate::cache::KvQuant;

/// Whether the fused op may be used at all (CPU backend, kernels on, not
/// switched off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        cpu_quant::enabled()
            && super::decode_attention::enabled()
            && std::env::var("MLXHOST_DECODE_LAYER").as_deref() != Ok("mlx")
    })
}

/// A layer's tensors in the op's order, when the op can compute it.
#[derive(Debug, Clone)]
pub struct FusedLayer {
    /// input norm, post-attention norm, then weight/scales/biases of qkv,
    /// o, gate_up, down, then the q/k/v bias (zeros when the layer has
    /// none): 15 arrays.
    tensors: Vec<Array>,
    bits: [i32; 4],
    groups: [i32; 4],
    /// Per product: the weight is in the packed layout ([`Linear::Packed`];
    /// its scales/biases slots hold empty placeholders), and that layout's
    /// scales are float16.
    packed: [i32; 4],
    f16: [i32; 4],
    /// The MLP width.
    intermediate: i32,
}

impl FusedLayer {
    /// The layer's tensors when every linear is a float32-scaled quantized
    /// weight the kernel computes, or a packed one, and q/k/v and gate/up
    /// are fused; `None`
    /// otherwise (the layer then runs through MLX ops; so does a
    /// mixture-of-experts layer, which the op has no router for).
    pub fn of(layer: &Layer) -> Option<FusedLayer> {
        let fused = |p: &Projections| match p {
            Projections::Fused(lin, _) => Some(lin.clone()),
            Projections::Separate(_) => None,
        };
        let Mlp::Dense(mlp) = &layer.mlp else {
            return None;
        };
        let linears = [
            fused(&layer.qkv)?,
            layer.o_proj.clone(),
            fused(&mlp.gate_up)?,
            mlp.down_proj.clone(),
        ];
        if layer.input_norm.dtype() != Dtype::Float32
            || layer.post_attention_norm.dtype() != Dtype::Float32
        {
            return None;
        }
        let mut tensors = vec![layer.input_norm.clone(), layer.post_attention_norm.clone()];
        let mut bits = [0; 4];
        let mut groups = [0; 4];
        let mut packed = [0; 4];
        let mut f16 = [0; 4];
        for (i, lin) in linears.iter().enumerate() {
            let spec = match lin {
                Linear::Quantized {
                    weight,
                    scales,
                    biases,
                    spec,
                } if cpu_quant::supports(*spec) && scales.dtype() == Dtype::Float32 => {
                    tensors.extend([weight.clone(), scales.clone(), biases.clone()]);
                    *spec
                }
                Linear::Packed {
                    packed: p,
                    spec,
                    f16: half,
                    ..
                } => {
                    let empty = Array::zeros::<f32>(&[0]).ok()?;
                    tensors.extend([p.clone(), empty.clone(), empty]);
                    packed[i] = 1;
                    f16[i] = i32::from(*half);
                    *spec
                }
                _ => return None,
            };
            let QuantSpec {
                bits: b,
                group_size,
            } = spec;
            bits[i] = b;
            groups[i] = group_size;
        }
        // The op has no per-head q/k norm (Qwen3): such layers decode
        // through MLX ops.
        if layer.q_norm.is_some() || layer.k_norm.is_some() {
            return None;
        }
        let qkv_width = linears[0].out_features();
        let bias = match &layer.qkv_bias {
            Some(b) if b.dtype() == Dtype::Float32 && b.shape() == [qkv_width] => b.clone(),
            Some(_) => return None,
            None => Array::zeros::<f32>(&[qkv_width]).ok()?,
        };
        tensors.push(bias);
        Some(FusedLayer {
            tensors,
            bits,
            groups,
            packed,
            f16,
            intermediate: linears[2].out_features() / 2,
        })
    }
}

/// Attention and MLP hyper-parameters the op needs.
#[derive(Debug, Clone, Copy)]
pub struct LayerShape {
    /// Query heads.
    pub heads: i32,
    /// KV heads (grouped-query attention: `heads % kv_heads == 0`).
    pub kv_heads: i32,
    /// Head width `D` (even).
    pub head_dim: i32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE base (half-split RoPE, no scaling).
    pub rope_theta: f32,
    /// The layer's KV cache scheme (`--kv-bits`; `None`: float32 rows).
    pub kv: Option<KvQuant>,
}

/// The LoRA deltas of one layer's products for the fused op: per adapter
/// of the step its [`PackedPair`]s for q/k/v, o, gate/up and down (`None`:
/// not adapted), and per row the index of its adapter (-1: none).
#[derive(Debug, Clone, Default)]
pub struct FusedLora<'a> {
    /// Per adapter, per product.
    pub adapters: Vec<[Option<&'a PackedPair>; 4]>,
    /// Per row, its adapter, or -1.
    pub rows: Vec<i32>,
}

/// Parts per product the op takes (q, k, v).
const LORA_PARTS: usize = 3;

/// One layer for `R` decode rows: `h [R, E]` float32 (the residual stream),
/// `caches[r]`: row r's key and value buffers `[1, H_kv, capacity, D]`
/// float32, or with `shape.kv` (`--kv-bits`) `[1, H_kv, capacity, P]` uint32
/// packed rows ([`crate::cache::quant`]; the op quantizes the new key and
/// value as MLX's `quantize` does and attends over the packed rows), owned
/// by that row alone, with `positions[r] < capacity`.
/// `kernel`: the products' CPU kernel. Returns `h' [R, E]` and every
/// row's buffers after the write (lazy; the same storage).
///
/// Errors: shapes or dtypes that do not fit.
pub fn decode_layer(
    h: &Array,
    layer: &FusedLayer,
    shape: LayerShape,
    caches: Vec<(Array, Array)>,
    positions: &[i32],
    kernel: cpu_quant::Kernel,
    lora: Option<&FusedLora<'_>>,
) -> Result<(Array, Vec<(Array, Array)>)> {
    let rows = positions.len();
    if caches.len() != rows || h.shape().first() != Some(&(rows as i32)) {
        return Err(Exception::custom(format!(
            "decode layer: {rows} positions, {} caches, h of shape {:?}",
            caches.len(),
            h.shape()
        ))
        .into());
    }
    let weights: Vec<mlx_sys::mlx_array> = layer.tensors.iter().map(|a| a.as_ptr()).collect();
    let keys: Vec<mlx_sys::mlx_array> = caches.iter().map(|(k, _)| k.as_ptr()).collect();
    let values: Vec<mlx_sys::mlx_array> = caches.iter().map(|(_, v)| v.as_ptr()).collect();
    // The op's LoRA tables: per product, per adapter (product-major), the
    // parts' spans and scales; the arrays of the adapted ones in order.
    let adapters = lora.map_or(&[][..], |l| &l.adapters[..]);
    let mut lora_arrays: Vec<mlx_sys::mlx_array> = Vec::new();
    let mut spans: Vec<i32> = Vec::with_capacity(4 * adapters.len() * LORA_PARTS * 4);
    let mut scales: Vec<f32> = Vec::with_capacity(4 * adapters.len() * LORA_PARTS);
    for product in 0..4 {
        for pairs in adapters {
            let pair = pairs[product];
            let parts = pair.map_or(&[][..], |p| &p.parts[..]);
            if parts.len() > LORA_PARTS {
                return Err(Exception::custom(format!(
                    "decode layer: a LoRA slot of {} parts (at most {LORA_PARTS})",
                    parts.len()
                ))
                .into());
            }
            for i in 0..LORA_PARTS {
                match parts.get(i) {
                    Some(p) => {
                        spans.extend([p.rank_offset, p.rank, p.out_offset, p.width]);
                        scales.push(p.scale);
                    }
                    None => {
                        spans.extend([0; 4]);
                        scales.push(0.0);
                    }
                }
            }
            if let Some(p) = pair {
                lora_arrays.extend([p.a.as_ptr(), p.b.as_ptr()]);
            }
        }
    }
    let lora_rows: Vec<i32> = match lora {
        Some(l) if l.rows.len() != rows => {
            return Err(Exception::custom(format!(
                "decode layer: {} LoRA rows for {rows} rows",
                l.rows.len()
            ))
            .into());
        }
        Some(l) => l.rows.clone(),
        None => vec![-1; rows],
    };
    let (status, out, new_k, new_v) = call_row_cache_op(rows, |out, new_k, new_v| {
        // SAFETY: the output handles come from `call_row_cache_op`; the
        // inputs are borrowed for the call's duration.
        unsafe {
            mlx_sys::mlxhost_decode_layer(
                out,
                new_k,
                new_v,
                h.as_ptr(),
                weights.as_ptr(),
                layer.bits.as_ptr(),
                layer.groups.as_ptr(),
                layer.packed.as_ptr(),
                layer.f16.as_ptr(),
                keys.as_ptr(),
                values.as_ptr(),
                positions.as_ptr(),
                lora_arrays.as_ptr(),
                spans.as_ptr(),
                scales.as_ptr(),
                adapters.len() as i32,
                lora_rows.as_ptr(),
                rows as i32,
                shape.heads,
                shape.kv_heads,
                shape.head_dim,
                layer.intermediate,
                shape.eps,
                shape.rope_theta,
                shape.kv.map_or(0, |q| q.bits as i32),
                shape.kv.map_or(0, |q| q.group_size as i32),
                kernel.variant(),
            )
        }
    });
    drop(caches);
    if status != 0 {
        return Err(Exception::custom(
            "decode layer: the fused op rejected its inputs (shapes, dtypes or positions)",
        )
        .into());
    }
    Ok((out, new_k.into_iter().zip(new_v).collect()))
}
