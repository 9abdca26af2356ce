//! `x @ W^T` from MLX affine 4-bit and 8-bit weights on the CPU, as one MLX
//! op of ours (`mlxhost_quantized_matmul`, a CPU primitive in
//! `host/mlx-sys/native/quantized_matmul.cpp`).
//!
//! Why: decode on the CPU is bound by how many bytes of weights each token
//! streams from memory. The float32 path streams 8x the bytes of 4-bit
//! weights, and MLX's own CPU `quantized_matmul` is slower still (it is a
//! reference loop). The op dequantizes each group of 32 weights in registers
//! (AVX-512 or AVX2 + FMA where present, else a portable loop the compiler
//! vectorizes) and multiplies it with up to 4 rows of `x` at a time, for 1 to 16 rows
//! (decode at every batch size the scheduler uses); more rows (prefill)
//! dequantize L2-sized tiles of W into float32 and run BLAS on them. Work is
//! split over output rows on a pool of `MLXHOST_CPU_THREADS` threads
//! (default: one per core).
//!
//! Chosen only on the CPU backend (GPU backends keep MLX's kernels) and
//! unless `MLXHOST_QUANTIZED_MATMUL=mlx` (a benchmarking switch back to
//! MLX's `quantized_matmul`).

use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array, Dtype};

use super::config::QuantSpec;
use super::error::Result;

/// Whether quantized linears use our op (CPU backend, not switched off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !crate::runtime::gpu_available()
            && std::env::var("MLXHOST_QUANTIZED_MATMUL").as_deref() != Ok("mlx")
    })
}

/// Whether the op computes this quantization: 4 or 8 bits, groups a
/// multiple of 32 elements.
pub fn supports(spec: QuantSpec) -> bool {
    matches!(spec.bits, 4 | 8) && spec.group_size > 0 && spec.group_size % 32 == 0
}

/// Whether this CPU runs the packed layout's SIMD kernel (AVX-512 F/BW/VNNI).
pub fn packed_available() -> bool {
    // SAFETY: a plain query.
    unsafe { mlx_sys::mlxhost_packed_available() != 0 }
}

/// Whether the quantized CPU path repacks linears for [`packed_matmul`]:
/// our op is on, the CPU has AVX-512 VNNI, and `MLXHOST_QUANTIZED_LAYOUT`
/// is not `mlx` (a benchmarking switch back to MLX's layout and the float
/// kernels).
pub fn packing_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        enabled()
            && packed_available()
            && std::env::var("MLXHOST_QUANTIZED_LAYOUT").as_deref() != Ok("mlx")
    })
}

/// Whether the packed layout holds this quantization: 4 or 8 bits, groups
/// of 32, 64 or 128 (integer group sums stay below 2^31).
pub fn supports_packed(spec: QuantSpec) -> bool {
    matches!(spec.bits, 4 | 8) && matches!(spec.group_size, 32 | 64 | 128)
}

