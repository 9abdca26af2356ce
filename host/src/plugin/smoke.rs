//! A smoke call per plugin, for `mlxhost plugins check`: a session is
//! created with default parameters (plus the manifest's defaults) and one
//! step runs on synthetic logits `[V = 512]` and a short history; the
//! chosen token must be in range. Adapters were already asked for their
//! routes at load. Parsers get a session and a short text fed in two
//! pieces (their events are checked as in serving).

use mlx_rs::{transforms::eval, Array, Dtype};

use super::manifest::Kind;
use super::runtime::{LoadedPlugin, PluginHost};
use super::session::{Chosen, RowChain, TokenChain};
use super::SamplingParams;

/// Synthetic vocabulary size of the smoke step.
const VOCAB: usize = 512;

/// Runs the smoke call for `plugin`; `Ok` carries a one-line summary.
/// A processor needs a sampler to complete its step: `standard` when loaded,
/// else any sampler in the directory.
pub fn check(host: &std::sync::Arc<PluginHost>, plugin: &LoadedPlugin) -> Result<String, String> {
    let kinds = &plugin.manifest.kinds;
    if kinds.contains(&Kind::ToolCallParser) || kinds.contains(&Kind::ReasoningParser) {
        return check_parser(host, plugin);
    }
    if kinds.contains(&Kind::Constraint) {
        return check_constraint(host, plugin);
    }
    if kinds.contains(&Kind::Drafter) {
        return check_drafter(host, plugin);
    }
    if kinds.contains(&Kind::ApiAdapter)
        && !kinds.contains(&Kind::Sampler)
        && !kinds.contains(&Kind::LogitsProcessor)
    {
        return Ok(format!(
            "routes: {}",
            plugin
                .routes
                .iter()
                .map(|(m, p)| format!("{m} {p}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let name = plugin.manifest.name.clone();
    let (sampler, processors) = if kinds.contains(&Kind::Sampler) {
        (name.clone(), Vec::new())
    } else {
        let sampler = if host.get("standard", Kind::Sampler).is_ok() {
            "standard".to_string()
        } else {
            host.plugins
                .values()
                .find(|p| p.manifest.kinds.contains(&Kind::Sampler))
                .map(|p| p.manifest.name.clone())
                .ok_or("no sampler in this directory to complete the processor's step")?
        };
        (sampler, vec![name.clone()])
    };
    let params = SamplingParams {
        seed: Some(0),
        ..SamplingParams::default()
    };
    let mut chain = RowChain::new(host, &sampler, &processors, &params, &serde_json::json!({}))
        .map_err(|e| e.to_string())?;
    let logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 7919) % 97) as f32 / 10.0)
        .collect();
    let history = [1u32, 5, 9, 5];
    let started = std::time::Instant::now();
    let out = chain
        .step(Array::from_slice(&logits, &[VOCAB as i32]), &history, 2, 0)
        .map_err(|e| e.to_string())?;
    let id = match out.token {
        Chosen::Host(id) => id,
        Chosen::Device(a) => {
            let a = a.as_dtype(Dtype::Uint32).map_err(|e| e.to_string())?;
            eval([&a]).map_err(|e| e.to_string())?;
            a.try_item_cast::<u32>().map_err(|e| e.to_string())?
        }
    };
    if id as usize >= VOCAB {
        return Err(format!(
            "chose token {id}, outside the vocabulary ({VOCAB})"
        ));
    }
    chain.accept(id, 0.0, 0.0).map_err(|e| e.to_string())?;
    Ok(format!(
        "one step in {:.2} ms, token {id}",
        started.elapsed().as_secs_f64() * 1e3
    ))
}

/// A constraint plugin's engine built over the loaded vocabulary, and a
/// `json_object` session's first mask: it must allow `{` and not EOS.
fn check_constraint(host: &PluginHost, plugin: &LoadedPlugin) -> Result<String, String> {
    use super::constraint::{ConstraintSession, Grammar, OpenError};
    let name = &plugin.manifest.name;
    let shared = host.constraint(name).map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    shared
        .lock()
        .map_err(|_| "its instance is poisoned".to_string())?
        .warm()
        .map_err(|e| e.to_string())?;
    let built = started.elapsed();
    let extra = plugin.manifest.defaults_json().to_string();
    let session =
        ConstraintSession::open(shared, Grammar::JsonObject, extra).map_err(|e| match e {
            OpenError::Rejected(m) => format!("rejected `json_object`: {m}"),
            OpenError::Failed(e) => e.to_string(),
        })?;
    let words = session.mask().map_err(|e| e.to_string())?;
    let allowed: u32 = words.iter().map(|w| w.count_ones()).sum();
    Ok(format!(
        "engine built in {:.0} ms; `json_object` allows {allowed} first tokens",
        built.as_secs_f64() * 1e3
    ))
}

/// A drafter session given a history that repeats (`1 2 3 4 1 2`), asked
/// for 4 drafts.
fn check_drafter(host: &PluginHost, plugin: &LoadedPlugin) -> Result<String, String> {
    let name = &plugin.manifest.name;
    let history = [1u32, 2, 3, 4, 1, 2];
    let mut d = super::drafter::PluginDrafter::new(host, name, 4, VOCAB, &serde_json::json!({}))
        .map_err(|e| e.to_string())?;
    let drafts = d.draft(&history, 4).map_err(|e| e.to_string())?;
    Ok(format!("drafts after {history:?}: {drafts:?}"))
}

/// A parser session fed `Hello, world.` in two pieces, then finished.
fn check_parser(
    host: &std::sync::Arc<PluginHost>,
    plugin: &LoadedPlugin,
) -> Result<String, String> {
    use crate::output::{ParserSession, ToolDefinition};
    let name = &plugin.manifest.name;
    let none = serde_json::json!({});
    let mut summary = Vec::new();
    let mut sessions = Vec::new();
    if plugin.manifest.kinds.contains(&Kind::ToolCallParser) {
        let tools = [ToolDefinition {
            name: "get_weather".into(),
            parameters_json: "{}".into(),
            description: String::new(),
        }];
        let mut s = ParserSession::tool_parser(host.clone(), name, &tools, true, &none)
            .map_err(|e| e.to_string())?;
        let prefix = s.call_prefix("get_weather").map_err(|e| e.to_string())?;
        summary.push(format!("call prefix {prefix:?}"));
        sessions.push(s);
    }
    if plugin.manifest.kinds.contains(&Kind::ReasoningParser) {
        sessions.push(
            ParserSession::reasoning_parser(host.clone(), name, "", &none)
                .map_err(|e| e.to_string())?,
        );
    }
    for mut s in sessions {
        let mut events = s.feed("Hello, ", &[]).map_err(|e| e.to_string())?;
        events.extend(s.feed("world.", &[]).map_err(|e| e.to_string())?);
        events.extend(s.finish().map_err(|e| e.to_string())?);
        summary.push(format!("{} events for plain text", events.len()));
    }
    Ok(summary.join("; "))
}
