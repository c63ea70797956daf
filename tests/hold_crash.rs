#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The process dies with SIGKILL while posts and voids of holds are in
//! flight; a new process starts on the same database, every request is
//! retried with its key until answered, and each hold must have ended
//! exactly once, as its answers say, with the ledger agreeing.

mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use futures::future::join_all;
use serde_json::{Value, json};
use sqlx::PgPool;

const HOLDS: usize = 20;
const LEASE: &str = "2s";

/// Principal A's POST of `body` to `path` under `key`.
fn keyed_post(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    path: &str,
    body: &Value,
) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}{path}"))
        .bearer_auth(TOKEN_A)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_string())
}

async fn post_until_final(base: &str, key: &str, path: &str, body: &Value) -> Reply {
    let client = fault_client(Duration::from_secs(10));
    until_final(
        path,
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let sent = client
                .post(format!("{base}{path}"))
                .bearer_auth(TOKEN_A)
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .ok()?;
            Some(Reply::read(sent).await)
        },
    )
    .await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sigkill_between_hold_and_capture_then_retries_end_every_hold_once(pool: PgPool) {
    let url = database_url(&pool);
    let env = [("NEXO_IDEMPOTENCY_LEASE", LEASE)];
    let server = ServerProcess::start(&url, &env).await;

    let mut holds = Vec::new();
    for n in 0..HOLDS {
        let key = new_key();
        let mut body = transfer(A_USD, B_USD, 1_000 + n as i64, "USD");
        body["mode"] = json!("pending");
        let reply = post_until_final(&server.base, &key, "/transfers", &body).await;
        assert_eq!(reply.status, 201);
        holds.push((key, body, reply));
    }
    // Posts and voids on every hold, the process killed while they run.
    let requests: Vec<(String, String, Value)> = holds
        .iter()
        .enumerate()
        .map(|(n, (_, _, created))| {
            let id = created.json()["transfer_id"].as_str().unwrap().to_owned();
            let action = if n % 2 == 0 { "post" } else { "void" };
            (new_key(), format!("/transfers/{id}/{action}"), json!({}))
        })
        .collect();
    let client = fault_client(Duration::from_secs(10));
    let base = server.base.clone();
    let first_answers = tokio::spawn({
        let requests = requests.clone();
        async move {
            join_all(requests.iter().map(|(key, path, body)| {
                let (client, base) = (&client, &base);
                async move {
                    keyed_post(client, base, key, path, body)
                        .send()
                        .await
                        .ok()
                        .map(|r| r.status().as_u16())
                }
            }))
            .await
        }
    });
    // Killed as soon as the first post or void holds its key: the others
    // are somewhere between arriving and committing.
    let claimed_by = tokio::time::Instant::now() + Duration::from_secs(10);
    while scalar(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE request_path <> '/transfers'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < claimed_by,
            "no post or void was claimed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    server.kill().await;
    let first: Vec<Option<u16>> = first_answers.await.unwrap();
    let cut = first.iter().filter(|a| a.is_none()).count();
    let in_progress: i64 = scalar(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'IN_PROGRESS'",
    )
    .await;
    let claimed: i64 = scalar(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE request_path <> '/transfers'",
    )
    .await;
    let pending_after_kill: i64 =
        scalar(&pool, "SELECT count(*) FROM holds WHERE status = 'pending'").await;
    println!(
        "killed with {cut} of {HOLDS} requests unanswered, {claimed} claimed, {in_progress} keys \
         IN_PROGRESS, {pending_after_kill} holds still pending"
    );
    assert!(cut > 0, "the kill found no request in flight");
    assert!(
        claimed > 0,
        "the kill came before any post or void reached the database"
    );

    let server = ServerProcess::start(&url, &env).await;
    // The holds' own retries replay from the database, byte for byte.
    for (key, body, created) in &holds {
        let again = post_until_final(&server.base, key, "/transfers", body).await;
        assert_eq!((again.status, &again.body), (201, &created.body));
    }
    let mut posted_total = 0;
    for (key, path, body) in &requests {
        let reply = post_until_final(&server.base, key, path, body).await;
        assert_eq!(
            reply.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        let view = reply.json();
        let expected = if path.ends_with("/post") {
            "posted"
        } else {
            "voided"
        };
        assert_eq!(view["status"], expected);
        if expected == "posted" {
            posted_total += view["amount_minor"].as_i64().unwrap();
        }
        // Its retry is the same bytes.
        let again = post_until_final(&server.base, key, path, body).await;
        assert_eq!(again.body, reply.body);
    }
    assert_eq!(balance(&pool, B_USD).await, posted_total);
    assert_eq!(balance(&pool, A_USD).await, OPENING_BALANCE - posted_total);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM holds WHERE status = 'pending'").await,
        0
    );
    assert_eq!(
        scalar(&pool, "SELECT sum(held_minor)::bigint FROM accounts").await,
        0
    );
    assert_reconciles(&pool).await;
}
