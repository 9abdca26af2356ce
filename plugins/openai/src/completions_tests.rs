//! Native unit tests of `POST /v1/completions` (`crate::completions`): the
//! request parser, the `text_completion` renderers and the route's
//! dispatch. Run as `tests.rs` says:
//!
//!     cd plugins/openai && cargo test --target x86_64-unknown-linux-gnu

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, GenerationUpdate, HttpRequest, RequestContext, TokenLogprob, TopLogprob,
    Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    GenerationRequest, Prompt, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{FinishReason, GenerationEvent as E};
use serde_json::{json, Value};

use crate::completions::{self, Offsets};
use crate::request::{Endpoint, RenderOptions};

fn parse(body: Value) -> (GenerationRequest, RenderOptions) {
    match completions::parse(body.to_string().as_bytes()) {
        Ok(r) => r,
        Err(e) => panic!("rejected: {e:?}\nbody: {body}"),
    }
}

fn rejection(body: Value) -> (String, String) {
    match completions::parse(body.to_string().as_bytes()) {
        Ok(_) => panic!("accepted: {body}"),
        Err(e) => (e.param.unwrap_or_default(), e.message),
    }
}

fn ctx() -> RequestContext {
    RequestContext {
        request_id: "r1".into(),
        created: 1_700_000_000,
        model_id: "m".into(),
    }
}

fn post(path: &str, body: Value) -> Action {
    <crate::Adapter as api::Guest>::handle(
        ctx(),
        HttpRequest {
            method: "POST".into(),
            path: path.into(),
            headers: Vec::new(),
            body: body.to_string().into_bytes(),
        },
    )
}

#[test]
fn prompt_shapes_and_defaults() {
    let (r, opts) = parse(json!({"model": "x", "prompt": "Once upon"}));
    assert!(matches!(&r.prompt, Prompt::Text(t) if t == "Once upon"));
    assert_eq!(r.max_tokens, Some(16), "OpenAI's default max_tokens");
    assert!(!r.stream && !r.logprobs && r.top_logprobs == 0);
    assert!(r.tools.is_empty());
    assert!(matches!(r.tool_choice, ToolChoice::None));
    assert_eq!(r.tool_parser.as_deref(), Some("none"));
    assert_eq!(r.reasoning_parser.as_deref(), Some("none"));
    assert_eq!(r.chat_template_kwargs, "{}");
    assert_eq!(r.plugin_params, "{}");
    assert_eq!(opts.endpoint, Endpoint::Completions);
    assert_eq!(opts.echo, None);

    let (r, _) = parse(json!({"prompt": ["Once upon"], "max_tokens": null}));
    assert!(matches!(&r.prompt, Prompt::Text(t) if t == "Once upon"));
    assert_eq!(r.max_tokens, Some(16));
    let (r, _) = parse(json!({"prompt": [1, 2, 3]}));
    assert!(matches!(&r.prompt, Prompt::TokenIds(ids) if ids == &[1, 2, 3]));
    let (r, _) = parse(json!({"prompt": [[4, 5]]}));
    assert!(matches!(&r.prompt, Prompt::TokenIds(ids) if ids == &[4, 5]));
}

#[test]
fn fields_map_to_the_canonical_request() {
    let (r, opts) = parse(json!({
        "model": "any",
        "prompt": "Hi",
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.9,
        "n": 1,
        "best_of": 1,
        "stream": true,
        "stream_options": {"include_usage": true},
        "logprobs": 3,
        "echo": false,
        "stop": ["\n", "END"],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": -100},
        "seed": 7,
        "user": "u-1",
        "suffix": "",
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "sampler": "standard",
        "logits_processors": ["dry"],
        "plugin_params": {"dry": {"multiplier": 0.8}},
        "return_tokens_as_token_ids": true,
        // Chat-only fields are ignored here.
        "messages": "not checked",
        "tools": "not checked",
    }));
    assert_eq!(r.max_tokens, Some(7));
    assert_eq!(r.sampling.temperature, Some(0.0));
    assert_eq!(r.sampling.top_p, Some(0.9));
    assert_eq!(r.sampling.top_k, Some(40));
    assert_eq!(r.sampling.min_p, Some(0.05));
    assert_eq!(r.sampling.seed, Some(7));
    assert_eq!(r.sampling.repetition_penalty, Some(1.1));
    assert_eq!(r.sampling.presence_penalty, Some(0.5));
    assert_eq!(r.sampling.frequency_penalty, Some(-0.5));
    assert_eq!(r.sampling.logit_bias, vec![(42, -100.0)]);
    assert!(r.stream && r.include_usage);
    assert!(r.logprobs);
    assert_eq!(r.top_logprobs, 3);
    assert_eq!(r.stop, vec!["\n".to_string(), "END".to_string()]);
    assert_eq!(r.sampler.as_deref(), Some("standard"));
    assert_eq!(r.logits_processors, vec!["dry".to_string()]);
    assert_eq!(
        serde_json::from_str::<Value>(&r.plugin_params).unwrap(),
        json!({"dry": {"multiplier": 0.8}})
    );
    assert!(opts.logprobs && opts.include_usage && opts.tokens_as_ids);

    // logprobs 0: the sampled token's logprob only; null: none.
    let (r, opts) = parse(json!({"prompt": "Hi", "logprobs": 0}));
    assert!(r.logprobs && r.top_logprobs == 0 && opts.logprobs);
    let (r, _) = parse(json!({"prompt": "Hi", "logprobs": null}));
    assert!(!r.logprobs);
    // echo keeps the prompt text for the renderer.
    let (_, opts) = parse(json!({"prompt": ["Hi there"], "echo": true}));
    assert_eq!(opts.echo.as_deref(), Some("Hi there"));
}

