//! Quantized mat-vec on CUDA: `y = x W^T` for up to [`MAX_ROWS`] rows of
//! activations and MLX's affine 4- or 8-bit weights, as one kernel of ours
//! (`kernels/quantized_matvec.cuh`, JIT-compiled by MLX through NVRTC,
//! [`super::cuda_kernel`]).
//!
//! Why: at real model sizes a decode step is the weights streamed once per
//! token, and MLX's CUDA quantized mat-vec reaches ~20% of an H100's
//! bandwidth there (issue 35: 8B step 0.86x mlx-lm's, all of it in those
//! products). The kernel's layout and arithmetic are described in its
//! header; it computes in float32, in the affine form MLX's own kernels use
//! (`scale * sum(q * x) + bias * sum(x)` per group).
//!
//! When it runs instead of MLX's `quantized_matmul`
//! ([`Linear::forward`](super::linear::Linear::forward)):
//! - a CUDA backend, float16 or bfloat16 activations in the scales' dtype,
//!   4 or 8 bits, groups of 32, 64 or 128, at most [`MAX_ROWS`] rows;
//! - its self-test passed for that template instance (dtype, bits, group
//!   size, rows; once per instance, at first use; [`available`]): ours no
//!   further from the float32 product than MLX's op, within 2 units;
//! - and, per product shape and row count, it measured faster than MLX's op
//!   on the device at first use ([`prefer`]): the choice is the card's, not
//!   a table's. `MLXHOST_QMV=on` skips the measurement (ours wherever it
//!   applies), `off` keeps MLX's op everywhere; default `auto`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use mlx_rs::{error::Exception, ops, Array, Dtype};

use super::config::QuantSpec;
use super::cuda_kernel::{relative_diff, CudaKernel, TemplateArg};
use super::error::Result;

/// Most activation rows one launch takes (decode batches up to this size);
/// more rows go to MLX's matrix kernels, which reuse weights across rows.
pub const MAX_ROWS: i32 = 8;

const HEADER: &str = include_str!("kernels/quantized_matvec.cuh");

/// The body MLX wraps in a generated signature (`x`, `w`, `scales`,
/// `biases` in, `y` out).
const SOURCE: &str = "mlxhost_qmv::matvec<T, BITS, GS, NR, R, U, WARPS, BF16 != 0>\
     (x, w, scales, biases, y, x_shape[1], w_shape[0]);";

/// How a launch spreads the work: `rows` output rows per warp, `unroll`
/// 16-byte chunks per row in flight per lane, `warps` per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Output rows per warp (R).
    pub rows: i32,
    /// Chunks per row loaded ahead per lane (U).
    pub unroll: i32,
    /// Warps per block.
    pub warps: i32,
}

/// The launch layout for `n` activation rows: more output rows per warp
/// where one activation row leaves the loads few per lane, fewer where
/// several rows multiply the registers each output row holds.
pub fn layout(n: i32) -> Layout {
    match n {
        1 | 2 => Layout {
            rows: 4,
            unroll: 2,
            warps: 4,
        },
        3 | 4 => Layout {
            rows: 2,
            unroll: 2,
            warps: 4,
        },
        _ => Layout {
            rows: 1,
            unroll: 2,
            warps: 4,
        },
    }
}

fn kernel() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_quantized_matvec",
            &["x", "w", "scales", "biases"],
            &["y"],
            SOURCE,
            HEADER,
        )
    })
}

/// Whether a product of this kind is one the kernel computes: 4 or 8
/// bits, a group size of 32, 64 or 128 dividing `k`, `1..=MAX_ROWS` rows,
/// float16 or bfloat16 activations. Says nothing of the backend or the
/// self-test ([`available`]).
pub fn supports(spec: QuantSpec, rows: i32, k: i32, dtype: Dtype) -> bool {
    matches!(spec.bits, 4 | 8)
        && matches!(spec.group_size, 32 | 64 | 128)
        && k > 0
        && k % spec.group_size == 0
        && (1..=MAX_ROWS).contains(&rows)
        && matches!(dtype, Dtype::Float16 | Dtype::Bfloat16)
}

