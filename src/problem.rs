//! RFC 9457 problem documents, rendered to exact bytes. Below the HTTP
//! layer because a business rejection is stored under its key inside the
//! posting transaction, and replayed byte for byte.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use problem_details::ProblemDetails;

use crate::idempotency::StoredResponse;

/// Problem types are URIs under this base; `docs/problems.md` describes each.
pub const PROBLEM_TYPE_BASE: &str = "https://nexo-transfers.example/problems/";

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Client-supplied text echoed in a problem `detail` (a serde message naming
/// an unknown field, say) is cut to this many characters.
pub const DETAIL_CHARS_MAX: usize = 300;

/// One problem: the stable slug of its `type`, its title, status and detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub slug: &'static str,
    pub title: &'static str,
    pub status: StatusCode,
    pub detail: String,
}

impl Problem {
    /// The document's exact bytes.
    pub fn body(&self) -> Bytes {
        let problem = ProblemDetails::new()
            .with_type(type_uri(self.slug))
            .with_title(self.title)
            .with_status(self.status)
            .with_detail(truncate_chars(&self.detail, DETAIL_CHARS_MAX));
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

fn type_uri(slug: &str) -> http::Uri {
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
        let problem = Problem {
            slug: "malformed-request",
            title: "Malformed request",
            status: StatusCode::BAD_REQUEST,
            detail: "x".repeat(1000),
        };
        let value: serde_json::Value = serde_json::from_slice(&problem.body()).unwrap_or_default();
        let detail = value["detail"].as_str().unwrap_or_default();
        assert_eq!(detail.chars().count(), DETAIL_CHARS_MAX + 1);
    }
}