#[test]
fn each_rejection_names_its_param() {
    let p = |extra: Value| {
        let mut body = json!({"model": "m", "prompt": "Hi"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"model": "m"}), "prompt", "required"),
        (json!({"prompt": null}), "prompt", "required"),
        (json!({"prompt": ""}), "prompt", "empty"),
        (json!({"prompt": []}), "prompt", "empty"),
        (json!({"prompt": [[]]}), "prompt", "empty"),
        (json!({"prompt": 12}), "prompt", "must be"),
        (json!({"prompt": {"text": "x"}}), "prompt", "must be"),
        (json!({"prompt": ["a", "b"]}), "prompt", "only one prompt"),
        (json!({"prompt": [[1], [2]]}), "prompt", "only one prompt"),
        (json!({"prompt": [1, "a"]}), "prompt", "token id"),
        (json!({"prompt": [1, -2]}), "prompt", "token id"),
        (json!({"prompt": [1.5]}), "prompt", "token id"),
        (json!({"prompt": [4294967296u64]}), "prompt", "token id"),
        (json!({"prompt": [true]}), "prompt", "must be"),
        (p(json!({"suffix": " end"})), "suffix", "not supported"),
        (p(json!({"suffix": 3})), "suffix", "string"),
        (p(json!({"best_of": 2})), "best_of", "best_of"),
        (p(json!({"best_of": 0})), "best_of", "best_of"),
        (p(json!({"n": 2})), "n", "n=1"),
        (p(json!({"max_tokens": 0})), "max_tokens", "at least 1"),
        (p(json!({"max_tokens": "5"})), "max_tokens", "integer"),
        (p(json!({"max_tokens": -1})), "max_tokens", "non-negative"),
        (p(json!({"logprobs": 6})), "logprobs", "[0, 5]"),
        (p(json!({"logprobs": true})), "logprobs", "integer"),
        (p(json!({"echo": "yes"})), "echo", "boolean"),
        (
            json!({"prompt": [1, 2], "echo": true}),
            "echo",
            "echo needs a text prompt",
        ),
        (
            p(json!({"echo": true, "logprobs": 1})),
            "echo",
            "prompt logprobs",
        ),
        (p(json!({"stream": 1})), "stream", "boolean"),
        (
            p(json!({"stream_options": true})),
            "stream_options",
            "object",
        ),
        (p(json!({"temperature": "hot"})), "temperature", "number"),
        (p(json!({"temperature": 3})), "temperature", ""),
        (p(json!({"top_p": 1.5})), "top_p", ""),
        (p(json!({"presence_penalty": 9})), "presence_penalty", ""),
        (p(json!({"frequency_penalty": -9})), "frequency_penalty", ""),
        (p(json!({"logit_bias": {"x": 1}})), "logit_bias", "token id"),
        (
            p(json!({"stop": ["a", "b", "c", "d", "e"]})),
            "stop",
            "at most 4",
        ),
        (p(json!({"stop": [""]})), "stop", "empty"),
        (p(json!({"stop": 5})), "stop", "string"),
        (p(json!({"seed": "s"})), "seed", "integer"),
        (p(json!({"model": 1})), "model", "string"),
        (p(json!({"user": 1})), "user", "string"),
        (
            p(json!({"logits_processors": "dry"})),
            "logits_processors",
            "array",
        ),
        (
            p(json!({"plugin_params": {"dry": 1}})),
            "plugin_params",
            "object",
        ),
        (
            p(json!({"repetition_penalty": 0})),
            "repetition_penalty",
            "> 0",
        ),
    ];
    let mut wrong = Vec::new();
    for (body, param, words) in &cases {
        let (got, message) = rejection(body.clone());
        if got != *param || !message.contains(words) {
            wrong.push(format!(
                "{body}\n  expected param {param} ({words:?}), got {got}: {message}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Not JSON, not an object: no param.
    assert!(completions::parse(b"{").unwrap_err().param.is_none());
    assert!(completions::parse(b"[1]").unwrap_err().param.is_none());
}

#[test]
fn the_route_is_served_and_rejections_are_openai_errors() {
    let routes = <crate::Adapter as api::Guest>::routes();
    assert!(routes
        .iter()
        .any(|r| r.method == "POST" && r.path == "/v1/completions"));
    assert!(routes
        .iter()
        .any(|r| r.method == "POST" && r.path == "/v1/chat/completions"));

    let Action::Respond(r) = post("/v1/completions", json!({"prompt": "x", "best_of": 3})) else {
        panic!("not a response")
    };
    assert_eq!(r.status, 400);
    assert_eq!(r.content_type, "application/json");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "best_of");
    assert_eq!(v["error"]["code"], Value::Null);

    // A generation; this instance then renders text completions.
    let Action::Generate(g) = post("/v1/completions", json!({"prompt": "Hi", "echo": true})) else {
        panic!("not a generation")
    };
    assert!(matches!(g.prompt, Prompt::Text(_)));
    let done = update(
        0,
        vec![E::Text(" there".into())],
        Some(FinishReason::Length),
    );
    let r = <crate::Adapter as api::Guest>::render(ctx(), done);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hi there");

    // The chat route on a fresh request still renders chat completions.
    let Action::Generate(_) = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    ) else {
        panic!("not a generation")
    };
    let done = update(0, vec![E::Text("Hello".into())], Some(FinishReason::Stop));
    let r = <crate::Adapter as api::Guest>::render(ctx(), done);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["object"], "chat.completion");
}

