//! Calling the builders of mlxhost's own MLX ops (`mlxhost_*` in
//! `host/mlx-sys`, C++ under `host/mlx-sys/native/`): each fills a fresh
//! array handle and returns mlx-c's status (0, or 1 after reporting the
//! error through mlx-c's handler).

use std::os::raw::c_int;

use mlx_rs::{error::Exception, Array};

/// The array a one-output builder makes. `build` gets a fresh handle to
/// fill and returns the builder's status; a non-zero status is an
/// [`Exception`] with `what()`'s text (the builder checks its inputs: the
/// text says what they must be).
///
/// # Safety
/// `build` must pass the builder only live handles (borrowed arrays that
/// outlive the call) besides the one it is given.
pub(crate) unsafe fn build_one(
    build: impl FnOnce(*mut mlx_sys::mlx_array) -> c_int,
    what: impl FnOnce() -> String,
) -> Result<Array, Exception> {
    // SAFETY: a fresh, empty handle; `Array` takes it over either way (so
    // a failed build leaks nothing), filled by the builder or still empty.
    let mut out = unsafe { mlx_sys::mlx_array_new() };
    let status = build(&mut out);
    let out = unsafe { Array::from_ptr(out) };
    if status != 0 {
        return Err(Exception::custom(what()));
    }
    Ok(out)
}
