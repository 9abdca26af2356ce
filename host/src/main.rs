//! The `mlxhost` binary: command-line edge over the library.

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod cli;

fn main() -> std::process::ExitCode {
    cli::run()
}