fn update(sequence: u32, events: Vec<E>, finish: Option<FinishReason>) -> GenerationUpdate {
    GenerationUpdate {
        sequence,
        events,
        logprobs: Vec::new(),
        finish,
        stop_sequence: None,
        usage: finish.map(|_| Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            cached_tokens: 0,
        }),
    }
}

/// The first update of a stream: no events, usage with the prompt's size.
fn first() -> GenerationUpdate {
    GenerationUpdate {
        usage: Some(Usage {
            prompt_tokens: 5,
            completion_tokens: 0,
            cached_tokens: 2,
        }),
        ..update(0, Vec::new(), None)
    }
}

fn token(text: &str, id: u32, logprob: f32, top: &[(&str, u32, f32)]) -> TokenLogprob {
    token_bytes(text, text.as_bytes(), id, logprob, top)
}

fn token_bytes(
    text: &str,
    bytes: &[u8],
    id: u32,
    logprob: f32,
    top: &[(&str, u32, f32)],
) -> TokenLogprob {
    TokenLogprob {
        token: text.into(),
        bytes: bytes.to_vec(),
        id,
        logprob,
        top: top
            .iter()
            .map(|(t, id, lp)| TopLogprob {
                token: t.to_string(),
                bytes: t.as_bytes().to_vec(),
                id: *id,
                logprob: *lp,
            })
            .collect(),
    }
}

fn opts(body: Value) -> RenderOptions {
    parse(body).1
}

