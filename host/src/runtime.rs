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

/// The `OPENBLAS_CORETYPE` to run with when OpenBLAS picked a kernel set
/// below what this CPU runs: a generic set on a CPU it does not know (Debian's
/// OpenBLAS 0.3.21 picks `prescott`, SSE3, on a Sapphire Rapids-class CPU,
/// which made prefill 2.2x slower than with `SkylakeX`), or its AVX2 set on an
/// AMD CPU with AVX-512 (0.3.21 maps Zen 4/5 to `Haswell`; `SkylakeX` gave
/// 1.1-1.2x its prefill on this machine's AMD EPYC, 512 prompt tokens,
/// interleaved runs). `None` when
/// OpenBLAS is absent, already chose a modern set, or the user set
/// `OPENBLAS_CORETYPE`.
pub fn better_openblas_coretype() -> Option<&'static str> {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
        return None;
    }
    let core = blas_corename()?;
    #[cfg(target_arch = "x86_64")]
    {
        coretype_for(
            &core,
            std::arch::is_x86_feature_detected!("avx512f"),
            std::arch::is_x86_feature_detected!("avx2"),
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = core;
        None
    }
}

/// The decision behind [`better_openblas_coretype`]: `core` is OpenBLAS's
/// lower-case kernel set name, the flags what the CPU (and OS) support.
fn coretype_for(core: &str, avx512f: bool, avx2: bool) -> Option<&'static str> {
    const GENERIC: [&str; 11] = [
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
    // OpenBLAS's AVX2 sets, which it also picks for AMD CPUs that have AVX-512.
    const AVX2_ONLY: [&str; 2] = ["haswell", "zen"];
    if GENERIC.contains(&core) || (avx512f && AVX2_ONLY.contains(&core)) {
        if avx512f {
            return Some("SkylakeX");
        }
        if avx2 && GENERIC.contains(&core) {
            return Some("Haswell");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::coretype_for;

    #[test]
    fn generic_sets_get_the_widest_set_the_cpu_runs() {
        assert_eq!(coretype_for("prescott", true, true), Some("SkylakeX"));
        assert_eq!(coretype_for("nehalem", false, true), Some("Haswell"));
        assert_eq!(coretype_for("unknown", false, false), None);
    }

    #[test]
    fn avx2_sets_move_to_avx512_only_where_the_cpu_has_it() {
        assert_eq!(coretype_for("zen", true, true), Some("SkylakeX"));
        assert_eq!(coretype_for("haswell", true, true), Some("SkylakeX"));
        assert_eq!(coretype_for("zen", false, true), None);
        assert_eq!(coretype_for("haswell", false, true), None);
    }

    #[test]
    fn modern_sets_are_left_alone() {
        for core in ["skylakex", "cooperlake", "sapphirerapids", "neoversen1"] {
            assert_eq!(coretype_for(core, true, true), None, "{core}");
        }
    }
}
