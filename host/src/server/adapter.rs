//! One API-adapter instance serving one HTTP request: `handle`, then
//! `render` or `render-stream` per update, or `render-error`. Every call has
//! the plugin epoch deadline; a trap or a malformed return fails the
//! request with the adapter's name, and the host falls back to its own
//! error body (the adapter cannot be trusted to render it).
//!
//! The host speaks WIT 0.2.0's types; a 0.1.0 adapter's values are
//! converted at this one boundary ([`super::adapter_v1`]).

use wasmtime::Store;

use crate::plugin::bindings::v2::adapter::exports::mlxhost::plugin::api_adapter as wit;
use crate::plugin::bindings::v2::adapter::ApiAdapterPlugin;
use crate::plugin::runtime::AdapterPre;
use crate::plugin::tensors::PluginState;
use crate::plugin::{Kind, PluginError, PluginHost};

pub use crate::plugin::bindings::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Message, Prompt, SamplingRequest, ToolCall, ToolChoice,
};
pub use wit::{
    Action, ApiError, ErrorKind, GenerationUpdate, HttpRequest, HttpResponse, RequestContext,
    SseEvent, TokenLogprob, TopLogprob, Usage,
};

use super::adapter_v1 as v1;

/// An instantiated adapter of either WIT version.
enum Bindings {
    V1(crate::plugin::bindings::adapter::ApiAdapterPlugin),
    V2(ApiAdapterPlugin),
}

/// A live adapter instance for one request.
pub struct AdapterCall {
    /// Keeps the plugin host (and its epoch ticker, which enforces the
    /// deadlines below) alive for as long as this instance, across reloads.
    host: std::sync::Arc<PluginHost>,
    name: String,
    store: Store<PluginState>,
    bindings: Bindings,
    deadline_ticks: u64,
    /// What the adapter is told about this request.
    pub ctx: RequestContext,
}

fn failed(name: &str, what: &str, e: impl std::fmt::Display) -> PluginError {
    PluginError::Failed {
        plugin: name.to_string(),
        cause: format!("`{what}` failed: {e}"),
    }
}

impl AdapterCall {
    /// Instantiates adapter `name` (~microseconds from the pre-instantiated
    /// component). Errors: unknown name, or instantiation failure.
    ///
    /// `services` are what the instance's `response-store` and `prompt`
    /// imports reach (`None`: they answer "absent").
    pub fn new(
        host: std::sync::Arc<PluginHost>,
        name: &str,
        ctx: RequestContext,
        services: Option<crate::plugin::AdapterServices>,
    ) -> Result<Self, PluginError> {
        let plugin = host.get(name, Kind::ApiAdapter)?;
        let pre = plugin
            .adapter
            .as_ref()
            .ok_or_else(|| failed(name, "instantiate", "no api-adapter world"))?;
        let mut store = host.new_store(Kind::ApiAdapter);
        store.data_mut().services = services;
        let bindings = match pre {
            AdapterPre::V1(pre) => pre.instantiate(&mut store).map(Bindings::V1),
            AdapterPre::V2(pre) => pre.instantiate(&mut store).map(Bindings::V2),
        }
        .map_err(|e| failed(name, "instantiate", format!("{e:#}")))?;
        let deadline_ticks = host.deadline_ticks(Kind::ApiAdapter);
        Ok(AdapterCall {
            host,
            name: name.into(),
            store,
            bindings,
            deadline_ticks,
            ctx,
        })
    }