#[test]
fn non_streamed_text_completion() {
    let o = opts(json!({"prompt": "The sky is", "logprobs": 2}));
    let mut u = update(
        0,
        vec![E::Text(" blue".into()), E::Text(" today".into())],
        Some(FinishReason::Stop),
    );
    u.logprobs = vec![
        token(
            " blue",
            10,
            -0.25,
            &[(" blue", 10, -0.25), (" grey", 11, -2.0)],
        ),
        // Sampled (temperature > 0) outside the top 2: it joins them.
        token(" today", 12, -3.0, &[(" now", 13, -0.5), (".", 14, -1.0)]),
    ];
    let v = completions::completion(&ctx(), &o, &u);
    assert_eq!(v["id"], "cmpl-r1");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["created"], 1_700_000_000);
    assert_eq!(v["model"], "m");
    let c = &v["choices"][0];
    assert_eq!(c["text"], " blue today");
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(
        c["logprobs"],
        json!({
            "tokens": [" blue", " today"],
            "token_logprobs": [-0.25, -3.0],
            "top_logprobs": [
                {" blue": -0.25, " grey": -2.0},
                {" now": -0.5, ".": -1.0, " today": -3.0},
            ],
            "text_offset": [0, 5],
        })
    );
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );

    // No logprobs asked: null; length; token ids as `token_id:<id>`.
    let o = opts(json!({"prompt": "x"}));
    let v = completions::completion(
        &ctx(),
        &o,
        &update(0, vec![E::Text("y".into())], Some(FinishReason::Length)),
    );
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let o = opts(json!({"prompt": "x", "logprobs": 0, "return_tokens_as_token_ids": true}));
    let mut u = update(0, vec![E::Text("y".into())], Some(FinishReason::Stop));
    u.logprobs = vec![token("y", 99, -0.1, &[])];
    let v = completions::completion(&ctx(), &o, &u);
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"],
        json!([{"token_id:99": -0.1f32}])
    );
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"],
        json!(["token_id:99"])
    );

    // Echo: the prompt, then the completion; invalid calls and reasoning
    // (never with the parsers off) would still be text, in order.
    let o = opts(json!({"prompt": "Q: 1+1?", "echo": true}));
    let v = completions::completion(
        &ctx(),
        &o,
        &update(
            0,
            vec![
                E::Text(" A".into()),
                E::Reasoning(":".into()),
                E::InvalidCall(" 2".into()),
                E::Error("ignored".into()),
            ],
            Some(FinishReason::Stop),
        ),
    );
    assert_eq!(v["choices"][0]["text"], "Q: 1+1? A: 2");
}

/// Parsed SSE data (`[DONE]` kept as a string).
fn stream(o: &mut RenderOptions, updates: &[GenerationUpdate]) -> Vec<Value> {
    updates
        .iter()
        .flat_map(|u| completions::stream_chunks(&ctx(), o, u))
        .map(|data| serde_json::from_str(&data).unwrap_or(Value::String(data)))
        .collect()
}

/// The streamed text joined, and the one finish reason.
fn fold(chunks: &[Value]) -> (String, String) {
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let mut text = String::new();
    let mut finishes = Vec::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], "cmpl-r1");
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        assert_eq!(choice["index"], 0);
        text += choice["text"].as_str().unwrap();
        if let Some(f) = choice["finish_reason"].as_str() {
            assert_eq!(choice["text"], "");
            finishes.push(f.to_string());
        }
    }
    assert_eq!(finishes.len(), 1, "{chunks:?}");
    (text, finishes.pop().unwrap())
}

#[test]
fn streamed_equals_non_streamed_and_usage_comes_once_at_the_end() {
    let body = json!({"prompt": "Hi", "stream": true, "stream_options": {"include_usage": true}});
    let mut o = opts(body.clone());
    let updates = [
        first(),
        update(1, vec![E::Text("Hel".into())], None),
        update(2, vec![E::Text(String::new())], None),
        update(3, vec![E::Text("lo".into()), E::Text("!".into())], None),
        update(4, Vec::new(), Some(FinishReason::Length)),
    ];
    let chunks = stream(&mut o, &updates);
    // "Hel", "lo!", finish, usage, [DONE]: nothing for the first update
    // (its usage is only the prompt's) nor for the empty text.
    assert_eq!(chunks.len(), 5, "{chunks:?}");
    let (text, finish) = fold(&chunks);
    assert_eq!(text, "Hello!");
    assert_eq!(finish, "length");
    for c in &chunks[..3] {
        assert_eq!(c["usage"], Value::Null);
        assert!(c.get("usage").is_some());
    }
    let usage = &chunks[3];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["usage"]["total_tokens"], 8);

    let whole = completions::completion(
        &ctx(),
        &opts(body),
        &update(
            0,
            vec![E::Text("Hello!".into())],
            Some(FinishReason::Length),
        ),
    );
    assert_eq!(whole["choices"][0]["text"], text.as_str());

    // Without include_usage: no usage key, no usage chunk; text and the
    // finish in the same (last) update.
    let mut o = opts(json!({"prompt": "Hi", "stream": true}));
    let chunks = stream(
        &mut o,
        &[
            first(),
            update(1, vec![E::Text("ok".into())], Some(FinishReason::Stop)),
        ],
    );
    assert_eq!(chunks.len(), 3);
    assert!(chunks[..2].iter().all(|c| c.get("usage").is_none()));
    assert_eq!(fold(&chunks), ("ok".to_string(), "stop".to_string()));
}

