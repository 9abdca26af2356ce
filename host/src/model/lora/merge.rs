//! `--lora-merge`: one adapter merged into a Llama-family model's weights at
//! load, `W' = W + (A @ B * scale)^T` per adapted product, as mlx-lm's
//! `LoRALinear.fuse` does: a quantized weight is dequantized (float32),
//! the delta added, and quantized again with its own bits and group size
//! (so merged outputs differ from unmerged ones by that rounding); dense
//! weights keep their dtype. In a fused product (q/k/v, gate/up) only the
//! modules the adapter names are merged; the others keep their stored
//! rows exactly, as mlx-lm leaves an unadapted module alone. Every row then
//! runs the adapter at the base model's cost, and no row can run without
//! it.

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Dtype};

use super::{LoraAdapter, LoraError, LoraPair, Slot};
use crate::model::decode_layer::FusedLayer;
use crate::model::error::Result;
use crate::model::linear::Linear;
use crate::model::llama::{Llama, Mlp, Projections};

/// Merges `adapter` into `model`'s weights.
///
/// Errors: MLX errors; an adapter built for another model's layers.
pub fn merge(model: &mut Llama, adapter: &LoraAdapter) -> Result<()> {
    if adapter.layers.len() != model.layers.len() {
        return Err(LoraError::Unsupported(format!(
            "adapter `{}` has {} layers, the model {}",
            adapter.name,
            adapter.layers.len(),
            model.layers.len()
        ))
        .into());
    }
    for (layer, slots) in model.layers.iter_mut().zip(&adapter.layers) {
        if let Some(p) = &slots[Slot::Qkv as usize] {
            layer.qkv = merge_projections(&layer.qkv, p)?;
        }
        if let Some(p) = &slots[Slot::O as usize] {
            layer.o_proj = merge_linear(&layer.o_proj, &delta_t(p)?)?;
        }
        if let Mlp::Dense(mlp) = &mut layer.mlp {
            if let Some(p) = &slots[Slot::GateUp as usize] {
                mlp.gate_up = merge_projections(&mlp.gate_up, p)?;
            }
            if let Some(p) = &slots[Slot::Down as usize] {
                mlp.down_proj = merge_linear(&mlp.down_proj, &delta_t(p)?)?;
            }
        }
    }
    // The fused decode op holds its own references to the weights.
    if model.fused_decode.is_some() {
        model.fused_decode = model.layers.iter().map(FusedLayer::of).collect();
    }
    let params: Vec<&Array> = model.parameters();
    mlx_rs::transforms::eval(params)?;
    Ok(())
}

/// `(A @ B)^T`, `[out, in]` float32 (the scale is in B).
fn delta_t(p: &LoraPair) -> Result<Array> {
    let a = p.a.as_dtype(Dtype::Float32)?;
    let b = p.b.as_dtype(Dtype::Float32)?;
    Ok(ops::matmul(b.t(), a.t())?)
}

fn merge_projections(p: &Projections, pair: &LoraPair) -> Result<Projections> {
    let d = delta_t(pair)?;
    // The slot's modules the adapter adapts, by their first output column.
    let adapted = |start: i32| {
        pair.packed
            .parts
            .iter()
            .any(|part| part.out_offset == start)
    };
    let spans = |widths: &[i32]| -> Vec<(i32, i32, bool)> {
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let span = (start, w, adapted(start));
                start += w;
                span
            })
            .collect()
    };
    Ok(match p {
        Projections::Fused(lin, widths) => {
            Projections::Fused(merge_rows(lin, &d, &spans(widths))?, widths.clone())
        }
        Projections::Separate(parts) => {
            let widths: Vec<i32> = parts.iter().map(Linear::out_features).collect();
            let mut out = Vec::with_capacity(parts.len());
            for (lin, (start, w, adapted)) in parts.iter().zip(spans(&widths)) {
                out.push(if adapted {
                    let rows = Array::from_iter(start..start + w, &[w]);
                    merge_linear(lin, &d.take_axis(&rows, 0)?)?
                } else {
                    lin.clone()
                });
            }
            Projections::Separate(out)
        }
    })
}

/// A fused product `lin` (`spans`: each module's first output row, rows,
/// and whether the adapter adapts it) with `delta [out, in]` merged into
/// the adapted modules' rows. A quantized weight keeps the other modules'
/// rows exactly as stored (codes, scales and biases), as mlx-lm fuses only
/// the modules an adapter names: quantizing already-quantized rows again
/// does not give them back (MLX's affine grid comes from each group's
/// min and max).
fn merge_rows(lin: &Linear, delta: &Array, spans: &[(i32, i32, bool)]) -> Result<Linear> {
    if spans.iter().all(|&(_, _, adapted)| adapted) {
        return merge_linear(lin, delta);
    }
    let base = lin.unpacked()?;
    let merged = merge_linear(&base, delta)?;
    let (
        Linear::Quantized {
            weight,
            scales,
            biases,
            spec,
        },
        Linear::Quantized {
            weight: new_weight,
            scales: new_scales,
            biases: new_biases,
            ..
        },
    ) = (&base, &merged)
    else {
        // Dense: the unadapted rows gained exact zeros.
        return Ok(merged);
    };
    let pick = |kept: &Array, new: &Array| -> Result<Array> {
        let rows: Vec<Array> = spans
            .iter()
            .map(|&(start, w, adapted)| {
                let from = if adapted { new } else { kept };
                from.index(start..start + w)
            })
            .collect();
        Ok(ops::concatenate(&rows, 0)?)
    };
    let spliced = Linear::Quantized {
        weight: pick(weight, new_weight)?,
        scales: pick(scales, new_scales)?,
        biases: pick(biases, new_biases)?,
        spec: *spec,
    };
    match lin {
        Linear::Packed { .. } => spliced.packed(),
        _ => Ok(spliced),
    }
}

/// `lin` with `delta [out, in]` added to its weight, in its own storage.
fn merge_linear(lin: &Linear, delta: &Array) -> Result<Linear> {
    let w = ops::add(&lin.dense_weight()?.as_dtype(Dtype::Float32)?, delta)?;
    Ok(match lin {
        Linear::Dense { weight_t } => Linear::Dense {
            weight_t: w.as_dtype(weight_t.dtype())?.t().contiguous()?,
        },
        Linear::Quantized {
            scales,
            biases,
            spec,
            ..
        } => {
            let (weight, s, b) = ops::quantize(&w, spec.group_size, spec.bits)?;
            Linear::Quantized {
                weight,
                scales: s.as_dtype(scales.dtype())?,
                biases: b.as_dtype(biases.dtype())?,
                spec: *spec,
            }
        }
        Linear::Packed { spec, .. } => {
            let (weight, scales, biases) = ops::quantize(&w, spec.group_size, spec.bits)?;
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec: *spec,
            }
            .packed()?
        }
    })
}
