//! Python call lists and literals (`[f(a=1, b="x"), g()]`), read into JSON,
//! telling "cut short" from "not Python" so a prefix can be judged while it
//! streams.
//!
//! Accepted: strings in either quote, triple-quoted, with `r`/`u`/`b`
//! prefixes and Python's escapes; ints (also `0x`/`0o`/`0b`, `_`), floats;
//! `True`/`False`/`None` (and JSON's `true`/`false`/`null`); lists, tuples
//! (as arrays), dicts (keys: strings, numbers, booleans, stringified;
//! nested dicts come out with sorted keys, keyword arguments in order).
//! Positional arguments and nested calls are not: a call's arguments must
//! be keywords, since JSON arguments have names.

use serde_json::{Map, Number, Value};

/// Why reading stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The text ended first.
    Short,
    /// Not this grammar, whatever follows.
    Bad,
}

type R<T> = Result<T, Stop>;

/// One call: name, keyword arguments, and its text span.
#[derive(Debug, Clone, PartialEq)]
pub struct PyCall {
    pub name: String,
    /// Keyword arguments in order.
    pub args: Vec<(String, Value)>,
    pub start: usize,
    pub end: usize,
}

/// Reads `[call, ...]` at `p` (which must hold `[`): the calls and the
/// offset after `]`.
pub fn call_list(text: &str, p: usize) -> R<(Vec<PyCall>, usize)> {
    let mut r = Reader { s: text, i: p };
    r.expect('[')?;
    let mut calls = Vec::new();
    loop {
        r.ws();
        if r.eat(']')? {
            return Ok((calls, r.i));
        }
        calls.push(r.call()?);
        r.ws();
        if r.eat(',')? {
            continue;
        }
        r.expect(']')?;
        return Ok((calls, r.i));
    }
}

/// Reads one call at `p`.
pub fn call(text: &str, p: usize) -> R<PyCall> {
    Reader { s: text, i: p }.call()
}