#[test]
fn streamed_echo_comes_first() {
    let mut o = opts(json!({"prompt": "Say:", "echo": true, "stream": true}));
    let chunks = stream(
        &mut o,
        &[
            first(),
            update(1, vec![E::Text(" yes".into())], None),
            update(2, Vec::new(), Some(FinishReason::Stop)),
        ],
    );
    assert_eq!(chunks[0]["choices"][0]["text"], "Say:");
    assert_eq!(fold(&chunks).0, "Say: yes");
}

#[test]
fn streamed_logprobs_and_text_offsets_continue_across_updates() {
    let mut o = opts(json!({"prompt": "Hi", "stream": true, "logprobs": 1}));
    let mut a = update(1, vec![E::Text("Hé".into())], None);
    // "é" split over two tokens: the second starts where "é" starts.
    a.logprobs = vec![
        token("H", 1, -0.1, &[("H", 1, -0.1)]),
        token_bytes("\u{fffd}", &[0xc3], 2, -0.2, &[]),
        token_bytes("\u{fffd}", &[0xa9], 3, -0.3, &[]),
    ];
    // Tokens held back (a stop string might start here): logprobs on an
    // empty text.
    let mut held = update(2, Vec::new(), None);
    held.logprobs = vec![token(" E", 4, -0.4, &[])];
    let mut b = update(3, vec![E::Text(" End".into())], None);
    b.logprobs = vec![token("nd", 5, -0.5, &[])];
    let done = update(4, Vec::new(), Some(FinishReason::Stop));
    let chunks = stream(&mut o, &[first(), a, held, b, done]);
    assert_eq!(chunks.len(), 5, "{chunks:?}");
    let lp = |k: usize| &chunks[k]["choices"][0]["logprobs"];
    assert_eq!(lp(0)["text_offset"], json!([0, 1, 1]));
    assert_eq!(lp(0)["tokens"], json!(["H", "\u{fffd}", "\u{fffd}"]));
    assert_eq!(lp(0)["top_logprobs"][0], json!({"H": -0.1f32}));
    assert_eq!(chunks[1]["choices"][0]["text"], "");
    assert_eq!(lp(1)["text_offset"], json!([2]));
    assert_eq!(lp(2)["text_offset"], json!([4]));
    assert_eq!(chunks[3]["choices"][0]["logprobs"], Value::Null);
    assert_eq!(fold(&chunks).0, "Hé End");
}

#[test]
fn offsets_count_code_points() {
    let mut o = Offsets::default();
    assert_eq!(o.advance(b"ab"), 0);
    assert_eq!(o.advance("€".as_bytes()), 2);
    // "€" in three pieces, then an invalid byte (one replacement char).
    let euro = "€".as_bytes();
    assert_eq!(o.advance(&euro[..1]), 3);
    assert_eq!(o.advance(&euro[1..2]), 3);
    assert_eq!(o.advance(&euro[2..]), 3);
    assert_eq!(o.advance(&[0xff]), 4);
    assert_eq!(o.advance(b"x"), 5);
    assert_eq!(o.offset, 6);
    assert!(o.pending.is_empty());
}

#[test]
fn seed_is_a_signed_64_bit_integer_as_in_responses() {
    let seed = |s: Value| parse(json!({"prompt": "x", "seed": s})).0.sampling.seed;
    assert_eq!(seed(json!(-1)), Some(u64::MAX));
    assert_eq!(seed(json!(i64::MAX)), Some(i64::MAX as u64));
    for bad in [json!(9223372036854775808u64), json!(2.5)] {
        let (param, message) = rejection(json!({"prompt": "x", "seed": bad}));
        assert_eq!(param, "seed");
        assert!(message.contains("-2^63 to 2^63-1"), "{message}");
    }
}

#[test]
fn vllm_structured_output_fields_become_the_constraint() {
    use mlxhost_plugin_sdk::structured::Grammar;
    let c = opts(json!({"prompt": "x", "guided_regex": "[a-z]+"}))
        .constraint
        .expect("constraint");
    assert_eq!(
        (c.field.as_str(), c.grammar),
        ("guided_regex", Grammar::Regex("[a-z]+".into()))
    );
    let c = opts(json!({"prompt": "x", "structured_outputs": {"grammar": "start: \"a\""}}))
        .constraint
        .expect("constraint");
    assert_eq!(c.field, "structured_outputs.grammar");
    assert!(opts(json!({"prompt": "x"})).constraint.is_none());
}
