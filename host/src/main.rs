//! The `mlxhost` binary: command-line edge over the library.

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod cli;

/// mimalloc for every allocation of the process on Linux: with its
/// `override` feature it also replaces `malloc`/`free` under MLX's C++ and
/// the CUDA libraries, not only Rust's heap. Why: each MLX primitive the
/// evaluating thread encodes allocates small objects that MLX's CUDA
/// completion thread frees, and glibc's malloc serializes those cross-thread
/// frees on the allocating arena's lock. Measured side by side on an H100
/// with mimalloc preloaded into the same binary (docs/benchmarks.md, run
/// 11): batch-1 decode over HTTP 1.30x glibc's (median of 12 rounds), 2.60x
/// mlx_lm.server's; on the CPU backend about neutral.
#[cfg(target_os = "linux")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    reexec_with_better_blas();
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