/// `x: [N, K]` times the affine-quantized `W: [O, K]` (`w: [O, K*bits/32]`
/// uint32, `scales`/`biases: [O, K/group]` in x's dtype), transposed:
/// `[N, O]` in x's dtype, with the launch layout `layout`. One kernel
/// launch; lazy.
///
/// Errors: shapes or dtypes outside [`supports`]; MLX's (no CUDA stream).
pub fn matvec_with(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    layout: Layout,
) -> Result<Array> {
    let (xs, ws) = (x.shape(), w.shape());
    let dtype = x.dtype();
    let fits = xs.len() == 2
        && ws.len() == 2
        && supports(spec, xs[0], xs[1], dtype)
        && ws[1] * 32 == xs[1] * spec.bits
        && scales.shape() == [ws[0], xs[1] / spec.group_size]
        && biases.shape() == scales.shape()
        && scales.dtype() == dtype
        && biases.dtype() == dtype
        && w.dtype() == Dtype::Uint32;
    if !fits {
        return Err(Exception::custom(format!(
            "quantized mat-vec: x {xs:?} {dtype:?}, w {ws:?} {:?}, scales {:?} {:?}, {} bits, \
             group {}",
            w.dtype(),
            scales.shape(),
            scales.dtype(),
            spec.bits,
            spec.group_size
        ))
        .into());
    }
    let (n, o) = (xs[0], ws[0]);
    let per_block = layout.rows * layout.warps;
    let blocks = (o + per_block - 1) / per_block;
    let mut out = kernel().apply(
        "quantized mat-vec",
        &[x, w, scales, biases],
        &[(&[n, o], dtype)],
        (blocks * layout.warps * 32, 1, 1),
        (layout.warps * 32, 1, 1),
        &[
            TemplateArg::Dtype("T", dtype),
            TemplateArg::Int("BITS", spec.bits),
            TemplateArg::Int("GS", spec.group_size),
            TemplateArg::Int("NR", n),
            TemplateArg::Int("R", layout.rows),
            TemplateArg::Int("U", layout.unroll),
            TemplateArg::Int("WARPS", layout.warps),
            TemplateArg::Int("BF16", i32::from(dtype == Dtype::Bfloat16)),
        ],
    )?;
    Ok(out.remove(0))
}

/// [`matvec_with`] at the [`layout`] for x's row count, or at the one
/// `MLXHOST_QMV_LAYOUT=R,U,W` names (rows per warp, chunks in flight,
/// warps per block; for tuning on a new card).
///
/// Errors: as [`matvec_with`].
pub fn matvec(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<Array> {
    let n = x.shape().first().copied().unwrap_or(0);
    let chosen = layout_override().unwrap_or_else(|| layout(n));
    matvec_with(x, w, scales, biases, spec, chosen)
}

fn layout_override() -> Option<Layout> {
    static CHOSEN: OnceLock<Option<Layout>> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let text = std::env::var("MLXHOST_QMV_LAYOUT").ok()?;
        let parsed = parse_layout(&text);
        if parsed.is_none() {
            tracing::warn!(
                "MLXHOST_QMV_LAYOUT={text:?} is not R,U,W (rows per warp 1-8, chunks 1-4, \
                 warps 1-32); using the defaults"
            );
        }
        parsed
    })
}

/// `"R,U,W"` as a [`Layout`] within the kernel's limits (R 1-8, U 1-4,
/// W 1-32), else `None`.
fn parse_layout(text: &str) -> Option<Layout> {
    let v: Vec<i32> = text
        .split(',')
        .map(|p| p.trim().parse().ok())
        .collect::<Option<_>>()?;
    match v[..] {
        [rows, unroll, warps]
            if (1..=8).contains(&rows)
                && (1..=4).contains(&unroll)
                && (1..=32).contains(&warps) =>
        {
            Some(Layout {
                rows,
                unroll,
                warps,
            })
        }
        _ => None,
    }
}

/// The `MLXHOST_QMV` switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Ours where it measured faster (default).
    Auto,
    /// Ours wherever it applies and passed its self-test.
    On,
    /// MLX's op everywhere.
    Off,
}

fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("MLXHOST_QMV").as_deref() {
        Ok("on") => Mode::On,
        Ok("off") => Mode::Off,
        Ok("auto") | Err(_) => Mode::Auto,
        Ok(other) => {
            tracing::warn!("MLXHOST_QMV={other:?} is not auto, on or off; using auto");
            Mode::Auto
        }
    })
}

/// One template instance of the kernel: what NVRTC compiles once and the
/// self-test checks once. The launch layout follows from `rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Instance {
    bf16: bool,
    bits: i32,
    group_size: i32,
    rows: i32,
}

