//! What keeps a web page in the user's browser from driving the server.
//!
//! - **DNS rebinding**: a page on `evil.example` whose name is then pointed at 127.0.0.1 reaches
//!   a loopback server as if same-origin, but its requests say `Host: evil.example`. A server
//!   listening on loopback therefore answers (GET included, since reading runs and configs is
//!   the point of such an attack) only requests whose `Host` is `localhost`, `127.0.0.1`,
//!   `[::1]` or the bound address, with any port (so an SSH port forward keeps working).
//! - **Cross-site requests**: any page may POST a form or a `text/plain` body to any address
//!   without asking first. A state-changing request (anything but GET, HEAD, OPTIONS) that
//!   carries an `Origin` must come from the server's own origin (`http://<Host>`), and none may
//!   have a content type a form can send (`text/plain`, `application/x-www-form-urlencoded`,
//!   `multipart/form-data`): the API takes JSON, and reward modules as raw bytes with a type
//!   such as `application/wasm`. Browsers send `Origin` on every cross-site POST; clients such
//!   as curl send none and are not affected by that rule.
//!
//! Listening beyond loopback needs a token, and the token is then the defence against both: a
//! page cannot send it without the user's help. `Host` is then not restricted (the server may
//! be reached under any name, or through a proxy), and an `Origin` may also be
//! `https://<Host>` (a proxy terminating TLS). The Origin and content-type rules still apply.

use crate::api::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// The request checks of one server, set from its bound address.
#[derive(Clone, Debug)]
pub struct Guard {
    /// Host names (lowercase, IPv6 in brackets) accepted in `Host`; `None` accepts any.
    hosts: Option<Vec<String>>,
    /// Whether `https://<Host>` is a same origin too (behind a TLS proxy; token servers only).
    https_origin: bool,
}

/// Content types a page can send cross-site without the browser asking the server first.
const SIMPLE_TYPES: [&str; 3] = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
];

impl Guard {
    /// The checks for a server bound to `bound`: loopback servers check `Host`.
    pub fn new(bound: SocketAddr) -> Guard {
        if bound.ip().is_loopback() {
            let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "[::1]"]
                .map(String::from)
                .to_vec();
            let own = match bound.ip() {
                IpAddr::V4(ip) => ip.to_string(),
                IpAddr::V6(ip) => format!("[{ip}]"),
            };
            if !hosts.contains(&own) {
                hosts.push(own);
            }
            Guard {
                hosts: Some(hosts),
                https_origin: false,
            }
        } else {
            Guard {
                hosts: None,
                https_origin: true,
            }
        }
    }

    /// Whether a request with this method and these headers may be served; the error says
    /// which rule refused it.
    pub fn admit(&self, method: &Method, headers: &HeaderMap) -> Result<(), ApiError> {
        let host = header_text(headers, header::HOST);
        if let Some(allowed) = &self.hosts {
            let name = host.map(host_name).unwrap_or_default().to_ascii_lowercase();
            if !allowed.contains(&name) {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!(
                        "Host '{}' is not this machine: a server on loopback answers only to {}",
                        host.unwrap_or_default(),
                        allowed.join(", ")
                    ),
                ));
            }
        }
        if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
            return Ok(());
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or_default();
            if !self.same_origin(origin, host.unwrap_or_default()) {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!(
                        "cross-site request refused: Origin '{origin}' is not this server \
                         (http://{})",
                        host.unwrap_or_default()
                    ),
                ));
            }
        }
        let content_type = header_text(headers, header::CONTENT_TYPE).unwrap_or_default();
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        if SIMPLE_TYPES.contains(&essence.as_str()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "Content-Type {essence} is refused (a web page can send it cross-site): \
                     send JSON as application/json, reward modules as application/wasm"
                ),
            ));
        }
        Ok(())
    }

    fn same_origin(&self, origin: &str, host: &str) -> bool {
        if host.is_empty() {
            return false;
        }
        let matches = |scheme: &str| {
            origin
                .strip_prefix(scheme)
                .is_some_and(|rest| rest.eq_ignore_ascii_case(host))
        };
        matches("http://") || (self.https_origin && matches("https://"))
    }
}

