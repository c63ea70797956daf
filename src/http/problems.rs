//! `GET /problems` and `GET /problems/{slug}`: a page for every problem
//! type, so the `type` of a problem document (`/problems/{slug}`, relative)
//! resolves on whatever host and port the service runs. Rendered from the
//! table in `docs/problems.md`, built into the binary: the documentation a
//! reader finds in the repository and the page a client reaches are one
//! text.

use std::sync::LazyLock;

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::extract::PathParam;

const PROBLEMS_MD: &str = include_str!("../../docs/problems.md");

/// Pages are static text with inline styles only.
const PAGE_CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProblemType {
    pub slug: String,
    pub title: String,
    pub status: u16,
    /// When the service answers with it (Markdown inline text).
    pub when: String,
    /// Whether resending with the same key is safe (Markdown inline text).
    pub retry: String,
}

static TYPES: LazyLock<Vec<ProblemType>> = LazyLock::new(|| parse_table(PROBLEMS_MD));

/// Every documented problem type, in the table's order.
pub fn types() -> &'static [ProblemType] {
    &TYPES
}

/// The documented type with this slug.
pub fn find(slug: &str) -> Option<&'static ProblemType> {
    types().iter().find(|t| t.slug == slug)
}

/// The rows `| `slug` | title | status | when | retry |` of the table.
fn parse_table(markdown: &str) -> Vec<ProblemType> {
    markdown
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split(" | ")
                .map(str::trim)
                .collect();
            let [slug, title, status, when, retry] = cells.as_slice() else {
                return None;
            };
            Some(ProblemType {
                slug: slug.strip_prefix('`')?.strip_suffix('`')?.to_owned(),
                title: (*title).to_owned(),
                status: status.parse().ok()?,
                when: (*when).to_owned(),
                retry: (*retry).to_owned(),
            })
        })
        .collect()
}

/// HTML-escaped text with Markdown's `code` spans rendered.
fn inline(markdown: &str) -> String {
    let escaped = markdown
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;");
    let mut html = String::with_capacity(escaped.len() + 32);
    for (i, part) in escaped.split('`').enumerate() {
        if i % 2 == 1 {
            html.push_str("<code>");
            html.push_str(part);
            html.push_str("</code>");
        } else {
            html.push_str(part);
        }
    }
    html
}

fn html_page(title: &str, body: &str) -> Response {
    let page = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · nexo-transfers</title>\
         <style>body{{font:16px/1.5 system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem}}\
         code{{background:#f3f3f3;padding:0 .2em}}dt{{font-weight:600}}</style></head>\
         <body>{body}</body></html>\n",
        title = inline(title),
    );
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(PAGE_CSP),
            ),
            (
                header::CACHE_CONTROL,
                HeaderValue::from_static("public, max-age=3600"),
            ),
        ],
        page,
    )
        .into_response()
}

/// `GET /problems`: every type, linked.
pub async fn index() -> Response {
    let items: String = types()
        .iter()
        .map(|t| {
            format!(
                "<li><a href=\"/problems/{slug}\"><code>{slug}</code></a> ({status}): {title}</li>",
                slug = inline(&t.slug),
                status = t.status,
                title = inline(&t.title),
            )
        })
        .collect();
    html_page(
        "Problem types",
        &format!(
            "<h1>Problem types</h1><p>Every error of the nexo-transfers API is an \
             <code>application/problem+json</code> document (RFC 9457) whose <code>type</code> \
             is one of these.</p><ul>{items}</ul>"
        ),
    )
}

/// `GET /problems/{slug}`: one type; an unknown slug is the 404 problem.
pub async fn page(PathParam(slug): PathParam) -> Result<Response, ApiError> {
    let t = find(&slug).ok_or(ApiError::NotFound)?;
    Ok(html_page(
        &t.title,
        &format!(
            "<p><a href=\"/problems\">All problem types</a></p>\
             <h1>{title}</h1><dl>\
             <dt><code>type</code></dt><dd><code>/problems/{slug}</code></dd>\
             <dt><code>status</code></dt><dd>{status}</dd>\
             <dt>When</dt><dd>{when}</dd>\
             <dt>Safe to retry with the same key?</dt><dd>{retry}</dd></dl>",
            title = inline(&t.title),
            slug = inline(&t.slug),
            status = t.status,
            when = inline(&t.when),
            retry = inline(&t.retry),
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_parses_into_every_row() {
        let rows = PROBLEMS_MD.lines().filter(|l| l.starts_with("| `")).count();
        assert!(rows >= 20, "{rows}");
        assert_eq!(types().len(), rows, "every row of the table parses");
        let funds = find("insufficient-funds");
        assert_eq!(funds.map(|t| t.status), Some(422));
        assert_eq!(funds.map(|t| t.title.as_str()), Some("Insufficient funds"));
    }

    #[test]
    fn text_is_escaped_and_code_spans_rendered() {
        assert_eq!(
            inline("a `<b>` & \"c\""),
            "a <code>&lt;b&gt;</code> &amp; &quot;c&quot;"
        );
    }
}
