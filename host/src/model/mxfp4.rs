//! MLX's `mxfp4` quantization: the OCP microscaling 4-bit float format
//! gpt-oss ships its experts in. Each weight is an E2M1 float (4 bits,
//! eight packed per uint32 along the input), each run of 32 along the input
//! shares one E8M0 scale (a power of two, one uint8), and there are no
//! biases. mlx-lm saves such a layer as `weight` (uint32) and `scales`
//! (uint8) and tells it apart from an affine one by the uint8 scales
//! (`mlx_lm.utils.infer_quant_config`).
//!
//! mlx-rs 0.33 passes mode `affine` to every quantization op; mlx-c takes
//! the mode as an argument, so these call mlx-c with `mxfp4` directly.

use std::ffi::CStr;

use mlx_rs::{error::Exception, Array, Dtype, Stream};

use super::error::Result;

/// Weights per scale.
pub const GROUP_SIZE: i32 = 32;
/// Bits per weight.
pub const BITS: i32 = 4;

const MODE: &CStr = c"mxfp4";

/// Whether a quantized tensor's `scales` (and `biases`, if any) are
/// `mxfp4`'s: uint8 scales and no biases (affine scales are floats).
pub fn is_mxfp4(scales: &Array, biases: Option<&Array>) -> bool {
    scales.dtype() == Dtype::Uint8 && biases.is_none()
}

fn optional_int(value: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value,
        has_value: true,
    }
}

/// An empty mlx-c handle, freed on drop: mlx-c's "null" for an optional
/// array argument.
fn null_array() -> Array {
    // SAFETY: `mlx_array_new` returns a fresh empty handle that the Array
    // owns from here on.
    unsafe { Array::from_ptr(mlx_sys::mlx_array_new()) }
}

/// Runs one mlx-c op writing one array; `what` names it in the error.
fn op(
    what: impl FnOnce() -> String,
    f: impl FnOnce(*mut mlx_sys::mlx_array) -> i32,
) -> Result<Array> {
    // SAFETY: `mlx_array_new` makes an empty handle the op fills (or
    // leaves empty); it is wrapped right after, which frees it on drop.
    let (status, out) = unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = f(&mut out);
        (status, Array::from_ptr(out))
    };
    if status != 0 {
        return Err(Exception::custom(format!("mxfp4: {} failed", what())).into());
    }
    Ok(out)
}

/// Quantizes `w: [..., out, in]` (`in` a multiple of 32) to `mxfp4`:
/// `(weight [..., out, in / 8] uint32, scales [..., out, in / 32] uint8)`.
pub fn quantize(w: &Array) -> Result<(Array, Array)> {
    let stream = Stream::thread_local_or_default();
    let no_scale = null_array();
    // SAFETY: every handle passed is live for the call; the vector is
    // freed below after its arrays are copied out (mlx-c reference counts
    // them).
    let (status, arrays) = unsafe {
        let mut res = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::mlx_quantize(
            &mut res,
            w.as_ptr(),
            optional_int(GROUP_SIZE),
            optional_int(BITS),
            MODE.as_ptr(),
            no_scale.as_ptr(),
            stream.as_ptr(),
        );
        let mut arrays = Vec::new();
        if status == 0 {
            for i in 0..mlx_sys::mlx_vector_array_size(res) {
                let mut a = mlx_sys::mlx_array_new();
                mlx_sys::mlx_vector_array_get(&mut a, res, i);
                arrays.push(Array::from_ptr(a));
            }
        }
        mlx_sys::mlx_vector_array_free(res);
        (status, arrays)
    };
    match <[Array; 2]>::try_from(arrays) {
        Ok([weight, scales]) if status == 0 => Ok((weight, scales)),
        _ => Err(Exception::custom(format!(
            "mxfp4: quantize of a {:?} weight failed (the input width must be a multiple of 32)",
            w.shape()
        ))
        .into()),
    }
}

