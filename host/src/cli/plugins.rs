//! `mlxhost plugins list|check [DIR]`.

use std::path::PathBuf;

use mlxhost::plugin::{PluginHost, PluginLimits};

/// Arguments of `mlxhost plugins`.
#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// What loads from DIR: name, kinds, WIT version; and why anything is rejected.
    List {
        /// Plugins directory.
        #[arg(default_value = "plugins")]
        dir: PathBuf,
        /// Also show what a running server holds (`GET /stats`): the plugins
        /// it serves, and those whose new file failed to load on hot reload
        /// (the last good version is kept), e.g. `http://127.0.0.1:8080`.
        #[arg(long)]
        server: Option<String>,
        /// API key for `--server` (sent as `Authorization: Bearer KEY`).
        #[arg(long, env = "MLXHOST_API_KEY")]
        api_key: Option<String>,
    },
    /// As `list`, plus a smoke call per plugin (a session and one step on
    /// synthetic logits); exits non-zero when anything is rejected or fails.
    Check {
        /// Plugins directory.
        #[arg(default_value = "plugins")]
        dir: PathBuf,
        /// Model whose vocabulary the smoke calls see (plugins using the
        /// `vocab` interface need one); default: the installed default model
        /// when present.
        #[arg(long, env = "MLXHOST_MODEL")]
        model: Option<PathBuf>,
    },
}

pub fn run(cmd: PluginsCommand) -> anyhow::Result<()> {
    let (dir, check, model) = match cmd {
        PluginsCommand::List {
            server: Some(url),
            api_key,
            ..
        } => return print_server_plugins(&url, api_key.as_deref()),
        PluginsCommand::List { dir, .. } => (dir, false, None),
        PluginsCommand::Check { dir, model } => (dir, true, model),
    };
    {
        {
            let host = std::sync::Arc::new(PluginHost::load_dir(&dir, PluginLimits::default())?);
            if check {
                let path = match model {
                    Some(m) => mlxhost::model::catalog::resolve(&m)?,
                    None => mlxhost::model::default_model_path(),
                };
                match mlxhost::model::load_tokenizer(&path) {
                    Ok(t) => {
                        // No model config here: EOS is the tokenizer's end-of-turn or
                        // end-of-text token, enough for a constraint plugin's smoke call.
                        let eos = mlxhost::plugin::vocab::likely_eos_ids(&t);
                        host.set_vocab(std::sync::Arc::new(
                            mlxhost::plugin::VocabView::new(t).with_model(eos, 0),
                        ))
                    }
                    Err(e) => println!("note: no vocabulary for the smoke calls ({e}); plugins using `vocab` will fail"),
                }
            }
            let mut failed = host.skipped.len();
            for p in host.plugins.values() {
                let kinds: Vec<String> = p.manifest.kinds.iter().map(|k| k.to_string()).collect();
                println!(
                    "ok       {:<16} {:<8} {:<20} {:<24} {}",
                    p.manifest.name,
                    p.manifest.version,
                    kinds.join(","),
                    p.manifest.wit,
                    p.manifest.description
                );
                if check {
                    match mlxhost::plugin::smoke::check(&host, p) {
                        Ok(summary) => println!("         smoke: {summary}"),
                        Err(e) => {
                            failed += 1;
                            println!("         smoke FAILED: {e}");
                        }
                    }
                }
            }
            for s in &host.skipped {
                println!("skipped  {}: {}", s.dir.display(), s.reason);
            }
            if host.plugins.is_empty() && host.skipped.is_empty() {
                println!(
                    "no plugins in {} (folders with a plugin.toml)",
                    dir.display()
                );
            }
            if check && failed > 0 {
                anyhow::bail!("{failed} plugin(s) in {} rejected or failed", dir.display());
            }
            Ok(())
        }
    }
}

/// `plugins list --server URL`: the `plugins` block of the server's
/// `/stats`, one line per plugin.
fn print_server_plugins(url: &str, api_key: Option<&str>) -> anyhow::Result<()> {
    let stats = super::http_get::get_json(url, "/stats", api_key)?;
    let plugins = stats
        .get("plugins")
        .ok_or_else(|| anyhow::anyhow!("{url}/stats has no `plugins` block (an older server?)"))?;
    let list = |key: &str| {
        plugins
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default()
    };
    let text = |v: &serde_json::Value, key: &str| {
        v.get(key)
            .and_then(|s| s.as_str())
            .unwrap_or("")
            .to_string()
    };
    for name in list("loaded") {
        println!("serving  {}", name.as_str().unwrap_or(""));
    }
    for kept in list("kept") {
        println!(
            "kept     {} (last good version; the new file in {} failed: {})",
            text(&kept, "name"),
            text(&kept, "dir"),
            text(&kept, "reason")
        );
    }
    for skipped in list("skipped") {
        println!(
            "skipped  {}: {}",
            text(&skipped, "dir"),
            text(&skipped, "reason")
        );
    }
    Ok(())
}
