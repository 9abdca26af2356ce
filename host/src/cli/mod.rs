//! Command-line interface: one file per command.

mod bench;
mod bench_chain;
mod config;
mod convert;
mod generate;
mod http_get;
mod models;
mod plugins;
mod score;
mod serve;
mod tensor_parallel;
mod tp_worker;

use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use mlxhost::model::{self, DtypeArg};

/// WebAssembly-plugin-extensible LLM inference host on MLX.
#[derive(Debug, Parser)]
#[command(name = "mlxhost", version, about)]
// A flag given twice keeps the last value: mlxhost.toml's settings come
// first, the command line's after them.
#[command(args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Teacher-forced log-likelihoods of given continuations (JSON lines in, JSON lines out).
    Score(score::ScoreArgs),
    /// Convert a GGUF checkpoint to the MLX model directory layout (loads in mlx-lm).
    Convert(convert::ConvertArgs),
    /// Measure prefill tok/s and decode forward time on this machine.
    Bench(bench::BenchArgs),
    /// Cost of choosing tokens through WASM plugins vs the same chain computed natively.
    BenchChain(bench_chain::BenchChainArgs),
    /// Generate a chat reply, every token chosen by a sampler plugin; streams to stdout.
    Generate(generate::GenerateArgs),
    /// Serve the model over HTTP; API dialects come from adapter plugins.
    Serve(Box<serve::ServeArgs>),
    /// Inspect a plugins directory.
    #[command(subcommand)]
    Plugins(plugins::PluginsCommand),
    /// List the known models and install one from its packages (`models pull NAME`).
    Models(models::ModelsArgs),
    /// One worker rank of a tensor-parallel server (`serve --tensor-parallel`).
    #[command(hide = true)]
    TpWorker(tp_worker::TpWorkerArgs),
}

/// Options shared by commands that load a model.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A `.gguf` file, an MLX model directory, or a known model's short
    /// name (`mlxhost models` lists them, e.g. `qwen2.5-coder-0.5b`).
    /// Default: SmolLM2-135M-Instruct as installed by scripts/setup.sh.
    #[arg(long, env = "MLXHOST_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute path: `auto` (float32 dequantized weights on CPU, the
    /// checkpoint's path on GPU), `native` (quantized weights, float16
    /// activations, mlx-lm's numerics), `float32`.
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
    /// Quantize the KV cache's keys and values to 8 or 4 bits (MLX affine
    /// quantization along the head dimension, as mlx-lm's
    /// `QuantizedKVCache`; full-attention layers only). Default: float.
    /// Alias `--kv-quant` (the seed's name).
    #[arg(long, alias = "kv-quant", value_name = "BITS")]
    pub kv_bits: Option<u32>,
    /// Elements sharing one scale and bias with `--kv-bits` (32, 64 or 128).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub kv_group_size: u32,
}

