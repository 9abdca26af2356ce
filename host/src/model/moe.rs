//! Sparse mixture-of-experts MLPs: a router picks each token's top-k
//! experts, and only those experts' gated MLPs run on it, their outputs
//! summed with the router's weights. Two architectures' blocks:
//!
//! - Qwen3-MoE (`qwen3_moe`): mlx-lm 0.32.2's `Qwen3MoeSparseMoeBlock`
//!   (`models/qwen3_moe.py`): router logits `x @ gate^T`; softmax in
//!   float32 whatever the activation dtype (`precise`), returned in it; the
//!   top-k by `argpartition`; scores renormalised to sum to 1 when
//!   `norm_topk_prob`; SwiGLU experts.
//! - gpt-oss (`gpt_oss`): its `MLPBlock` (`models/gpt_oss.py`): a router
//!   with a bias; the top-k of the raw logits, then a (precise) softmax over
//!   those k only; experts with biases and `swiglu_oai` (below), stored in
//!   MLX's `mxfp4` mode ([`super::mxfp4`]) by gpt-oss's checkpoints.
//!
//! Both run the experts as mlx-lm's `SwitchGLU` (`models/switch_layers.py`)
//! does, op for op, so the numerics are mlx-lm's: each expert's gate/up/down
//! weights stacked `[experts, out, in]` and multiplied through MLX's
//! `gather_mm` / `gather_qmm`, which read only the chosen experts'
//! matrices. Every token routes on its own, so the rows of a ragged batch
//! packed into one `[N, H]` activation need nothing per row.

use mlx_rs::{
    ops::{self, indexing::IndexOp},
    Array, Dtype,
};

use super::config::QuantSpec;
use super::error::{ModelError, Result};
use super::linear::Linear;
use super::mxfp4;
use super::weights::TensorMap;

/// `SwitchGLU` sorts the (token, expert) pairs by expert when there are at
/// least this many, so each expert's weights are read once for a run of
/// tokens (`do_sort = indices.size >= 64` in mlx-lm).
const SORT_FROM_PAIRS: i32 = 64;

/// One projection of every expert, stacked, with an optional per-expert
/// bias: mlx-lm's `SwitchLinear` (dense) and `QuantizedSwitchLinear` (MLX
/// affine or `mxfp4`). Applied to each token with the experts it was
/// routed to.
#[derive(Debug, Clone)]
pub struct SwitchLinear {
    /// The stacked weights.
    pub weights: ExpertWeights,
    /// `[experts, out]`, added to each expert's product (gpt-oss); `None`
    /// without (Qwen3-MoE).
    pub bias: Option<Array>,
}

/// The stacked `[experts, out, in]` weights of a [`SwitchLinear`].
#[derive(Debug, Clone)]
pub enum ExpertWeights {
    /// `[experts, in, out]` (each expert's weight transposed, contiguous).
    Dense {
        /// The stacked transposed weights.
        weight_t: Array,
    },
    /// MLX affine: `weight [experts, out, in * bits / 32]` uint32-packed,
    /// `scales`/`biases [experts, out, in / group_size]`.
    Quantized {
        /// Packed weights.
        weight: Array,
        /// Per-group scales.
        scales: Array,
        /// Per-group biases.
        biases: Array,
        /// Bits and group size.
        spec: QuantSpec,
    },
    /// MLX `mxfp4`: `weight [experts, out, in / 8]` uint32-packed E2M1
    /// values, `scales [experts, out, in / 32]` uint8 (E8M0).
    Mxfp4 {
        /// Packed weights.
        weight: Array,
        /// Per-group power-of-two scales.
        scales: Array,
        /// The dtype the product is computed in (inputs cast to it, the
        /// output cast back): float32 on the CPU backend, as for affine
        /// weights (see [`Linear::forward_with`]).
        compute: Dtype,
    },
}

