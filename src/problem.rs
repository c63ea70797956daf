//! RFC 9457 problem documents, rendered to exact bytes. Below the HTTP
//! layer because a business rejection is stored under its key inside the
//! posting transaction, and replayed byte for byte.

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use problem_details::ProblemDetails;
use serde::Serialize;

use crate::idempotency::StoredResponse;

/// Problem types are URI references under this base, relative so that they
/// resolve, against the URL of the request that got the problem, to the
/// page this service serves for each (`/problems/{slug}`, rendered from
/// `docs/problems.md`) on whatever host and port it runs (ADR-002).
pub const PROBLEM_TYPE_BASE: &str = "/problems/";

/// A `param` naming a field the client sent is cut to this many characters.
pub const PARAM_CHARS_MAX: usize = 64;

/// The longest `x-request-id` a client may send; a longer one (or one with
/// other than visible ASCII) is replaced by a generated one. Bounds what a
/// problem document and a key's record carry.
pub const REQUEST_ID_CHARS_MAX: usize = 128;

/// Whether a client's `x-request-id` is kept as the request's id.
pub fn acceptable_request_id(value: &[u8]) -> bool {
    (1..=REQUEST_ID_CHARS_MAX).contains(&value.len())
        && value.iter().all(|b| (0x21..=0x7e).contains(b))
}

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Client-supplied text echoed in a problem `detail` (a serde message naming
/// an unknown field, say) is cut to this many characters.
pub const DETAIL_CHARS_MAX: usize = 300;

/// One problem: the stable slug of its `type`, its title, status and
/// detail; the field or header at fault, when one is; and the id of the
/// request that got it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub slug: &'static str,
    pub title: &'static str,
    pub status: StatusCode,
    pub detail: String,
    /// The JSON field, query parameter or header at fault.
    pub param: Option<Cow<'static, str>>,
    /// The `x-request-id` of the request answered. A problem built without
    /// one gets it on its way out (`http::problem_request_id`).
    pub request_id: Option<String>,
}

/// The members this service adds to RFC 9457's, after them.
#[derive(Serialize)]
struct Extensions<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

impl Problem {
    pub fn new(
        slug: &'static str,
        title: &'static str,
        status: StatusCode,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            slug,
            title,
            status,
            detail: detail.into(),
            param: None,
            request_id: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<Cow<'static, str>>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_request_id(mut self, request_id: Option<&str>) -> Self {
        self.request_id = request_id.map(str::to_owned);
        self
    }

    /// The document's exact bytes.
    pub fn body(&self) -> Bytes {
        let problem = ProblemDetails::new()
            .with_type(type_uri(self.slug))
            .with_title(self.title)
            .with_status(self.status)
            .with_detail(truncate_chars(&self.detail, DETAIL_CHARS_MAX))
            .with_extensions(Extensions {
                param: self
                    .param
                    .as_deref()
                    .map(|p| truncate_chars(p, PARAM_CHARS_MAX)),
                request_id: self.request_id.as_deref(),
            });
        // Serialising a struct of strings and a status code cannot fail; an
        // empty body would still carry the status.
        Bytes::from(serde_json::to_vec(&problem).unwrap_or_default())
    }

    /// This problem as an answer to store under an idempotency key.
    pub fn to_stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status,
            headers: vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
            )],
            body: self.body(),
        }
    }
}

/// A problem document with `request_id` added last, unless it has one
/// (a stored refusal replayed keeps the id of the request that got it).
/// Anything that is not a JSON object is returned as it is.
pub fn with_request_id(body: Bytes, request_id: &str) -> Bytes {
    let has_id = match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body) {
        Ok(members) => members.contains_key("request_id"),
        Err(_) => return body,
    };
    let Some(close) = body.iter().rposition(|&b| b == b'}') else {
        return body;
    };
    let empty = body[..close]
        .iter()
        .rev()
        .find(|b| !b.is_ascii_whitespace())
        == Some(&b'{');
    if has_id || empty {
        return body;
    }
    let Ok(id) = serde_json::to_string(request_id) else {
        return body;
    };
    let mut out = Vec::with_capacity(body.len() + id.len() + 14);
    out.extend_from_slice(&body[..close]);
    out.extend_from_slice(b",\"request_id\":");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(&body[close..]);
    Bytes::from(out)
}

pub fn type_uri(slug: &str) -> http::Uri {
    format!("{PROBLEM_TYPE_BASE}{slug}")
        .parse()
        .unwrap_or_else(|_| http::Uri::from_static("about:blank"))
}

fn truncate_chars(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_details_are_cut() {
        let problem = Problem::new(
            "malformed-request",
            "Malformed request",
            StatusCode::BAD_REQUEST,
            "x".repeat(1000),
        )
        .with_param("y".repeat(1000));
        let value: serde_json::Value = serde_json::from_slice(&problem.body()).unwrap_or_default();
        let detail = value["detail"].as_str().unwrap_or_default();
        assert_eq!(detail.chars().count(), DETAIL_CHARS_MAX + 1);
        let param = value["param"].as_str().unwrap_or_default();
        assert_eq!(param.chars().count(), PARAM_CHARS_MAX + 1);
    }

    #[test]
    fn the_request_id_is_added_last_once() {
        let bare = Problem::new("not-found", "Not found", StatusCode::NOT_FOUND, "x");
        let added = with_request_id(bare.body(), "r\"1");
        assert_eq!(
            added,
            r#"{"type":"/problems/not-found","status":404,"title":"Not found","detail":"x","request_id":"r\"1"}"#
        );
        assert_eq!(
            with_request_id(added.clone(), "r-2"),
            added,
            "kept as it was"
        );
        for other in ["[1]", "not json", "{}", ""] {
            let body = Bytes::from(other);
            assert_eq!(with_request_id(body.clone(), "r"), body);
        }
    }

    #[test]
    fn members_come_in_a_fixed_order_and_absent_ones_are_left_out() {
        let bare = Problem::new("not-found", "Not found", StatusCode::NOT_FOUND, "not found");
        assert_eq!(
            bare.body(),
            r#"{"type":"/problems/not-found","status":404,"title":"Not found","detail":"not found"}"#
        );
        let full = bare.with_param("to").with_request_id(Some("r-1"));
        assert_eq!(
            full.body(),
            r#"{"type":"/problems/not-found","status":404,"title":"Not found","detail":"not found","param":"to","request_id":"r-1"}"#
        );
    }
}
