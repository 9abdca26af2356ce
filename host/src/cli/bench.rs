//! `mlxhost bench`: prefill throughput and per-token decode forward time of
//! the model alone (no sampling), for comparing compute paths and peers.
//! `benches/model_forward.sh` runs it beside mlx-lm on the same files.

use std::time::Instant;

use mlx_rs::{ops, transforms::eval, Array};
use mlxhost::model::RowInput;

use super::ModelArgs;

/// Arguments of `mlxhost bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill measurement, in tokens.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Decode steps measured (after 3 warm-up steps).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Repetitions of the prefill measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let loaded = args.model.load(false)?;
    let model = &loaded.model;
    let vocab = model.config.vocab_size as u32;
    // A deterministic, varied prompt (token ids spread over the vocabulary).
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();

    let mut prefill = Vec::new();
    for _ in 0..args.repeats.max(1) {
        let mut cache = model.new_cache();
        let started = Instant::now();
        let logits = model.forward(&mut [RowInput {
            tokens: &prompt,
            cache: &mut cache,
            logits_from: prompt.len() - 1,
        }])?;
        let mut arrays: Vec<&Array> = logits.iter().collect();
        arrays.extend(cache.arrays());
        eval(arrays)?;
        prefill.push(started.elapsed().as_secs_f64());
    }
    prefill.sort_by(f64::total_cmp);
    let prefill_s = prefill[prefill.len() / 2];

    // Decode: feed the argmax back, one token per step, evaluating each step.
    let mut cache = model.new_cache();
    let logits = model.forward(&mut [RowInput {
        tokens: &prompt,
        cache: &mut cache,
        logits_from: prompt.len() - 1,
    }])?;
    let mut next =
        ops::indexing::argmax_axis(&logits[0], -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
    eval([&next])?;
    let mut times = Vec::new();
    for step in 0..args.decode_tokens + 3 {
        let token = next.as_slice::<u32>()[0];
        let started = Instant::now();
        let logits = model.forward(&mut [RowInput {
            tokens: &[token],
            cache: &mut cache,
            logits_from: 0,
        }])?;
        next = ops::indexing::argmax_axis(&logits[0], -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
        let mut arrays = vec![&next];
        arrays.extend(cache.arrays());
        eval(arrays)?;
        if step >= 3 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let decode_ms = times[times.len() / 2] * 1e3;
    let result = serde_json::json!({
        "engine": "mlxhost",
        "compute": format!("{:?}", loaded.compute).to_lowercase(),
        "backend": mlxhost::runtime::backend_name(),
        "model": loaded.path,
        "prompt_tokens": args.prompt_tokens,
        "prefill_tok_s": args.prompt_tokens as f64 / prefill_s,
        "decode_ms_per_token": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
    });
    println!("{result}");
    Ok(())
}
