//! Linear layers and embeddings over dense or MLX-affine-quantized weights.

use mlx_rs::{ops, Array, Dtype};

use super::config::QuantSpec;
use super::cpu_quant;
use super::cuda_qmv;
use super::error::Result;

/// The product through mlxhost's CUDA mat-vec kernel ([`cuda_qmv`]) when
/// `x: [..., K]` has few enough rows and the kernel is preferred for this
/// shape; `None` leaves it to MLX's `quantized_matmul`.
fn cuda_matvec(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<Option<Array>> {
    let shape = x.shape();
    let Some((&k, lead)) = shape.split_last() else {
        return Ok(None);
    };
    let rows: i32 = lead.iter().product();
    if !cuda_qmv::supports(spec, rows, k, x.dtype()) {
        return Ok(None);
    }
    let x2 = x.reshape(&[rows, k])?;
    if !cuda_qmv::prefer(&x2, weight, scales, biases, spec) {
        return Ok(None);
    }
    let y = cuda_qmv::matvec(&x2, weight, scales, biases, spec)?;
    let mut out_shape = lead.to_vec();
    out_shape.push(weight.shape()[0]);
    Ok(Some(y.reshape(&out_shape)?))
}

/// A bias-free linear layer `y = x W^T`, `W: [out, in]`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Dense weight, stored transposed as `[in, out]` (contiguous): with BLAS
    /// on CPU, `x [1, in] @ W^T` on this layout runs ~1.3-1.6x faster than on
    /// a transposed view of `[out, in]` (measured for 576x1536 and the
    /// 576x49152 output head).
    Dense {
        /// `[in, out]`.
        weight_t: Array,
    },
    /// MLX affine-quantized weight (`mx.quantize`): `weight [out, in*bits/32]`
    /// u32-packed, `scales`/`biases [out, in/group_size]`.
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
    /// An MLX affine weight repacked for the CPU's integer kernel
    /// ([`cpu_quant::pack`]: 16 output rows side by side, 24-bit activations
    /// with AVX-512 VNNI). Only built on the quantized CPU path
    /// ([`cpu_quant::packing_enabled`]).
    Packed {
        /// `[ceil(out / 16), bytes per tile]` uint8.
        packed: Array,
        /// Bits and group size.
        spec: QuantSpec,
        /// Output width.
        out: i32,
        /// Input width.
        input: i32,
        /// Scales and biases stored as float16 (lossless) in `packed`.
        f16: bool,
    },
}