    /// The adapter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `handle`: the request as an action.
    pub fn handle(&mut self, req: &HttpRequest) -> Result<Action, PluginError> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let action = match &self.bindings {
            Bindings::V1(b) => b
                .mlxhost_plugin_api_adapter()
                .call_handle(
                    &mut self.store,
                    &v1::context(&self.ctx),
                    &v1::http_request(req),
                )
                .map(v1::action),
            Bindings::V2(b) => {
                b.mlxhost_plugin_api_adapter()
                    .call_handle(&mut self.store, &self.ctx, req)
            }
        }
        .map_err(|e| {
            if self.store.data().limits.memory_exhausted() {
                PluginError::OutOfMemory {
                    plugin: self.name.clone(),
                    cap_bytes: self.host.limits.adapter_memory_bytes,
                }
            } else {
                failed(&self.name, "handle", trap(&e))
            }
        })?;
        if let Action::Respond(r) = &action {
            self.check(r, "handle")?;
        }
        Ok(action)
    }

    /// The output constraint the adapter attached during `handle`
    /// (`structured-output.constrain`), taken.
    pub fn take_constraint(&mut self) -> Option<crate::plugin::constraint::ConstraintRequest> {
        self.store.data_mut().constraint.take()
    }

    /// The speculation settings the adapter chose during `handle`
    /// (`speculation.speculate`, WIT 0.4.0), taken.
    pub fn take_speculation(&mut self) -> Option<crate::plugin::services::SpeculationChoice> {
        self.store.data_mut().speculation.take()
    }

    /// The tools the adapter marked strict during `handle`
    /// (`structured-output.strict-tools`), taken.
    pub fn take_strict_tools(&mut self) -> Vec<String> {
        std::mem::take(&mut self.store.data_mut().strict_tools)
    }

    /// `render`: the whole, non-streamed response.
    pub fn render(&mut self, update: &GenerationUpdate) -> Result<HttpResponse, PluginError> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let r = match &self.bindings {
            Bindings::V1(b) => b
                .mlxhost_plugin_api_adapter()
                .call_render(
                    &mut self.store,
                    &v1::context(&self.ctx),
                    &v1::update(update),
                )
                .map(v1::http_response),
            Bindings::V2(b) => {
                b.mlxhost_plugin_api_adapter()
                    .call_render(&mut self.store, &self.ctx, update)
            }
        }
        .map_err(|e| failed(&self.name, "render", trap(&e)))?;
        self.check(&r, "render")?;
        Ok(r)
    }

    /// `render-stream`: SSE events for one update.
    pub fn render_stream(
        &mut self,
        update: &GenerationUpdate,
    ) -> Result<Vec<SseEvent>, PluginError> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let events = match &self.bindings {
            Bindings::V1(b) => b
                .mlxhost_plugin_api_adapter()
                .call_render_stream(
                    &mut self.store,
                    &v1::context(&self.ctx),
                    &v1::update(update),
                )
                .map(|events| events.into_iter().map(v1::sse_event).collect()),
            Bindings::V2(b) => b.mlxhost_plugin_api_adapter().call_render_stream(
                &mut self.store,
                &self.ctx,
                update,
            ),
        }
        .map_err(|e| failed(&self.name, "render-stream", trap(&e)))?;
        // SSE event names cannot hold line breaks; data lines are split by
        // the framing, so any text is fine there.
        if let Some(bad) = events.iter().find(|e| e.event.contains(['\n', '\r'])) {
            return Err(failed(
                &self.name,
                "render-stream",
                format!("event name {:?} contains a line break", bad.event),
            ));
        }
        Ok(events)
    }

    /// `render-error`, falling back to the host's own JSON body when the
    /// adapter fails too.
    pub fn render_error(&mut self, error: &ApiError) -> HttpResponse {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let rendered = match &self.bindings {
            Bindings::V1(b) => b
                .mlxhost_plugin_api_adapter()
                .call_render_error(
                    &mut self.store,
                    &v1::context(&self.ctx),
                    &v1::api_error(error),
                )
                .map(v1::http_response),
            Bindings::V2(b) => {
                b.mlxhost_plugin_api_adapter()
                    .call_render_error(&mut self.store, &self.ctx, error)
            }
        }
        .map_err(|e| failed(&self.name, "render-error", trap(&e)))
        .and_then(|r| self.check(&r, "render-error").map(|()| r));
        match rendered {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "adapter could not render an error; using the host's body");
                host_error(error)
            }
        }
    }

    /// `render-stream-error`: an error after the stream began, as the
    /// stream's last events. A 0.1.0 adapter (which lacks the call), or an
    /// adapter that fails here, gets its `render-error` body as one
    /// data-only event.
    pub fn render_stream_error(&mut self, error: &ApiError) -> Vec<SseEvent> {
        if let Bindings::V2(b) = &self.bindings {
            self.store.set_epoch_deadline(self.deadline_ticks);
            match b.mlxhost_plugin_api_adapter().call_render_stream_error(
                &mut self.store,
                &self.ctx,
                error,
            ) {
                Ok(events) if !events.iter().any(|e| e.event.contains(['\n', '\r'])) => {
                    return events
                }
                Ok(_) => {
                    tracing::warn!(adapter = %self.name, "stream error event name holds a line break; using the error body")
                }
                Err(e) => {
                    tracing::warn!(adapter = %self.name, error = %trap(&e), "adapter could not render a stream error; using the error body")
                }
            }
        }
        let body = self.render_error(error);
        vec![SseEvent {
            event: String::new(),
            data: String::from_utf8_lossy(&body.body).into_owned(),
        }]
    }

    fn check(&self, r: &HttpResponse, what: &str) -> Result<(), PluginError> {
        if !(100..=599).contains(&r.status) {
            return Err(failed(
                &self.name,
                what,
                format!("returned HTTP status {}", r.status),
            ));
        }
        if axum::http::HeaderValue::from_str(&r.content_type).is_err() {
            return Err(failed(
                &self.name,
                what,
                format!("returned an invalid content type {:?}", r.content_type),
            ));
        }
        Ok(())
    }
}

fn trap(e: &wasmtime::Error) -> String {
    crate::plugin::session::trap_cause(e)
}

/// The host's own error body, used when no adapter can render one (no
/// route, or the adapter failed). OpenAI's shape, the most common client
/// expectation: `{"error": {"message", "type", "param", "code"}}`.
pub fn host_error(error: &ApiError) -> HttpResponse {
    let kind = match error.kind {
        ErrorKind::InvalidRequest | ErrorKind::NotFound | ErrorKind::TooLarge => {
            "invalid_request_error"
        }
        ErrorKind::Plugin | ErrorKind::Server => "server_error",
    };
    HttpResponse {
        status: error.status,
        content_type: "application/json".into(),
        body: serde_json::json!({
            "error": {
                "message": error.message,
                "type": kind,
                "param": error.param,
                "code": null,
            }
        })
        .to_string()
        .into_bytes(),
    }
}
