//! The `mlxhost` binary: command-line edge over the library.

mod cli;

fn main() -> std::process::ExitCode {
    cli::run()
}