impl Linear {
    /// `x: [..., in]` -> `[..., out]`, exact in the compute dtype (on the
    /// CPU, quantized products take the float32 kernel).
    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_with(x, cpu_quant::Kernel::Float)
    }

    /// As [`Linear::forward`], with the CPU kernel for decode-sized
    /// quantized products chosen by the caller ([`cpu_quant::Kernel`]).
    pub fn forward_with(&self, x: &Array, kernel: cpu_quant::Kernel) -> Result<Array> {
        Ok(match self {
            Linear::Dense { weight_t } => ops::matmul(x, weight_t)?,
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => {
                // The product runs in the scales' dtype and comes back in x's:
                // on the CPU backend scales are kept in float32 (MLX's CPU
                // quantized matmul is ~50x slower with float16 inputs,
                // measured: 34 ms vs 0.7 ms for 1536x576, 4-bit), and there
                // our own op computes it (`cpu_quant`).
                let compute = scales.dtype();
                let xc = if x.dtype() == compute {
                    x.clone()
                } else {
                    x.as_dtype(compute)?
                };
                let y = if compute == Dtype::Float32
                    && cpu_quant::enabled()
                    && cpu_quant::supports(*spec)
                {
                    cpu_quant::quantized_matmul(&xc, weight, scales, biases, *spec, kernel)?
                } else if let Some(y) = cuda_matvec(&xc, weight, scales, biases, *spec)? {
                    y
                } else {
                    ops::quantized_matmul(
                        &xc,
                        weight,
                        scales,
                        biases,
                        true,
                        spec.group_size,
                        spec.bits,
                    )?
                };
                if y.dtype() == x.dtype() {
                    y
                } else {
                    y.as_dtype(x.dtype())?
                }
            }
            Linear::Packed {
                packed,
                spec,
                out,
                f16,
                ..
            } => {
                let xc = if x.dtype() == Dtype::Float32 {
                    x.clone()
                } else {
                    x.as_dtype(Dtype::Float32)?
                };
                let y = cpu_quant::packed_matmul(
                    &xc,
                    packed,
                    *out,
                    *spec,
                    *f16,
                    cpu_quant::PackedKernel::Simd,
                )?;
                if y.dtype() == x.dtype() {
                    y
                } else {
                    y.as_dtype(x.dtype())?
                }
            }
        })
    }

    /// This linear repacked for the CPU's integer kernel ([`Linear::Packed`])
    /// when it is quantized with float32 scales in a layout the packed
    /// kernel holds; a clone otherwise.
    pub fn packed(&self) -> Result<Linear> {
        Ok(match self {
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec,
            } if cpu_quant::supports_packed(*spec)
                && scales.dtype() == Dtype::Float32
                && biases.dtype() == Dtype::Float32 =>
            {
                let (packed, f16) = cpu_quant::pack(weight, scales, biases, *spec)?;
                Linear::Packed {
                    packed,
                    spec: *spec,
                    out: weight.shape()[0],
                    input: weight.shape()[1] * 32 / spec.bits,
                    f16,
                }
            }
            other => other.clone(),
        })
    }

    /// This linear as MLX's affine arrays ([`Linear::Quantized`], float32
    /// scales and biases) when it is [`Linear::Packed`]: exactly the codes,
    /// scales and biases that were packed. A clone otherwise.
    ///
    /// Errors: MLX errors.
    pub fn unpacked(&self) -> Result<Linear> {
        Ok(match self {
            Linear::Packed {
                packed,
                spec,
                out,
                input,
                f16,
            } => {
                let (weight, scales, biases) =
                    cpu_quant::unpack(packed, *out, *input, *spec, *f16)?;
                Linear::Quantized {
                    weight,
                    scales,
                    biases,
                    spec: *spec,
                }
            }
            other => other.clone(),
        })
    }

    /// Dequantizes to a dense `[out, in]` weight in `dtype` (no-op cast for
    /// dense weights).
    pub fn to_dense(&self, dtype: Dtype) -> Result<Linear> {
        Ok(Linear::Dense {
            weight_t: self.dense_weight()?.as_dtype(dtype)?.t().contiguous()?,
        })
    }

    /// The weight as a dense `[out, in]` array (dequantized when needed,
    /// in float32: `ops::dequantize` computes in the scales' dtype, and
    /// float16 scales would round every weight to float16).
    pub fn dense_weight(&self) -> Result<Array> {
        Ok(match self {
            Linear::Dense { weight_t } => weight_t.t(),
            // The identity through the op's prefill path (dequantized tiles
            // into BLAS): exactly the float32 weights, `[in, out]`.
            Linear::Packed { input, .. } => {
                self.forward(&Array::eye::<f32>(*input, None, None)?)?.t()
            }
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ops::dequantize(
                weight,
                scales.as_dtype(Dtype::Float32)?,
                &biases.as_dtype(Dtype::Float32)?,
                spec.group_size,
                spec.bits,
            )?,
        })
    }

    /// Casts dense weights to `dtype`; quantized weights keep their packed
    /// storage and get scales/biases in `qdtype`, the dtype their product is
    /// computed in (outputs are cast back to the input's dtype).
    pub fn cast(&self, dtype: Dtype, qdtype: Dtype) -> Result<Linear> {
        Ok(match self {
            Linear::Dense { weight_t } => Linear::Dense {
                weight_t: weight_t.as_dtype(dtype)?,
            },
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => Linear::Quantized {
                weight: weight.clone(),
                scales: scales.as_dtype(qdtype)?,
                biases: biases.as_dtype(qdtype)?,
                spec: *spec,
            },
            // Its products always run in float32 (cast at the boundary).
            Linear::Packed { .. } => self.clone(),
        })
    }

    /// Parameter tensors (`weight_t`, or `weight`, `scales`, `biases`).
    pub fn tensors(&self) -> Vec<(&'static str, &Array)> {
        match self {
            Linear::Dense { weight_t } => vec![("weight_t", weight_t)],
            Linear::Quantized {
                weight,
                scales,
                biases,
                ..
            } => vec![("weight", weight), ("scales", scales), ("biases", biases)],
            Linear::Packed { packed, .. } => vec![("packed", packed)],
        }
    }

    /// Output width.
    pub fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight_t } => weight_t.shape()[1],
            Linear::Quantized { weight, .. } => weight.shape()[0],
            Linear::Packed { out, .. } => *out,
        }
    }

    /// The quantization, if any.
    pub fn quant_spec(&self) -> Option<QuantSpec> {
        match self {
            Linear::Dense { .. } => None,
            Linear::Quantized { spec, .. } | Linear::Packed { spec, .. } => Some(*spec),
        }
    }

    /// One layer computing all of `parts` (same input) side by side: outputs
    /// are concatenated along the last axis, in order. Fewer, larger matrix
    /// products (q/k/v, gate/up) cost less per step than separate ones.
    /// `None` when the parts cannot be fused (mixed kinds or quantizations).
    pub fn fuse(parts: &[Linear]) -> Result<Option<Linear>> {
        if let Some(ws) = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight_t } => Some(weight_t),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
        {
            return Ok(Some(Linear::Dense {
                weight_t: ops::concatenate(&ws, 1)?,
            }));
        }
        // Packed weights are fused before packing (`weights.rs`).
        if parts.iter().any(|p| matches!(p, Linear::Packed { .. })) {
            return Ok(None);
        }
        let mut specs = parts.iter().map(|p| p.quant_spec());
        let first = specs.next().flatten();
        if first.is_none() || !specs.all(|s| s == first) {
            return Ok(None);
        }
        let pick = |i: usize| -> Vec<&Array> {
            parts
                .iter()
                .filter_map(|p| p.tensors().get(i).map(|t| t.1))
                .collect()
        };
        first
            .map(|spec| -> Result<Linear> {
                Ok(Linear::Quantized {
                    weight: ops::concatenate(&pick(0), 0)?,
                    scales: ops::concatenate(&pick(1), 0)?,
                    biases: ops::concatenate(&pick(2), 0)?,
                    spec,
                })
            })
            .transpose()
    }

    /// Bytes of parameter storage.
    pub fn nbytes(&self) -> usize {
        self.tensors().iter().map(|(_, a)| a.nbytes()).sum()
    }
}

/// Token embedding `[V, H]`, also usable as the tied output head.
#[derive(Debug, Clone)]
pub struct Embedding(pub Linear);

impl Embedding {
    /// `ids: [N]` (uint32) -> `[N, H]` rows in `dtype`, dequantized in
    /// `dtype` when quantized (as mlx-lm's `QuantizedEmbedding` does).
    pub fn lookup(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        Ok(match &self.0 {
            Linear::Dense { weight_t } => weight_t.take_axis(ids, 1)?.t().as_dtype(dtype)?,
            Linear::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => ops::dequantize(
                weight.take_axis(ids, 0)?,
                scales.take_axis(ids, 0)?.as_dtype(dtype)?,
                &biases.take_axis(ids, 0)?.as_dtype(dtype)?,
                spec.group_size,
                spec.bits,
            )?,
            Linear::Packed {
                packed,
                spec,
                out,
                input,
                f16,
            } => cpu_quant::packed_rows(ids, packed, *out, *input, *spec, *f16)?.as_dtype(dtype)?,
        })
    }

    /// Tied output head: `x: [..., H]` -> logits `[..., V]`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.0.forward(x)
    }
}
