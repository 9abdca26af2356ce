//! mlxhost's own CUDA kernels, JIT-compiled by MLX through NVRTC
//! (`mlx::core::fast::cuda_kernel`, mlx-c's `mlx_fast_cuda_kernel_*`): a
//! kernel is a named body, MLX writes its signature from the argument names
//! and compiles it once per name and template arguments. Each apply is one
//! lazy MLX primitive, so one kernel launch in the step's graph.
//!
//! Why our own kernels on a GPU: a small model's decode step there is bound
//! by the host encoding and launching kernels, not by the device
//! (docs/benchmarks.md, runs 4-9). A kernel of ours costs the host more per
//! call than a stock one, though: it pays where it replaces many ops (the
//! slab attention, several kernels per layer), not for a few elementwise
//! ones (the fused layer kernels measured slower, so they are opt-in).
//! [`SelfTestedGate`] decides, per dtype, whether a family is used.

use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::OnceLock;

use mlx_rs::{error::Exception, Array, Dtype, StreamOrDevice};

use super::error::Result;

/// MLX's device headers a body may use besides `utils.cuh` (which MLX
/// always includes): the functors of MLX's own elementwise kernels, so a
/// fused kernel computes exactly what the separate ops would.
pub const ELEMENTWISE_HEADER: &str = "#include \"mlx/backend/cuda/device/unary_ops.cuh\"\n\
     #include \"mlx/backend/cuda/device/binary_ops.cuh\"\n";

/// A compiled-on-first-use kernel description (MLX caches the compiled
/// module by name and template arguments).
pub struct CudaKernel(mlx_sys::mlx_fast_cuda_kernel);

// SAFETY: the handle is an immutable description (name, source, argument
// names) that MLX only reads; applying it from any thread is allowed.
unsafe impl Send for CudaKernel {}
unsafe impl Sync for CudaKernel {}

