//! `mlxhost score`.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use mlxhost::model::lora::LoraSet;
use mlxhost::score;

use super::tensor_parallel::{self, TensorParallelArgs};
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
    /// A LoRA adapter folder (mlx-lm or PEFT) every row is scored under,
    /// unless its line names another (`"lora"`).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// A folder of adapters a line's `"lora": "name"` picks from.
    #[arg(long)]
    lora_dir: Option<PathBuf>,
    /// A LoRA adapter folder merged into the weights at load.
    #[arg(long)]
    lora_merge: Option<PathBuf>,
    #[command(flatten)]
    tp: TensorParallelArgs,
}

pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    // Before the input is read: a worker rank's failure to start should
    // not wait on stdin.
    let cluster = args.tp.start(&args.model)?;
    let reader: Box<dyn BufRead> = if args.input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = std::fs::File::open(&args.input)
            .with_context(|| format!("--input {}", args.input.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    let mut model = tensor_parallel::load(&args.model, cluster)?;
    if let Some(dir) = &args.lora_merge {
        model.merge_lora(dir)?;
    }
    let default_lora = match &args.lora {
        Some(dir) => Some(std::rc::Rc::new(LoraSet::load_one(
            "lora",
            dir,
            model.model.lora_targets(),
        )?)),
        None => None,
    };
    if let Some(dir) = &args.lora_dir {
        model.lora = LoraSet::open(dir, model.model.lora_targets())?;
        if let Some((name, why)) = model.lora.failures().into_iter().next() {
            anyhow::bail!("--lora-dir: adapter `{name}`: {why}");
        }
    }
    let mut rows = Vec::new();
    let mut adapters = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading --input {}", args.input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let (prompt, cont, lora) = score::parse_line_lora(&model, &line, i + 1)?;
        adapters.push(match lora {
            Some(name) => Some(model.lora.get(&name).with_context(|| {
                format!("input line {}: no adapter `{name}` in --lora-dir", i + 1)
            })?),
            None => default_lora.clone(),
        });
        rows.push((prompt, cont));
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let batch_size = args.batch_size as usize;
    for (batch, lora) in rows.chunks(batch_size).zip(adapters.chunks(batch_size)) {
        let lora: Vec<_> = lora.iter().map(|a| a.as_deref()).collect();
        for result in score::score_rows_lora(
            &model,
            batch,
            &lora,
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
