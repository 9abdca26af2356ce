//! `mlxhost.toml`: the same settings as `serve`'s flags, in a file.
//!
//! ```toml
//! [serve]
//! port = 9000
//! temp = 0.7
//! max-tokens = 1024      # or max_tokens
//! plugins = "/opt/mlxhost/plugins"
//! ```
//!
//! The file is `--config PATH` (env `MLXHOST_CONFIG`), else `./mlxhost.toml`
//! when present. Its settings become flags placed before the command line's
//! own, so a flag given on the command line wins. Unknown settings are
//! errors naming the key.

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Context};

/// The config file named by `args` (`--config X` / `--config=X`), the env,
/// or `./mlxhost.toml` when it exists.
fn config_path(args: &[OsString]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    if let Some(p) = std::env::var_os("MLXHOST_CONFIG") {
        return Some(PathBuf::from(p));
    }
    let local = PathBuf::from("mlxhost.toml");
    local.is_file().then_some(local)
}

/// Returns `args` with the config file's `[serve]` settings inserted as
/// flags right after `serve` (only for the `serve` command).
///
/// Errors: unreadable or invalid TOML, an unknown key, a value that is not
/// a string, number, boolean or array of those; all name the file.
pub fn with_config(args: Vec<OsString>, known_flags: &[String]) -> anyhow::Result<Vec<OsString>> {
    // Only when `serve` is the command itself (not some argument's value).
    if args.get(1).is_none_or(|a| a != "serve") {
        return Ok(args);
    }
    let serve_at = 1;
    let Some(path) = config_path(&args[serve_at..]) else {
        return Ok(args);
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("--config {}", path.display()))?;
    let doc: toml::Table = toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
    let table = match doc.get("serve") {
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => bail!("{}: `serve` must be a table ([serve])", path.display()),
        None => doc,
    };
    let mut flags = Vec::new();
    for (key, value) in &table {
        let flag = key.replace('_', "-");
        if flag == "config" || !known_flags.contains(&flag) {
            bail!(
                "{}: unknown setting `{key}` (settings are `mlxhost serve` flags without the dashes: see docs/configuration.md)",
                path.display()
            );
        }
        let values: Vec<&toml::Value> = match value {
            toml::Value::Array(items) => items.iter().collect(),
            other => vec![other],
        };
        for v in values {
            match v {
                toml::Value::Boolean(true) => flags.push(OsString::from(format!("--{flag}"))),
                toml::Value::Boolean(false) => {}
                toml::Value::String(s) => flags.push(OsString::from(format!("--{flag}={s}"))),
                toml::Value::Integer(i) => flags.push(OsString::from(format!("--{flag}={i}"))),
                toml::Value::Float(x) => flags.push(OsString::from(format!("--{flag}={x}"))),
                _ => bail!(
                    "{}: `{key}` must be a string, number or boolean",
                    path.display()
                ),
            }
        }
    }
    let mut out = args[..=serve_at].to_vec();
    out.extend(flags);
    out.extend_from_slice(&args[serve_at + 1..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn settings_become_flags_before_the_command_lines_own() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(
            &f,
            "[serve]\nport = 9000\ntemp = 0.5\nmax_tokens = 7\nhost = \"0.0.0.0\"\n",
        )
        .unwrap();
        let known: Vec<String> = ["port", "temp", "max-tokens", "host", "config"]
            .map(String::from)
            .to_vec();
        let args = os(&[
            "mlxhost",
            "serve",
            "--config",
            f.to_str().unwrap(),
            "--port",
            "1",
        ]);
        let out = with_config(args, &known).unwrap();
        let out: Vec<String> = out
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert_eq!(out[..2], ["mlxhost", "serve"]);
        assert!(out.contains(&"--max-tokens=7".to_string()));
        let port_from_file = out.iter().position(|a| a == "--port=9000").unwrap();
        let port_from_cli = out.iter().position(|a| a == "--port").unwrap();
        assert!(port_from_file < port_from_cli, "the command line wins");
    }

    #[test]
    fn unknown_settings_are_named() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.toml");
        std::fs::write(&f, "portt = 1\n").unwrap();
        let args = os(&["mlxhost", "serve", "--config", f.to_str().unwrap()]);
        let err = with_config(args, &["port".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("portt"), "{err}");
    }
}
