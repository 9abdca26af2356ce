//! `mlxhost convert`.

use std::path::PathBuf;

/// Arguments of `mlxhost convert`.
#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// The GGUF checkpoint to convert.
    gguf: PathBuf,
    /// Output directory (must not exist, or be empty).
    out_dir: PathBuf,
}

pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let report = mlxhost::model::convert::convert_gguf(&args.gguf, &args.out_dir, true)?;
    eprintln!(
        "wrote {} ({} tensors, {:.1} MiB)",
        report.out_dir.display(),
        report.tensors,
        report.bytes as f64 / (1u64 << 20) as f64
    );
    Ok(())
}