/// A template argument of one apply: a type or an integer constant.
pub enum TemplateArg<'a> {
    /// `using NAME = <dtype's CUDA type>;`
    Dtype(&'a str, Dtype),
    /// `constexpr int NAME = value;`
    Int(&'a str, i32),
}

/// An IEEE-754 float32 as an integer template constant: a body gets it back
/// with `__int_as_float(NAME)`, so scalars such as an epsilon cost no input
/// array per call.
pub fn float_bits(value: f32) -> i32 {
    value.to_bits() as i32
}

fn string_vector(names: &[&str]) -> mlx_sys::mlx_vector_string {
    let owned: Vec<CString> = names
        .iter()
        .map(|n| CString::new(*n).expect("argument names hold no NUL"))
        .collect();
    let mut ptrs: Vec<*const c_char> = owned.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: the pointers are valid NUL-terminated strings for the call;
    // the vector copies them.
    unsafe { mlx_sys::mlx_vector_string_new_data(ptrs.as_mut_ptr(), ptrs.len()) }
}

impl CudaKernel {
    /// Describes a kernel: `inputs` and `outputs` name its pointer
    /// arguments (MLX adds `<input>_shape` / `_strides` / `_ndim` where the
    /// body mentions them), `header` goes before the body's function.
    /// Inputs that are not row-contiguous are copied by MLX first.
    pub fn new(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
    ) -> CudaKernel {
        let name = CString::new(name).expect("kernel names hold no NUL");
        let source = CString::new(source).expect("kernel sources hold no NUL");
        let header = CString::new(header).expect("kernel headers hold no NUL");
        let inputs = string_vector(inputs);
        let outputs = string_vector(outputs);
        // SAFETY: all arguments are valid for the call; MLX copies the names
        // and source; the string vectors are freed after.
        unsafe {
            let k = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                inputs,
                outputs,
                source.as_ptr(),
                header.as_ptr(),
                true,
                0,
            );
            mlx_sys::mlx_vector_string_free(inputs);
            mlx_sys::mlx_vector_string_free(outputs);
            CudaKernel(k)
        }
    }

    /// One launch over `grid` threads (x, y, z; not blocks) in thread blocks
    /// of `block`, with `outputs` (shape, dtype) allocated by MLX. Returns
    /// the outputs, lazy.
    ///
    /// Errors: MLX's (no GPU stream, argument counts that do not match the
    /// description); `what` names the kernel in the message.
    pub fn apply(
        &self,
        what: &str,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
        templates: &[TemplateArg<'_>],
    ) -> Result<Vec<Array>> {
        let stream = StreamOrDevice::default();
        let handles: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        let names: Vec<CString> = templates
            .iter()
            .map(|t| match t {
                TemplateArg::Dtype(n, _) | TemplateArg::Int(n, _) => {
                    CString::new(*n).expect("template names hold no NUL")
                }
            })
            .collect();
        // SAFETY: every handle is alive for the call; the config and vectors
        // are created and freed here; output handles are wrapped in `Array`s,
        // which free them.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut status = 0;
            for (shape, dtype) in outputs {
                status |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    shape.as_ptr(),
                    shape.len(),
                    *dtype as mlx_sys::mlx_dtype,
                );
            }
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, grid.0, grid.1, grid.2);
            status |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                config, block.0, block.1, block.2,
            );
            for (t, name) in templates.iter().zip(&names) {
                status |= match t {
                    TemplateArg::Dtype(_, d) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                            config,
                            name.as_ptr(),
                            *d as mlx_sys::mlx_dtype,
                        )
                    }
                    TemplateArg::Int(_, v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                            config,
                            name.as_ptr(),
                            *v,
                        )
                    }
                };
            }
            let input_vec = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
            let mut output_vec = mlx_sys::mlx_vector_array_new();
            if status == 0 {
                status = mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut output_vec,
                    self.0,
                    input_vec,
                    config,
                    stream.as_ref().as_ptr(),
                );
            }
            let mut out = Vec::with_capacity(outputs.len());
            if status == 0 && mlx_sys::mlx_vector_array_size(output_vec) == outputs.len() {
                for i in 0..outputs.len() {
                    let mut a = mlx_sys::mlx_array_new();
                    status |= mlx_sys::mlx_vector_array_get(&mut a, output_vec, i);
                    out.push(Array::from_ptr(a));
                }
            } else if status == 0 {
                status = 1;
            }
            mlx_sys::mlx_vector_array_free(output_vec);
            mlx_sys::mlx_vector_array_free(input_vec);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if status != 0 {
                return Err(
                    Exception::custom(format!("{what}: the CUDA kernel was refused")).into(),
                );
            }
            Ok(out)
        }
    }
}

/// Whether a family of our kernels replaces MLX's ops, decided once per
/// activation dtype at its first use: on a CUDA backend, when switched on,
/// and when its self-test (largest difference from MLX's ops on random
/// inputs) is within tolerance. Anything else keeps MLX's ops; the verdict
/// is logged (info when in use, a warning when a test failed or disagreed).
pub struct SelfTestedGate {
    /// Names the kernels in the log lines ("slab decode attention: CUDA
    /// kernel", ...); `tests/gpu/check.py` looks for "<name> in use".
    pub name: &'static str,
    /// What runs instead, and what the self-test compares against, for the
    /// log lines ("MLX's SDPA", ...).
    pub fallback: &'static str,
    f16: OnceLock<bool>,
    bf16: OnceLock<bool>,
    f32: OnceLock<bool>,
}

impl SelfTestedGate {
    /// An undecided gate.
    pub const fn new(name: &'static str, fallback: &'static str) -> Self {
        Self {
            name,
            fallback,
            f16: OnceLock::new(),
            bf16: OnceLock::new(),
            f32: OnceLock::new(),
        }
    }

