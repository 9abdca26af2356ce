//! The `mlxhost` binary: command-line edge over the library.

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod cli;

/// mimalloc for every allocation of the process on Linux: with its
/// `override` feature it also replaces `malloc`/`free` under MLX's C++ and
/// the CUDA libraries, not only Rust's heap. Why: each MLX primitive the
/// evaluating thread encodes allocates small objects that MLX's CUDA
/// completion thread frees, and glibc's malloc likely serializes those
/// cross-thread frees on the allocating arena's lock (our reading, not
/// profiled). Measured side by side on an H100 with Debian's mimalloc 2.0.9
/// preloaded into a glibc build (docs/benchmarks.md, run 11): batch-1
/// decode over HTTP 1.30x glibc's (median of 12 rounds), 2.56x
/// mlx_lm.server's by tokens; this linked build has not yet run on a GPU.
/// On the CPU backend about neutral.
#[cfg(target_os = "linux")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    reexec_with_better_blas();
    // Before any thread or MLX kernel: it sets environment variables.
    mlxhost::gpu_kernel_cache::persist();
    cli::run()
}

/// OpenBLAS picks its kernels when it loads, before `main`; when it fell
/// back to a generic set on a CPU it does not know, run again with
/// `OPENBLAS_CORETYPE` naming the right one (same arguments, same PID).
/// Failing to re-exec leaves the process running as it is.
fn reexec_with_better_blas() {
    #[cfg(unix)]
    if let Some(core) = mlxhost::runtime::better_openblas_coretype() {
        use std::os::unix::process::CommandExt;
        if let Ok(exe) = std::env::current_exe() {
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("OPENBLAS_CORETYPE", core)
                .exec();
            eprintln!("mlxhost: could not re-run with OPENBLAS_CORETYPE={core}: {err}");
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod allocator_tests {
    /// Every allocation entry point a shared library (MLX, CUDA, libstdc++)
    /// may call resolves, through the process's global symbol lookup, to
    /// the executable's own mimalloc definitions, not to glibc's: a library
    /// that allocated with one and freed with the other would corrupt the
    /// heap.
    #[test]
    fn shared_libraries_allocate_from_mimalloc() {
        let exe = std::fs::canonicalize("/proc/self/exe").expect("/proc/self/exe");
        for name in [
            "malloc",
            "free",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
            "memalign",
            "malloc_usable_size",
            "_Znwm",
            "_ZdlPv",
            "_Znam",
            "_ZdaPv",
        ] {
            let symbol = std::ffi::CString::new(name).expect("no NUL");
            // SAFETY: dlsym/dladdr only read the loaded objects' tables;
            // `info` is written by dladdr before it is read.
            let path = unsafe {
                let addr = libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr());
                assert!(!addr.is_null(), "{name} not found");
                let mut info: libc::Dl_info = std::mem::zeroed();
                assert!(libc::dladdr(addr, &mut info) != 0, "dladdr({name})");
                std::ffi::CStr::from_ptr(info.dli_fname)
                    .to_string_lossy()
                    .into_owned()
            };
            let from = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone().into());
            assert_eq!(
                from, exe,
                "{name} resolves to {path}, not to the executable"
            );
        }
    }
}