impl SwitchLinear {
    /// Reads projection `proj` (`gate_proj`, `up_proj`, `down_proj`) of the
    /// experts of Qwen3-MoE's MLP at `mlp` (`model.layers.N.mlp`) and checks
    /// it holds `experts` `[out_dim, in_dim]` matrices:
    /// `{mlp}.switch_mlp.{proj}.weight` (+ `.scales`, `.biases` when
    /// quantized) as mlx-lm saves a `SwitchLinear`, or, in a Hugging Face
    /// checkpoint, one `{mlp}.experts.{e}.{proj}.weight` per expert, stacked
    /// here as mlx-lm's `sanitize` does.
    ///
    /// Errors: [`ModelError::Tensor`] naming the missing or mis-shaped
    /// tensor.
    pub fn load(
        tensors: &TensorMap,
        mlp: &str,
        proj: &str,
        experts: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<SwitchLinear> {
        let prefix = format!("{mlp}.switch_mlp.{proj}");
        let wname = format!("{prefix}.weight");
        if !tensors.contains_key(&wname)
            && tensors.contains_key(&format!("{mlp}.experts.0.{proj}.weight"))
        {
            let stacked = stack_experts(tensors, mlp, proj, experts, in_dim, out_dim)?;
            return Self::from_weight(tensors, &prefix, &stacked, experts, in_dim, out_dim);
        }
        Self::load_stacked(tensors, &prefix, experts, in_dim, out_dim)
    }

    /// Reads the stacked projection `{prefix}.weight` (+ `.scales`, and
    /// `.biases` for affine quantization; + `.bias`, a `[experts, out_dim]`
    /// per-expert bias, when present) holding `experts` `[out_dim, in_dim]`
    /// matrices. The quantization is inferred from the tensors as mlx-lm
    /// 0.32 does (`infer_quant_config`): uint8 scales and no biases are
    /// `mxfp4`, else affine with the bits and group size the shapes give.
    ///
    /// Errors: [`ModelError::Tensor`] naming the missing or mis-shaped
    /// tensor.
    pub fn load_stacked(
        tensors: &TensorMap,
        prefix: &str,
        experts: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<SwitchLinear> {
        let wname = format!("{prefix}.weight");
        let weight = tensors.get(&wname).ok_or_else(|| ModelError::Tensor {
            name: wname.clone(),
            reason: "missing from the checkpoint".into(),
        })?;
        Self::from_weight(tensors, prefix, weight, experts, in_dim, out_dim)
    }

    /// [`SwitchLinear::load_stacked`] with the weight given (read or
    /// stacked by the caller); the other tensors are read at `prefix`.
    fn from_weight(
        tensors: &TensorMap,
        prefix: &str,
        weight: &Array,
        experts: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<SwitchLinear> {
        let wname = format!("{prefix}.weight");
        let bad = |name: &str, reason: String| ModelError::Tensor {
            name: name.into(),
            reason,
        };
        let bias_name = format!("{prefix}.bias");
        let bias = match tensors.get(&bias_name) {
            Some(b) if b.shape() == [experts as i32, out_dim as i32] => Some(b.clone()),
            Some(b) => {
                return Err(bad(
                    &bias_name,
                    format!(
                        "expected shape [{experts}, {out_dim}], found {:?}",
                        b.shape()
                    ),
                ))
            }
            None => None,
        };
        let shape = weight.shape().to_vec();
        let (e, o) = (experts as i32, out_dim as i32);
        if shape.len() != 3 || shape[..2] != [e, o] {
            return Err(bad(
                &wname,
                format!("expected {experts} experts of {out_dim} rows, found shape {shape:?}"),
            ));
        }
        let sname = format!("{prefix}.scales");
        let Some(scales) = tensors.get(&sname) else {
            if shape[2] as usize != in_dim {
                return Err(bad(
                    &wname,
                    format!("expected shape [{experts}, {out_dim}, {in_dim}], found {shape:?}"),
                ));
            }
            let weights = ExpertWeights::Dense {
                weight_t: weight.swap_axes(1, 2)?.contiguous()?,
            };
            return Ok(SwitchLinear { weights, bias });
        };
        let groups = match scales.shape() {
            [se, so, g] if [*se, *so] == [e, o] => *g as usize,
            other => {
                return Err(bad(
                    &sname,
                    format!("expected [{experts}, {out_dim}, groups], found {other:?}"),
                ))
            }
        };
        let packed = shape[2] as usize;
        let bname = format!("{prefix}.biases");
        let biases = tensors.get(&bname);
        if mxfp4::is_mxfp4(scales, biases) {
            let (group, bits) = (mxfp4::GROUP_SIZE as usize, mxfp4::BITS as usize);
            if groups * group != in_dim || packed * 32 / bits != in_dim {
                return Err(bad(
                    &wname,
                    format!(
                        "uint8 scales without biases are mxfp4 (4 bits, groups of 32), but \
                         packed width {packed} and {groups} groups do not fit input width {in_dim}"
                    ),
                ));
            }
            let weights = ExpertWeights::Mxfp4 {
                weight: weight.clone(),
                scales: scales.clone(),
                compute: Dtype::Float32,
            };
            return Ok(SwitchLinear { weights, bias });
        }
        let biases = biases.ok_or_else(|| {
            bad(
                &bname,
                "missing beside the quantized weight's scales (affine quantization)".into(),
            )
        })?;
        if groups == 0 || !in_dim.is_multiple_of(groups) || !(packed * 32).is_multiple_of(in_dim) {
            return Err(bad(
                &wname,
                format!(
                    "cannot infer quantization: packed width {packed}, {groups} groups, input width {in_dim}"
                ),
            ));
        }
        if biases.shape() != scales.shape() {
            return Err(bad(
                &bname,
                format!(
                    "expected the scales' shape {:?}, found {:?}",
                    scales.shape(),
                    biases.shape()
                ),
            ));
        }
        let weights = ExpertWeights::Quantized {
            weight: weight.clone(),
            scales: scales.clone(),
            biases: biases.clone(),
            spec: QuantSpec {
                group_size: (in_dim / groups) as i32,
                bits: (packed * 32 / in_dim) as i32,
            },
        };
        Ok(SwitchLinear { weights, bias })
    }

    /// Dequantizes to dense stacked weights in `dtype` (a cast for dense
    /// ones), dequantizing in float32 as [`Linear::dense_weight`] does; the
    /// bias cast to `dtype`.
    pub fn to_dense(&self, dtype: Dtype) -> Result<SwitchLinear> {
        let dense_t = |w: Array| -> Result<ExpertWeights> {
            Ok(ExpertWeights::Dense {
                weight_t: w.as_dtype(dtype)?.swap_axes(1, 2)?.contiguous()?,
            })
        };
        let weights = match &self.weights {
            ExpertWeights::Dense { weight_t } => ExpertWeights::Dense {
                weight_t: weight_t.as_dtype(dtype)?,
            },
            ExpertWeights::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => dense_t(ops::dequantize(
                weight,
                scales.as_dtype(Dtype::Float32)?,
                &biases.as_dtype(Dtype::Float32)?,
                spec.group_size,
                spec.bits,
            )?)?,
            // Exact in float32: each value is a small float times a power
            // of two.
            ExpertWeights::Mxfp4 { weight, scales, .. } => {
                dense_t(mxfp4::dequantize(weight, scales, Dtype::Float32)?)?
            }
        };
        Ok(SwitchLinear {
            weights,
            bias: self.cast_bias(dtype)?,
        })
    }

    /// Casts the bias to `dtype`; every product is computed in `qdtype`
    /// (the activations cast to it and back): dense weights are cast to it
    /// (MLX's CPU `gather_mm` takes float32 only, where `qdtype` is
    /// float32; on a GPU it is the activation dtype), quantized weights keep
    /// their packed storage (affine scales and biases cast to it; see
    /// [`Linear::cast`]).
    pub fn cast(&self, dtype: Dtype, qdtype: Dtype) -> Result<SwitchLinear> {
        let weights = match &self.weights {
            ExpertWeights::Dense { weight_t } => ExpertWeights::Dense {
                weight_t: weight_t.as_dtype(qdtype)?,
            },
            ExpertWeights::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ExpertWeights::Quantized {
                weight: weight.clone(),
                scales: scales.as_dtype(qdtype)?,
                biases: biases.as_dtype(qdtype)?,
                spec: *spec,
            },
            ExpertWeights::Mxfp4 { weight, scales, .. } => ExpertWeights::Mxfp4 {
                weight: weight.clone(),
                scales: scales.clone(),
                compute: qdtype,
            },
        };
        Ok(SwitchLinear {
            weights,
            bias: self.cast_bias(dtype)?,
        })
    }

    fn cast_bias(&self, dtype: Dtype) -> Result<Option<Array>> {
        Ok(match &self.bias {
            Some(b) => Some(b.as_dtype(dtype)?),
            None => None,
        })
    }

    /// Whether the weights are quantized (affine or `mxfp4`).
    pub fn is_quantized(&self) -> bool {
        !matches!(self.weights, ExpertWeights::Dense { .. })
    }

    /// `x: [..., 1, in]` times the transposed weight of expert
    /// `experts[...]` for each batch position (`experts` broadcast against
    /// `x`'s batch axes), plus that expert's bias -> `[..., 1, out]` in
    /// `x`'s dtype. `sorted`: the experts are in ascending order (a hint
    /// MLX's kernels use).
    pub fn forward(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        // A product runs in its compute dtype (float32 on the CPU backend,
        // whose quantized kernels are far slower in float16 and whose
        // gather_mm takes float32 only) and comes back in x's, as
        // `Linear::forward_with` does.
        let in_dtype = |compute: Dtype| -> Result<Array> {
            Ok(if x.dtype() == compute {
                x.clone()
            } else {
                x.as_dtype(compute)?
            })
        };
        let y = match &self.weights {
            ExpertWeights::Dense { weight_t } => ops::gather_mm(
                &in_dtype(weight_t.dtype())?,
                weight_t,
                None,
                experts,
                sorted,
            )?,
            ExpertWeights::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ops::gather_qmm(
                &in_dtype(scales.dtype())?,
                weight,
                scales,
                biases,
                None,
                experts,
                true,
                spec.group_size,
                spec.bits,
                sorted,
            )?,
            ExpertWeights::Mxfp4 {
                weight,
                scales,
                compute,
            } => mxfp4::gather_qmm(&in_dtype(*compute)?, weight, scales, experts, sorted)?,
        };
        let y = if y.dtype() == x.dtype() {
            y
        } else {
            y.as_dtype(x.dtype())?
        };
        match &self.bias {
            // Each position's expert's bias, `[..., out]` -> `[..., 1, out]`
            // (mlx-lm: `x + expand_dims(bias[indices], -2)`).
            Some(b) => Ok(ops::add(&y, b.take_axis(experts, 0)?.expand_dims(-2)?)?),
            None => Ok(y),
        }
    }

    /// Parameter tensors.
    pub fn tensors(&self) -> Vec<&Array> {
        let mut out = match &self.weights {
            ExpertWeights::Dense { weight_t } => vec![weight_t],
            ExpertWeights::Quantized {
                weight,
                scales,
                biases,
                ..
            } => vec![weight, scales, biases],
            ExpertWeights::Mxfp4 { weight, scales, .. } => vec![weight, scales],
        };
        out.extend(&self.bias);
        out
    }
}

/// A Hugging Face checkpoint's per-expert weights
/// `{mlp}.experts.{e}.{proj}.weight` (`[out_dim, in_dim]` each) stacked
/// into `[experts, out_dim, in_dim]`.
fn stack_experts(
    tensors: &TensorMap,
    mlp: &str,
    proj: &str,
    experts: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<Array> {
    let mut parts = Vec::with_capacity(experts);
    for e in 0..experts {
        let name = format!("{mlp}.experts.{e}.{proj}.weight");
        let w = tensors.get(&name).ok_or_else(|| ModelError::Tensor {
            name: name.clone(),
            reason: "missing from the checkpoint (the other experts' weights are present)".into(),
        })?;
        if w.shape() != [out_dim as i32, in_dim as i32] {
            return Err(ModelError::Tensor {
                name,
                reason: format!(
                    "expected shape [{out_dim}, {in_dim}], found {:?}",
                    w.shape()
                ),
            });
        }
        if tensors.contains_key(&format!("{mlp}.experts.{e}.{proj}.scales")) {
            return Err(ModelError::Tensor {
                name,
                reason: "quantized per-expert weights are not supported; convert the \
                         checkpoint with mlx-lm, which stacks them"
                    .into(),
            });
        }
        parts.push(w);
    }
    Ok(ops::stack(&parts, 0)?)
}

/// How the router's logits become each token's experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Qwen3-MoE: softmax over every expert, the top-k probabilities,
    /// renormalised to sum to 1 when `norm_topk_prob`.
    SoftmaxTopK {
        /// Renormalise the chosen experts' probabilities.
        norm_topk_prob: bool,
    },
    /// gpt-oss: the top-k logits, softmaxed over those k.
    TopKSoftmax,
}

/// The experts' gated activation of the gate and up products.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GateActivation {
    /// `silu(gate) * up` (Qwen3-MoE).
    Silu,
    /// gpt-oss's `swiglu_oai`: `(clip(up, -limit, limit) + 1) * g *
    /// sigmoid(alpha g)` with `g = min(gate, limit)` (mlx-lm's defaults
    /// alpha 1.702, limit 7; mlx-lm ignores Hugging Face's `swiglu_limit`).
    SwigluOai {
        /// Slope inside the sigmoid.
        alpha: f32,
        /// Clipping bound.
        limit: f32,
    },
}

impl GateActivation {
    /// gpt-oss's activation with mlx-lm's constants.
    pub const GPT_OSS: GateActivation = GateActivation::SwigluOai {
        alpha: 1.702,
        limit: 7.0,
    };

    /// The activation of `gate` and `up` (same shape and dtype).
    pub fn apply(self, gate: &Array, up: &Array) -> Result<Array> {
        Ok(match self {
            GateActivation::Silu => ops::multiply(ops::multiply(gate, ops::sigmoid(gate)?)?, up)?,
            GateActivation::SwigluOai { alpha, limit } => {
                // Scalars in the activations' dtype, as mlx-lm's Python
                // floats are (weakly typed).
                let scalar = |v: f32| Array::from_f32(v).as_dtype(gate.dtype());
                let (alpha, limit, neg, one) = (
                    scalar(alpha)?,
                    scalar(limit)?,
                    scalar(-limit)?,
                    scalar(1.0)?,
                );
                let gate = ops::minimum(gate, &limit)?;
                let up = ops::clip(up, (&neg, &limit))?;
                let glu = ops::multiply(&gate, ops::sigmoid(ops::multiply(&alpha, &gate)?)?)?;
                ops::multiply(ops::add(&up, &one)?, &glu)?
            }
        })
    }
}

/// The experts of one sparse layer and their router.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// The router: `[experts, H]` (Qwen3-MoE's `mlp.gate`, gpt-oss's
    /// `mlp.router`).
    pub router: Linear,
    /// The router's bias `[experts]` (gpt-oss), in the activation dtype.
    pub router_bias: Option<Array>,
    /// Every expert's `gate_proj`, `[experts, I, H]`.
    pub gate_proj: SwitchLinear,
    /// Every expert's `up_proj`, `[experts, I, H]`.
    pub up_proj: SwitchLinear,
    /// Every expert's `down_proj`, `[experts, H, I]`.
    pub down_proj: SwitchLinear,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: i32,
    /// How the router's logits choose and weigh the experts.
    pub routing: Routing,
    /// The experts' activation.
    pub activation: GateActivation,
}

impl SparseMoe {
    /// `x: [N, H]` -> `[N, H]` in `x`'s dtype: each token through its top-k
    /// experts, weighted by the router.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (experts, scores) = self.route(x)?;
        let y = self.experts(x, &experts)?;
        let weighted = ops::multiply(&y, scores.expand_dims(-1)?)?;
        Ok(weighted.sum_axis(-2, false)?.as_dtype(y.dtype())?)
    }

