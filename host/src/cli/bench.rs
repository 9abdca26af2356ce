//! `mlxhost bench`: prefill throughput and per-token decode forward time of
//! the model alone (no sampling), for comparing compute paths and peers.
//! `benches/model_forward.sh` runs it beside mlx-lm on the same files;
//! `--batch N` measures a batched decode step (N rows in one forward).

use std::time::Instant;

use mlx_rs::{
    ops,
    transforms::{async_eval, eval},
    Array,
};
use mlxhost::cache::KvCache;
use mlxhost::model::arch::CausalLm;
use mlxhost::model::lora::LoraSet;
use mlxhost::model::RowInput;

use super::tensor_parallel::{self, TensorParallelArgs};
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
    /// Rows decoded together in each step (continuous batching's decode
    /// step: one forward for all rows, each with its own cache).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Decode after this many cached positions of random keys and values
    /// written straight into each row's cache instead of after the
    /// prompt's prefill: a decode step's cost at a long context without
    /// paying for its prefill (attention reads the same bytes whatever they
    /// hold). 0: decode after the prompt.
    #[arg(long, default_value_t = 0)]
    context: usize,
    /// Build each decode step from the previous step's tokens still on the
    /// device, before reading them (as `serve --decode-lookahead` and
    /// mlx-lm's generate loop do), so the host builds step N+1 while the
    /// device computes step N; a step's time is then the larger of the two.
    #[arg(long)]
    lookahead: bool,
    /// LoRA adapter folders (mlx-lm or PEFT): decode row i runs adapter
    /// `i % count` (unmerged: the delta beside the base products).
    #[arg(long)]
    lora: Vec<std::path::PathBuf>,
    /// A LoRA adapter folder merged into the weights at load (every row
    /// runs it at the base's cost).
    #[arg(long)]
    lora_merge: Option<std::path::PathBuf>,
    #[command(flatten)]
    tp: TensorParallelArgs,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let cluster = args.tp.start(&args.model)?;
    let mut loaded = tensor_parallel::load(&args.model, cluster)?;
    if let Some(dir) = &args.lora_merge {
        loaded.merge_lora(dir)?;
    }
    let adapters = args
        .lora
        .iter()
        .enumerate()
        .map(|(i, dir)| LoraSet::load_one(&format!("lora{i}"), dir, loaded.model.lora_targets()))
        .collect::<Result<Vec<_>, _>>()?;
    let model = &loaded.model;
    let vocab = model.config().vocab_size as u32;
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
            lora: None,
        }])?;
        let mut arrays: Vec<&Array> = logits.iter().collect();
        arrays.extend(cache.arrays());
        eval(arrays)?;
        prefill.push(started.elapsed().as_secs_f64());
    }
    prefill.sort_by(f64::total_cmp);
    let prefill_s = prefill[prefill.len() / 2];

    // Decode: `batch` rows, each prefilled with the prompt (shifted per
    // row), feed their argmax back one token per step; each step is one
    // forward for all rows and one evaluation.
    let batch = args.batch.max(1);
    let mut caches: Vec<_> = (0..batch).map(|_| model.new_cache()).collect();
    let mut next = Vec::with_capacity(batch);
    for (r, cache) in caches.iter_mut().enumerate() {
        if args.context > 0 {
            fill_random(model.as_ref(), cache, args.context)?;
            next.push((r as u32 * 7919 + 13) % vocab);
            continue;
        }
        let row_prompt: Vec<u32> = prompt.iter().map(|&t| (t + r as u32) % vocab).collect();
        let logits = model.forward(&mut [RowInput {
            tokens: &row_prompt,
            cache,
            logits_from: row_prompt.len() - 1,
            lora: None,
        }])?;
        let t =
            ops::indexing::argmax_axis(&logits[0], -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
        let mut arrays = vec![&t];
        arrays.extend(cache.arrays());
        eval(arrays)?;
        next.push(t.as_slice::<u32>()[0]);
    }
    // As `serve` does after its warm-up (the GPU was used above).
    mlxhost::busy_threads::isolate_from_caller_once();
    let mut times = Vec::new();
    let mut build_times = Vec::new();
    let mut census = None;
    static ONE_TOKEN: [u32; 1] = [0];
    let mut ahead: Option<Array> = None;
    for step in 0..args.decode_tokens + 3 {
        let started = Instant::now();
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut rows: Vec<RowInput<'_>> = caches
            .iter_mut()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (cache, t))| RowInput {
                tokens: t,
                cache,
                logits_from: 0,
                lora: (!adapters.is_empty()).then(|| &adapters[i % adapters.len()]),
            })
            .collect();
        let logits = match (&ahead, args.lookahead) {
            // This step's ids are the last step's argmax, still on the device.
            (Some(ids), true) => {
                for row in rows.iter_mut() {
                    row.tokens = &ONE_TOKEN;
                }
                model.forward_device_ids(&mut rows, ids)?
            }
            _ => model.forward(&mut rows)?,
        };
        drop(rows);
        let stacked = ops::concatenate(&logits, 0)?;
        let chosen =
            ops::indexing::argmax_axis(&stacked, -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
        let built = started.elapsed();
        let mut arrays = vec![&chosen];
        arrays.extend(caches.iter().flat_map(|c| c.arrays()));
        if step == 3 {
            census = Some(mlxhost::census::graph_census(&arrays)?);
        }
        if args.lookahead {
            // Start this step, then read the previous one's tokens (a
            // server streams them meanwhile).
            async_eval(arrays)?;
            if let Some(previous) = ahead.replace(chosen) {
                eval([&previous])?;
                next = previous.as_slice::<u32>().to_vec();
            }
        } else {
            eval(arrays)?;
            next = chosen.as_slice::<u32>().to_vec();
        }
        if step >= 3 {
            times.push(started.elapsed().as_secs_f64());
            build_times.push(built.as_secs_f64());
        }
    }
    build_times.sort_by(f64::total_cmp);
    let build_ms = build_times[build_times.len() / 2] * 1e3;
    let decode_mean_ms = times.iter().sum::<f64>() / times.len().max(1) as f64 * 1e3;
    times.sort_by(f64::total_cmp);
    let decode_ms = times[times.len() / 2] * 1e3;
    let result = serde_json::json!({
        "engine": "mlxhost",
        "compute": format!("{:?}", loaded.compute).to_lowercase(),
        "backend": mlxhost::runtime::backend_name(),
        "model": loaded.path,
        "prompt_tokens": args.prompt_tokens,
        "decode_context": if args.context > 0 { args.context } else { args.prompt_tokens },
        "prefill_tok_s": args.prompt_tokens as f64 / prefill_s,
        "batch": batch,
        "decode_ms_per_token": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
        "decode_ms_per_step": decode_ms,
        "decode_mean_ms_per_step": decode_mean_ms,
        // The fastest tenth of the steps: on a machine shared with other
        // work, the steps nothing else slowed (comparisons side by side).
        "decode_p10_ms_per_step": times[times.len() / 10] * 1e3,
        "decode_graph_build_ms": build_ms,
        "decode_step_primitives": census,
        "decode_aggregate_tok_s": batch as f64 * 1e3 / decode_ms,
        "lookahead": args.lookahead,
        "lora_adapters": adapters.len(),
        "lora_rank": adapters.iter().map(|a| a.rank).max(),
        "lora_merged": args.lora_merge.is_some(),
        "peak_rss_mib": peak_rss_mib(),
        "kv": caches[0].quant().map(|q| q.name()).unwrap_or_else(|| "float".into()),
        // Bytes the first row's cache holds per position (its allocation,
        // rounded up to the growth step, over the positions it holds).
        "kv_bytes_per_token": caches[0].nbytes() as f64 / caches[0].offset().max(1) as f64,
    });
    println!("{result}");
    Ok(())
}

