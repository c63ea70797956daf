#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Request ids and request logs: `x-request-id` is taken or generated and
//! echoed; the real binary's JSON log line for a request carries the route,
//! the request id, the principal, the idempotency outcome and the transfer,
//! and the bearer token never appears in the logs, even at trace level.
mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::Value;
use sqlx::PgPool;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_request_id_is_echoed_or_generated(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let given = app
        .client
        .get(app.url("/healthz"))
        .header("x-request-id", "ops-trace-0042")
        .send()
        .await
        .unwrap();
    assert_eq!(given.headers()["x-request-id"], "ops-trace-0042");

    let generated = app
        .client
        .post(app.url("/transfers"))
        .bearer_auth(TOKEN_A)
        .header("Idempotency-Key", new_key())
        .json(&transfer(A_USD, B_USD, 5, "USD"))
        .send()
        .await
        .unwrap();
    assert_eq!(generated.status(), 201);
    let id = generated.headers()["x-request-id"].to_str().unwrap();
    assert!(uuid::Uuid::parse_str(id).is_ok(), "{id}");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_request_log_names_everything_but_the_token(pool: PgPool) {
    // A principal of our own, so the token is a string no log line could
    // contain by accident (the demo tokens are named in a start-up warning).
    let token = format!("tok_secret_{}", uuid::Uuid::new_v4().simple());
    let principal = nexo_transfers::admin::ensure_principal(&pool, "log-test", &token)
        .await
        .unwrap();
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    nexo_transfers::admin::open_account(&pool, "log-test", "USD", Some("acc_logtest"))
        .await
        .unwrap();
    nexo_transfers::admin::deposit(&pool, "acc_logtest", 10_000, "log-test-funds")
        .await
        .unwrap();

    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let child = tokio::process::Command::new(BIN)
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", database_url_for(&pool))
        .env("RUST_LOG", "trace")
        .env("NEXO_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    assert!(wait_until_healthy(&base, Duration::from_secs(20)).await);

    let key = new_key();
    let response = reqwest::Client::new()
        .post(format!("{base}/transfers"))
        .bearer_auth(&token)
        .header("Idempotency-Key", &key)
        .header("x-request-id", "log-test-request-1")
        .json(&transfer("acc_logtest", B_USD, 600, "USD"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-request-id"], "log-test-request-1");
    let transfer_id = response.json::<Value>().await.unwrap()["transfer_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // The response line is written before the response is sent, so it is
    // in the pipe by now; stop the server (this test's own child) and read.
    let mut child = child;
    child.start_kill().unwrap();
    let output = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("the server stops")
        .unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);

    assert!(!logs.contains(&token), "the bearer token was logged");
    assert!(
        !logs.to_ascii_lowercase().contains("bearer tok_"),
        "an Authorization value was logged"
    );
    let line: Value = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| {
            l["fields"]["message"] == "response" && l["span"]["request_id"] == "log-test-request-1"
        })
        .unwrap_or_else(|| panic!("no response line for the request in:\n{logs}"));
    let span = &line["span"];
    assert_eq!(span["name"], "request");
    assert_eq!(span["method"], "POST");
    assert_eq!(span["route"], "/transfers");
    assert_eq!(span["principal_id"], principal.to_string());
    assert_eq!(span["idempotency_outcome"], "claimed");
    assert_eq!(span["transfer_id"], transfer_id);
    assert_eq!(line["fields"]["status"], 201);
    assert_eq!(balance(&pool, "acc_logtest").await, 9_400);
    assert_ledger_consistent(&pool).await;
}