    /// Each token's chosen experts `[N, k]` (uint32, in no particular order)
    /// and their weights `[N, k]` (x's dtype), by [`SparseMoe::routing`].
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let logits = self.router.forward(x)?;
        let logits = match &self.router_bias {
            Some(b) => ops::add(&logits, b)?,
            None => logits,
        };
        let n_experts = logits.shape()[logits.ndim() - 1];
        let first = n_experts - self.top_k;
        let top_k = |a: &Array| -> Result<Array> {
            Ok(ops::argpartition_axis(a, first, -1)?.index((.., first..)))
        };
        match self.routing {
            Routing::SoftmaxTopK { norm_topk_prob } => {
                // Softmax accumulated in float32 (mlx-lm's `precise=True`),
                // so a float16 model routes as mlx-lm's does.
                let probs = ops::softmax_axis(&logits, -1, true)?;
                let experts = top_k(&probs)?;
                let scores = probs.take_along_axis(&experts, -1)?;
                let scores = if norm_topk_prob {
                    ops::divide(&scores, scores.sum_axis(-1, true)?)?
                } else {
                    scores
                };
                Ok((experts, scores))
            }
            Routing::TopKSoftmax => {
                let experts = top_k(&logits)?;
                let chosen = logits.take_along_axis(&experts, -1)?;
                Ok((experts, ops::softmax_axis(&chosen, -1, true)?))
            }
        }
    }

    /// Each token through each of its experts' gated MLPs: `x: [N, H]`,
    /// `experts: [N, k]` -> `[N, k, H]` (mlx-lm's `SwitchGLU`).
    pub fn experts(&self, x: &Array, experts: &Array) -> Result<Array> {
        let (n, h) = (x.shape()[0], x.shape()[1]);
        let k = self.top_k;
        if n * k < SORT_FROM_PAIRS {
            // Each token a batch element `[N, 1, 1, H]`, broadcast against
            // its k experts: `[N, k, 1, out]`.
            let y = self.glu(&x.reshape(&[n, 1, 1, h])?, experts, false)?;
            return Ok(y.reshape(&[n, k, h])?);
        }
        // (token, expert) pairs in expert order, then back in token order.
        let flat = experts.reshape(&[n * k])?;
        let order = ops::argsort_axis(&flat, 0)?;
        let back = ops::argsort_axis(&order, 0)?;
        let tokens = ops::floor_divide(&order, Array::from_slice(&[k as u32], &[1]))?;
        let xs = x.take_axis(&tokens, 0)?.reshape(&[n * k, 1, h])?;
        let y = self.glu(&xs, &flat.take_axis(&order, 0)?, true)?;
        Ok(y.take_axis(&back, 0)?.reshape(&[n, k, h])?)
    }

    /// `down(activation(gate(x), up(x)))` with each position's expert.
    fn glu(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        let up = self.up_proj.forward(x, experts, sorted)?;
        let gate = self.gate_proj.forward(x, experts, sorted)?;
        let act = self.activation.apply(&gate, &up)?;
        self.down_proj.forward(&act, experts, sorted)
    }

    /// Parameter tensors.
    pub fn tensors(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.router.tensors().into_iter().map(|(_, a)| a).collect();
        out.extend(&self.router_bias);
        for s in [&self.gate_proj, &self.up_proj, &self.down_proj] {
            out.extend(s.tensors());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    const H: i32 = 32;
    const I: i32 = 64;
    const E: i32 = 6;

    /// Normal values times `scale`, from `key`.
    fn normal(shape: &[i32], scale: f32, key: u64) -> Array {
        let k = random::key(key).expect("key");
        random::normal::<f32>(shape, None, scale, &k).expect("normal")
    }

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32)
            .expect("cast")
            .as_slice::<f32>()
            .to_vec()
    }

    /// The expert weights as a checkpoint holds them (`[E, out, in]`).
    fn checkpoint(key: u64) -> TensorMap {
        let mut t = TensorMap::new();
        let p = "model.layers.0.mlp";
        t.insert(format!("{p}.gate.weight"), normal(&[E, H], 0.5, key));
        t.insert(
            format!("{p}.switch_mlp.gate_proj.weight"),
            normal(&[E, I, H], 0.3, key + 1),
        );
        t.insert(
            format!("{p}.switch_mlp.up_proj.weight"),
            normal(&[E, I, H], 0.3, key + 2),
        );
        t.insert(
            format!("{p}.switch_mlp.down_proj.weight"),
            normal(&[E, H, I], 0.3, key + 3),
        );
        t
    }

    fn block(t: &TensorMap, top_k: i32, norm: bool) -> Result<SparseMoe> {
        let p = "model.layers.0.mlp";
        let (h, i, e) = (H as usize, I as usize, E as usize);
        let router = Linear::Dense {
            weight_t: t[&format!("{p}.gate.weight")].t().contiguous()?,
        };
        let sw = |name: &str, in_dim, out_dim| SwitchLinear::load(t, p, name, e, in_dim, out_dim);
        Ok(SparseMoe {
            router,
            router_bias: None,
            gate_proj: sw("gate_proj", h, i)?,
            up_proj: sw("up_proj", h, i)?,
            down_proj: sw("down_proj", i, h)?,
            top_k,
            routing: Routing::SoftmaxTopK {
                norm_topk_prob: norm,
            },
            activation: GateActivation::Silu,
        })
    }

    /// Row `r` of a `[rows, cols]` row-major slice.
    fn row(v: &[f32], r: usize, cols: usize) -> &[f32] {
        &v[r * cols..(r + 1) * cols]
    }

    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    /// Plain routing in f64: (expert, weight) pairs of each token, by expert.
    fn plain_route(
        x: &[f32],
        router: &[f32],
        n: usize,
        k: usize,
        norm: bool,
    ) -> Vec<Vec<(u32, f64)>> {
        let (h, e) = (H as usize, E as usize);
        (0..n)
            .map(|t| {
                let logits: Vec<f64> = (0..e)
                    .map(|j| dot(row(x, t, h), row(router, j, h)))
                    .collect();
                let max = logits.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
                let mut p: Vec<(u32, f64)> = logits
                    .iter()
                    .enumerate()
                    .map(|(j, l)| (j as u32, (l - max).exp() / z))
                    .collect();
                p.sort_by(|a, b| b.1.total_cmp(&a.1));
                p.truncate(k);
                let s: f64 = p.iter().map(|x| x.1).sum();
                if norm {
                    p.iter_mut().for_each(|x| x.1 /= s);
                }
                p.sort_by_key(|x| x.0);
                p
            })
            .collect()
    }

    #[test]
    fn routes_each_token_to_its_top_k_with_renormalised_weights() -> Result<()> {
        let t = checkpoint(1);
        let n = 9usize;
        let x = normal(&[n as i32, H], 1.0, 50);
        let router = values(&t["model.layers.0.mlp.gate.weight"]);
        for (k, norm) in [(2, true), (2, false), (3, true), (1, false)] {
            let moe = block(&t, k, norm)?;
            let (experts, scores) = moe.route(&x)?;
            assert_eq!(experts.shape(), [n as i32, k]);
            let ids = experts.contiguous()?;
            let ids = ids.as_slice::<u32>();
            let w = values(&scores);
            let want = plain_route(&values(&x), &router, n, k as usize, norm);
            for (tok, want) in want.iter().enumerate() {
                let mut got: Vec<(u32, f32)> = (0..k as usize)
                    .map(|j| (ids[tok * k as usize + j], w[tok * k as usize + j]))
                    .collect();
                got.sort_by_key(|x| x.0);
                for ((ge, gw), (we, ww)) in got.iter().zip(want) {
                    assert_eq!(ge, we, "k={k} token {tok}: experts {got:?} vs {want:?}");
                    assert!(
                        (*gw as f64 - ww).abs() < 1e-5,
                        "k={k} token {tok}: {gw} vs {ww}"
                    );
                }
                if norm {
                    let sum: f32 = got.iter().map(|x| x.1).sum();
                    assert!((sum - 1.0).abs() < 1e-5);
                }
            }
        }
        Ok(())
    }

    /// The block's output computed token by token in f64 from the
    /// checkpoint's weights.
    fn plain_forward(t: &TensorMap, x: &[f32], n: usize, k: usize) -> Vec<f64> {
        let p = "model.layers.0.mlp";
        let get = |name: &str| values(&t[&format!("{p}.{name}.weight")]);
        let (router, gate, up, down) = (
            get("gate"),
            get("switch_mlp.gate_proj"),
            get("switch_mlp.up_proj"),
            get("switch_mlp.down_proj"),
        );
        let (h, i) = (H as usize, I as usize);
        let mut out = vec![0f64; n * h];
        for (tok, chosen) in plain_route(x, &router, n, k, true).iter().enumerate() {
            let xt = row(x, tok, h);
            for &(e, w) in chosen {
                let e = e as usize;
                let act: Vec<f32> = (0..i)
                    .map(|r| {
                        let g = dot(xt, row(&gate, e * i + r, h));
                        let u = dot(xt, row(&up, e * i + r, h));
                        (g / (1.0 + (-g).exp()) * u) as f32
                    })
                    .collect();
                for c in 0..h {
                    out[tok * h + c] += w * dot(&act, row(&down, e * h + c, i));
                }
            }
        }
        out
    }

    #[test]
    fn output_is_the_weighted_sum_of_the_chosen_experts() -> Result<()> {
        let t = checkpoint(7);
        // 3 tokens take the unsorted path, 40 (80 pairs) the sorted one.
        for n in [3usize, 40] {
            let x = normal(&[n as i32, H], 1.0, 60 + n as u64);
            let got = values(&block(&t, 2, true)?.forward(&x)?);
            let want = plain_forward(&t, &values(&x), n, 2);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((*g as f64 - w).abs() < 1e-4, "n={n} [{j}]: {g} vs {w}");
            }
        }
        Ok(())
    }

    #[test]
    fn tokens_batched_together_equal_tokens_alone() -> Result<()> {
        // A ragged batch's rows, packed: 1 token, 3 tokens, 36 tokens (the
        // batch sorts its 80 pairs; each row alone takes the other path).
        let t = checkpoint(11);
        let moe = block(&t, 2, true)?;
        let x = normal(&[40, H], 1.0, 70);
        let batched = values(&moe.forward(&x)?);
        let mut alone = Vec::new();
        for (start, end) in [(0, 1), (1, 4), (4, 40)] {
            alone.extend(values(&moe.forward(&x.index(start..end))?));
        }
        for (j, (b, a)) in batched.iter().zip(&alone).enumerate() {
            assert!((b - a).abs() < 1e-5, "[{j}]: batched {b} vs alone {a}");
        }
        // The tokens route to more than two experts between them.
        let (experts, _) = moe.route(&x)?;
        let mut seen = values(&experts);
        seen.sort_by(f32::total_cmp);
        seen.dedup();
        assert!(seen.len() > 2, "experts used: {seen:?}");
        Ok(())
    }

    #[test]
    fn quantized_experts_equal_their_dequantized_weights() -> Result<()> {
        let dense = checkpoint(13);
        let mut quant = dense.clone();
        for name in ["gate_proj", "up_proj", "down_proj"] {
            let p = format!("model.layers.0.mlp.switch_mlp.{name}");
            let (w, s, b) = ops::quantize(&dense[&format!("{p}.weight")], 32, 4)?;
            quant.insert(format!("{p}.weight"), w);
            quant.insert(format!("{p}.scales"), s);
            quant.insert(format!("{p}.biases"), b);
        }
        let q = block(&quant, 2, true)?;
        assert!(q.gate_proj.is_quantized());
        assert!(matches!(
            q.down_proj.weights,
            ExpertWeights::Quantized {
                spec: QuantSpec {
                    group_size: 32,
                    bits: 4
                },
                ..
            }
        ));
        assert_equals_dequantized(&q, 80, "gather_qmm", |a, b| (a - b).abs() < 1e-4)
    }

    /// `q` (quantized experts) against the same block with its experts
    /// dequantized to float32 (`gather_mm`), on 5 and 40 random tokens
    /// (keys `seed + n`): every output within `close(ours, dequantized)`.
    fn assert_equals_dequantized(
        q: &SparseMoe,
        seed: u64,
        what: &str,
        close: impl Fn(f32, f32) -> bool,
    ) -> Result<()> {
        let deq = SparseMoe {
            gate_proj: q.gate_proj.to_dense(Dtype::Float32)?,
            up_proj: q.up_proj.to_dense(Dtype::Float32)?,
            down_proj: q.down_proj.to_dense(Dtype::Float32)?,
            ..q.clone()
        };
        for n in [5, 40] {
            let x = normal(&[n, H], 1.0, seed + n as u64);
            let (a, b) = (values(&q.forward(&x)?), values(&deq.forward(&x)?));
            for (j, (a, b)) in a.iter().zip(&b).enumerate() {
                assert!(close(*a, *b), "n={n} [{j}]: {what} {a} vs gather_mm {b}");
            }
        }
        Ok(())
    }

    #[test]
    fn hugging_face_per_expert_weights_are_stacked() -> Result<()> {
        let t = checkpoint(17);
        let mut hf = TensorMap::new();
        let p = "model.layers.0.mlp";
        hf.insert(
            format!("{p}.gate.weight"),
            t[&format!("{p}.gate.weight")].clone(),
        );
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let w = &t[&format!("{p}.switch_mlp.{proj}.weight")];
            for e in 0..E {
                hf.insert(format!("{p}.experts.{e}.{proj}.weight"), w.index(e));
            }
        }
        let x = normal(&[4, H], 1.0, 90);
        let a = values(&block(&t, 2, true)?.forward(&x)?);
        let b = values(&block(&hf, 2, true)?.forward(&x)?);
        assert_eq!(a, b);
        hf.remove(&format!("{p}.experts.3.up_proj.weight"));
        let msg = block(&hf, 2, true).map(|_| ()).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("{p}.experts.3.up_proj.weight")),
            "{msg}"
        );
        Ok(())
    }

    #[test]
    fn missing_or_misshaped_expert_tensors_are_named() {
        let p = "model.layers.0.mlp.switch_mlp";
        let err = |t: &TensorMap| match block(t, 2, true) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("loaded a broken checkpoint"),
        };
        let mut t = checkpoint(3);
        t.remove(&format!("{p}.up_proj.weight"));
        let msg = err(&t);
        assert!(
            msg.contains(&format!("{p}.up_proj.weight")) && msg.contains("missing"),
            "{msg}"
        );

        let mut t = checkpoint(3);
        t.insert(
            format!("{p}.down_proj.weight"),
            normal(&[E - 1, H, I], 1.0, 1),
        );
        let msg = err(&t);
        assert!(
            msg.contains(&format!("{p}.down_proj.weight")) && msg.contains("experts"),
            "{msg}"
        );

        let mut t = checkpoint(3);
        t.insert(
            format!("{p}.gate_proj.weight"),
            normal(&[E, I, H + 1], 1.0, 1),
        );
        assert!(err(&t).contains(&format!("{p}.gate_proj.weight")));

        let mut t = checkpoint(3);
        let w = format!("{p}.gate_proj.weight");
        let (qw, s, _) = ops::quantize(&t[&w], 32, 4).expect("quantize");
        t.insert(w, qw);
        t.insert(format!("{p}.gate_proj.scales"), s);
        let msg = err(&t);
        assert!(msg.contains(&format!("{p}.gate_proj.biases")), "{msg}");
    }

    /// gpt-oss's block as its checkpoint holds it (`mlp.router` with a
    /// bias, `mlp.experts.{proj}` with per-expert biases), weights wide
    /// enough that `swiglu_oai` clips.
    fn gpt_oss_checkpoint(key: u64) -> TensorMap {
        let mut t = TensorMap::new();
        let p = "model.layers.0.mlp";
        t.insert(format!("{p}.router.weight"), normal(&[E, H], 0.5, key));
        t.insert(format!("{p}.router.bias"), normal(&[E], 0.5, key + 1));
        for (j, (proj, out, inp, scale)) in [
            ("gate_proj", I, H, 1.5),
            ("up_proj", I, H, 1.5),
            ("down_proj", H, I, 0.3),
        ]
        .into_iter()
        .enumerate()
        {
            let k = key + 10 * (j as u64 + 1);
            t.insert(
                format!("{p}.experts.{proj}.weight"),
                normal(&[E, out, inp], scale, k),
            );
            t.insert(
                format!("{p}.experts.{proj}.bias"),
                normal(&[E, out], 1.0, k + 1),
            );
        }
        t
    }

    fn gpt_oss_block(t: &TensorMap, top_k: i32) -> Result<SparseMoe> {
        let p = "model.layers.0.mlp";
        let (h, i, e) = (H as usize, I as usize, E as usize);
        let sw = |proj: &str, in_dim, out_dim| {
            SwitchLinear::load_stacked(t, &format!("{p}.experts.{proj}"), e, in_dim, out_dim)
        };
        Ok(SparseMoe {
            router: Linear::Dense {
                weight_t: t[&format!("{p}.router.weight")].t().contiguous()?,
            },
            router_bias: Some(t[&format!("{p}.router.bias")].clone()),
            gate_proj: sw("gate_proj", h, i)?,
            up_proj: sw("up_proj", h, i)?,
            down_proj: sw("down_proj", i, h)?,
            top_k,
            routing: Routing::TopKSoftmax,
            activation: GateActivation::GPT_OSS,
        })
    }

    /// gpt-oss's block token by token in f64: the top-k router logits
    /// (bias added) softmaxed over those k; each expert's biased gate and
    /// up products through `swiglu_oai`, its biased down product.
    fn plain_gpt_oss(t: &TensorMap, x: &[f32], n: usize, k: usize) -> (Vec<f64>, f64) {
        let p = "model.layers.0.mlp";
        let get = |name: &str| values(&t[&format!("{p}.{name}")]);
        let (router, rbias) = (get("router.weight"), get("router.bias"));
        let w = |proj: &str| {
            (
                get(&format!("experts.{proj}.weight")),
                get(&format!("experts.{proj}.bias")),
            )
        };
        let ((gate, gb), (up, ub), (down, db)) = (w("gate_proj"), w("up_proj"), w("down_proj"));
        let (h, i, e) = (H as usize, I as usize, E as usize);
        let mut out = vec![0f64; n * h];
        let mut clipped = 0usize;
        for tok in 0..n {
            let xt = row(x, tok, h);
            let mut logits: Vec<(usize, f64)> = (0..e)
                .map(|j| (j, dot(xt, row(&router, j, h)) + rbias[j] as f64))
                .collect();
            logits.sort_by(|a, b| b.1.total_cmp(&a.1));
            logits.truncate(k);
            let max = logits[0].1;
            let z: f64 = logits.iter().map(|l| (l.1 - max).exp()).sum();
            for &(ex, l) in &logits {
                let weight = (l - max).exp() / z;
                let act: Vec<f32> = (0..i)
                    .map(|r| {
                        let g = dot(xt, row(&gate, ex * i + r, h)) + gb[ex * i + r] as f64;
                        let u = dot(xt, row(&up, ex * i + r, h)) + ub[ex * i + r] as f64;
                        clipped += usize::from(g > 7.0) + usize::from(u.abs() > 7.0);
                        let (g, u) = (g.min(7.0), u.clamp(-7.0, 7.0));
                        ((u + 1.0) * g / (1.0 + (-1.702 * g).exp())) as f32
                    })
                    .collect();
                for c in 0..h {
                    let d = dot(&act, row(&down, ex * h + c, i)) + db[ex * h + c] as f64;
                    out[tok * h + c] += weight * d;
                }
            }
        }
        (out, clipped as f64 / (2 * n * k * i) as f64)
    }

    #[test]
    fn gpt_oss_block_softmaxes_the_top_k_logits_through_clipped_swiglu() -> Result<()> {
        let t = gpt_oss_checkpoint(21);
        let moe = gpt_oss_block(&t, 4)?;
        // 3 tokens take the unsorted path, 40 (160 pairs) the sorted one.
        for n in [3usize, 40] {
            let x = normal(&[n as i32, H], 1.0, 100 + n as u64);
            let got = values(&moe.forward(&x)?);
            let (want, clipped) = plain_gpt_oss(&t, &values(&x), n, 4);
            assert!(
                clipped > 0.05,
                "n={n}: only {clipped} of the inputs clipped"
            );
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() < 1e-3 * (1.0 + w.abs()),
                    "n={n} [{j}]: {g} vs {w}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn mxfp4_experts_equal_their_dequantized_weights() -> Result<()> {
        let dense = gpt_oss_checkpoint(31);
        let mut quant = dense.clone();
        for name in ["gate_proj", "up_proj", "down_proj"] {
            let p = format!("model.layers.0.mlp.experts.{name}");
            let (w, s) = mxfp4::quantize(&dense[&format!("{p}.weight")])?;
            quant.insert(format!("{p}.weight"), w);
            quant.insert(format!("{p}.scales"), s);
        }
        let q = gpt_oss_block(&quant, 4)?;
        assert!(matches!(q.up_proj.weights, ExpertWeights::Mxfp4 { .. }));
        assert_equals_dequantized(&q, 110, "mxfp4 gather_qmm", |a, b| {
            (a - b).abs() < 1e-3 * (1.0 + b.abs())
        })?;
        // Scales of the wrong width, and a bias of the wrong length, are
        // named.
        let mut bad = quant.clone();
        let s = "model.layers.0.mlp.experts.down_proj.scales";
        bad.insert(s.into(), ops::concatenate(&[&quant[s], &quant[s]], -1)?);
        let msg = gpt_oss_block(&bad, 4).map(|_| ()).unwrap_err().to_string();
        assert!(
            msg.contains("model.layers.0.mlp.experts.down_proj.weight") && msg.contains("mxfp4"),
            "{msg}"
        );
        let mut bad = quant;
        let b = "model.layers.0.mlp.experts.gate_proj.bias";
        bad.insert(b.into(), normal(&[E, I + 1], 1.0, 1));
        let msg = gpt_oss_block(&bad, 4).map(|_| ()).unwrap_err().to_string();
        assert!(msg.contains(b), "{msg}");
        Ok(())
    }

    /// A bfloat16 model's dense experts (the native path) compute in the
    /// product dtype the loader gives them (float32 on the CPU, where MLX's
    /// gather_mm takes nothing else) and hand back bfloat16.
    #[test]
    fn dense_experts_take_low_precision_activations() -> Result<()> {
        let t = gpt_oss_checkpoint(41);
        let f32_block = gpt_oss_block(&t, 4)?;
        let cast = |s: &SwitchLinear| s.cast(Dtype::Bfloat16, Dtype::Float32);
        let bf16_block = SparseMoe {
            gate_proj: cast(&f32_block.gate_proj)?,
            up_proj: cast(&f32_block.up_proj)?,
            down_proj: cast(&f32_block.down_proj)?,
            router_bias: f32_block
                .router_bias
                .as_ref()
                .map(|b| b.as_dtype(Dtype::Bfloat16))
                .transpose()?,
            ..f32_block.clone()
        };
        let x = normal(&[6, H], 1.0, 120);
        let y = bf16_block.forward(&x.as_dtype(Dtype::Bfloat16)?)?;
        assert_eq!(y.dtype(), Dtype::Bfloat16);
        let (got, want) = (values(&y), values(&f32_block.forward(&x)?));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        // bfloat16 keeps 8 bits: a few percent of the output's range.
        assert!(worst < 0.05 * scale, "{worst} of {scale}");
        Ok(())
    }
}
