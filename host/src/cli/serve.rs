//! `mlxhost serve`: the HTTP server. Routes come from API adapter plugins
//! (`--plugins`); `/health` is the host's.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use mlxhost::cache::SsdConfig;
use mlxhost::engine::admission::MemoryBudget;
use mlxhost::engine::scheduler::{
    Lookahead, DEFAULT_BATCH, DEFAULT_PREFILL_BUDGET, GPU_PREFILL_BUDGET,
};
use mlxhost::engine::worker::CacheConfig;
use mlxhost::engine::SchedulerConfig;
use mlxhost::plugin::{Kind, LivePlugins, PluginLimits};
use mlxhost::server::{self, Defaults, ServeConfig};

use super::tensor_parallel::{self, TensorParallelArgs};
use super::ModelArgs;

/// Arguments of `mlxhost serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Settings file (`[serve]` table: these flags without the dashes);
    /// default `./mlxhost.toml` when present. Command-line flags win.
    #[arg(long, env = "MLXHOST_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Plugins directory (one folder per plugin): samplers, processors and
    /// the API adapters whose routes are served.
    #[arg(long, default_value = "plugins", env = "MLXHOST_PLUGINS")]
    plugins: PathBuf,
    /// Address to listen on (loopback by default; `0.0.0.0` exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model id clients see (`model` in responses, `/v1/models`);
    /// default: the model file or directory name.
    #[arg(long, alias = "served-model-name")]
    model_id: Option<String>,
    /// Default sampler plugin when a request names none.
    #[arg(long, default_value = "standard")]
    sampler: String,
    /// Default temperature when a request omits it (OpenAI's default is 1.0).
    #[arg(long, alias = "temperature", default_value_t = 1.0)]
    temp: f32,
    /// Default top-p when a request omits it (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Default top-k when a request omits it (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Default min-p when a request omits it (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Default seed when a request omits it (none: a fresh seed per request).
    #[arg(long)]
    seed: Option<u64>,
    /// Cap on generated tokens when a request omits `max_tokens`.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// System message added to requests that have none.
    #[arg(long, alias = "system-prompt")]
    system: Option<String>,
    /// Tool-call parser plugin for requests with `tools` that name none
    /// (`hermes`, `llama3-json`, `mistral`, `qwen3-coder`, `pythonic`, or
    /// any loaded tool-call-parser plugin); `none` turns parsing off.
    /// Default: the parser whose template markers the chat template holds.
    #[arg(long, alias = "tool-call-parser")]
    tool_parser: Option<String>,
    /// Reasoning parser plugin for requests that name none (`think`);
    /// `none` turns it off. Default: chosen from the chat template.
    #[arg(long)]
    reasoning_parser: Option<String>,
    /// Largest accepted request body, MiB (larger: 413).
    #[arg(long, default_value_t = 32)]
    body_limit: usize,
    /// Most request bodies over 1 MiB read and prepared at once; more wait
    /// (up to --body-timeout, then a 503). Smaller bodies never wait.
    #[arg(long, value_name = "N", default_value_t = 1)]
    large_bodies: usize,
    /// Most requests prepared at once (the API adapter's parse, the chat
    /// template, the tokenizer; `count_tokens` too); more wait in order.
    /// Default: half the CPUs (at least 1), so preparation never takes
    /// every core from the engine (measured: docs/benchmarks.md, soak).
    #[arg(long, value_name = "N")]
    prepare_concurrency: Option<usize>,
    /// Most JSON values (array elements, object members, containers) a
    /// request body may hold; more get a 413 before the adapter parses it.
    #[arg(long, value_name = "N", default_value_t = 200_000)]
    max_json_values: usize,
    /// Most prompt characters tokenized per request; a longer prompt gets a
    /// 400 before tokenizing. 0: 32 per token of the model's context.
    #[arg(long, value_name = "CHARS", default_value_t = 0)]
    max_prompt_chars: usize,
    /// Reject a request whose `max_tokens` exceeds what the context leaves
    /// after its prompt (400), as OpenAI's API does. Without it, such a
    /// `max_tokens` is an upper bound in every dialect (agents send large
    /// fixed values: Claude Code 32000, opencode 32000).
    #[arg(long)]
    strict_max_tokens: bool,
    /// Keep client metadata in the prompt verbatim. Without it, adapters
    /// drop blocks that are not instructions to the model and change per
    /// session (Claude Code's `x-anthropic-billing-header` system block),
    /// so an agent's unchanged system prompt is reused from the prompt
    /// cache across sessions (docs/anthropic.md).
    #[arg(long)]
    keep_prompt_metadata: bool,
    /// After SIGTERM/SIGINT, seconds in-flight requests may take to finish
    /// before they are cancelled.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// How often the plugins directory is checked for changes, ms (changed
    /// plugins apply to new requests); 0 turns hot reload off.
    #[arg(long, default_value_t = 1000)]
    plugins_poll_ms: u64,
    /// RAM prompt cache: KV of finished requests reused for the longest
    /// shared prefix of new prompts, capped at this many GiB (0 disables it).
    /// Default: 8 GiB (llama.cpp's `--cache-ram`) or a quarter of the memory
    /// available at start, whichever is less, at least 1 GiB (and at most a
    /// quarter of `--memory-limit` where one applies). An agent's
    /// ~19k-token prompt holds ~1 GiB of KV on Qwen2.5-1.5B (float32), so
    /// the old 1 GiB kept none of it.
    #[arg(long)]
    prompt_cache: Option<f64>,
    /// A folder of LoRA adapters (one subfolder each, mlx-lm or PEFT
    /// format), served beside the base model: a request picks one by
    /// model name (`base:adapter` or `adapter`) or its `lora` field; the
    /// folder is watched (adapters added, changed and removed while
    /// serving). `GET /v1/models` lists them.
    #[arg(long, value_name = "DIR")]
    lora_dir: Option<PathBuf>,
    /// A LoRA adapter folder merged into the weights at load: every
    /// request runs it, at the base model's cost (for serving one adapter
    /// only; quantized weights are re-quantized after the merge).
    #[arg(long, value_name = "DIR")]
    lora_merge: Option<PathBuf>,
    #[command(flatten)]
    tp: TensorParallelArgs,
    /// SSD cache directory: prompt-cache entries are written here (on RAM
    /// eviction, and once requests settle) and restored after restarts;
    /// created private to the user. Off when not given.
    #[arg(long, value_name = "DIR")]
    ssd_cache: Option<PathBuf>,
    /// Byte cap of the SSD cache directory, GiB (every model's entries; the
    /// least recently used go first).
    #[arg(long, value_name = "GiB", default_value_t = 16.0)]
    ssd_cache_max: f64,
    /// Verify every tensor's checksum before an SSD entry is used (reads
    /// the whole entry first; the header is always verified).
    #[arg(long)]
    ssd_cache_verify: bool,
    /// How long no request may arrive before unwritten cache entries are
    /// written to the SSD cache (write-behind once requests settle), ms.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    ssd_cache_settle_ms: u64,
    /// How long a stored response (OpenAI Responses `store`) is kept after
    /// it is written, seconds; 0 keeps none (`previous_response_id` then
    /// gets a 404). Kept in `--ssd-cache`'s `responses/` folder across
    /// restarts when that is set, else in RAM.
    #[arg(long, value_name = "SECONDS", default_value_t = 86_400)]
    response_store_ttl: u64,
    /// Byte cap of the stored responses, MiB (the least recently used go
    /// first).
    #[arg(long, value_name = "MiB", default_value_t = 256)]
    response_store_max: u64,
    /// Most generations queued or running at once; more get a 503 (each
    /// holds plugin instances from a shared pool of 512).
    #[arg(long, default_value_t = 128)]
    max_queue: usize,
    /// Most requests decoded together in one step (continuous batching);
    /// 1 serves requests one after another. Requests beyond it wait.
    #[arg(long, alias = "decode-concurrency", default_value_t = DEFAULT_BATCH)]
    batch: usize,
    /// Prompt tokens prefilled per step while other requests decode (chunked
    /// prefill: a long prompt joins the batch a chunk at a time instead of
    /// freezing the running streams). Default: 256 on the CPU backend, 2048
    /// on a GPU (where a 2048-token piece takes milliseconds).
    #[arg(long, alias = "prefill-step-size")]
    prefill_budget: Option<usize>,
    /// Start each decode step before the previous one's tokens are read, so
    /// the host builds step N+1 while the device computes step N (for rows
    /// whose plugins all declare `history_free`: the standard sampler and
    /// logit_bias): `auto` (default), `on` (also the bare flag) or `off`.
    /// `auto` turns it on with a GPU backend for models of 1 GiB of weights
    /// or more: measured on an H100, it took the 8B shape's batch-1 step
    /// from 6.67 to 3.80 ms; a SmolLM2 step, bound by launching kernels,
    /// got slower with it, and the CPU's steps gain nothing
    /// (docs/benchmarks.md).
    #[arg(
        long,
        env = "MLXHOST_DECODE_LOOKAHEAD",
        value_name = "auto|on|off",
        num_args = 0..=1,
        default_value = "auto",
        default_missing_value = "on",
        value_parser = parse_lookahead
    )]
    decode_lookahead: Lookahead,
    /// While requests share a batch step: the most any one plugin call may
    /// take (a row over it fails), and the plugin time after which the
    /// step's remaining rows run their chains at the next step instead.
    /// A request alone in the batch keeps the plugins' own deadlines.
    #[arg(long, value_name = "MS", default_value_t = 50)]
    plugin_step_ms: u64,
    /// Linear memory cap per sampler/processor instance, MiB.
    #[arg(long, default_value_t = 64)]
    plugin_memory: usize,
    /// Linear memory cap per API-adapter instance, MiB.
    #[arg(long, default_value_t = 256)]
    adapter_memory: usize,
    /// Linear memory cap of a constraint plugin's per-model instance, MiB
    /// (the token trie plus every constrained row's parser).
    #[arg(long, default_value_t = 512)]
    constraint_memory: usize,
    /// The constraint plugin that enforces structured output (JSON Schema,
    /// regex, grammars) when a request names none.
    #[arg(long, value_name = "NAME", default_value = "grammar")]
    grammar_plugin: String,
    /// Speculative decoding: the drafter plugin a request gets when it
    /// names none (e.g. `prompt-lookup`; `none`: off). Output is unchanged,
    /// only its speed; see docs/speculative.md.
    #[arg(long, value_name = "NAME", default_value = "none")]
    drafter: String,
    /// The most tokens drafted per step when a request does not say
    /// (llama.cpp's `--draft-max`); each row adapts its draft length below
    /// it from its acceptance rate.
    #[arg(long, alias = "draft", value_name = "N", default_value_t = mlxhost::engine::speculative::DEFAULT_DRAFT_MAX)]
    draft_max: usize,
    /// Speculative decoding with a draft model: a smaller model sharing
    /// the target's tokenizer (a `.gguf` file, an MLX directory or a known
    /// short name, loaded as `--model` is), run in the engine as the
    /// `draft-model` drafter (`--drafter draft-model` makes it the
    /// default). Its vocabulary is checked against the target's.
    #[arg(long, value_name = "PATH")]
    draft_model: Option<PathBuf>,
    /// Deadline per sampler call, ms.
    #[arg(long, default_value_t = 1000)]
    sampler_deadline_ms: u64,
    /// Deadline per logits-processor call, ms.
    #[arg(long, default_value_t = 1000)]
    processor_deadline_ms: u64,
    /// Deadline per API-adapter call, ms.
    #[arg(long, default_value_t = 1000)]
    adapter_deadline_ms: u64,
    /// API key clients must send (`Authorization: Bearer KEY` or
    /// `x-api-key: KEY`); repeatable. `/health` stays open; `/stats` and
    /// `/metrics` need it too. None given: no key needed.
    #[arg(long = "api-key", value_name = "KEY", env = "MLXHOST_API_KEY")]
    api_keys: Vec<String>,
    /// File of API keys, one per line (`#` comments and blank lines
    /// skipped); added to `--api-key`.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Host names the server answers to (the `Host` header, without port;
    /// comma-separated; `*` = any). Default: loopback names on a loopback
    /// bind (a DNS-rebinding defence), any host otherwise.
    #[arg(long, value_name = "HOSTS", value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>>,
    /// Browser origins allowed to call the server (`https://app.example`,
    /// comma-separated; `*` = any), with CORS preflights answered. Default:
    /// none (a request carrying another `Origin` gets a 403).
    #[arg(long, value_name = "ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Longest wait for a request's headers, seconds (also how long an idle
    /// keep-alive connection stays open).
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    header_timeout: u64,
    /// Longest wait for a request's body once its headers arrived, seconds
    /// (a shorter body than declared, or an unterminated chunked body, gets
    /// a 408).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    body_timeout: u64,
    /// Most client connections open at once; more wait to be accepted.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Longest a generation may take from its arrival, queueing included,
    /// seconds; past it the generation is stopped and the client gets a
    /// 504 (or the dialect's stream error). 0 = no limit.
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    request_timeout: u64,
    /// Memory the running requests' KV caches and prefill activations may
    /// take together, GiB. A request that could never fit gets a 400
    /// naming `max_tokens`; one that fits once others finish waits. 0 =
    /// no check. Default: inside `--memory-limit` where one applies (the
    /// limit less the weights, `--memory-cache` and `--prompt-cache`), else
    /// 90% of the memory available once the model is loaded, less
    /// `--prompt-cache` (no check where that cannot be read).
    #[arg(long, value_name = "GIB")]
    memory_budget: Option<f64>,
    /// MLX's memory limit, GiB: weights, KV caches, activations and MLX's
    /// buffer cache together (vLLM's `--gpu-memory-utilization` as a size).
    /// Default on a GPU: 90% of the device's memory; on the CPU backend
    /// none. Two servers on one card need limits that fit together.
    #[arg(long, value_name = "GIB")]
    memory_limit: Option<f64>,
    /// Cap of MLX's buffer cache (freed buffers kept for reuse), GiB.
    /// Default: a tenth of `--memory-limit`. Unbounded, it held 79 of an
    /// H100's 80 GB after warm-up for a 17 GB model.
    #[arg(long, value_name = "GIB")]
    memory_cache: Option<f64>,
    /// How long a stream may be silent (a long prefill) before a keep-alive
    /// is sent: the adapter's keep-alive event (Anthropic's `ping`) or an
    /// SSE comment. Seconds, at least 1.
    #[arg(long, value_name = "SECONDS", default_value_t = 15)]
    sse_keep_alive: u64,
}