/// The `mxfp4` weight `weight`/`scales` as floats `[..., out, in]` in
/// `dtype` (every E2M1 value times its power-of-two scale is exact in
/// float32).
pub fn dequantize(weight: &Array, scales: &Array, dtype: Dtype) -> Result<Array> {
    let stream = Stream::thread_local_or_default();
    let (no_biases, no_scale) = (null_array(), null_array());
    let out_dtype = mlx_sys::mlx_optional_dtype {
        value: dtype as mlx_sys::mlx_dtype,
        has_value: true,
    };
    op(
        || format!("dequantize of {:?} / {:?}", weight.shape(), scales.shape()),
        // SAFETY: every handle passed is live for the call.
        |res| unsafe {
            mlx_sys::mlx_dequantize(
                res,
                weight.as_ptr(),
                scales.as_ptr(),
                no_biases.as_ptr(),
                optional_int(GROUP_SIZE),
                optional_int(BITS),
                MODE.as_ptr(),
                no_scale.as_ptr(),
                out_dtype,
                stream.as_ptr(),
            )
        },
    )
}

/// MLX's `gather_qmm` with `mxfp4` weights: `x: [..., 1, in]` times the
/// transposed weight of expert `experts[...]` for each batch position
/// (`weight [experts, out, in / 8]`, `scales [experts, out, in / 32]`) ->
/// `[..., 1, out]` in `x`'s dtype. `sorted`: the experts are in ascending
/// order.
pub fn gather_qmm(
    x: &Array,
    weight: &Array,
    scales: &Array,
    experts: &Array,
    sorted: bool,
) -> Result<Array> {
    let stream = Stream::thread_local_or_default();
    let (no_biases, no_lhs) = (null_array(), null_array());
    op(
        || {
            format!(
                "gather_qmm of x {:?} with weight {:?}, experts {:?}",
                x.shape(),
                weight.shape(),
                experts.shape()
            )
        },
        // SAFETY: every handle passed is live for the call.
        |res| unsafe {
            mlx_sys::mlx_gather_qmm(
                res,
                x.as_ptr(),
                weight.as_ptr(),
                scales.as_ptr(),
                no_biases.as_ptr(),
                no_lhs.as_ptr(),
                experts.as_ptr(),
                true,
                optional_int(GROUP_SIZE),
                optional_int(BITS),
                MODE.as_ptr(),
                sorted,
                stream.as_ptr(),
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{ops, random};

    fn normal(shape: &[i32], key: u64) -> Array {
        let k = random::key(key).expect("key");
        random::normal::<f32>(shape, None, 1.0, &k).expect("normal")
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        ops::abs(ops::subtract(a, b).expect("sub"))
            .expect("abs")
            .max(None)
            .expect("max")
            .item_exact::<f32>()
    }

    #[test]
    fn round_trips_onto_the_fp4_grid_with_power_of_two_scales() -> Result<()> {
        let w = normal(&[3, 8, 64], 1);
        let (q, s) = quantize(&w)?;
        assert_eq!(q.shape(), [3, 8, 8]);
        assert_eq!(s.shape(), [3, 8, 2]);
        assert_eq!(s.dtype(), Dtype::Uint8);
        assert!(is_mxfp4(&s, None));
        let d = dequantize(&q, &s, Dtype::Float32)?;
        assert_eq!(d.dtype(), Dtype::Float32);
        // Quantizing the dequantized weight changes nothing: it is on the
        // grid already.
        let (q2, s2) = quantize(&d)?;
        assert_eq!(
            max_abs_diff(&dequantize(&q2, &s2, Dtype::Float32)?, &d),
            0.0
        );
        // Each value is within half an E2M1 step (the largest, between 4
        // and 6, is 2) times its scale, at most the group's largest / 6
        // rounded up to a power of two, of the original.
        assert!(max_abs_diff(&d, &w) < 1.0 * 4.0 / 6.0 * 2.0);
        Ok(())
    }

    #[test]
    fn gather_qmm_equals_the_dequantized_product() -> Result<()> {
        let w = normal(&[4, 16, 64], 2);
        let (q, s) = quantize(&w)?;
        let dense_t = dequantize(&q, &s, Dtype::Float32)?.swap_axes(1, 2)?;
        let x = normal(&[5, 1, 1, 64], 3);
        let experts = Array::from_slice(&[0u32, 3, 3, 1, 2], &[5, 1]);
        let got = gather_qmm(&x, &q, &s, &experts, false)?;
        let want = ops::gather_mm(&x, &dense_t, None, &experts, false)?;
        assert_eq!(got.shape(), [5, 1, 1, 16]);
        assert!(max_abs_diff(&got, &want) < 1e-4);
        Ok(())
    }

    #[test]
    fn a_width_off_the_group_is_an_error() {
        let w = ops::zeros::<f32>(&[4, 48]).expect("zeros");
        assert!(quantize(&w).is_err());
    }
}
