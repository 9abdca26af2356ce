//! Facts about the MLX runtime this process linked.

/// `(metal, cuda)`: which GPU backends this libmlx has.
fn gpu_backends() -> (bool, bool) {
    let mut metal = false;
    let mut cuda = false;
    // SAFETY: both functions write one bool through a valid pointer.
    unsafe {
        mlx_sys::mlx_metal_is_available(&mut metal);
        mlx_sys::mlx_cuda_is_available(&mut cuda);
    }
    (metal, cuda)
}

/// Whether MLX has a GPU backend here (Metal or CUDA).
pub fn gpu_available() -> bool {
    let (metal, cuda) = gpu_backends();
    metal || cuda
}

/// Name of the backend for logs: `metal`, `cuda` or `cpu`.
pub fn backend_name() -> &'static str {
    match gpu_backends() {
        (true, _) => "metal",
        (_, true) => "cuda",
        _ => "cpu",
    }
}

/// `MemAvailable` from `/proc/meminfo` in bytes (Linux); `None` elsewhere.
pub fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The kernel set OpenBLAS picked for this CPU (`openblas_get_corename`,
/// lower case, e.g. `skylakex`), or `None` when the BLAS is not OpenBLAS.
pub fn blas_corename() -> Option<String> {
    // SAFETY: returns null or a static NUL-terminated string.
    let name = unsafe { mlx_sys::mlxhost_blas_corename() };
    if name.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, static (checked above).
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    Some(name.to_string_lossy().trim().to_lowercase())
}

/// The `OPENBLAS_CORETYPE` to run with when OpenBLAS fell back to a generic
/// kernel set on a CPU it does not know (Debian's OpenBLAS 0.3.21 picks
/// `prescott`, SSE3, on this machine's Sapphire Rapids-class CPU, which made
/// prefill 2.2x slower than with `SkylakeX`). `None` when OpenBLAS is
/// absent, already chose a modern set, or the user set `OPENBLAS_CORETYPE`.
pub fn better_openblas_coretype() -> Option<&'static str> {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
        return None;
    }
    let core = blas_corename()?;
    let generic = [
        "prescott",
        "core2",
        "katmai",
        "coppermine",
        "northwood",
        "unknown",
        "banias",
        "atom",
        "penryn",
        "dunnington",
        "nehalem",
    ];
    if !generic.contains(&core.as_str()) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some("SkylakeX");
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Some("Haswell");
        }
    }
    None
}
