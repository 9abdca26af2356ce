//! `mlxhost score`.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use mlxhost::score;

use super::ModelArgs;

/// Arguments of `mlxhost score`.
#[derive(Debug, clap::Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON lines: `{"prompt_ids": [...] | "messages": [...], "continuation_ids": [...]}`; `-` for stdin.
    #[arg(long)]
    input: PathBuf,
    /// Alternatives reported per step.
    #[arg(long, default_value_t = 5)]
    top_logprobs: usize,
    /// Rows scored together in one forward pass.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    batch_size: u32,
    /// Feed each continuation one token per forward pass after the prompt
    /// (the decode path generation runs, the rows of a batch decoding
    /// together) instead of in prefill chunks.
    #[arg(long)]
    decode: bool,
    /// Tokens per forward pass while prefilling.
    #[arg(long, default_value_t = score::PREFILL_CHUNK as u64, value_parser = clap::value_parser!(u64).range(1..))]
    prefill_chunk: u64,
}

pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let reader: Box<dyn BufRead> = if args.input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(&args.input)
            .with_context(|| format!("--input {}", args.input.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let model = args.model.load(false)?;
    let mut rows = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading --input {}", args.input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        rows.push(score::parse_line(&model, &line, i + 1)?);
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for batch in rows.chunks(args.batch_size as usize) {
        for result in score::score_rows(
            &model,
            batch,
            args.top_logprobs,
            args.decode,
            args.prefill_chunk as usize,
        )? {
            serde_json::to_writer(&mut out, &result)?;
            writeln!(out)?;
        }
    }
    Ok(())
}
