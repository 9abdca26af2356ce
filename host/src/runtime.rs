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