struct Reader<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> R<char> {
        self.s[self.i..].chars().next().ok_or(Stop::Short)
    }

    fn ws(&mut self) {
        self.i = crate::text::skip_ws(self.s, self.i);
    }

    /// Consumes `c` if it is next.
    fn eat(&mut self, c: char) -> R<bool> {
        if self.peek()? == c {
            self.i += c.len_utf8();
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn expect(&mut self, c: char) -> R<()> {
        if self.eat(c)? {
            Ok(())
        } else {
            Err(Stop::Bad)
        }
    }

    /// An identifier; at the end of the text it could still grow: `Short`.
    fn ident(&mut self) -> R<&'a str> {
        let start = self.i;
        let rest = &self.s[start..];
        let len = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if len == rest.len() {
            return Err(Stop::Short);
        }
        if len == 0 || rest.starts_with(|c: char| c.is_numeric()) {
            return Err(Stop::Bad);
        }
        self.i += len;
        Ok(&self.s[start..start + len])
    }

    /// `name(.name)*(kw=value, ...)`.
    fn call(&mut self) -> R<PyCall> {
        let start = self.i;
        let mut name = self.ident()?.to_string();
        while self.eat('.')? {
            name.push('.');
            name.push_str(self.ident()?);
        }
        self.ws();
        self.expect('(')?;
        let mut args = Vec::new();
        loop {
            self.ws();
            if self.eat(')')? {
                return Ok(PyCall {
                    name,
                    args,
                    start,
                    end: self.i,
                });
            }
            let key = self.ident()?.to_string();
            self.ws();
            self.expect('=')?;
            self.ws();
            let value = self.value()?;
            args.push((key, value));
            self.ws();
            if !self.eat(',')? {
                self.expect(')')?;
                return Ok(PyCall {
                    name,
                    args,
                    start,
                    end: self.i,
                });
            }
        }
    }

    fn value(&mut self) -> R<Value> {
        match self.peek()? {
            '"' | '\'' => self.string(false),
            '[' => self.sequence('[', ']'),
            '(' => self.sequence('(', ')'),
            '{' => self.dict(),
            c if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => self.number(),
            c if c.is_alphabetic() || c == '_' => {
                let word = self.ident()?;
                match word {
                    "True" | "true" => Ok(Value::Bool(true)),
                    "False" | "false" => Ok(Value::Bool(false)),
                    "None" | "null" => Ok(Value::Null),
                    w if w.len() <= 2 && w.chars().all(|c| "rRuUbB".contains(c)) => {
                        match self.peek()? {
                            '"' | '\'' => self.string(w.contains(['r', 'R'])),
                            _ => Err(Stop::Bad),
                        }
                    }
                    _ => Err(Stop::Bad),
                }
            }
            _ => Err(Stop::Bad),
        }
    }

    /// `[a, b]` or `(a, b)` as an array; `(a)` is just `a`, as in Python.
    fn sequence(&mut self, open: char, close: char) -> R<Value> {
        self.expect(open)?;
        let mut items = Vec::new();
        let mut trailing_comma = false;
        loop {
            self.ws();
            if self.eat(close)? {
                break;
            }
            items.push(self.value()?);
            self.ws();
            trailing_comma = self.eat(',')?;
            if !trailing_comma {
                self.ws();
                self.expect(close)?;
                break;
            }
        }
        if open == '(' && items.len() == 1 && !trailing_comma {
            return Ok(items.pop().unwrap_or(Value::Null));
        }
        Ok(Value::Array(items))
    }

    fn dict(&mut self) -> R<Value> {
        self.expect('{')?;
        let mut map = Map::new();
        loop {
            self.ws();
            if self.eat('}')? {
                return Ok(Value::Object(map));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                k @ (Value::Number(_) | Value::Bool(_)) => k.to_string(),
                _ => return Err(Stop::Bad),
            };
            self.ws();
            self.expect(':')?;
            self.ws();
            let value = self.value()?;
            map.insert(key, value);
            self.ws();
            if !self.eat(',')? {
                self.ws();
                self.expect('}')?;
                return Ok(Value::Object(map));
            }
        }
    }

    fn number(&mut self) -> R<Value> {
        let rest = &self.s[self.i..];
        let mut len = 0;
        for (k, c) in rest.char_indices() {
            let after_exponent =
                k > 0 && matches!(rest.as_bytes()[k - 1], b'e' | b'E') && !rest.starts_with("0x");
            let ok = c.is_ascii_alphanumeric()
                || c == '_'
                || c == '.'
                || ((c == '-' || c == '+') && (k == 0 || after_exponent));
            if !ok {
                break;
            }
            len = k + c.len_utf8();
        }
        if len == rest.len() {
            return Err(Stop::Short);
        }
        self.i += len;
        parse_number(&rest[..len].replace('_', "")).ok_or(Stop::Bad)
    }

    /// A string whose opening quote is next.
    fn string(&mut self, raw: bool) -> R<Value> {
        let q = self.peek()?;
        let rest = &self.s[self.i..];
        let triple: String = [q; 3].iter().collect();
        // `"` or `""` at the end could still become `"""`.
        if rest.len() < 3 && triple.starts_with(rest) {
            return Err(Stop::Short);
        }
        let long = rest.starts_with(&triple);
        self.i += if long { 3 } else { 1 };
        let mut out = String::new();
        loop {
            let c = self.peek()?;
            if long && self.s[self.i..].starts_with(&triple) {
                self.i += 3;
                return Ok(Value::String(out));
            }
            if long && c == q && could_close(&self.s[self.i..], &triple) {
                return Err(Stop::Short);
            }
            self.i += c.len_utf8();
            match c {
                _ if c == q && !long => return Ok(Value::String(out)),
                '\n' if !long => return Err(Stop::Bad),
                '\\' if raw => {
                    // Raw strings keep the backslash; it still protects a quote.
                    out.push('\\');
                    let next = self.peek()?;
                    out.push(next);
                    self.i += next.len_utf8();
                }
                '\\' => self.escape(&mut out)?,
                c => out.push(c),
            }
        }
    }

    /// Python's escapes, after the backslash.
    fn escape(&mut self, out: &mut String) -> R<()> {
        let c = self.peek()?;
        self.i += c.len_utf8();
        let simple = match c {
            '\n' => Some(None),
            '\\' => Some(Some('\\')),
            '\'' => Some(Some('\'')),
            '"' => Some(Some('"')),
            'a' => Some(Some('\x07')),
            'b' => Some(Some('\x08')),
            'f' => Some(Some('\x0c')),
            'n' => Some(Some('\n')),
            'r' => Some(Some('\r')),
            't' => Some(Some('\t')),
            'v' => Some(Some('\x0b')),
            _ => None,
        };
        if let Some(ch) = simple {
            out.extend(ch);
            return Ok(());
        }
        let (digits, radix) = match c {
            'x' => (2, 16),
            'u' => (4, 16),
            'U' => (8, 16),
            '0'..='7' => {
                // Up to three octal digits, the first already read.
                let more = self.s[self.i..]
                    .chars()
                    .take(2)
                    .take_while(|d| d.is_digit(8))
                    .count();
                let code = u32::from_str_radix(&self.s[self.i - 1..self.i + more], 8)
                    .map_err(|_| Stop::Bad)?;
                self.i += more;
                out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                return Ok(());
            }
            other => {
                // Unknown escapes stay as written.
                out.push('\\');
                out.push(other);
                return Ok(());
            }
        };
        let hex = self.s.get(self.i..self.i + digits).ok_or(Stop::Short)?;
        let mut code = u32::from_str_radix(hex, radix).map_err(|_| Stop::Bad)?;
        self.i += digits;
        // A UTF-16 surrogate pair written as two `\u` escapes.
        if (0xD800..0xDC00).contains(&code) && self.s[self.i..].starts_with("\\u") {
            if let Some(low) = self
                .s
                .get(self.i + 2..self.i + 6)
                .and_then(|h| u32::from_str_radix(h, 16).ok())
            {
                if (0xDC00..0xE000).contains(&low) {
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    self.i += 6;
                }
            }
        }
        out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
        Ok(())
    }
}