impl ModelArgs {
    /// The model path, defaulting to the installed SmolLM2. Errors: a
    /// known short name whose model is not installed.
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        match &self.model {
            None => Ok(model::default_model_path()),
            Some(m) => Ok(model::catalog::resolve(m)?),
        }
    }

    /// The short name when `--model` named a known model.
    pub fn known_name(&self) -> Option<&'static str> {
        let m = self.model.as_ref()?;
        if m.exists() {
            return None;
        }
        model::catalog::find(&m.to_string_lossy()).map(|k| k.name)
    }

    /// The KV scheme `--kv-bits`/`--kv-group-size` ask for (`None`:
    /// float). Errors: a value outside the schemes, naming the flag.
    pub fn kv_quant(&self) -> anyhow::Result<Option<mlxhost::cache::KvQuant>> {
        match self.kv_bits {
            None => Ok(None),
            Some(bits) => Ok(Some(mlxhost::cache::KvQuant::new(
                bits,
                self.kv_group_size,
            )?)),
        }
    }

    /// Loads the model, with a spinner on stderr.
    pub fn load(&self, keep_tensors: bool) -> anyhow::Result<model::LoadedModel> {
        self.load_with(keep_tensors, None)
    }

    /// [`ModelArgs::load`] of one rank's shard when `tensor_parallel` is
    /// given (`serve --tensor-parallel`, `tp-worker`).
    pub fn load_with(
        &self,
        keep_tensors: bool,
        tensor_parallel: Option<std::sync::Arc<mlxhost::distributed::Group>>,
    ) -> anyhow::Result<model::LoadedModel> {
        let path = self.path()?;
        let spinner = indicatif::ProgressBar::new_spinner();
        spinner.set_message(format!("loading {}", path.display()));
        spinner.enable_steady_tick(std::time::Duration::from_millis(120));
        let started = std::time::Instant::now();
        let loaded = model::load(
            &path,
            &model::LoadOptions {
                dtype: self.dtype,
                keep_tensors,
                tensor_parallel,
            },
        );
        spinner.finish_and_clear();
        // The flags are checked before the model's head dimension is.
        let quant = self.kv_quant()?;
        let loaded = loaded.map_err(|e| {
            if self.model.is_none() && matches!(e, model::ModelError::MissingFile(_)) {
                anyhow::anyhow!("{e}\n  (the default model is installed by scripts/setup.sh; or pass --model PATH)")
            } else {
                anyhow::anyhow!("{e}")
            }
        })?;
        let loaded = model::quantized_kv::with_kv_quant(loaded, quant)?;
        tracing::info!(
            path = %path.display(),
            compute = ?loaded.compute,
            kv = quant.map(|q| q.name()).unwrap_or_else(|| "float".into()),
            backend = mlxhost::runtime::backend_name(),
            weights_mib = loaded.model.nbytes() / (1 << 20),
            ms = started.elapsed().as_millis() as u64,
            "model loaded"
        );
        Ok(loaded)
    }
}

/// Parses arguments, runs the command, maps errors to exit code 1 with the
/// message on stderr.
/// Loads a plugins directory (warning about skipped folders on stderr) and
/// the model, and lends the model's vocabulary to the plugins: what the
/// one-shot commands that generate (`generate`, `bench-chain`) need.
pub fn load_plugins_and_model(
    plugins_dir: &std::path::Path,
    model: &ModelArgs,
) -> anyhow::Result<(mlxhost::plugin::PluginHost, model::LoadedModel)> {
    use anyhow::Context;
    let plugins = mlxhost::plugin::PluginHost::load_dir(
        plugins_dir,
        mlxhost::plugin::PluginLimits::default(),
    )
    .context("--plugins")?;
    for s in &plugins.skipped {
        eprintln!("warning: plugin {} skipped: {}", s.dir.display(), s.reason);
    }
    let loaded = model.load(false)?;
    plugins.set_vocab(std::sync::Arc::new(mlxhost::plugin::VocabView::new(
        loaded.tokenizer.clone(),
    )));
    Ok((plugins, loaded))
}

/// Parses the command line, with `mlxhost.toml` settings for `serve`.
fn parse() -> anyhow::Result<Cli> {
    let mut command = Cli::command();
    let known: Vec<String> = command
        .find_subcommand_mut("serve")
        .map(|c| {
            c.get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let args = config::with_config(std::env::args_os().collect(), &known)?;
    let matches = command
        .try_get_matches_from(args)
        .unwrap_or_else(|e| e.exit());
    Ok(Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit()))
}

pub fn run() -> std::process::ExitCode {
    let cli = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The server logs each request (with its id) by default; one-shot
    // commands only warn.
    let default_filter = match cli.command {
        Command::Serve(_) => "info,wasmtime=warn,cranelift=warn",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MLXHOST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Score(a) => score::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchChain(a) => bench_chain::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Serve(a) => serve::run(*a),
        Command::Plugins(c) => plugins::run(c),
        Command::Models(a) => models::run(a),
        Command::TpWorker(a) => tp_worker::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
