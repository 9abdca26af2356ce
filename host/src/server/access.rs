//! Who may talk to the server: API keys, the `Host` header (DNS-rebinding
//! defence), browser origins (CORS) and JSON content types. Pure checks
//! over request headers; `super::guard` applies them to every request and
//! renders the refusals in the dialect's error shape.
//!
//! Why each exists: a server on loopback is still reachable from any web
//! page the user opens. A page can send a "simple" cross-origin POST
//! (`text/plain` or form body, no preflight), so JSON routes refuse other
//! content types (415); a page on a rebinding domain reaches `127.0.0.1`
//! with its own name in `Host`, so on loopback binds only loopback names
//! are accepted (403); a page's fetch carries its `Origin`, refused unless
//! `--allowed-origins` lists it (403, and no CORS grant in preflights).

use std::net::IpAddr;

use axum::http::{header, HeaderMap, Method, Uri};

/// The server's access settings (`--api-key`, `--allowed-hosts`,
/// `--allowed-origins`).
#[derive(Debug, Clone, Default)]
pub struct AccessPolicy {
    /// Accepted API keys; empty = no key needed.
    pub api_keys: Vec<String>,
    /// Accepted `Host` names (without port; lower case); `None` = any.
    pub allowed_hosts: Option<Vec<String>>,
    /// Origins a browser page may call from (`scheme://host[:port]`,
    /// lower case); `*` = any; empty = none (CORS off).
    pub allowed_origins: Vec<String>,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 401: no or a wrong API key.
    Unauthorized,
    /// 403: a `Host` this server does not answer to.
    ForeignHost(String),
    /// 403: a browser origin not in `--allowed-origins`.
    ForeignOrigin(String),
    /// 415: a body that is not JSON on a JSON route.
    NotJson(String),
    /// 415: a JSON body in a charset other than UTF-8 (RFC 8259 §8.1).
    NotUtf8(String),
    /// 415: a body sent with a `Content-Encoding` (gzip, ...): bodies are
    /// read as sent, and decoding them would let a small request expand
    /// past `--body-limit` before it could be measured.
    Encoded(String),
    /// 400: more than one `Host` header (RFC 9112 §3.2: a server must
    /// answer 400), or an absolute-form target naming a host the server
    /// does not answer to alongside an accepted `Host`.
    AmbiguousHost(String),
}

impl Refusal {
    /// HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Unauthorized => 401,
            Refusal::ForeignHost(_) | Refusal::ForeignOrigin(_) => 403,
            Refusal::NotJson(_) | Refusal::NotUtf8(_) | Refusal::Encoded(_) => 415,
            Refusal::AmbiguousHost(_) => 400,
        }
    }

    /// The message the client sees.
    pub fn message(&self) -> String {
        match self {
            Refusal::Unauthorized => "invalid or missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY` (--api-key)".into(),
            Refusal::ForeignHost(h) => format!(
                "Host `{h}` is not allowed (this server answers to its bound address and --allowed-hosts)"
            ),
            Refusal::ForeignOrigin(o) => {
                format!("origin `{o}` is not allowed (--allowed-origins)")
            }
            Refusal::NotJson(t) => format!(
                "Content-Type `{t}` is not supported: send the body as `application/json` (curl: -H 'content-type: application/json')"
            ),
            Refusal::NotUtf8(t) => format!(
                "Content-Type `{t}` is not supported: JSON bodies must be UTF-8 (send `application/json` or `charset=utf-8`)"
            ),
            Refusal::Encoded(e) => format!(
                "Content-Encoding `{e}` is not supported: send the body uncompressed"
            ),
            Refusal::AmbiguousHost(why) => format!("bad request target: {why}"),
        }
    }
}

/// The default `--allowed-hosts` for a bind address: loopback names on a
/// loopback bind (the DNS-rebinding defence matters there: the server is
/// "private"), any host otherwise (a server exposed on purpose is reached
/// by names we cannot know).
pub fn default_allowed_hosts(bind: IpAddr) -> Option<Vec<String>> {
    bind.is_loopback().then(|| {
        ["localhost", "127.0.0.1", "::1", "[::1]"]
            .into_iter()
            .map(String::from)
            .chain(std::iter::once(bind.to_string()))
            .collect()
    })
}

/// The host name of a `Host` header value, without the port, lower case.
fn host_name(value: &str) -> String {
    let v = value.trim();
    let name = if v.starts_with('[') {
        // `[::1]:8080` -> `[::1]`
        v.split_inclusive(']').next().unwrap_or(v)
    } else {
        v.rsplit_once(':').map(|(h, _)| h).unwrap_or(v)
    };
    name.to_ascii_lowercase()
}