/// Whether the kernel may replace MLX's op for `rows` rows of `dtype`
/// activations and `spec` weights: a CUDA backend, `MLXHOST_QMV` not
/// `off`, and [`self_test`] passed for that template instance (checked
/// once per instance, at first use, and logged with its time).
///
/// Why per instance and not once per dtype: each instance is a separate
/// NVRTC compile (~7 s on a cold H100), so a test of every instance up
/// front cost minutes before the first token; a model at batch 1 uses one
/// or two, and the test reuses the compile the product then uses.
fn available(dtype: Dtype, spec: QuantSpec, rows: i32) -> bool {
    // The caller ([`prefer`]) checked `supports` for the product's shape.
    if mode() == Mode::Off || crate::runtime::backend_name() != "cuda" {
        return false;
    }
    let instance = Instance {
        bf16: dtype == Dtype::Bfloat16,
        bits: spec.bits,
        group_size: spec.group_size,
        rows,
    };
    static VERDICTS: OnceLock<Mutex<HashMap<Instance, bool>>> = OnceLock::new();
    let verdicts = VERDICTS.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(known) = verdicts.lock().ok().and_then(|m| m.get(&instance).copied()) {
        return known;
    }
    let started = Instant::now();
    let verdict = self_test(dtype, spec, rows);
    let self_test_ms = started.elapsed().as_millis() as u64;
    let (name, fallback) = ("quantized mat-vec CUDA kernel", "MLX's quantized_matmul");
    let allowed = match verdict {
        Ok(excess) if excess <= tolerance(dtype) => {
            tracing::info!(?instance, excess, self_test_ms, "{name} in use");
            true
        }
        Ok(excess) => {
            tracing::warn!(
                ?instance,
                excess,
                self_test_ms,
                "{name} is less accurate than {fallback}; using {fallback}"
            );
            false
        }
        Err(e) => {
            tracing::warn!(?instance, error = %e, self_test_ms, "{name} failed; using {fallback}");
            false
        }
    };
    if let Ok(mut m) = verdicts.lock() {
        m.insert(instance, allowed);
    }
    allowed
}

/// How much less accurate than MLX's op the self-test lets the kernel be:
/// two units in the last place of `dtype`, in [`relative_diff`]'s measure
/// against the float32 product.
fn tolerance(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => 2.0 * 2f32.powi(-10),
        Dtype::Bfloat16 => 2.0 * 2f32.powi(-7),
        _ => 1e-5,
    }
}

/// The kernel's instance for `rows` rows of `dtype` and `spec`, and MLX's
/// `quantized_matmul`, on random inputs, each against the float32 product
/// of the same quantized weights, at an output width (1000) that is no
/// multiple of any layout's rows per block. Returns how much further from
/// that reference the kernel lands than MLX's op does (the largest
/// [`relative_diff`] of ours minus MLX's).
///
/// Why not ours against MLX's directly: on the H100 the two land up to
/// ~2 bfloat16 units apart (each rounds differently on the way), which says
/// nothing about which is closer to the product; the question the gate
/// asks is whether ours is as accurate as the op it replaces. Uses its own
/// random keys, so the global generator is not advanced.
///
/// Errors: whatever the kernel or MLX raised.
pub fn self_test(dtype: Dtype, spec: QuantSpec, rows: i32) -> Result<f32> {
    use mlx_rs::random;
    let (o, k) = (1000, 1536);
    let salt = (spec.bits * 1000 + spec.group_size * 10 + rows) as u64;
    let key = random::key(0x9e3 + salt)?;
    let wf = ops::multiply(
        random::normal::<f32>(&[o, k], None, None, &key)?,
        Array::from_f32(0.05),
    )?
    .as_dtype(dtype)?;
    let (w, scales, biases) = ops::quantize(&wf, spec.group_size, spec.bits)?;
    let key = random::key(0x5eed + salt)?;
    let x = random::normal::<f32>(&[rows, k], None, None, &key)?.as_dtype(dtype)?;
    let exact = ops::quantized_matmul(
        &x.as_dtype(Dtype::Float32)?,
        &w,
        &scales.as_dtype(Dtype::Float32)?,
        &biases.as_dtype(Dtype::Float32)?,
        true,
        spec.group_size,
        spec.bits,
    )?;
    let theirs = ops::quantized_matmul(&x, &w, &scales, &biases, true, spec.group_size, spec.bits)?;
    let ours = matvec(&x, &w, &scales, &biases, spec)?;
    Ok(relative_diff(&ours, &exact)? - relative_diff(&theirs, &exact)?)
}

/// A product's shape, for the per-shape choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShapeKey {
    out: i32,
    input: i32,
    rows: i32,
    bits: i32,
    group_size: i32,
    bf16: bool,
}

