//! SwiGLU, `silu(gate) * up` (Shazeer 2020, "GLU Variants Improve
//! Transformer"; the MLP of Llama, Qwen and SmolLM). On GPU backends it runs
//! as one fused elementwise kernel compiled by MLX (`mx.compile`,
//! shapeless, as mlx-lm's `swiglu` in `mlx_lm/models/activations.py`)
//! instead of three kernels: on a GPU a decode step is host-bound, each
//! kernel costing the host ~5 µs to encode and launch. The CPU keeps plain
//! ops (MLX's CPU compile would build C++ at run time).

use std::cell::RefCell;

use mlx_rs::{error::Exception, ops, transforms::compile::compile, Array};

use super::error::Result;

type Compiled = Box<dyn for<'a> FnMut(&'a [Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// `silu(gate) * up` with plain ops: three kernels.
pub fn plain(gate: &Array, up: &Array) -> Result<Array> {
    Ok(ops::multiply(
        ops::multiply(gate, ops::sigmoid(gate)?)?,
        up,
    )?)
}

/// `silu(gate) * up` through MLX's compile (one fused kernel). Shapes and
/// dtypes of `gate` and `up` must match (`[N, I]`).
///
/// Errors: MLX errors from tracing or compiling.
pub fn compiled(gate: &Array, up: &Array) -> Result<Array> {
    thread_local! {
        // One compiled function per thread (the engine thread): MLX caches
        // its traces by the function's id.
        static F: RefCell<Option<Compiled>> = const { RefCell::new(None) };
    }
    F.with(|cell| {
        let mut slot = cell.borrow_mut();
        let f = slot.get_or_insert_with(|| {
            let body = |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
                let (gate, up) = match args {
                    [gate, up] => (gate, up),
                    _ => return Err(Exception::custom("swiglu: expects (gate, up)")),
                };
                Ok(vec![ops::multiply(
                    ops::multiply(gate, ops::sigmoid(gate)?)?,
                    up,
                )?])
            };
            Box::new(compile(body, true))
        });
        let mut out = f(&[gate.clone(), up.clone()])?;
        out.pop()
            .ok_or_else(|| Exception::custom("swiglu: no output").into())
    })
}

/// [`compiled`] on GPU backends, [`plain`] on the CPU.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    if crate::runtime::gpu_available() {
        compiled(gate, up)
    } else {
        plain(gate, up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compiled function equals the plain ops (on this machine's CPU
    /// backend, where MLX compiles it to C++), twice with different shapes
    /// (shapeless).
    #[test]
    fn compiled_equals_plain() -> Result<()> {
        mlx_rs::random::seed(5)?;
        for shape in [[3, 40], [7, 40]] {
            let gate = mlx_rs::random::normal::<f32>(&shape, None, None, None)?;
            let up = mlx_rs::random::normal::<f32>(&shape, None, None, None)?;
            let a = compiled(&gate, &up)?;
            let b = plain(&gate, &up)?;
            let d = ops::max(&ops::abs(ops::subtract(&a, &b)?)?, None)?;
            mlx_rs::transforms::eval([&d])?;
            assert_eq!(a.shape(), &shape);
            assert!(d.as_slice::<f32>()[0] < 1e-5);
        }
        Ok(())
    }
}