fn header_text(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The name part of a `Host` value: `localhost:8080` → `localhost`, `[::1]:80` → `[::1]`.
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    }
}

/// The middleware: refuses what [`Guard::admit`] refuses, before anything else runs, in the
/// error shape of the API asked (OpenAI's under `/v1`).
pub async fn check(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    match guard.admit(request.method(), request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) if is_openai_path(request.uri().path()) => {
            crate::openai::refusal(e.status(), e.message())
        }
        Err(e) => e.into_response(),
    }
}

/// Whether `path` is the OpenAI-compatible endpoint's.
fn is_openai_path(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("header value"));
        }
        h
    }

    fn status(guard: &Guard, method: Method, pairs: &[(&'static str, &str)]) -> u16 {
        match guard.admit(&method, &headers(pairs)) {
            Ok(()) => 200,
            Err(e) => e.status().as_u16(),
        }
    }

    #[test]
    fn a_loopback_server_answers_only_to_local_names() {
        let g = Guard::new("127.0.0.1:8080".parse().expect("addr"));
        for host in [
            "localhost",
            "localhost:8080",
            "LOCALHOST:9000",
            "127.0.0.1",
            "127.0.0.1:8080",
            "[::1]",
            "[::1]:8080",
        ] {
            assert_eq!(status(&g, Method::GET, &[("host", host)]), 200, "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io:8080",
            "",
        ] {
            assert_eq!(status(&g, Method::GET, &[("host", host)]), 403, "{host}");
        }
        assert_eq!(status(&g, Method::GET, &[]), 403);
        let own = Guard::new("127.0.0.2:8080".parse().expect("addr"));
        assert_eq!(
            status(&own, Method::GET, &[("host", "127.0.0.2:8080")]),
            200
        );
        let v6 = Guard::new("[::1]:8080".parse().expect("addr"));
        assert_eq!(status(&v6, Method::GET, &[("host", "[::1]:8080")]), 200);
    }

    #[test]
    fn state_changes_need_the_same_origin_and_a_non_form_type() {
        let g = Guard::new("127.0.0.1:8080".parse().expect("addr"));
        let host = ("host", "127.0.0.1:8080");
        let json = ("content-type", "application/json");
        assert_eq!(status(&g, Method::POST, &[host, json]), 200);
        let same = ("origin", "http://127.0.0.1:8080");
        assert_eq!(status(&g, Method::POST, &[host, json, same]), 200);
        for origin in [
            "http://evil.example",
            "http://localhost:8080",
            "http://127.0.0.1:9999",
            "https://127.0.0.1:8080",
            "null",
        ] {
            let o = ("origin", origin);
            assert_eq!(status(&g, Method::POST, &[host, json, o]), 403, "{origin}");
            assert_eq!(status(&g, Method::DELETE, &[host, o]), 403, "{origin}");
            // Reads are not refused for their Origin: without CORS the page cannot read them.
            assert_eq!(status(&g, Method::GET, &[host, o]), 200, "{origin}");
        }
        for t in [
            "text/plain",
            "text/plain;charset=UTF-8",
            "application/x-www-form-urlencoded",
            "Multipart/Form-Data; boundary=x",
        ] {
            let ct = ("content-type", t);
            assert_eq!(status(&g, Method::POST, &[host, ct]), 415, "{t}");
        }
        assert_eq!(status(&g, Method::POST, &[host]), 200);
        let wasm = ("content-type", "application/wasm");
        assert_eq!(status(&g, Method::POST, &[host, wasm, same]), 200);
    }

    #[test]
    fn a_token_server_takes_any_host_but_checks_origin() {
        let g = Guard::new("0.0.0.0:8080".parse().expect("addr"));
        let host = ("host", "anneal.lab.example");
        assert_eq!(status(&g, Method::GET, &[host]), 200);
        for origin in ["http://anneal.lab.example", "https://anneal.lab.example"] {
            assert_eq!(status(&g, Method::POST, &[host, ("origin", origin)]), 200);
        }
        let evil = ("origin", "https://evil.example");
        assert_eq!(status(&g, Method::POST, &[host, evil]), 403);
    }
}
