#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Errors a program can act on: every problem document names the request
//! that got it (`request_id`, the `x-request-id`) and, when a field, query
//! parameter or header is at fault, that one (`param`); every `type`
//! resolves to a page the service serves. Stored refusals replay with the
//! id of the request that first got them.
mod common;

use common::*;
use reqwest::Method;
use serde_json::{Value, json};
use sqlx::PgPool;

/// Sends a request with our own `x-request-id` and returns the reply.
async fn send(
    app: &TestApp,
    method: Method,
    path: &str,
    request_id: &str,
    build: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
) -> Reply {
    let request = app
        .client
        .request(method, app.url(path))
        .header("x-request-id", request_id);
    Reply::read(build(request).send().await.unwrap()).await
}

fn transfer_request(
    token: &str,
    key: &str,
    body: String,
) -> impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    let (token, key) = (token.to_owned(), key.to_owned());
    move |r| {
        r.bearer_auth(token)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body)
    }
}

/// The problem's `param` (or null), after checking its request id is ours.
#[track_caller]
fn checked(reply: &Reply, status: u16, slug: &str, request_id: &str) -> Value {
    reply.assert_problem(status, slug);
    let problem = reply.json();
    assert_eq!(problem["request_id"], request_id, "{problem}");
    assert_eq!(reply.header("x-request-id"), Some(request_id));
    problem["param"].clone()
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_error_path_names_its_request_and_the_field_at_fault(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let body = |v: Value| v.to_string();
    let good = transfer(A_USD, B_USD, 100, "USD");

    // (what, reply, status, slug, expected param)
    let mut cases: Vec<(&str, Reply, u16, &str, Value)> = Vec::new();
    let mut id = 0;
    let mut next_id = || {
        id += 1;
        format!("req-{id}")
    };
    macro_rules! case {
        ($what:expr, $method:expr, $path:expr, $build:expr, $status:expr, $slug:expr, $param:expr) => {{
            let rid = next_id();
            let reply = send(&app, $method, $path, &rid, $build).await;
            let param = checked(&reply, $status, $slug, &rid);
            cases.push(($what, reply, $status, $slug, param.clone()));
            assert_eq!(param, $param, "{}", $what);
        }};
    }
    case!(
        "no token",
        Method::POST,
        "/transfers",
        |r| r,
        401,
        "unauthorized",
        json!("Authorization")
    );
    case!(
        "no key",
        Method::POST,
        "/transfers",
        |r| r
            .bearer_auth(TOKEN_A)
            .header("Content-Type", "application/json")
            .body(good.to_string()),
        400,
        "missing-idempotency-key",
        json!("Idempotency-Key")
    );
    case!(
        "not JSON",
        Method::POST,
        "/transfers",
        |r| r
            .bearer_auth(TOKEN_A)
            .header("Idempotency-Key", new_key())
            .body("x"),
        415,
        "unsupported-media-type",
        json!("Content-Type")
    );
    case!(
        "a float amount",
        Method::POST,
        "/transfers",
        transfer_request(
            TOKEN_A,
            &new_key(),
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":1.5,"currency":"USD"}"#
                .to_owned()
        ),
        400,
        "malformed-request",
        json!("amount_minor")
    );
    case!(
        "an unknown field",
        Method::POST,
        "/transfers",
        transfer_request(
            TOKEN_A,
            &new_key(),
            body(
                json!({"from": A_USD, "to": B_USD, "amount_minor": 1, "currency": "USD", "memo": "x"})
            )
        ),
        400,
        "malformed-request",
        json!("memo")
    );
    case!(
        "a missing field",
        Method::POST,
        "/transfers",
        transfer_request(
            TOKEN_A,
            &new_key(),
            body(json!({"from": A_USD, "amount_minor": 1, "currency": "USD"}))
        ),
        400,
        "malformed-request",
        json!("to")
    );
    case!(
        "a zero amount",
        Method::POST,
        "/transfers",
        transfer_request(TOKEN_A, &new_key(), body(transfer(A_USD, B_USD, 0, "USD"))),
        422,
        "invalid-amount",
        json!("amount_minor")
    );
    case!(
        "the same account",
        Method::POST,
        "/transfers",
        transfer_request(TOKEN_A, &new_key(), body(transfer(A_USD, A_USD, 1, "USD"))),
        422,
        "same-account",
        json!("to")
    );
    case!(
        "an unsupported currency",
        Method::POST,
        "/transfers",
        transfer_request(TOKEN_A, &new_key(), body(transfer(A_USD, B_USD, 1, "XXX"))),
        422,
        "unsupported-currency",
        json!("currency")
    );
    case!(
        "an unknown destination",
        Method::POST,
        "/transfers",
        transfer_request(
            TOKEN_A,
            &new_key(),
            body(transfer(A_USD, "acc_nobody", 1, "USD"))
        ),
        422,
        "unknown-destination",
        json!("to")
    );
    case!(
        "a page too large",
        Method::GET,
        "/transfers?limit=100000",
        |r| r.bearer_auth(TOKEN_A),
        400,
        "invalid-query",
        json!("limit")
    );
    case!(
        "a forged cursor",
        Method::GET,
        &format!("/accounts/{A_USD}/entries?cursor=zz"),
        |r| r.bearer_auth(TOKEN_A),
        400,
        "invalid-query",
        json!("cursor")
    );
    case!(
        "no such route",
        Method::GET,
        "/nowhere",
        |r| r,
        404,
        "not-found",
        Value::Null
    );
    case!(
        "a wrong method",
        Method::DELETE,
        "/transfers",
        |r| r.bearer_auth(TOKEN_A),
        405,
        "method-not-allowed",
        Value::Null
    );
    case!(
        "insufficient funds",
        Method::POST,
        "/transfers",
        transfer_request(
            TOKEN_A,
            &new_key(),
            body(transfer(A_USD, B_USD, OPENING_BALANCE * 10, "USD"))
        ),
        422,
        "insufficient-funds",
        json!("amount_minor")
    );
    assert_eq!(cases.len(), 15);
    assert_eq!(
        customer_transfer_count(&app.pool).await,
        0,
        "no error moved money"
    );
}

/// Another principal's destination in another currency: the refusal says
/// the currency does not match without telling which one it holds.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_currency_mismatch_does_not_reveal_another_principal_s_currency(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let reply = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_EUR, 1, "USD"))
        .await;
    reply.assert_problem(422, "currency-mismatch");
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(!detail.contains("EUR"), "{detail}");
    assert_eq!(reply.json()["param"], "currency");
}