/// Constant-time equality, so a key cannot be guessed byte by byte from
/// response times.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `ct` (a Content-Type value) names a charset other than UTF-8.
fn foreign_charset(ct: &str) -> bool {
    ct.split(';').skip(1).any(|param| {
        let Some((name, value)) = param.split_once('=') else {
            return false;
        };
        let value = value.trim().trim_matches('"').to_ascii_lowercase();
        name.trim().eq_ignore_ascii_case("charset") && value != "utf-8" && value != "utf8"
    })
}

/// Whether `ct` (a Content-Type value) is JSON: `application/json` or a
/// `+json` type, any parameters.
fn is_json(ct: &str) -> bool {
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

impl AccessPolicy {
    /// Whether an origin may call (`--allowed-origins`).
    pub fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim().to_ascii_lowercase();
        self.allowed_origins
            .iter()
            .any(|o| o == "*" || *o == origin)
    }

    /// The API key a request carries: `Authorization: Bearer KEY` or
    /// `x-api-key: KEY` (Anthropic clients).
    fn presented_key(headers: &HeaderMap) -> Option<&str> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, key) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
            });
        bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
    }

    /// Whether the request has a valid key (always, when none is set).
    pub fn authorized(&self, headers: &HeaderMap) -> bool {
        if self.api_keys.is_empty() {
            return true;
        }
        let Some(key) = Self::presented_key(headers) else {
            return false;
        };
        // Every key is compared, so the time does not say which matched.
        self.api_keys
            .iter()
            .fold(false, |ok, k| same_key(k.as_bytes(), key.as_bytes()) | ok)
    }

    /// The checks every request passes before its route runs, in order:
    /// one `Host` (and the target's authority, for an absolute-form target
    /// `POST http://host/path`), `Origin`, then (unless `open`: `/health`)
    /// the API key, then (for a body-carrying method on a JSON route) the
    /// content type, its charset and the content encoding.
    ///
    /// Errors: the first refusal.
    pub fn check(
        &self,
        method: &Method,
        target: &Uri,
        headers: &HeaderMap,
        open: bool,
        json_route: bool,
    ) -> Result<(), Refusal> {
        if headers.get_all(header::HOST).iter().count() > 1 {
            return Err(Refusal::AmbiguousHost("more than one `Host` header".into()));
        }
        if let Some(hosts) = &self.allowed_hosts {
            let allowed = |raw: &str| {
                let name = host_name(raw);
                hosts.iter().any(|h| h == "*" || *h == name)
            };
            // HTTP/1.1 requires Host; a request without one gets the
            // bound address's rules as if it named it (curl --http1.0).
            if let Some(value) = headers.get(header::HOST) {
                let raw = value.to_str().unwrap_or("");
                if !allowed(raw) {
                    return Err(Refusal::ForeignHost(raw.to_string()));
                }
            }
            // An absolute-form target's authority overrides `Host`
            // (RFC 9112 §3.2.2), so it must pass the same check.
            if let Some(authority) = target.authority() {
                if !allowed(authority.as_str()) {
                    return Err(Refusal::AmbiguousHost(format!(
                        "the target names host `{authority}`, which this server does not answer to"
                    )));
                }
            }
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let o = origin.to_str().unwrap_or("");
            if !self.origin_allowed(o) {
                return Err(Refusal::ForeignOrigin(o.to_string()));
            }
        }
        if !open && !self.authorized(headers) {
            return Err(Refusal::Unauthorized);
        }
        let has_body = matches!(*method, Method::POST | Method::PUT | Method::PATCH);
        if json_route && has_body {
            // No Content-Type at all is read as JSON (scripts posting raw
            // bytes): a browser sends such a body cross-origin only with an
            // `Origin`, which the check above already refused.
            if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                let ct = ct.to_str().unwrap_or("(not text)");
                if !is_json(ct) {
                    return Err(Refusal::NotJson(ct.to_string()));
                }
                if foreign_charset(ct) {
                    return Err(Refusal::NotUtf8(ct.to_string()));
                }
            }
            for encoding in headers.get_all(header::CONTENT_ENCODING) {
                let e = encoding.to_str().unwrap_or("(not text)");
                if !e.trim().eq_ignore_ascii_case("identity") {
                    return Err(Refusal::Encoded(e.to_string()));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn loopback() -> AccessPolicy {
        AccessPolicy {
            allowed_hosts: default_allowed_hosts("127.0.0.1".parse().unwrap()),
            ..Default::default()
        }
    }

    #[test]
    fn loopback_binds_answer_only_loopback_names() {
        let p = loopback();
        let get = |host: &'static str| {
            p.check(
                &Method::GET,
                &Uri::from_static("/"),
                &headers(&[("host", host)]),
                false,
                false,
            )
        };
        assert!(get("127.0.0.1:8080").is_ok());
        assert!(get("localhost:8080").is_ok());
        assert!(get("LOCALHOST").is_ok());
        assert!(get("[::1]:8080").is_ok());
        assert_eq!(
            get("evil.example:8080"),
            Err(Refusal::ForeignHost("evil.example:8080".into()))
        );
        let open = AccessPolicy {
            allowed_hosts: default_allowed_hosts("0.0.0.0".parse().unwrap()),
            ..Default::default()
        };
        assert!(open
            .check(
                &Method::GET,
                &Uri::from_static("/"),
                &headers(&[("host", "any.name")]),
                false,
                false
            )
            .is_ok());
    }

    #[test]
    fn keys_are_accepted_as_bearer_or_x_api_key() {
        let p = AccessPolicy {
            api_keys: vec!["k1".into(), "k2".into()],
            ..Default::default()
        };
        assert!(p.authorized(&headers(&[("authorization", "Bearer k1")])));
        assert!(p.authorized(&headers(&[("authorization", "bearer  k2")])));
        assert!(p.authorized(&headers(&[("x-api-key", "k2")])));
        assert!(!p.authorized(&headers(&[("authorization", "Bearer k3")])));
        assert!(!p.authorized(&headers(&[("authorization", "Basic k1")])));
        assert!(!p.authorized(&headers(&[])));
        // `/health` stays open.
        assert!(p
            .check(
                &Method::GET,
                &Uri::from_static("/"),
                &headers(&[]),
                true,
                false
            )
            .is_ok());
        assert_eq!(
            p.check(
                &Method::GET,
                &Uri::from_static("/"),
                &headers(&[]),
                false,
                false
            ),
            Err(Refusal::Unauthorized)
        );
        assert!(AccessPolicy::default().authorized(&headers(&[])));
    }

    #[test]
    fn json_routes_refuse_other_bodies() {
        let p = AccessPolicy::default();
        let post = |h: HeaderMap| p.check(&Method::POST, &Uri::from_static("/"), &h, false, true);
        assert!(post(headers(&[("content-type", "application/json")])).is_ok());
        assert!(post(headers(&[(
            "content-type",
            "application/json; charset=utf-8"
        )]))
        .is_ok());
        assert!(post(headers(&[("content-type", "application/vnd.api+json")])).is_ok());
        assert_eq!(
            post(headers(&[("content-type", "text/plain")])),
            Err(Refusal::NotJson("text/plain".into()))
        );
        assert!(post(headers(&[(
            "content-type",
            "application/x-www-form-urlencoded"
        )]))
        .is_err());
        assert!(post(headers(&[])).is_ok());
        assert!(post(headers(&[("content-length", "0")])).is_ok());
        assert!(p
            .check(
                &Method::GET,
                &Uri::from_static("/"),
                &headers(&[]),
                false,
                true
            )
            .is_ok());
    }

    #[test]
    fn origins_need_allowing() {
        let p = AccessPolicy::default();
        let h = headers(&[("origin", "https://evil.example")]);
        assert_eq!(
            p.check(&Method::POST, &Uri::from_static("/"), &h, false, false),
            Err(Refusal::ForeignOrigin("https://evil.example".into()))
        );
        let allowed = AccessPolicy {
            allowed_origins: vec!["https://app.example".into()],
            ..Default::default()
        };
        assert!(allowed.origin_allowed("https://APP.example"));
        assert!(!allowed.origin_allowed("https://evil.example"));
        let any = AccessPolicy {
            allowed_origins: vec!["*".into()],
            ..Default::default()
        };
        assert!(any
            .check(&Method::POST, &Uri::from_static("/"), &h, false, false)
            .is_ok());
    }

    #[test]
    fn one_host_and_a_target_that_agrees_with_it() {
        let p = loopback();
        let mut two = headers(&[("host", "localhost")]);
        two.append("host", HeaderValue::from_static("evil.example"));
        assert!(matches!(
            p.check(&Method::GET, &Uri::from_static("/"), &two, false, false),
            Err(Refusal::AmbiguousHost(_))
        ));
        let h = headers(&[("host", "localhost")]);
        let foreign = Uri::from_static("http://evil.example/v1/models");
        let err = p
            .check(&Method::GET, &foreign, &h, false, false)
            .unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.message().contains("evil.example"));
        let own = Uri::from_static("http://127.0.0.1:8080/v1/models");
        assert!(p.check(&Method::GET, &own, &h, false, false).is_ok());
    }

    #[test]
    fn json_bodies_are_utf8_and_unencoded() {
        let p = AccessPolicy::default();
        let post = |h: HeaderMap| p.check(&Method::POST, &Uri::from_static("/"), &h, false, true);
        assert!(matches!(
            post(headers(&[(
                "content-type",
                "application/json; charset=utf-16"
            )])),
            Err(Refusal::NotUtf8(_))
        ));
        assert!(post(headers(&[(
            "content-type",
            "application/json; charset=\"UTF-8\""
        )]))
        .is_ok());
        let err = post(headers(&[
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ]))
        .unwrap_err();
        assert_eq!(
            (err.status(), err.clone()),
            (415, Refusal::Encoded("gzip".into()))
        );
        assert!(post(headers(&[("content-encoding", "identity")])).is_ok());
    }
}