/// Whether this product (`x: [N, K]`, weights as for [`matvec`]) should
/// take the kernel: [`available`] for x's dtype and, under
/// `MLXHOST_QMV=auto`, the kernel measured faster than MLX's op for this
/// shape and row count on this device (measured once per shape: the
/// fastest of 3 rounds of 8 products each, after one to compile, logged at
/// info). The measuring itself is ~1 ms per shape; the compile is NVRTC's,
/// once per template instance (row count, bits, group size), seconds each
/// on a cold H100 and read back from disk after ([`crate::gpu_kernel_cache`]).
pub fn prefer(x: &Array, w: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> bool {
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != 2 || ws.len() != 2 || !supports(spec, xs[0], xs[1], x.dtype()) {
        return false;
    }
    if !available(x.dtype(), spec, xs[0]) {
        return false;
    }
    if mode() == Mode::On {
        return true;
    }
    static CHOICES: OnceLock<Mutex<HashMap<ShapeKey, bool>>> = OnceLock::new();
    let key = ShapeKey {
        out: ws[0],
        input: xs[1],
        rows: xs[0],
        bits: spec.bits,
        group_size: spec.group_size,
        bf16: x.dtype() == Dtype::Bfloat16,
    };
    let choices = CHOICES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(known) = choices.lock().ok().and_then(|m| m.get(&key).copied()) {
        return known;
    }
    let verdict = match race(key, x.dtype(), w, scales, biases, spec) {
        Ok((ours, theirs)) => {
            tracing::info!(
                out = key.out,
                input = key.input,
                rows = key.rows,
                bits = key.bits,
                ours_us = ours * 1e6,
                mlx_us = theirs * 1e6,
                "quantized mat-vec: {}",
                if ours < theirs { "ours" } else { "MLX's" }
            );
            ours < theirs
        }
        Err(e) => {
            tracing::warn!(error = %e, "quantized mat-vec: measuring failed; using MLX's op");
            false
        }
    };
    if let Ok(mut m) = choices.lock() {
        m.insert(key, verdict);
    }
    verdict
}

/// Seconds per product for the kernel and for MLX's op on random
/// activations of `key`'s shape: each the fastest of 3 rounds of 8
/// independent products in one evaluation, after one to compile.
fn race(
    key: ShapeKey,
    dtype: Dtype,
    w: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<(f64, f64)> {
    use mlx_rs::{random, transforms::eval};
    const REPS: usize = 8;
    let xs = (0..REPS)
        .map(|i| {
            let k = random::key(0x71e5 + i as u64)?;
            Ok(random::normal::<f32>(&[key.rows, key.input], None, None, &k)?.as_dtype(dtype)?)
        })
        .collect::<Result<Vec<Array>>>()?;
    eval(xs.iter())?;
    let ours = |x: &Array| matvec(x, w, scales, biases, spec);
    let theirs = |x: &Array| -> Result<Array> {
        Ok(ops::quantized_matmul(
            x,
            w,
            scales,
            biases,
            true,
            spec.group_size,
            spec.bits,
        )?)
    };
    let time = |f: &dyn Fn(&Array) -> Result<Array>| -> Result<f64> {
        eval([&f(&xs[0])?])?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            let ys = xs.iter().map(f).collect::<Result<Vec<Array>>>()?;
            eval(ys.iter())?;
            best = best.min(start.elapsed().as_secs_f64() / REPS as f64);
        }
        Ok(best)
    };
    Ok((time(&ours)?, time(&theirs)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's arithmetic, lane by lane in float32 (chunks of 128/bits
    /// values, lane l taking chunks l, l+32, ...; per chunk and row
    /// `scale * sum(q * x) + bias * sum(x)`; the lanes' sums added as the
    /// shuffles add them), on the host: checks the unpacking order, the
    /// group indexing and the affine form against MLX's CPU op.
    fn emulate(
        x: &[f32],
        n: usize,
        k: usize,
        w: &[u32],
        s: &[f32],
        b: &[f32],
        spec: QuantSpec,
    ) -> Vec<f32> {
        let bits = spec.bits as usize;
        let gs = spec.group_size as usize;
        let v = 128 / bits;
        let chunks = k / v;
        let words = k * bits / 32;
        let o = w.len() / words;
        let groups = k / gs;
        let mut y = vec![0f32; n * o];
        for row in 0..o {
            for r in 0..n {
                let mut lanes = [0f32; 32];
                for (lane, acc) in lanes.iter_mut().enumerate() {
                    let mut c = lane;
                    while c < chunks {
                        let g = c * v / gs;
                        let (mut dot, mut xsum) = (0f32, 0f32);
                        for j in 0..v {
                            let idx = c * v + j;
                            let word = w[row * words + idx * bits / 32];
                            let q = (word >> ((idx * bits) % 32)) & ((1u32 << bits) - 1);
                            let xv = x[r * k + idx];
                            xsum += xv;
                            dot = (q as f32).mul_add(xv, dot);
                        }
                        *acc = s[row * groups + g]
                            .mul_add(dot, b[row * groups + g].mul_add(xsum, *acc));
                        c += 32;
                    }
                }
                let mut width = 16;
                while width > 0 {
                    let prev = lanes;
                    for l in 0..32 {
                        lanes[l] = prev[l] + prev[l ^ width];
                    }
                    width /= 2;
                }
                y[r * o + row] = lanes[0];
            }
        }
        y
    }

    #[test]
    fn kernel_arithmetic_matches_mlx_quantized_matmul() {
        use mlx_rs::random;
        for (bits, group_size) in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 128)] {
            let spec = QuantSpec { group_size, bits };
            let (o, k, n) = (37, 640, 3);
            let key = random::key(7 + bits as u64).unwrap();
            let wf = random::normal::<f32>(&[o, k], None, None, &key).unwrap();
            let (w, s, b) = ops::quantize(&wf, group_size, bits).unwrap();
            let key = random::key(11).unwrap();
            let x = random::normal::<f32>(&[n, k], None, None, &key).unwrap();
            let want = ops::quantized_matmul(&x, &w, &s, &b, true, group_size, bits).unwrap();
            let got = emulate(
                x.as_slice::<f32>(),
                n as usize,
                k as usize,
                w.as_slice::<u32>(),
                s.as_slice::<f32>(),
                b.as_slice::<f32>(),
                spec,
            );
            let want = want.as_slice::<f32>();
            for (i, (g, e)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                    "{bits}-bit g{group_size} [{i}]: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn supports_only_what_the_kernel_computes() {
        let q4 = QuantSpec {
            group_size: 64,
            bits: 4,
        };
        assert!(supports(q4, 1, 4096, Dtype::Bfloat16));
        assert!(supports(q4, MAX_ROWS, 4096, Dtype::Float16));
        assert!(
            !supports(q4, MAX_ROWS + 1, 4096, Dtype::Bfloat16),
            "batches over MAX_ROWS"
        );
        assert!(!supports(q4, 0, 4096, Dtype::Bfloat16));
        assert!(
            !supports(q4, 1, 4096, Dtype::Float32),
            "float32 activations"
        );
        assert!(
            !supports(q4, 1, 4000, Dtype::Bfloat16),
            "K not a multiple of the group"
        );
        for bits in [2, 3, 5, 6] {
            assert!(!supports(
                QuantSpec {
                    group_size: 64,
                    bits
                },
                1,
                4096,
                Dtype::Bfloat16
            ));
        }
        assert!(!supports(
            QuantSpec {
                group_size: 16,
                bits: 4
            },
            1,
            4096,
            Dtype::Bfloat16
        ));
    }

    #[test]
    fn layout_override_is_parsed_within_limits() {
        assert_eq!(
            parse_layout("4, 2,8"),
            Some(Layout {
                rows: 4,
                unroll: 2,
                warps: 8
            })
        );
        for bad in ["", "4,2", "4,2,8,1", "0,1,4", "4,5,4", "4,1,33", "a,b,c"] {
            assert_eq!(parse_layout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn layouts_cover_every_row_count() {
        for n in 1..=MAX_ROWS {
            let l = layout(n);
            assert!(l.rows >= 1 && l.unroll >= 1 && l.warps >= 1 && l.warps * 32 <= 1024);
        }
    }

    #[test]
    fn off_the_gpu_mlx_keeps_the_product() {
        if crate::runtime::backend_name() == "cuda" {
            return;
        }
        let x = Array::zeros::<f32>(&[1, 64])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let wf = Array::zeros::<f32>(&[8, 64])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let (w, s, b) = ops::quantize(&wf, 64, 4).unwrap();
        assert!(!prefer(
            &x,
            &w,
            &s,
            &b,
            QuantSpec {
                group_size: 64,
                bits: 4
            }
        ));
        // A wrong shape is an error, not a launch.
        let bad = Array::zeros::<f32>(&[2, 32])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        assert!(matvec(
            &bad,
            &w,
            &s,
            &b,
            QuantSpec {
                group_size: 64,
                bits: 4
            }
        )
        .is_err());
    }
}