/// A client's own request id is kept when it is reasonable; an oversized
/// or odd one is replaced by a generated one everywhere it shows.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_unreasonable_request_id_is_replaced(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for bad in ["x".repeat(129), "two words".to_owned()] {
        let reply = send(&app, Method::GET, "/nowhere", &bad, |r| r).await;
        reply.assert_problem(404, "not-found");
        let generated = reply.header("x-request-id").unwrap().to_owned();
        assert_ne!(generated, bad);
        assert_eq!(reply.json()["request_id"], generated.as_str());
    }
    let kept = send(&app, Method::GET, "/nowhere", &"y".repeat(128), |r| r).await;
    assert_eq!(kept.json()["request_id"], "y".repeat(128));
}

/// Every `type` a response carries resolves, against the URL of the
/// request, to a page about it; the index links every type; an unknown
/// type is the 404 problem.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn problem_types_resolve_to_their_pages(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let reply = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 0, "USD"))
        .await;
    let base = reqwest::Url::parse(&app.url("/transfers")).unwrap();
    let type_uri = base.join(reply.json()["type"].as_str().unwrap()).unwrap();
    let page = app.client.get(type_uri).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
    let html = page.text().await.unwrap();
    assert!(html.contains("<h1>Invalid amount</h1>"), "{html}");
    assert!(html.contains("<code>amount_minor</code>"), "{html}");

    let index = app.client.get(app.url("/problems")).send().await.unwrap();
    assert_eq!(index.status(), 200);
    let index = index.text().await.unwrap();
    for slug in nexo_transfers::http::problems::types()
        .iter()
        .map(|t| &t.slug)
    {
        assert!(
            index.contains(&format!("href=\"/problems/{slug}\"")),
            "{slug}"
        );
        let page = app
            .client
            .get(app.url(&format!("/problems/{slug}")))
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 200, "{slug}");
    }
    app.get(TOKEN_A, "/problems/no-such-type")
        .await
        .assert_problem(404, "not-found");
}

/// A stored refusal is replayed with the id of the request that first got
/// it, byte for byte, whatever id the retry sends; the refusal of a
/// cancelled intent names the request that cancelled it, on every retry.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn refusals_decided_by_a_key_name_the_request_that_decided_them(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let too_much = transfer(A_USD, B_USD, OPENING_BALANCE * 10, "USD").to_string();
    let first = send(
        &app,
        Method::POST,
        "/transfers",
        "first",
        transfer_request(TOKEN_A, &key, too_much.clone()),
    )
    .await;
    checked(&first, 422, "insufficient-funds", "first");
    let retry = send(
        &app,
        Method::POST,
        "/transfers",
        "retry",
        transfer_request(TOKEN_A, &key, too_much),
    )
    .await;
    assert_eq!((retry.status, &retry.body), (422, &first.body));
    assert!(retry.replayed());
    assert_eq!(retry.header("x-request-id"), Some("retry"));

    let cancelled = new_key();
    let cancel = send(
        &app,
        Method::POST,
        &format!("/idempotency-keys/{cancelled}/cancel"),
        "the-cancel",
        |r| r.bearer_auth(TOKEN_A),
    )
    .await;
    assert_eq!(cancel.status, 200);
    let good = transfer(A_USD, B_USD, 1, "USD").to_string();
    let mut bodies = Vec::new();
    for attempt in ["late-1", "late-2"] {
        let refused = send(
            &app,
            Method::POST,
            "/transfers",
            attempt,
            transfer_request(TOKEN_A, &cancelled, good.clone()),
        )
        .await;
        checked_cancelled(&refused);
        bodies.push(refused.body.clone());
    }
    assert_eq!(bodies[0], bodies[1], "the same refusal, byte for byte");
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
}

#[track_caller]
fn checked_cancelled(reply: &Reply) {
    reply.assert_problem(409, "intent-cancelled");
    assert_eq!(reply.json()["request_id"], "the-cancel");
}