/// Writes `n` positions of random keys and values (normal, in the model's
/// dtype; quantized as they are written under `--kv-bits`) into every
/// layer of `cache`, 4096 at a time, evaluated.
///
/// Errors: a model with recurrent-state layers (their states are not
/// positions); MLX errors.
fn fill_random(model: &dyn CausalLm, cache: &mut KvCache, n: usize) -> anyhow::Result<()> {
    if cache.has_recurrent() {
        anyhow::bail!(
            "--context: this model keeps recurrent states; decode after a real prompt instead"
        );
    }
    let shapes = model.kv_shapes();
    let mut done = 0;
    while done < n {
        let t = (n - done).min(4096) as i32;
        for (l, s) in shapes.iter().enumerate() {
            let shape = [1, s.kv_heads as i32, t, s.head_dim as i32];
            let k =
                mlx_rs::random::normal::<f32>(&shape, None, None, None)?.as_dtype(model.dtype())?;
            let v =
                mlx_rs::random::normal::<f32>(&shape, None, None, None)?.as_dtype(model.dtype())?;
            cache.update_view(l, &k, &v)?;
        }
        cache.advance(t as usize);
        eval(cache.arrays())?;
        done += t as usize;
    }
    Ok(())
}

/// Peak resident set size of this process in MiB (`VmHWM` in
/// `/proc/self/status`, Linux); `None` elsewhere.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