/// Whether `rest` (starting with a quote) is a proper prefix of `triple`,
/// i.e. the text ends inside what may be the closing quotes.
fn could_close(rest: &str, triple: &str) -> bool {
    rest.len() < triple.len() && triple.starts_with(rest)
}

fn parse_number(t: &str) -> Option<Value> {
    let (neg, body) = match t.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let lower = body.to_ascii_lowercase();
    let radix = [("0x", 16), ("0o", 8), ("0b", 2)]
        .iter()
        .find(|(p, _)| lower.starts_with(p));
    if let Some((prefix, radix)) = radix {
        let v = i64::from_str_radix(&lower[prefix.len()..], *radix).ok()?;
        return Some(Value::Number(Number::from(if neg { -v } else { v })));
    }
    if !body.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return None;
    }
    if body.chars().all(|c| c.is_ascii_digit()) {
        if let Ok(v) = t.parse::<i64>() {
            return Some(Value::Number(Number::from(v)));
        }
    }
    let f: f64 = t.parse().ok()?;
    Number::from_f64(f).map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(s: &str) -> R<Value> {
        call(s, 0).map(|c| Value::Object(c.args.into_iter().collect()))
    }

    #[test]
    fn literals_become_json() {
        assert_eq!(
            args(
                r#"f(a=1, b="x", c='y', d=True, e=None, f=-2.5, g=[1, (2, 3)], h={"k": {'n': 1e3}}, i=0x10) "#
            ),
            Ok(
                json!({"a": 1, "b": "x", "c": "y", "d": true, "e": null, "f": -2.5, "g": [1, [2, 3]], "h": {"k": {"n": 1000.0}}, "i": 16})
            )
        );
        assert_eq!(
            args(r#"f(s='it\'s "q" \n \u00e9 \x41 \101', r=r'\d+', t="""a"b""") "#),
            Ok(json!({"s": "it's \"q\" \n é A A", "r": "\\d+", "t": "a\"b"}))
        );
        assert_eq!(args("f(x='😀 東京',) "), Ok(json!({"x": "😀 東京"})));
        assert_eq!(args("f() "), Ok(json!({})));
    }

    #[test]
    fn cut_short_or_not_python() {
        for cut in [
            "f(a=1",
            "f(a=\"x",
            "f(a=Tru",
            "f(a=[1, 2",
            "f",
            "f(a=\"\"",
            "f(a='\\",
        ] {
            assert_eq!(args(cut), Err(Stop::Short), "{cut}");
        }
        for bad in [
            "f(1) ",
            "f(a=Paris) ",
            "f(a=g()) ",
            "1f() ",
            "f(a=1 b=2) ",
            "f(a='x\n') ",
        ] {
            assert_eq!(args(bad), Err(Stop::Bad), "{bad}");
        }
    }

    #[test]
    fn lists_of_calls() {
        let (calls, end) = call_list("[a.b(x=1), c()] tail", 0).unwrap();
        assert_eq!(end, 15);
        assert_eq!(
            calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["a.b", "c"]
        );
        assert_eq!(call_list("[]", 0).map(|(c, _)| c.len()), Ok(0));
        assert_eq!(call_list("[a(", 0), Err(Stop::Short));
        assert_eq!(call_list("[1]", 0), Err(Stop::Bad));
    }
}
