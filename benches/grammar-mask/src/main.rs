//! Run with `cargo run --release -p grammar-mask-bench -- [MODEL] [PLUGINS_DIR]`
//! (defaults: `qwen2.5-coder-0.5b`, `plugins`; build the plugins first with
//! `scripts/build-plugins.sh`).
//!
//! Measures the `grammar` constraint plugin on the model's real vocabulary,
//! in WASM through the host exactly as serving calls it (the per-model
//! instance, `ConstraintSession`) and natively (the plugin's own engine
//! modules compiled for this CPU): the engine build (the token trie, once
//! per model), the compile time of a typical tool schema, and the time of
//! each step's mask while walking a valid output token by token (the
//! model's own tokenization of a reference JSON value). Prints JSON lines.

#![cfg_attr(test, allow(clippy::unwrap_used))] // the included modules' unit tests

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

// The `grammar` plugin's engine modules, natively: the same source files
// the component is built from (they refer to each other as `crate::...`).
#[path = "../../../plugins/grammar/src/engine.rs"]
#[allow(dead_code)] // the bench uses part of the plugin's API
mod engine;
#[path = "../../../plugins/grammar/src/spec.rs"]
#[allow(dead_code)]
mod spec;
#[path = "../../../plugins/grammar/src/tokens.rs"]
mod tokens;
use mlxhost::plugin::constraint::{ConstraintSession, Grammar as WitGrammar};
use mlxhost::plugin::{PluginHost, PluginLimits, VocabView};

/// A typical tool schema (the shape of an agent's `edit_file` tool).
const SCHEMA: &str = r#"{"type": "object", "additionalProperties": false,
 "required": ["path", "edits", "dry_run"],
 "properties": {
  "path": {"type": "string", "pattern": "^[a-zA-Z0-9_./-]+$", "maxLength": 200},
  "edits": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
    "type": "object", "additionalProperties": false, "required": ["old", "new"],
    "properties": {"old": {"type": "string"}, "new": {"type": "string"},
                   "occurrence": {"type": "integer", "minimum": 1, "maximum": 100}}}},
  "dry_run": {"type": "boolean"},
  "mode": {"enum": ["replace", "insert_before", "insert_after"]}}}"#;

/// A value of [`SCHEMA`], in the layout the plugin enforces (`, ` / `: `).
const VALUE: &str = r#"{"path": "src/engine/step.rs", "edits": [{"old": "let x = 1;", "new": "let x = compute(y, 2);", "occurrence": 1}, {"old": "fn main() {}", "new": "fn main() {\n    run();\n}"}], "dry_run": false, "mode": "replace"}"#;

/// Median and 99th percentile, microseconds.
fn percentiles(mut d: Vec<Duration>) -> (f64, f64) {
    d.sort();
    let at = |q: f64| d[((d.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .map(String::as_str)
        .unwrap_or("qwen2.5-coder-0.5b");
    let plugins = args.get(1).map(String::as_str).unwrap_or("plugins");
    let path = mlxhost::model::catalog::resolve(std::path::Path::new(model))?;
    let tokenizer = mlxhost::model::load_tokenizer(&path)?;
    let ids = tokenizer.encode(VALUE)?;
    let eos = mlxhost::plugin::vocab::likely_eos_ids(&tokenizer);
    let vocab = std::sync::Arc::new(VocabView::new(tokenizer).with_model(eos, 0));
    let table = vocab.token_table();
    let steps = ids.len();
    let report = |path: &str, build: Duration, compile: Duration, masks: Vec<Duration>| {
        let (median, p99) = percentiles(masks);
        println!(
            "{}",
            serde_json::json!({
                "path": path, "model": model, "vocab": table.ends.len(), "steps": steps,
                "engine_build_ms": build.as_secs_f64() * 1e3,
                "schema_compile_ms": compile.as_secs_f64() * 1e3,
                "mask_us_median": median, "mask_us_p99": p99,
            })
        );
    };

    // Natively: the plugin's engine modules on this CPU.
    let native_table = tokens::TokenTable {
        bytes: table.bytes.clone(),
        ends: table.ends.clone(),
        eos: table.eos.clone(),
        special: table.special.clone(),
    };
    let t = Instant::now();
    let engine = engine::Engine::new(&native_table, "{}").map_err(|e| anyhow!(e))?;
    let build = t.elapsed();
    let t = Instant::now();
    let mut session = engine
        .session(&spec::Grammar::JsonSchema(SCHEMA.into()), "{}")
        .map_err(|e| anyhow!(e))?;
    let compile = t.elapsed();
    let mut masks = Vec::with_capacity(steps);
    for &id in &ids {
        let t = Instant::now();
        session.mask().map_err(|e| anyhow!(e))?;
        masks.push(t.elapsed());
        session.accept(id).map_err(|e| anyhow!(e))?;
    }
    report("native", build, compile, masks);

    // In WASM, through the host (the per-model instance serving uses).
    let host = PluginHost::load_dir(std::path::Path::new(plugins), PluginLimits::default())
        .context("--plugins")?;
    host.set_vocab(vocab.clone());
    let shared = host.constraint("grammar")?;
    let t = Instant::now();
    shared.lock().map_err(|_| anyhow!("poisoned"))?.warm()?;
    let build = t.elapsed();
    let t = Instant::now();
    let session =
        ConstraintSession::open(shared, WitGrammar::JsonSchema(SCHEMA.into()), "{}".into())
            .map_err(|e| anyhow!("{e:?}"))?;
    let compile = t.elapsed();
    let mut masks = Vec::with_capacity(steps);
    for &id in &ids {
        let t = Instant::now();
        session.mask()?;
        masks.push(t.elapsed());
        session.accept(id)?;
    }
    report("wasm", build, compile, masks);
    Ok(())
}
