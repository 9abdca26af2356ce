//! Behaviours the recorded fixtures do not pin down: schema typing,
//! requests without tools, what streaming holds back, call ids.

use super::{Format, ToolParser};
use crate::stream::{Event, Stream};
use crate::think::Think;
use crate::tools::Tools;

fn stream(format: Format, tools: &[(&str, &str)]) -> Stream<ToolParser> {
    let tools = Tools::new(tools.iter().map(|(n, s)| (n.to_string(), s.to_string())));
    Stream::new(ToolParser { format, tools }, "")
}

fn all(s: &mut Stream<ToolParser>, text: &str) -> Vec<Event> {
    let mut e = s.feed(text);
    e.extend(s.finish());
    e
}

fn arguments(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::CallArguments { arguments, .. } => Some(arguments.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn qwen3_coder_types_values_by_the_schema() {
    let text = "<tool_call>\n<function=f>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>";
    let schema = r#"{"type": "object", "properties": {"days": {"type": "integer"}, "zip": {"type": "string"}, "flag": {"type": "boolean"}}}"#;
    let mut s = stream(Format::Qwen3Coder, &[("f", schema)]);
    assert_eq!(
        arguments(&all(&mut s, text)),
        [r#"{"days":3,"zip":"01234","flag":true}"#]
    );
    // Without a schema: JSON when it parses (`01234` does not), else text.
    let mut s = stream(Format::Qwen3Coder, &[("f", "{}")]);
    assert_eq!(
        arguments(&all(&mut s, text)),
        [r#"{"days":3,"zip":"01234","flag":true}"#]
    );
    let mut s = stream(
        Format::Qwen3Coder,
        &[("f", r#"{"properties": {"days": {"type": "string"}}}"#)],
    );
    assert_eq!(
        arguments(&all(&mut s, text)),
        [r#"{"days":"3","zip":"01234","flag":true}"#]
    );
}

#[test]
fn without_declared_tools_tagged_calls_count_and_bare_ones_do_not() {
    let mut s = stream(Format::Hermes, &[]);
    let e = all(
        &mut s,
        "<tool_call>\n{\"name\": \"anything\", \"arguments\": {}}\n</tool_call>",
    );
    assert!(matches!(&e[0], Event::CallStart { name, .. } if name == "anything"));
    let mut s = stream(Format::Hermes, &[]);
    let bare = "{\"name\": \"anything\", \"arguments\": {}}";
    assert_eq!(all(&mut s, bare), [Event::Text(bare.into())]);
}

#[test]
fn streaming_holds_back_only_what_may_still_be_a_call() {
    let mut s = stream(Format::Hermes, &[("f", "{}")]);
    assert_eq!(s.feed("Hi <tool_"), [Event::Text("Hi".into())]);
    assert_eq!(s.feed("x"), [Event::Text(" <tool_x".into())]);
    assert_eq!(s.feed(" <tool_call>\n{\"name\": \"f\", "), []);
    let e = s.feed("\"arguments\": {}}\n</tool_call>");
    assert_eq!(e.len(), 3, "{e:?}");
    // The whitespace before the call was dropped, not sent late.
    assert_eq!(s.finish(), []);

    let mut s = stream(Format::Pythonic, &[("f", "{}")]);
    assert_eq!(s.feed("[f(a="), []);
    assert_eq!(
        s.feed("1)] and more"),
        [Event::Text("[f(a=1)] and more".into())]
    );

    let mut s = Stream::new(Think::new(""), "");
    assert_eq!(
        s.feed("<think>\nstep one\n"),
        [Event::Reasoning("step one".into())]
    );
    assert_eq!(s.feed("</thi"), []);
    assert_eq!(s.feed("nk>\n\nAnswer"), [Event::Text("Answer".into())]);
}

#[test]
fn call_ids_differ_per_call_and_per_salt() {
    let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    let ids = |salt: &str| -> Vec<String> {
        let tools = Tools::new([("f".to_string(), "{}".to_string())]);
        let mut s = Stream::new(
            ToolParser {
                format: Format::Hermes,
                tools,
            },
            salt,
        );
        let mut e = s.feed(text);
        e.extend(s.finish());
        e.into_iter()
            .filter_map(|e| match e {
                Event::CallStart { id, .. } => Some(id),
                _ => None,
            })
            .collect()
    };
    let a = ids("");
    assert_eq!(a.len(), 2);
    assert_ne!(a[0], a[1]);
    assert_eq!(a, ids(""));
    assert_ne!(a, ids("request-2"));
}

#[test]
fn call_prefixes_quote_names_as_their_format_does() {
    assert_eq!(
        Format::Hermes.call_prefix("a\"b"),
        "<tool_call>\n{\"name\": \"a\\\"b\", \"arguments\": "
    );
    assert_eq!(
        Format::Qwen3Coder.call_prefix("f"),
        "<tool_call>\n<function=f>\n"
    );
    assert_eq!(Format::Pythonic.call_prefix("f"), "[f(");
}
