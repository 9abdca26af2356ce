//! `GET /v1/models` and `GET /v1/models/{model}`: the served model, in
//! OpenAI's shape (`{"object": "list", "data": [{"id", "object": "model",
//! "created", "owned_by"}]}`), or in Anthropic's (`{"data": [{"type":
//! "model", "id", "display_name", "created_at"}], "has_more", "first_id",
//! "last_id"}`, RFC 3339 time) for Anthropic clients, which send an
//! `anthropic-version` header on every request (the two dialects share the
//! path, and the host routes a path to one adapter).

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    HttpResponse, RequestContext,
};
use serde_json::{json, Value};

fn is_anthropic(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("anthropic-version"))
}

fn respond(status: u16, body: Value) -> HttpResponse {
    HttpResponse {
        status,
        content_type: "application/json".into(),
        body: body.to_string().into_bytes(),
    }
}

/// Unix seconds as RFC 3339 UTC (`2026-12-02T18:55:54Z`); days to a civil
/// date by Howard Hinnant's `civil_from_days` algorithm.
pub fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

fn model(ctx: &RequestContext, anthropic: bool) -> Value {
    if anthropic {
        json!({"type": "model", "id": ctx.model_id, "display_name": ctx.model_id,
               "created_at": rfc3339(ctx.created)})
    } else {
        json!({"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "mlxhost"})
    }
}

/// The list of models: the one served.
pub fn list(ctx: &RequestContext, headers: &[(String, String)]) -> HttpResponse {
    if is_anthropic(headers) {
        respond(
            200,
            json!({"data": [model(ctx, true)], "has_more": false,
                   "first_id": ctx.model_id, "last_id": ctx.model_id}),
        )
    } else {
        respond(200, json!({"object": "list", "data": [model(ctx, false)]}))
    }
}

/// One model by id: the served one, or a 404 in the dialect's shape.
pub fn retrieve(ctx: &RequestContext, headers: &[(String, String)], id: &str) -> HttpResponse {
    let anthropic = is_anthropic(headers);
    if id == ctx.model_id {
        return respond(200, model(ctx, anthropic));
    }
    let message = format!(
        "The model `{id}` does not exist; this server serves `{}`",
        ctx.model_id
    );
    if anthropic {
        respond(
            404,
            json!({"type": "error", "error": {"type": "not_found_error", "message": message},
                   "request_id": ctx.request_id}),
        )
    } else {
        respond(
            404,
            json!({"error": {"message": message, "type": "invalid_request_error",
                             "param": "model", "code": "model_not_found"}}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn rfc3339_matches_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_237_754), "2026-12-02T18:55:54Z");
    }
}
