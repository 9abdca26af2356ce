//! Which LoRA adapter a request runs under, and the adapters in `GET
//! /v1/models`. Done by the host on the HTTP body, beside the API adapter
//! plugin: every dialect names the model in a top-level `model` field, and
//! the plugin interface (WIT 0.2.0, released) carries neither the model
//! name nor a list of served models.
//!
//! A request picks an adapter by its top-level `lora` field (an adapter's
//! name), else by `model`: an adapter's own name, or `<base>:<adapter>`
//! (vLLM's and llama.cpp's spellings). Any other `model` runs the base
//! model, as before adapters existed.

use serde_json::Value;

use super::adapter::{ApiError, ErrorKind, HttpResponse};
use super::http::api_error;
use crate::model::lora::LoraInfo;

/// The adapter the request `body` names among `served` (`None`: the base
/// model), given the base's id `base`.
///
/// Errors: a 404 when `lora` names no served adapter, or `model` is
/// `<base>:<name>` with no adapter `name`.
pub fn resolve(body: &[u8], base: &str, served: &[LoraInfo]) -> Result<Option<String>, ApiError> {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) else {
        return Ok(None);
    };
    let is_served = |n: &str| served.iter().any(|a| a.name == n);
    let missing = |n: &str, field: &str| {
        let names: Vec<&str> = served.iter().map(|a| a.name.as_str()).collect();
        let mut e = api_error(
            404,
            ErrorKind::NotFound,
            format!(
                "no LoRA adapter `{n}` is served (adapters: {})",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ),
        );
        e.param = Some(field.to_string());
        e
    };
    match map.get("lora") {
        Some(Value::String(n)) if is_served(n) => return Ok(Some(n.clone())),
        Some(Value::String(n)) => return Err(missing(n, "lora")),
        Some(Value::Null) | None => {}
        Some(_) => {
            let mut e = api_error(
                400,
                ErrorKind::InvalidRequest,
                "`lora` must be an adapter's name (a string)",
            );
            e.param = Some("lora".into());
            return Err(e);
        }
    }
    let Some(Value::String(model)) = map.get("model") else {
        return Ok(None);
    };
    if is_served(model) {
        return Ok(Some(model.clone()));
    }
    if let Some((prefix, name)) = model.rsplit_once(':') {
        if is_served(name) {
            return Ok(Some(name.to_string()));
        }
        if prefix == base {
            return Err(missing(name, "model"));
        }
    }
    Ok(None)
}

/// `GET /v1/models` as the API adapter answered it, with one entry per
/// served adapter after the base's: a copy of the base's entry (the
/// dialect's shape) with the adapter's name as `id` (and `display_name`),
/// `parent` the base's id and `lora` its facts. Anything else passes
/// through.
pub fn with_adapters(resp: HttpResponse, served: &[LoraInfo]) -> HttpResponse {
    if resp.status != 200 || served.is_empty() {
        return resp;
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(&resp.body) else {
        return resp;
    };
    let Some(Value::Array(data)) = body.get_mut("data") else {
        return resp;
    };
    let Some(Value::Object(base)) = data.first().cloned() else {
        return resp;
    };
    let base_id = base.get("id").cloned().unwrap_or(Value::Null);
    for a in served {
        let mut entry = base.clone();
        entry.insert("id".into(), Value::String(a.name.clone()));
        if entry.contains_key("display_name") {
            entry.insert("display_name".into(), Value::String(a.name.clone()));
        }
        entry.insert("parent".into(), base_id.clone());
        entry.insert(
            "lora".into(),
            serde_json::json!({"format": a.format, "rank": a.rank, "modules": a.modules}),
        );
        data.push(Value::Object(entry));
    }
    if let (Some(Value::String(_)), Some(last)) = (body.get("last_id"), served.last()) {
        body.insert("last_id".into(), Value::String(last.name.clone()));
    }
    HttpResponse {
        body: Value::Object(body).to_string().into_bytes(),
        ..resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Vec<LoraInfo> {
        ["alpha", "beta"]
            .into_iter()
            .map(|n| LoraInfo {
                name: n.into(),
                format: "mlx".into(),
                rank: 8,
                modules: vec!["self_attn.q_proj".into()],
                fingerprint: "f".into(),
            })
            .collect()
    }

    #[test]
    fn model_names_and_the_field_pick_adapters() {
        let s = served();
        let r = |b: &str| resolve(b.as_bytes(), "smol", &s);
        assert_eq!(r(r#"{"model": "alpha"}"#).ok(), Some(Some("alpha".into())));
        assert_eq!(
            r(r#"{"model": "smol:beta"}"#).ok(),
            Some(Some("beta".into()))
        );
        assert_eq!(r(r#"{"model": "smol"}"#).ok(), Some(None));
        assert_eq!(r(r#"{"model": "gpt-4o"}"#).ok(), Some(None));
        assert_eq!(
            r(r#"{"model": "smol", "lora": "beta"}"#).ok(),
            Some(Some("beta".into()))
        );
        let e = r(r#"{"model": "smol:gamma"}"#).expect_err("no gamma");
        assert_eq!(e.status, 404);
        assert!(e.message.contains("`gamma`") && e.message.contains("alpha, beta"));
        assert_eq!(r(r#"{"lora": "gamma"}"#).map_err(|e| e.status), Err(404));
        assert_eq!(r(r#"{"lora": 3}"#).map_err(|e| e.status), Err(400));
    }

    #[test]
    fn the_listing_gains_one_entry_per_adapter() {
        let resp = HttpResponse {
            status: 200,
            content_type: "application/json".into(),
            body: br#"{"object":"list","data":[{"id":"smol","object":"model","created":1,"owned_by":"mlxhost"}]}"#.to_vec(),
        };
        let out = with_adapters(resp, &served());
        let v: Value = serde_json::from_slice(&out.body).expect("json");
        let ids: Vec<&str> = v["data"]
            .as_array()
            .expect("data")
            .iter()
            .filter_map(|e| e["id"].as_str())
            .collect();
        assert_eq!(ids, ["smol", "alpha", "beta"]);
        assert_eq!(v["data"][1]["parent"], "smol");
        assert_eq!(v["data"][2]["object"], "model");
    }
}