/// The access policy the flags ask for.
fn access_policy(args: &ServeArgs) -> anyhow::Result<server::access::AccessPolicy> {
    let mut keys: Vec<String> = args.api_keys.iter().map(|k| k.trim().to_string()).collect();
    if let Some(file) = &args.api_key_file {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("--api-key-file {}", file.display()))?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
        if keys.is_empty() {
            anyhow::bail!("--api-key-file {}: no keys in the file", file.display());
        }
    }
    if keys.iter().any(String::is_empty) {
        anyhow::bail!("--api-key must not be empty");
    }
    let lower = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let allowed_hosts = match &args.allowed_hosts {
        Some(h) => {
            let mut hosts = server::access::default_allowed_hosts(args.host).unwrap_or_default();
            hosts.extend(lower(h));
            Some(hosts)
        }
        None => server::access::default_allowed_hosts(args.host),
    };
    Ok(server::access::AccessPolicy {
        api_keys: keys,
        allowed_hosts,
        allowed_origins: lower(&args.allowed_origins),
    })
}

/// `--prompt-cache`'s default, GiB: 8 or a quarter of `available` bytes,
/// whichever is less, at least 1 (1 where available memory is unknown);
/// within a memory limit (`limit` bytes) at most a quarter of it.
fn default_prompt_cache_gib(available: Option<u64>, limit: Option<u64>) -> f64 {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let quarter = available.map_or(1.0, |b| gib(b) / 4.0).clamp(1.0, 8.0);
    limit.map_or(quarter, |l| quarter.min(gib(l) / 4.0))
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.temp.is_nan() || args.temp < 0.0 {
        anyhow::bail!("--temp must be >= 0, got {}", args.temp);
    }
    if !(args.ssd_cache_max > 0.0 && args.ssd_cache_max.is_finite()) {
        anyhow::bail!(
            "--ssd-cache-max must be a size in GiB > 0, got {}",
            args.ssd_cache_max
        );
    }
    for (flag, v) in [("--top-p", args.top_p), ("--min-p", args.min_p)] {
        if !(0.0..=1.0).contains(&v) {
            anyhow::bail!("{flag} must be in [0, 1], got {v}");
        }
    }
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    if args.batch == 0 {
        anyhow::bail!("--batch must be at least 1 (1 = one request at a time)");
    }
    if args.prefill_budget == Some(0) {
        anyhow::bail!("--prefill-budget must be at least 1 token");
    }
    // Before plugins and the HTTP runtime start threads: forming the group
    // sets MLX's environment variables.
    let mut cluster = start_cluster(&args)?;
    // A cache directory another server holds, or one that is not private,
    // refuses the start now, before plugins, the port and the model.
    if let Some(dir) = &args.ssd_cache {
        mlxhost::cache::SsdCache::check_usable(&SsdConfig {
            dir: dir.clone(),
            max_bytes: 0,
            verify: false,
        })
        // The message already names the directory and the cause.
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let max_mib = PluginLimits::MAX_MEMORY_BYTES >> 20;
    for (flag, mib) in [
        ("--plugin-memory", args.plugin_memory),
        ("--adapter-memory", args.adapter_memory),
        ("--constraint-memory", args.constraint_memory),
    ] {
        if mib == 0 || mib > max_mib {
            anyhow::bail!("{flag} must be in 1..={max_mib} MiB, got {mib}");
        }
    }
    let limits = PluginLimits {
        memory_bytes: args.plugin_memory << 20,
        adapter_memory_bytes: args.adapter_memory << 20,
        constraint_memory_bytes: args.constraint_memory << 20,
        sampler_deadline: Duration::from_millis(args.sampler_deadline_ms.max(1)),
        processor_deadline: Duration::from_millis(args.processor_deadline_ms.max(1)),
        adapter_deadline: Duration::from_millis(args.adapter_deadline_ms.max(1)),
    };
    let live = LivePlugins::load(&args.plugins, limits).context("--plugins")?;
    if args.plugins_poll_ms > 0 {
        live.watch(Duration::from_millis(args.plugins_poll_ms))
            .context("starting the plugin reload thread")?;
    }
    let plugins = live.current();
    for s in &plugins.skipped {
        eprintln!("warning: plugin {} skipped: {}", s.dir.display(), s.reason);
    }
    let draft_model_path = match &args.draft_model {
        Some(p) if args.tp.tensor_parallel > 1 => {
            anyhow::bail!(
                "--draft-model {}: not with --tensor-parallel yet (the draft model runs on one rank)",
                p.display()
            )
        }
        Some(p) => Some(
            mlxhost::model::catalog::resolve(p)
                .with_context(|| format!("--draft-model {}", p.display()))?,
        ),
        None => None,
    };
    if args.drafter == mlxhost::engine::draft_model::DRAFTER_NAME {
        if draft_model_path.is_none() {
            anyhow::bail!(
                "--drafter {}: needs --draft-model PATH (the model that drafts)",
                args.drafter
            );
        }
    } else if args.drafter != "none" {
        if let Err(e) = plugins.get(&args.drafter, Kind::Drafter) {
            anyhow::bail!("--drafter {}: {e}", args.drafter);
        }
    }
    if args.draft_max > mlxhost::plugin::services::MAX_DRAFT_TOKENS as usize {
        anyhow::bail!(
            "--draft-max {}: at most {} draft tokens per step",
            args.draft_max,
            mlxhost::plugin::services::MAX_DRAFT_TOKENS
        );
    }
    if let Err(e) = plugins.get(&args.sampler, Kind::Sampler) {
        anyhow::bail!("--sampler {}: {e}", args.sampler);
    }
    for (flag, value, kind) in [
        ("--tool-parser", &args.tool_parser, Kind::ToolCallParser),
        (
            "--reasoning-parser",
            &args.reasoning_parser,
            Kind::ReasoningParser,
        ),
    ] {
        if let Some(name) = value.as_deref().filter(|n| *n != "none") {
            if let Err(e) = plugins.get(name, kind) {
                anyhow::bail!("{flag} {name}: {e}");
            }
        }
    }
    let adapters = plugins
        .plugins
        .values()
        .filter(|p| p.manifest.kinds.contains(&Kind::ApiAdapter))
        .count();
    if adapters == 0 {
        eprintln!(
            "warning: no API adapter plugin in {}: only /health is served",
            args.plugins.display()
        );
    }
    let model_args = args.model.clone();
    let path = model_args.path()?;
    let known = model_args.known_name();
    let model_id = args
        .model_id
        .clone()
        .or(known.map(String::from))
        .unwrap_or_else(|| {
            let name = if path.is_dir() {
                path.file_name()
            } else {
                path.file_stem()
            };
            name.map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
    let lora_dir = args.lora_dir.clone();
    let lora_merge = args.lora_merge.clone();
    let has_draft_model = draft_model_path.is_some();
    let load = Box::new(move || {
        // The draft model loads first: loading sets process-wide numerics
        // switches (the quantized prefill's precision) from the checkpoint,
        // and the target's must win.
        let draft = match &draft_model_path {
            Some(p) => Some(
                mlxhost::model::load(
                    p,
                    &mlxhost::model::LoadOptions {
                        dtype: model_args.dtype,
                        ..Default::default()
                    },
                )
                .map_err(|e| format!("--draft-model {}: {e}", p.display()))?,
            ),
            None => None,
        };
        let mut m =
            tensor_parallel::load(&model_args, cluster.take()).map_err(|e| format!("{e:#}"))?;
        if let Some(d) = draft {
            mlxhost::engine::draft_model::attach(&mut m, d).map_err(|e| e.to_string())?;
        }
        if let Some(dir) = &lora_merge {
            m.merge_lora(dir)
                .map_err(|e| format!("--lora-merge {}: {e}", dir.display()))?;
        }
        if let Some(dir) = &lora_dir {
            m.lora = mlxhost::model::lora::LoraSet::open(dir, m.model.lora_targets())
                .map_err(|e| format!("--lora-dir: {e}"))?;
        }
        Ok((m, model_id))
    });
    let access = access_policy(&args)?;
    if args.header_timeout == 0 || args.body_timeout == 0 {
        anyhow::bail!("--header-timeout and --body-timeout must be at least 1 second");
    }
    if args.sse_keep_alive == 0 {
        anyhow::bail!("--sse-keep-alive must be at least 1 second");
    }
    if args.max_connections == 0 {
        anyhow::bail!("--max-connections must be at least 1");
    }
    let gpu = mlxhost::runtime::gpu_available();
    let limits = mlxhost::device_memory::MemoryLimits::resolve(
        args.memory_limit,
        args.memory_cache,
        gpu,
        mlxhost::device_memory::device_bytes(),
    )
    .map_err(anyhow::Error::msg)?;
    let prompt_cache_gib = match args.prompt_cache {
        Some(g) if !(g >= 0.0 && g.is_finite()) => {
            anyhow::bail!("--prompt-cache must be a size in GiB >= 0, got {g}")
        }
        Some(g) => g,
        None => default_prompt_cache_gib(
            mlxhost::runtime::available_memory_bytes(),
            limits.map(|l| l.limit),
        ),
    };
    if let Some(l) = limits {
        l.apply();
        tracing::info!(
            limit_gib = format!("{:.2}", l.limit as f64 / (1u64 << 30) as f64),
            cache_gib = format!("{:.2}", l.cache_limit as f64 / (1u64 << 30) as f64),
            "MLX memory limits set"
        );
    }
    let memory_budget = match args.memory_budget {
        Some(g) if !(g >= 0.0 && g.is_finite()) => {
            anyhow::bail!("--memory-budget must be a size in GiB >= 0, got {g}")
        }
        Some(0.0) => MemoryBudget::Off,
        Some(g) => MemoryBudget::Bytes((g * (1u64 << 30) as f64) as u64),
        None => {
            let keep = (prompt_cache_gib * (1u64 << 30) as f64) as u64;
            match limits {
                Some(limits) => MemoryBudget::Device { limits, keep },
                None => MemoryBudget::Auto { keep },
            }
        }
    };
    let response_store = open_response_store(&args)?;
    // Backend-dependent scheduling defaults (libmlx is loaded by now).
    let config = ServeConfig {
        addr: SocketAddr::new(args.host, args.port),
        plugins: live.clone(),
        defaults: Defaults {
            temperature: args.temp,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
            max_tokens: args.max_tokens,
            sampler: args.sampler.clone(),
            system: args.system.clone(),
            tool_parser: args.tool_parser.clone(),
            reasoning_parser: args.reasoning_parser.clone(),
            max_prompt_chars: args.max_prompt_chars,
            strict_max_tokens: args.strict_max_tokens,
            keep_prompt_metadata: args.keep_prompt_metadata,
            grammar_plugin: args.grammar_plugin.clone(),
            drafter: (args.drafter != "none").then(|| args.drafter.clone()),
            draft_max: args.draft_max,
            draft_model: has_draft_model,
        },
        body_limit: args.body_limit << 20,
        intake: mlxhost::server::intake::Intake::new(
            args.large_bodies,
            args.prepare_concurrency.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
            }),
            args.max_json_values,
            Duration::from_secs(args.body_timeout),
        ),
        drain: Duration::from_secs(args.shutdown_timeout),
        caches: CacheConfig {
            prompt_cache_bytes: (prompt_cache_gib * (1u64 << 30) as f64) as usize,
            ssd: args.ssd_cache.clone().map(|dir| SsdConfig {
                dir,
                max_bytes: (args.ssd_cache_max * (1u64 << 30) as f64) as u64,
                verify: args.ssd_cache_verify,
            }),
            settle: Duration::from_millis(args.ssd_cache_settle_ms),
        },
        max_queue: args.max_queue.max(1),
        response_store,
        access,
        connections: server::listen::ConnectionLimits {
            header_timeout: Duration::from_secs(args.header_timeout),
            max_connections: args.max_connections,
        },
        body_timeout: Duration::from_secs(args.body_timeout),
        request_timeout: (args.request_timeout > 0)
            .then(|| Duration::from_secs(args.request_timeout)),
        sse_keep_alive: Duration::from_secs(args.sse_keep_alive),
        schedule: SchedulerConfig {
            max_batch: args.batch,
            prefill_budget: args.prefill_budget.unwrap_or(if gpu {
                GPU_PREFILL_BUDGET
            } else {
                DEFAULT_PREFILL_BUDGET
            }),
            prefill_chunk: if gpu {
                GPU_PREFILL_BUDGET
            } else {
                SchedulerConfig::default().prefill_chunk
            },
            memory_budget,
            decode_lookahead: args.decode_lookahead,
            plugin_step: Duration::from_millis(args.plugin_step_ms.max(1)),
        },
    };
    let summary_plugins = live.clone();
    server::run(config, load, move |ready| {
        let f = &ready.frontend;
        eprintln!(
            "mlxhost: serving {} ({} compute, context {} tokens) at http://{}",
            f.model_id, f.compute, f.context, ready.addr
        );
        for p in summary_plugins.current().plugins.values() {
            let kinds: Vec<String> = p.manifest.kinds.iter().map(|k| k.to_string()).collect();
            eprintln!("  plugin {:<16} {}", p.manifest.name, kinds.join(", "));
        }
        eprintln!("  route  GET  /health");
        for (method, path, adapter) in &ready.routes {
            eprintln!("  route  {method:<4} {path}  ({adapter})");
        }
    })?;
    Ok(())
}

/// Brings up the tensor-parallel group `--tensor-parallel` asks for
/// (`None` for one rank), refusing the flags it does not support yet.
fn start_cluster(
    args: &ServeArgs,
) -> anyhow::Result<Option<mlxhost::distributed::launch::Cluster>> {
    if args.tp.tensor_parallel > 1 {
        for (flag, set) in [
            ("--ssd-cache", args.ssd_cache.is_some()),
            ("--lora-dir", args.lora_dir.is_some()),
            ("--lora-merge", args.lora_merge.is_some()),
        ] {
            if set {
                anyhow::bail!(
                    "--tensor-parallel does not support {flag} yet (docs/distributed.md)"
                );
            }
        }
    }
    args.tp.start(&args.model)
}

/// The response store the flags ask for: none with `--response-store-ttl
/// 0`, on disk under `--ssd-cache`'s `responses/` folder, else in RAM.
fn open_response_store(
    args: &ServeArgs,
) -> anyhow::Result<Option<std::sync::Arc<mlxhost::cache::ResponseStore>>> {
    use mlxhost::cache::{ResponseStore, ResponseStoreConfig};
    if args.response_store_ttl == 0 || args.response_store_max == 0 {
        return Ok(None);
    }
    let dir = args.ssd_cache.as_ref().map(|d| d.join("responses"));
    let store = ResponseStore::open(ResponseStoreConfig {
        ttl: Duration::from_secs(args.response_store_ttl),
        max_bytes: args.response_store_max << 20,
        dir: dir.clone(),
    })
    .map_err(|e| {
        let where_ = dir.map(|d| d.display().to_string()).unwrap_or_default();
        anyhow::anyhow!("cannot open the response store {where_} (--ssd-cache): {e}")
    })?;
    Ok(Some(std::sync::Arc::new(store)))
}

/// `--decode-lookahead`'s value (clap's parser; the error names the values).
fn parse_lookahead(text: &str) -> Result<Lookahead, String> {
    Lookahead::parse(text).ok_or_else(|| format!("`{text}`: expected auto, on or off"))
}

#[cfg(test)]
mod tests {
    use super::default_prompt_cache_gib;

    #[test]
    fn prompt_cache_default_is_a_quarter_of_available_memory_within_1_and_8_gib() {
        let gib = |g: u64| Some(g << 30);
        assert_eq!(default_prompt_cache_gib(gib(20), None), 5.0);
        assert_eq!(default_prompt_cache_gib(gib(64), None), 8.0);
        assert_eq!(default_prompt_cache_gib(gib(2), None), 1.0);
        assert_eq!(default_prompt_cache_gib(None, None), 1.0);
        // Within --memory-limit: at most a quarter of it.
        assert_eq!(default_prompt_cache_gib(gib(20), gib(4)), 1.0);
        assert_eq!(default_prompt_cache_gib(gib(20), gib(2)), 0.5);
        assert_eq!(default_prompt_cache_gib(gib(64), gib(72)), 8.0);
    }
}