    /// The verdict for `dtype` (float16, bfloat16 or float32; any other is
    /// `false`). At the first call per dtype: `switched_on()` (read
    /// environment switches) and a CUDA backend, then `self_test(dtype)`,
    /// accepted when `<= tolerance(dtype)`.
    pub fn allows(
        &self,
        dtype: Dtype,
        switched_on: impl FnOnce() -> bool,
        self_test: impl FnOnce(Dtype) -> Result<f32>,
        tolerance: impl FnOnce(Dtype) -> f32,
    ) -> bool {
        let cell = match dtype {
            Dtype::Float16 => &self.f16,
            Dtype::Bfloat16 => &self.bf16,
            Dtype::Float32 => &self.f32,
            _ => return false,
        };
        *cell.get_or_init(|| {
            if !switched_on() || crate::runtime::backend_name() != "cuda" {
                return false;
            }
            let (name, fallback) = (self.name, self.fallback);
            // The test's time is mostly NVRTC compiling each template
            // instance at first use (seconds each on an H100, cached on disk
            // after: gpu_kernel_cache), so it is logged with the verdict.
            let started = std::time::Instant::now();
            let verdict = self_test(dtype);
            let self_test_ms = started.elapsed().as_millis() as u64;
            match verdict {
                Ok(diff) if diff <= tolerance(dtype) => {
                    tracing::info!(?dtype, max_diff = diff, self_test_ms, "{name} in use");
                    true
                }
                Ok(diff) => {
                    tracing::warn!(
                        ?dtype,
                        max_diff = diff,
                        self_test_ms,
                        "{name} disagrees with {fallback}; using {fallback}"
                    );
                    false
                }
                Err(e) => {
                    tracing::warn!(
                        ?dtype,
                        error = %e,
                        self_test_ms,
                        "{name} failed; using {fallback}"
                    );
                    false
                }
            }
        })
    }
}

/// Largest `|got - want| / (1 + |want|)` over two arrays of one shape,
/// compared in float32 (a kernel's self-test against MLX's ops).
///
/// Errors: MLX's.
pub fn relative_diff(got: &Array, want: &Array) -> Result<f32> {
    use mlx_rs::ops;
    let want = want.as_dtype(Dtype::Float32)?;
    let diff = ops::abs(ops::subtract(&got.as_dtype(Dtype::Float32)?, &want)?)?;
    let rel = ops::divide(&diff, &ops::add(&ops::abs(&want)?, Array::from_f32(1.0))?)?;
    let worst = ops::max(&rel, None)?;
    mlx_rs::transforms::eval([&worst])?;
    let value = worst.as_slice::<f32>().first().copied().unwrap_or(f32::NAN);
    Ok(if value.is_finite() {
        value
    } else {
        f32::INFINITY
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_keeps_mlx_ops_off_cuda_and_for_other_dtypes_without_testing() {
        static GATE: SelfTestedGate = SelfTestedGate::new("test kernel", "MLX's ops");
        let never = |_: Dtype| -> Result<f32> { panic!("no self-test should run here") };
        // Integer activations never use a kernel, whatever the backend.
        assert!(!GATE.allows(Dtype::Int32, || true, never, |_| 1.0));
        // Switched off: no test, MLX's ops.
        assert!(!GATE.allows(Dtype::Float16, || false, never, |_| 1.0));
        if crate::runtime::backend_name() != "cuda" {
            // The verdict is kept per dtype: float32 off the GPU is decided
            // without running the test.
            assert!(!GATE.allows(Dtype::Float32, || true, never, |_| 1.0));
            assert!(!GATE.allows(Dtype::Float32, || true, never, |_| 1.0));
        }
    }

    #[test]
    fn float_bits_round_trip() {
        for v in [1e-5f32, 1e-6, 0.125, -3.5] {
            assert_eq!(f32::from_bits(float_bits(v) as u32), v);
        }
    }

    #[test]
    fn relative_diff_is_zero_for_equal_arrays_and_scales_with_magnitude() {
        let a = Array::from_slice(&[1.0f32, -100.0, 0.0], &[3]);
        assert_eq!(relative_diff(&a, &a).unwrap(), 0.0);
        let b = Array::from_slice(&[1.0f32, -101.0, 0.0], &[3]);
        let d = relative_diff(&b, &a).unwrap();
        assert!((d - 1.0 / 101.0).abs() < 1e-6, "{d}");
    }
}
