#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `openapi.yaml` against the server: the routes the router serves are the
//! paths and methods the spec documents (both ways), the spec and the docs
//! are served as built, and every problem type the server can answer with
//! is documented. The schemas themselves are driven against the running
//! server by schemathesis in `.ci/steps/20-contract.sh`.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use nexo_transfers::http::docs;
use nexo_transfers::http::error::{ApiError, PROBLEM_TYPE_BASE, ValidationKind};
use nexo_transfers::http::problems;
use nexo_transfers::idempotency::KeyError;
use nexo_transfers::transfers::{Rejection, RetryReason};
use serde_json::Value;
use sqlx::PgPool;

const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

fn spec() -> Value {
    serde_saphyr::from_str(docs::OPENAPI_YAML).expect("openapi.yaml parses")
}

/// (path template, methods) as the spec documents them.
fn spec_routes() -> BTreeMap<String, BTreeSet<String>> {
    spec()["paths"]
        .as_object()
        .expect("the spec has paths")
        .iter()
        .map(|(path, item)| {
            let methods = item
                .as_object()
                .expect("a path item is a map")
                .keys()
                .filter(|k| METHODS.contains(&k.as_str()))
                .map(|k| k.to_ascii_uppercase())
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

/// (path template, methods) as `src/http/mod.rs` registers them: every
/// `.route("PATH", get(..).post(..))` call. Axum cannot list its routes, so
/// the router's source is read; anything this reader would not understand
/// (merged or nested routers, services) fails the test instead of being
/// skipped, and `router_and_spec_agree` then proves each route it found is
/// really served.
fn router_routes() -> BTreeMap<String, BTreeSet<String>> {
    let source = include_str!("../src/http/mod.rs");
    for unsupported in [".merge(", ".nest(", ".route_service(", ".nest_service("] {
        assert!(
            !source.contains(unsupported),
            "src/http/mod.rs uses {unsupported}: teach router_routes() to read it"
        );
    }
    let mut routes = BTreeMap::new();
    for (at, _) in source.match_indices(".route(") {
        let call = balanced_call(&source[at + ".route".len()..]);
        let path = call
            .split('"')
            .nth(1)
            .expect("a route's first argument is a string literal");
        let methods: BTreeSet<String> = METHODS
            .iter()
            .filter(|m| {
                call.match_indices(&format!("{m}(")).any(|(i, _)| {
                    i == 0
                        || !call.as_bytes()[i - 1].is_ascii_alphanumeric()
                            && call.as_bytes()[i - 1] != b'_'
                })
            })
            .map(|m| m.to_ascii_uppercase())
            .collect();
        assert!(!methods.is_empty(), "no method found in .route{call}");
        let previous = routes.insert(path.to_owned(), methods);
        assert!(previous.is_none(), "{path} is registered twice");
    }
    assert!(
        !routes.is_empty(),
        "no .route( calls found in src/http/mod.rs"
    );
    routes
}

/// The text of a parenthesised call, from its `(` to the matching `)`.
fn balanced_call(text: &str) -> &str {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return &text[..=i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced call: {text}")
}

/// A concrete path for a template: every `{param}` becomes a plain value.
fn concrete(template: &str) -> String {
    template
        .split('/')
        .map(|s| if s.starts_with('{') { "x1" } else { s })
        .collect::<Vec<_>>()
        .join("/")
}

#[test]
fn the_spec_is_openapi_3_1_and_every_reference_resolves() {
    let spec = spec();
    assert!(
        spec["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "openapi: {}",
        spec["openapi"]
    );
    let mut refs = Vec::new();
    collect_refs(&spec, &mut refs);
    assert!(!refs.is_empty());
    for reference in refs {
        let pointer = reference
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("only local references: {reference}"));
        assert!(
            spec.pointer(pointer).is_some(),
            "{reference} points at nothing"
        );
    }
}

fn collect_refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                out.push(r.clone());
            }
            map.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

#[test]
fn every_router_route_is_in_the_spec_and_every_spec_path_in_the_router() {
    let router = router_routes();
    let spec = spec_routes();
    let only_router: Vec<_> = router.keys().filter(|p| !spec.contains_key(*p)).collect();
    let only_spec: Vec<_> = spec.keys().filter(|p| !router.contains_key(*p)).collect();
    assert!(
        only_router.is_empty() && only_spec.is_empty(),
        "routes served but not documented: {only_router:?}; documented but not served: {only_spec:?}"
    );
    for (path, methods) in &router {
        assert_eq!(methods, &spec[path], "methods of {path}: router vs spec");
    }
}

/// The same agreement, seen from outside: for every documented path, a
/// method it does not serve gets the router's `405` (not the `404` of an
/// unknown route), and its `Allow` header lists exactly the documented
/// methods (plus the HEAD that axum answers for every GET).
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_documented_path_is_served_with_exactly_its_documented_methods(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for (template, methods) in spec_routes() {
        assert!(
            !methods.contains("PATCH"),
            "this probe uses PATCH as the undocumented method"
        );
        let response = app
            .client
            .patch(app.url(&concrete(&template)))
            .send()
            .await
            .unwrap();
        let reply = Reply::read(response).await;
        assert_eq!(
            reply.status, 405,
            "{template} is documented but the router does not serve it"
        );
        reply.assert_problem(405, "method-not-allowed");
        let allowed: BTreeSet<String> = reply
            .header("allow")
            .unwrap_or_else(|| panic!("405 on {template} without Allow"))
            .split(',')
            .map(|m| m.trim().to_owned())
            .filter(|m| m != "HEAD" || !methods.contains("GET"))
            .collect();
        assert_eq!(allowed, methods, "Allow of {template}");
    }
    // And an undocumented path is the fallback's 404, which the probe above
    // would have seen had a documented path been missing from the router.
    let response = app
        .client
        .patch(app.url("/no/such/route"))
        .send()
        .await
        .unwrap();
    Reply::read(response).await.assert_problem(404, "not-found");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_spec_is_served_as_built_without_credentials(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let response = app
        .client
        .get(app.url("/openapi.yaml"))
        .send()
        .await
        .unwrap();
    let reply = Reply::read(response).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/yaml"));
    let on_disk = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.yaml")).unwrap();
    assert_eq!(reply.body.as_ref(), on_disk.as_slice());
}

/// The page and everything it references come from this server, and its
/// Content-Security-Policy forbids any other origin, so the docs work with
/// no network and leak nothing.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_docs_page_loads_only_assets_this_server_serves(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let page = Reply::read(app.client.get(app.url("/docs")).send().await.unwrap()).await;
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(csp.contains("connect-src 'self'"), "{csp}");
    assert!(!csp.contains("http"), "no other origin is allowed: {csp}");

    let html = String::from_utf8(page.body.to_vec()).unwrap();
    let referenced: Vec<&str> = ["src=\"", "href=\""]
        .iter()
        .flat_map(|attr| html.split(attr).skip(1))
        .map(|rest| rest.split('"').next().unwrap())
        .collect();
    assert!(referenced.len() >= 3, "{referenced:?}");
    for url in referenced {
        assert!(url.starts_with('/'), "{url} is not on this server");
        let asset = Reply::read(app.client.get(app.url(url)).send().await.unwrap()).await;
        assert_eq!(asset.status, 200, "{url}");
        assert!(!asset.body.is_empty(), "{url}");
    }
    let init = Reply::read(
        app.client
            .get(app.url("/docs/init.js"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(String::from_utf8_lossy(&init.body).contains("url: \"/openapi.yaml\""));

    let unknown = Reply::read(
        app.client
            .get(app.url("/docs/secrets.txt"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    unknown.assert_problem(404, "not-found");
}

#[test]
fn the_documented_docs_assets_are_the_served_ones() {
    let spec = spec();
    let documented: BTreeSet<&str> =
        spec["paths"]["/docs/{asset}"]["get"]["parameters"][0]["schema"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
    let served: BTreeSet<&str> = docs::asset_names().collect();
    assert_eq!(documented, served);
}

/// Every error the API can answer with. The matches have no wildcard arm, so
/// a new variant does not compile until it is listed here, and then this
/// test demands the spec documents its problem type.
fn every_api_error() -> Vec<ApiError> {
    let kinds = [
        ValidationKind::InvalidAmount,
        ValidationKind::UnsupportedCurrency,
        ValidationKind::CurrencyMismatch,
        ValidationKind::SameAccount,
        ValidationKind::InvalidAccountId,
        ValidationKind::UnknownDestination,
        ValidationKind::InvalidDescription,
        ValidationKind::InvalidMode,
        ValidationKind::InvalidExpiry,
        ValidationKind::InvalidBatch,
    ];
    for kind in kinds {
        match kind {
            ValidationKind::InvalidAmount
            | ValidationKind::UnsupportedCurrency
            | ValidationKind::CurrencyMismatch
            | ValidationKind::SameAccount
            | ValidationKind::InvalidAccountId
            | ValidationKind::UnknownDestination
            | ValidationKind::InvalidDescription
            | ValidationKind::InvalidMode
            | ValidationKind::InvalidExpiry
            | ValidationKind::InvalidBatch => {}
        }
    }
    let mut errors: Vec<ApiError> = kinds
        .into_iter()
        .map(|kind| ApiError::Validation {
            kind,
            param: "x",
            detail: "x".to_owned(),
        })
        .collect();
    errors.extend([
        ApiError::Unauthorized,
        ApiError::IdempotencyKey(KeyError::Missing),
        ApiError::IdempotencyKey(KeyError::Repeated),
        ApiError::UnsupportedMediaType,
        ApiError::PayloadTooLarge,
        ApiError::MalformedRequest {
            detail: "x".to_owned(),
            param: None,
        },
        ApiError::invalid_query("limit", "x"),
        ApiError::InvalidEventCursor,
        ApiError::InvalidWebhookEndpoint {
            param: "url",
            detail: "x".to_owned(),
        },
        ApiError::TooManyWebhookEndpoints,
        ApiError::WebhookEndpointExists {
            existing: uuid::Uuid::nil(),
        },
        ApiError::InvalidRedelivery {
            detail: "x".to_owned(),
        },
        ApiError::NotFound,
        ApiError::MethodNotAllowed,
        ApiError::IdempotencyKeyReused,
        ApiError::RequestInFlight {
            retry_after_secs: 1,
        },
        ApiError::InsufficientFunds,
        ApiError::IntentCancelled { request_id: None },
        ApiError::IntentCompleted { transfer_id: None },
        ApiError::RateLimited {
            retry_after_secs: 1,
        },
        ApiError::ServiceUnavailable,
        ApiError::NotPostedNow(RetryReason::LockTimeout),
        ApiError::Rejected(Rejection::NotPending),
        ApiError::Rejected(Rejection::NotPosted),
        ApiError::Rejected(Rejection::ReversalExceedsTransfer),
        ApiError::Internal,
    ]);
    for error in &errors {
        match error {
            ApiError::Unauthorized
            | ApiError::IdempotencyKey(_)
            | ApiError::UnsupportedMediaType
            | ApiError::PayloadTooLarge
            | ApiError::MalformedRequest { .. }
            | ApiError::Validation { .. }
            | ApiError::InvalidQuery { .. }
            | ApiError::InvalidEventCursor
            | ApiError::InvalidWebhookEndpoint { .. }
            | ApiError::TooManyWebhookEndpoints
            | ApiError::WebhookEndpointExists { .. }
            | ApiError::InvalidRedelivery { .. }
            | ApiError::NotFound
            | ApiError::MethodNotAllowed
            | ApiError::IdempotencyKeyReused
            | ApiError::RequestInFlight { .. }
            | ApiError::InsufficientFunds
            | ApiError::IntentCancelled { .. }
            | ApiError::IntentCompleted { .. }
            | ApiError::RateLimited { .. }
            | ApiError::ServiceUnavailable
            | ApiError::NotPostedNow(_)
            | ApiError::Rejected(_)
            | ApiError::Internal => {}
        }
    }
    errors
}

/// Problem types that exist in `ApiError` but that no route answers with
/// today; the spec documents what the server does, so they stay out of it
/// until a route uses them.
const NOT_ANSWERED_BY_ANY_ROUTE: &[&str] = &["rate-limited"];

#[test]
fn every_problem_type_the_server_answers_with_is_documented() {
    let spec_text = docs::OPENAPI_YAML;
    for error in every_api_error() {
        let slug = error.slug();
        let uri = format!("{PROBLEM_TYPE_BASE}{slug}");
        if NOT_ANSWERED_BY_ANY_ROUTE.contains(&slug) {
            continue;
        }
        // A 405 answers a method the spec does not list for a path, so no
        // operation can carry it; the table documents it.
        if !matches!(error, ApiError::MethodNotAllowed) {
            assert!(
                spec_text.contains(&format!("const: {uri}"))
                    || spec_text.contains(&format!("- {uri}")),
                "no response in openapi.yaml carries the problem type {uri}"
            );
        }
        assert!(
            spec_text.contains(&format!("| `{slug}` | {} |", error.status().as_u16())),
            "the problem table in openapi.yaml lacks `{slug}` with its status"
        );
    }
}

/// Every problem type the server can answer with has its page, with the
/// title and status the documents carry: `docs/problems.md`, which the
/// pages are rendered from, cannot drift from the code.
#[test]
fn every_problem_type_has_its_page_with_its_title_and_status() {
    for error in every_api_error() {
        let problem = error.problem();
        let page = problems::find(problem.slug)
            .unwrap_or_else(|| panic!("docs/problems.md has no row for `{}`", problem.slug));
        assert_eq!(page.title, problem.title, "title of `{}`", problem.slug);
        assert_eq!(
            page.status,
            problem.status.as_u16(),
            "status of `{}`",
            problem.slug
        );
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_documented_currencies_are_the_ledger_s(pool: PgPool) {
    let spec = spec();
    let description = spec["components"]["schemas"]["Currency"]["description"]
        .as_str()
        .unwrap()
        .to_owned();
    let codes: Vec<String> = sqlx::query_scalar("SELECT code FROM currencies")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(!codes.is_empty());
    for code in codes {
        assert!(
            description.contains(&code),
            "{code} is missing from the Currency description"
        );
    }
}

/// A percent-encoded segment that is not UTF-8 names no resource: the same
/// `404` problem as any unknown id, not a plain-text `400`.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn non_utf8_path_segments_are_a_404_problem(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for path in [
        "/accounts/%FF",
        "/accounts/%FF/entries",
        "/transfers/%C0%AF",
        "/docs/%FF",
    ] {
        app.get(TOKEN_A, path)
            .await
            .assert_problem(404, "not-found");
    }
}

/// Cursors are accepted only as the server spells them.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn cursors_the_server_never_issued_are_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for cursor in ["e%2B5", "e05", "e0"] {
        app.get(
            TOKEN_A,
            &format!("/accounts/{A_USD}/entries?cursor={cursor}"),
        )
        .await
        .assert_problem(400, "invalid-query");
    }
    let page = app
        .get(TOKEN_A, &format!("/accounts/{A_USD}/entries?cursor=e5"))
        .await;
    assert_eq!(page.status, 200);
}
