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
        PluginsCommand::List { dir } => (dir, false, None),
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
                    Ok(t) => host.set_vocab(std::sync::Arc::new(mlxhost::plugin::VocabView::new(t))),
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
