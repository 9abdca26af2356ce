//! `mlxhost plugins list [DIR]`.

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
}

pub fn run(cmd: PluginsCommand) -> anyhow::Result<()> {
    match cmd {
        PluginsCommand::List { dir } => {
            let host = PluginHost::load_dir(&dir, PluginLimits::default())?;
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
            Ok(())
        }
    }
}