/// A linear's weight repacked for [`packed_matmul`] (16 output rows side by
/// side; `native/packed_matmul.cpp`), evaluated now: `weight [N, K * bits /
/// 32]` uint32, `scales`/`biases [N, K / group]` float32. Returns the packed
/// `[ceil(N / 16), bytes per tile]` uint8 array and whether it stores scales
/// and biases as float16 (only when every one is exactly a float16).
///
/// Errors: an unsupported `spec` ([`supports_packed`]) or shapes that do not
/// fit.
pub fn pack(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<(Array, bool)> {
    let mut f16 = 0;
    // SAFETY: as in `quantized_matmul`; `f16` outlives the call.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_pack_quantized(
            &mut out,
            &mut f16,
            weight.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            spec.bits,
            spec.group_size,
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "pack: weight {:?}, scales {:?} ({:?}), {} bits, group {} do not fit the packed layout",
            weight.shape(),
            scales.shape(),
            scales.dtype(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    Ok((out, f16 != 0))
}

/// The inverse of [`pack`], evaluated now: a packed weight of `n` output
/// rows and input width `k` back to MLX's affine `(weight [n, k * bits /
/// 32] uint32, scales, biases [n, k / group] float32)`, exactly (the
/// codes, scales and biases that were packed; `--lora-merge` keeps the
/// rows it does not change this way).
///
/// Errors: an unsupported `spec` or a packed array that does not fit.
pub fn unpack(
    packed: &Array,
    n: i32,
    k: i32,
    spec: QuantSpec,
    f16: bool,
) -> Result<(Array, Array, Array)> {
    // SAFETY: as in `pack`; the three outputs are fresh handles wrapped in
    // `Array`s, which free them.
    let (status, w, s, b) = unsafe {
        let (mut w, mut s, mut b) = (
            mlx_sys::mlx_array_new(),
            mlx_sys::mlx_array_new(),
            mlx_sys::mlx_array_new(),
        );
        let status = mlx_sys::mlxhost_unpack_quantized(
            &mut w,
            &mut s,
            &mut b,
            packed.as_ptr(),
            n,
            k,
            spec.bits,
            spec.group_size,
            i32::from(f16),
        );
        (
            status,
            Array::from_ptr(w),
            Array::from_ptr(s),
            Array::from_ptr(b),
        )
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "unpack: packed {:?} is not a [{n}, {k}] weight of {} bits, group {}",
            packed.shape(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    Ok((w, s, b))
}

/// Which code computes a packed product's decode-sized rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedKernel {
    /// x rounded to 24-bit integers per weight group (three int8 digits),
    /// `vpdpbusd` (AVX-512 VNNI) where the CPU has it, else the portable
    /// loop.
    Simd,
    /// The same arithmetic in portable C++ (tests).
    Portable,
    /// As `Simd`, but products of more than 16 rows (prefill) round x to
    /// int8 per weight group instead of going through BLAS: llama.cpp's
    /// numerics for its K-quants, ~3x the multiply-adds per instruction
    /// (tests name it; `MLXHOST_PREFILL_PRODUCTS=int8` makes `Simd` do it).
    Int8Prefill,
    /// As `Simd`, but products of more than 16 rows round x and the
    /// dequantized weights to bfloat16 and sum in float32 on AMX tiles
    /// (`native/amx_matmul.cpp`), falling back to `Int8Prefill` on CPUs
    /// without AMX-BF16 (tests; `MLXHOST_PREFILL_PRODUCTS=bf16`).
    Bf16Prefill,
}

/// Whether this CPU (and kernel) runs the AMX bfloat16 prefill product.
pub fn amx_available() -> bool {
    // SAFETY: a CPUID query and, once, arch_prctl asking for AMX state.
    unsafe { mlx_sys::mlxhost_amx_available() != 0 }
}

/// Whether prefill-sized packed products (more than 16 rows) may round
/// their inputs: to bfloat16 on AMX (relative error <= 2^-9 per element,
/// float32 sums; ~4x the int8 kernel's speed), else x to int8 per weight
/// group (AVX-512 VNNI), instead of dequantizing tiles into BLAS (exact in
/// float32). The model loader sets it for GGUF K-quant checkpoints, whose
/// parity reference is llama.cpp (itself int8 activations);
/// `MLXHOST_PREFILL_PRODUCTS=float|int8|bf16` overrides. Process-wide: one
/// server serves one model.
pub fn set_low_precision_prefill(on: bool) {
    // SAFETY: stores one integer in the kernels' atomic.
    unsafe { mlx_sys::mlxhost_set_low_precision_prefill(i32::from(on)) }
}

/// `y = x @ W^T` from a packed weight ([`pack`]) of `n` output rows: `x
/// [..., K]` float32 -> `[..., n]` float32 (lazy). Up to
/// [`max_kernel_rows`] rows, x is rounded per weight group to 24-bit
/// integers (`d = max|x| / 8355711`, float32's resolution; the bias term
/// uses x's float sums) and multiplied with integer dot products, so the
/// result equals the float product to ~1e-6 relative; more rows (prefill)
/// dequantize tiles into BLAS, exact in float32.
///
/// Errors: dtypes or shapes that do not fit.
pub fn packed_matmul(
    x: &Array,
    packed: &Array,
    n: i32,
    spec: QuantSpec,
    f16: bool,
    kernel: PackedKernel,
) -> Result<Array> {
    if x.dtype() != Dtype::Float32 {
        return Err(Exception::custom(format!(
            "packed matmul: x must be float32, found {:?}",
            x.dtype()
        ))
        .into());
    }
    // SAFETY: as in `quantized_matmul`.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_packed_matmul(
            &mut out,
            x.as_ptr(),
            packed.as_ptr(),
            n,
            spec.bits,
            spec.group_size,
            i32::from(f16),
            match kernel {
                PackedKernel::Simd => 0,
                PackedKernel::Portable => 1,
                PackedKernel::Int8Prefill => 2,
                PackedKernel::Bf16Prefill => 3,
            },
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "packed matmul: inputs do not fit (x {:?}, packed {:?}, {n} rows, {} bits, group {})",
            x.shape(),
            packed.shape(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    Ok(out)
}

/// `W[ids]`: rows of a packed weight ([`pack`]; `n` rows of width `k`)
/// gathered by id and dequantized to float32 (`s * q + b`, as MLX's
/// `dequantize`): `ids` of any shape -> `[..., k]` (lazy). An id past the
/// table gives a zero row (callers check ids against the vocabulary).
///
/// Errors: shapes that do not fit.
pub fn packed_rows(
    ids: &Array,
    packed: &Array,
    n: i32,
    k: i32,
    spec: QuantSpec,
    f16: bool,
) -> Result<Array> {
    let ids = if ids.dtype() == Dtype::Uint32 {
        ids.clone()
    } else {
        ids.as_dtype(Dtype::Uint32)?
    };
    // SAFETY: as in `quantized_matmul`.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_packed_rows(
            &mut out,
            ids.as_ptr(),
            packed.as_ptr(),
            n,
            k,
            spec.bits,
            spec.group_size,
            i32::from(f16),
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "packed rows: packed {:?} does not fit {n} rows of {k} ({} bits, group {})",
            packed.shape(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    Ok(out)
}

/// Threads of the op's pool (the calling thread included).
pub fn threads() -> usize {
    // SAFETY: a plain query; it starts the pool on first use.
    unsafe { mlx_sys::mlxhost_cpu_threads() as usize }
}

/// Rows above which the op multiplies through float32 tiles and BLAS.
pub fn max_kernel_rows() -> usize {
    // SAFETY: returns a constant.
    unsafe { mlx_sys::mlxhost_quantized_matmul_max_rows() as usize }
}

/// Which code computes decode-sized products (up to [`max_kernel_rows`]
/// rows; larger products always dequantize tiles into BLAS, exact in
/// float32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// The default: float32 activations, weights dequantized in registers
    /// with the widest SIMD the CPU has (AVX-512, else AVX2 + FMA, else
    /// the portable loop). Exact: the same products as dequantize-then-dot.
    Float,
    /// `x` rounded to int8 per block of 32 (`d = max|x| / 127`, llama.cpp's
    /// Q8 activations) and integer dot products (AVX2). Against the AVX2
    /// float kernel it made SmolLM2 decode 1.3-1.5x faster here (13-15 vs
    /// 20 ms per token), but it is slower than the AVX-512 float kernel
    /// (14 vs 12 ms) and it moved teacher-forced logprobs by up to 0.15
    /// nats (top-1) and 0.33 (top-5) against mlx-lm, outside semantics.md's
    /// thresholds, so it is opt-in (`MLXHOST_QUANTIZED_KERNEL=int8`).
    Int8,
    /// Float32 activations, portable C++ the compiler vectorizes (NEON on
    /// Apple CPUs).
    Portable,
    /// Float32 activations with AVX2 + FMA even where AVX-512 exists (tests).
    FloatAvx2,
}

impl Kernel {
    fn code(self) -> i32 {
        match self {
            Kernel::Int8 => 0,
            Kernel::Portable => 1,
            Kernel::Float => 2,
            Kernel::FloatAvx2 => 3,
        }
    }

    /// The decoder layers' kernel on the quantized path: [`Kernel::Float`],
    /// or [`Kernel::Int8`] when `MLXHOST_QUANTIZED_KERNEL=int8`.
    pub fn for_layers() -> Kernel {
        match std::env::var("MLXHOST_QUANTIZED_KERNEL").as_deref() {
            Ok("int8") => Kernel::Int8,
            _ => Kernel::Float,
        }
    }

    /// The `variant` code of the C++ ops.
    pub fn variant(self) -> i32 {
        self.code()
    }
}

/// `y = x @ W^T`: `x [..., K]` float32, `weight [N, K * bits / 32]` uint32
/// (MLX affine layout, `mx.quantize`), `scales`/`biases [N, K / group]`
/// float32 -> `[..., N]` float32 (lazy).
///
/// Errors: an unsupported `spec` ([`supports`]), dtypes other than those
/// above, or shapes that do not fit.
pub fn quantized_matmul(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    kernel: Kernel,
) -> Result<Array> {
    if x.dtype() != Dtype::Float32 {
        return Err(Exception::custom(format!(
            "quantized matmul: x must be float32, found {:?}",
            x.dtype()
        ))
        .into());
    }
    // SAFETY: `mlx_array_new` makes an empty handle that the call fills (or
    // leaves empty); it is wrapped in an `Array` right after, which frees it
    // on drop. The input handles are borrowed for the call; the op keeps its
    // own references.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxhost_quantized_matmul(
            &mut out,
            x.as_ptr(),
            weight.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            spec.bits,
            spec.group_size,
            kernel.code(),
        );
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!(
            "quantized matmul: inputs do not fit (x {:?}, weight {:?}, scales {:?}, {} bits, group {})",
            x.shape(),
            weight.shape(),
            scales.shape(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{ops, transforms::eval};

    fn max_rel_err(got: &Array, want: &Array) -> Result<f32> {
        let diff = ops::abs(&ops::subtract(got, want)?)?.max(None)?;
        let scale = ops::abs(want)?.max(None)?;
        eval([&diff, &scale])?;
        Ok(diff.item_exact::<f32>() / scale.item_exact::<f32>().max(1e-6))
    }

    /// Against dequantize-then-matmul (MLX's own ops) for every bit width,
    /// group size, row count 1..=16, a prefill-sized row count (the BLAS
    /// tile path), odd output widths and a batch axis; both kernels.
    #[test]
    fn matches_dequantized_product() -> Result<()> {
        mlx_rs::random::seed(11)?;
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                for (n, k) in [(37, 128), (130, 384), (9, 256)] {
                    let spec = QuantSpec {
                        bits,
                        group_size: group,
                    };
                    let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None)?;
                    let (qw, s, b) = ops::quantize(&w, group, bits)?;
                    let dense = ops::dequantize(&qw, &s, &b, group, bits)?;
                    for rows in (1..=16).chain([17, 70]) {
                        let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None)?;
                        let want = ops::matmul(&x, dense.t())?;
                        // The int8 kernel computes the exact product of the
                        // rounded x (decode sizes; prefill sizes are exact).
                        let x8 = if rows as usize <= max_kernel_rows() && int8_kernel() {
                            round_like_q8(&x)?
                        } else {
                            x.clone()
                        };
                        let want8 = ops::matmul(&x8, dense.t())?;
                        for kernel in [
                            Kernel::Int8,
                            Kernel::Portable,
                            Kernel::Float,
                            Kernel::FloatAvx2,
                        ] {
                            let got = quantized_matmul(&x, &qw, &s, &b, spec, kernel)?;
                            let want = if kernel == Kernel::Int8 {
                                &want8
                            } else {
                                &want
                            };
                            assert_eq!(got.shape(), &[rows, n]);
                            let err = max_rel_err(&got, want)?;
                            assert!(
                                err < 1e-5,
                                "{bits}-bit group {group} [{n}x{k}] rows {rows} {kernel:?}: \
                                 relative error {err}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The packed layout (24-bit activations, `vpdpbusd`) against the float
    /// product of the same weights, for every bit width and group size it
    /// holds, float32 and (lossless) float16 scales, row counts 1..=16 and
    /// the prefill path (17, 70 rows: dequantized tiles into BLAS, exact),
    /// odd output widths (a partial last tile) and both kernels; the SIMD
    /// kernel against the portable one; [`unpack`] gives back the packed
    /// codes, scales and biases exactly.
    #[test]
    fn packed_matches_dequantized_product() -> Result<()> {
        mlx_rs::random::seed(12)?;
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                for (n, k) in [(37, 128), (130, 384), (9, 256), (16, 640)] {
                    for half in [false, true] {
                        let spec = QuantSpec {
                            bits,
                            group_size: group,
                        };
                        let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None)?;
                        let (qw, s, b) = ops::quantize(&w, group, bits)?;
                        // float16-exact scales and biases (as GGUF's Q4_0/Q4_1/Q8_0
                        // give), or arbitrary float32 ones.
                        let (s, b) = if half {
                            let r = |a: &Array| -> Result<Array> {
                                Ok(a.as_dtype(Dtype::Float16)?.as_dtype(Dtype::Float32)?)
                            };
                            (r(&s)?, r(&b)?)
                        } else {
                            (s, b)
                        };
                        let dense = ops::dequantize(&qw, &s, &b, group, bits)?;
                        let (packed, f16) = pack(&qw, &s, &b, spec)?;
                        assert_eq!(f16, half, "{bits}-bit group {group}: float16 scales");
                        assert_eq!(packed.shape()[0], (n + 15) / 16);
                        // `unpack` gives back exactly what was packed.
                        let (uw, us, ub) = unpack(&packed, n, k, spec, f16)?;
                        for (what, got, want) in [
                            ("codes", &uw, &qw),
                            ("scales", &us, &s),
                            ("biases", &ub, &b),
                        ] {
                            assert!(
                                got.eq_values(want)?,
                                "{bits}-bit group {group} f16 {half} [{n}x{k}]: unpacked {what} differ"
                            );
                        }
                        for rows in (1..=16).chain([17, 70]) {
                            let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None)?;
                            let want = ops::matmul(&x, dense.t())?;
                            // 24-bit rounding of x (|error| <= max|x| / 2^24 per
                            // element) is float32's own resolution; BLAS too.
                            let tol = 1e-5;
                            let simd =
                                packed_matmul(&x, &packed, n, spec, f16, PackedKernel::Simd)?;
                            let portable =
                                packed_matmul(&x, &packed, n, spec, f16, PackedKernel::Portable)?;
                            assert_eq!(simd.shape(), &[rows, n]);
                            for (name, got) in [("simd", &simd), ("portable", &portable)] {
                                let err = max_rel_err(got, &want)?;
                                assert!(
                                    err < tol,
                                    "{bits}-bit group {group} f16 {half} [{n}x{k}] rows {rows} \
                                     {name}: relative error {err}"
                                );
                            }
                            let err = max_rel_err(&simd, &portable)?;
                            assert!(
                                err < 1e-5,
                                "{bits}-bit group {group} [{n}x{k}] rows {rows}: simd vs \
                                 portable {err}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The int8 prefill product: equal (to float rounding) to the same
    /// arithmetic in MLX ops (x rounded per group of 32 to int8 steps), and
    /// within that rounding of the float product (|error| <= max|x| / 254
    /// per element: here up to ~2% of the output's largest entry), for 4-
    /// and 8-bit weights, row counts past the decode kernel's 16 (blocks of
    /// 8 and a remainder) and a partial last tile.
    #[test]
    fn int8_prefill_product_is_close_to_the_float_product() -> Result<()> {
        if !packed_available() {
            return Ok(());
        }
        mlx_rs::random::seed(5)?;
        for bits in [4, 8] {
            for (n, k, rows) in [(37, 128, 17), (130, 384, 70), (16, 640, 133)] {
                let spec = QuantSpec {
                    bits,
                    group_size: 32,
                };
                let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None)?;
                let (qw, s, b) = ops::quantize(&w, 32, bits)?;
                let dense = ops::dequantize(&qw, &s, &b, 32, bits)?;
                let (packed, f16) = pack(&qw, &s, &b, spec)?;
                let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None)?;
                let want = ops::matmul(&x, dense.t())?;
                let got = packed_matmul(&x, &packed, n, spec, f16, PackedKernel::Int8Prefill)?;
                assert_eq!(got.shape(), &[rows, n]);
                // The same arithmetic in MLX ops: x rounded per group of 32
                // to int8 steps of max|x| / 127 times the weights' scale
                // term, plus the bias term on x's float values.
                let groups = k / 32;
                let xg = x.reshape(&[rows, groups, 32])?;
                let step = ops::divide(
                    &ops::abs(&xg)?.max_axes(&[2], true)?,
                    Array::from_f32(127.0),
                )?;
                let xq = ops::multiply(&ops::round(&ops::divide(&xg, &step)?, None)?, &step)?
                    .reshape(&[rows, k])?;
                let zeros = ops::zeros_like(&b)?;
                let scaled = ops::dequantize(&qw, &s, &zeros, 32, bits)?;
                let biased = ops::dequantize(&qw, &ops::zeros_like(&s)?, &b, 32, bits)?;
                let exact8 = ops::add(
                    &ops::matmul(&xq, scaled.t())?,
                    &ops::matmul(&x, biased.t())?,
                )?;
                let err8 = ops::abs(&ops::subtract(&got, &exact8)?)?
                    .max(None)?
                    .item_exact::<f32>();
                let scale8 = ops::abs(&exact8)?.max(None)?.item_exact::<f32>();
                assert!(
                    err8 < 1e-4 * scale8,
                    "{bits}-bit [{n}x{k}] rows {rows}: {err8} from the int8 arithmetic (scale {scale8})"
                );
                // Relative to the output's scale (entries near zero have no
                // meaningful relative error).
                let scale = ops::abs(&want)?.max(None)?.item_exact::<f32>();
                let err = ops::abs(&ops::subtract(&got, &want)?)?
                    .max(None)?
                    .item_exact::<f32>();
                assert!(
                    err < 0.03 * scale,
                    "{bits}-bit [{n}x{k}] rows {rows}: max error {err} of scale {scale}"
                );
                // And not the float path by accident: int8 rounding shows.
                assert!(err > 1e-6 * scale, "{bits}-bit: suspiciously exact ({err})");
            }
        }
        Ok(())
    }

    /// The bfloat16 prefill product on AMX: equal (to float32 summation
    /// order) to the same arithmetic in MLX ops (x and the dequantized
    /// weights rounded to bfloat16, float32 products), and within that
    /// rounding of the float product, for 4- and 8-bit weights, float16 and
    /// float32 scales, row counts that are not multiples of the 32-row
    /// block, an odd number of 16-row tiles and a partial last tile.
    #[test]
    fn bf16_prefill_product_is_the_bfloat16_arithmetic() -> Result<()> {
        if !amx_available() {
            return Ok(());
        }
        mlx_rs::random::seed(6)?;
        for bits in [4, 8] {
            for (n, k, rows) in [(37, 128, 17), (130, 384, 70), (16, 640, 133), (64, 96, 32)] {
                let spec = QuantSpec {
                    bits,
                    group_size: 32,
                };
                let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None)?;
                let (qw, s, b) = ops::quantize(&w, 32, bits)?;
                for half in [false, true] {
                    let (s, b) = if half {
                        (
                            s.as_dtype(Dtype::Float16)?.as_dtype(Dtype::Float32)?,
                            b.as_dtype(Dtype::Float16)?.as_dtype(Dtype::Float32)?,
                        )
                    } else {
                        (s.clone(), b.clone())
                    };
                    let dense = ops::dequantize(&qw, &s, &b, 32, bits)?;
                    let (packed, f16) = pack(&qw, &s, &b, spec)?;
                    assert_eq!(f16, half);
                    let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None)?;
                    let got = packed_matmul(&x, &packed, n, spec, f16, PackedKernel::Bf16Prefill)?;
                    assert_eq!(got.shape(), &[rows, n]);
                    let bf = |a: &Array| -> Result<Array> {
                        Ok(a.as_dtype(Dtype::Bfloat16)?.as_dtype(Dtype::Float32)?)
                    };
                    let exact = ops::matmul(&bf(&x)?, bf(&dense)?.t())?;
                    let want = ops::matmul(&x, dense.t())?;
                    let max = |a: &Array| -> Result<f32> {
                        Ok(ops::abs(a)?.max(None)?.item_exact::<f32>())
                    };
                    let scale = max(&want)?;
                    let err_bf = max(&ops::subtract(&got, &exact)?)?;
                    assert!(
                        err_bf < 1e-4 * scale,
                        "{bits}-bit [{n}x{k}] rows {rows} f16 {half}: {err_bf} from the \
                         bfloat16 arithmetic (scale {scale})"
                    );
                    let err = max(&ops::subtract(&got, &want)?)?;
                    assert!(
                        err < 0.01 * scale,
                        "{bits}-bit [{n}x{k}] rows {rows}: max error {err} of scale {scale}"
                    );
                    assert!(err > 1e-6 * scale, "{bits}-bit: suspiciously exact ({err})");
                }
            }
        }
        Ok(())
    }

    /// A hidden state with an outlier channel (as SmolLM2's have): 24-bit
    /// rounding per group keeps the small channels (int8 per block of 32
    /// flattened them).
    #[test]
    fn packed_keeps_small_channels_beside_an_outlier() -> Result<()> {
        let spec = QuantSpec {
            bits: 4,
            group_size: 32,
        };
        let w = mlx_rs::random::normal::<f32>(&[64, 576], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 32, 4)?;
        let dense = ops::dequantize(&qw, &s, &b, 32, 4)?;
        let mut xs = vec![0.01f32; 576];
        for (i, v) in xs.iter_mut().enumerate() {
            *v *= ((i * 7919) % 13) as f32 - 6.0;
        }
        xs[5] = 300.0;
        let x = Array::from_slice(&xs, &[1, 576]);
        let (packed, f16) = pack(&qw, &s, &b, spec)?;
        let got = packed_matmul(&x, &packed, 64, spec, f16, PackedKernel::Simd)?;
        // Without the outlier's own contribution, the rest must still match.
        let mut small = xs.clone();
        small[5] = 0.0;
        let x_small = Array::from_slice(&small, &[1, 576]);
        let want = ops::matmul(&x, dense.t())?;
        let err = ops::abs(&ops::subtract(&got, &want)?)?.max(None)?;
        let scale = ops::abs(&ops::matmul(&x_small, dense.t())?)?.max(None)?;
        eval([&err, &scale])?;
        let rel = err.item_exact::<f32>() / scale.item_exact::<f32>();
        assert!(
            rel < 0.05,
            "small channels moved by {rel} of their own product"
        );
        Ok(())
    }

    /// A packed linear's dense weight is exactly the dequantized one, and a
    /// packed linear computes like the quantized one it came from.
    #[test]
    fn packed_linear_round_trips() -> Result<()> {
        let w = mlx_rs::random::normal::<f32>(&[40, 256], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 64, 4)?;
        let spec = QuantSpec {
            bits: 4,
            group_size: 64,
        };
        let lin = crate::model::linear::Linear::Quantized {
            weight: qw.clone(),
            scales: s.clone(),
            biases: b.clone(),
            spec,
        };
        let packed = lin.packed()?;
        assert!(matches!(
            packed,
            crate::model::linear::Linear::Packed {
                out: 40,
                input: 256,
                ..
            }
        ));
        let dense = ops::dequantize(&qw, &s, &b, 64, 4)?;
        let diff = ops::abs(&ops::subtract(&packed.dense_weight()?, &dense)?)?.max(None)?;
        eval([&diff])?;
        assert_eq!(diff.item_exact::<f32>(), 0.0);
        let x = mlx_rs::random::normal::<f32>(&[3, 256], None, None, None)?;
        let err = max_rel_err(&packed.forward(&x)?, &lin.forward(&x)?)?;
        assert!(err < 1e-5, "packed vs quantized linear: {err}");
        // As an embedding: rows gathered by id equal MLX's lookup.
        let ids = Array::from_slice(&[0u32, 39, 17, 17], &[4]);
        let table = crate::model::linear::Embedding(packed);
        let want = crate::model::linear::Embedding(lin).lookup(&ids, Dtype::Float32)?;
        let got = table.lookup(&ids, Dtype::Float32)?;
        assert_eq!(got.shape(), &[4, 256]);
        let diff = ops::abs(&ops::subtract(&got, &want)?)?.max(None)?;
        eval([&diff])?;
        assert_eq!(diff.item_exact::<f32>(), 0.0);
        Ok(())
    }

    #[test]
    fn packed_rejects_what_it_cannot_compute() -> Result<()> {
        let w = mlx_rs::random::normal::<f32>(&[8, 512], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 128, 4)?;
        // Groups above 128 could overflow the integer sums.
        let spec = QuantSpec {
            bits: 4,
            group_size: 256,
        };
        assert!(!supports_packed(spec));
        assert!(pack(&qw, &s, &b, spec).is_err());
        let (qw, s, b) = ops::quantize(&w, 32, 4)?;
        let spec = QuantSpec {
            bits: 4,
            group_size: 32,
        };
        let (packed, f16) = pack(&qw, &s, &b, spec)?;
        let wrong = mlx_rs::random::normal::<f32>(&[1, 256], None, None, None)?;
        assert!(packed_matmul(&wrong, &packed, 8, spec, f16, PackedKernel::Simd).is_err());
        let x = mlx_rs::random::normal::<f32>(&[1, 512], None, None, None)?;
        assert!(packed_matmul(&x, &packed, 17, spec, f16, PackedKernel::Simd).is_err());
        Ok(())
    }

    /// Whether this CPU runs the int8 kernel (AVX2 + FMA).
    fn int8_kernel() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `x [M, K]` rounded as the int8 kernel rounds it: per block of 32,
    /// `d = max|x| / 127`, `q = round_ties_even(x * (1 / d))` clamped to
    /// ±127, back to `q * d`.
    fn round_like_q8(x: &Array) -> Result<Array> {
        let shape = x.shape().to_vec();
        let xs = x.as_slice::<f32>();
        let mut out = Vec::with_capacity(xs.len());
        for block in xs.chunks(32) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            out.extend(
                block
                    .iter()
                    .map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) * d),
            );
        }
        Ok(Array::from_slice(&out, &shape))
    }

    /// The int8 kernel's rounding of x stays close to the float product
    /// (relative to the output's largest value).
    #[test]
    fn int8_activations_stay_close_to_float() -> Result<()> {
        let w = mlx_rs::random::normal::<f32>(&[256, 576], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 32, 4)?;
        let x = mlx_rs::random::normal::<f32>(&[3, 576], None, None, None)?;
        let spec = QuantSpec {
            bits: 4,
            group_size: 32,
        };
        let exact = quantized_matmul(&x, &qw, &s, &b, spec, Kernel::Float)?;
        let int8 = quantized_matmul(&x, &qw, &s, &b, spec, Kernel::Int8)?;
        let err = max_rel_err(&int8, &exact)?;
        assert!(err < 0.02, "int8 activations moved the product by {err}");
        Ok(())
    }

    /// A `[B, T, K]` input and a non-contiguous (transposed) one.
    #[test]
    fn takes_batched_and_strided_inputs() -> Result<()> {
        let spec = QuantSpec {
            bits: 4,
            group_size: 64,
        };
        let w = mlx_rs::random::normal::<f32>(&[48, 128], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 64, 4)?;
        let dense = ops::dequantize(&qw, &s, &b, 64, 4)?;
        let x = mlx_rs::random::normal::<f32>(&[2, 3, 128], None, None, None)?;
        let got = quantized_matmul(&x, &qw, &s, &b, spec, Kernel::Float)?;
        assert_eq!(got.shape(), &[2, 3, 48]);
        assert!(max_rel_err(&got, &ops::matmul(&x, dense.t())?)? < 1e-5);
        let xt = mlx_rs::random::normal::<f32>(&[128, 5], None, None, None)?.t();
        let got = quantized_matmul(&xt, &qw, &s, &b, spec, Kernel::Float)?;
        assert!(max_rel_err(&got, &ops::matmul(&xt, dense.t())?)? < 1e-5);
        Ok(())
    }

    #[test]
    fn rejects_what_it_cannot_compute() -> Result<()> {
        let w = mlx_rs::random::normal::<f32>(&[8, 64], None, None, None)?;
        let (qw, s, b) = ops::quantize(&w, 32, 4)?;
        let spec = QuantSpec {
            bits: 4,
            group_size: 32,
        };
        let wrong_width = mlx_rs::random::normal::<f32>(&[1, 96], None, None, None)?;
        assert!(quantized_matmul(&wrong_width, &qw, &s, &b, spec, Kernel::Float).is_err());
        let half =
            mlx_rs::random::normal::<f32>(&[1, 64], None, None, None)?.as_dtype(Dtype::Float16)?;
        assert!(quantized_matmul(&half, &qw, &s, &b, spec, Kernel::Float).is_err());
        let three_bits = QuantSpec {
            bits: 3,
            group_size: 32,
        };
        assert!(!supports(three_bits));
        let x = mlx_rs::random::normal::<f32>(&[1, 64], None, None, None)?;
        assert!(quantized_matmul(&x, &qw, &s, &b, three_bits, Kernel::Float).is_err());
        Ok(())
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use mlx_rs::{ops, transforms::eval};

    /// Not a test: prints the op's time per product (run with --ignored).
    #[test]
    #[ignore]
    fn print_speed() -> Result<()> {
        for (n, k, bits, rows) in [
            (1536, 576, 4, 1),
            (49152, 576, 8, 1),
            (3072, 576, 4, 1),
            (576, 1536, 4, 1),
            (3072, 576, 4, 8),
            (3072, 576, 4, 16),
        ] {
            let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None)?;
            let (qw, s, b) = ops::quantize(&w, 32, bits)?;
            let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None)?;
            eval([&qw, &s, &b, &x])?;
            let spec = QuantSpec {
                bits,
                group_size: 32,
            };
            let iters = 200;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                let y = quantized_matmul(&x, &qw, &s, &b, spec, Kernel::Float)?;
                eval([&y])?;
            }
            let per = t.elapsed().as_secs_f64() / iters as f64;
            let bytes = (qw.nbytes() + s.nbytes() + b.nbytes()) as f64;
            println!(
                "[{rows}x{k}] @ [{n}x{k}]^T {bits}-bit: {:.3} ms, {:.1} GB/s",
                per * 1e3,
                bytes / per / 1e9
            );
        }
        Ok(())
    }
}
