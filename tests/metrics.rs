#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `GET /metrics`: each idempotency outcome, posting and rejection counted
//! as it happened on the ledger; bounded labels; pool, purge and scheduled
//! reconciliation series; and the admin-only reconciliation endpoint.
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use nexo_transfers::http::operations::Operations;
use nexo_transfers::idempotency;
use nexo_transfers::reconcile::{self, LastRunCell};
use sqlx::PgPool;

/// The recorder is global to this test process: tests that compare two
/// scrapes take turns, so one test's requests never land in another's
/// difference.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const ADMIN_TOKEN: &str = "adm_0123456789abcdef0123456789abcdef";

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_replay_a_mismatch_a_conflict_and_a_takeover_are_each_counted(pool: PgPool) {
    let _turn = SERIAL.lock().await;
    let app = TestApp::spawn(pool).await;
    let before = app.metrics().await;

    let key = new_key();
    let body = transfer(A_USD, B_USD, 250, "USD");
    assert_eq!(app.post_transfer(TOKEN_A, &key, &body).await.status, 201);
    assert!(app.post_transfer(TOKEN_A, &key, &body).await.replayed());
    app.post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 251, "USD"))
        .await
        .assert_problem(422, "idempotency-key-reused");
    let held = new_key();
    claim_for_a(&app.pool, &held, &body).await;
    app.post_transfer(TOKEN_A, &held, &body)
        .await
        .assert_problem(409, "request-in-flight");
    // A claim whose process died: past its lease, the retry takes it over.
    let abandoned = new_key();
    let retried = transfer(A_USD, B_USD, 125, "USD");
    claim_for_a(&app.pool, &abandoned, &retried).await;
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' WHERE idempotency_key = $1",
    )
    .bind(&abandoned)
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        app.post_transfer(TOKEN_A, &abandoned, &retried)
            .await
            .status,
        201
    );
    app.post_beyond_balance().await;
    app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, A_USD, 1, "USD"))
        .await
        .assert_problem(422, "same-account");

    let after = app.metrics().await;
    let outcome = |o| {
        after.delta(
            &before,
            "nexo_idempotency_outcomes_total",
            &[("outcome", o)],
        )
    };
    assert_eq!(outcome("claimed"), 2.0, "the transfer and the refused one");
    assert_eq!(outcome("replayed"), 1.0);
    assert_eq!(outcome("mismatch"), 1.0);
    assert_eq!(outcome("in_flight"), 1.0);
    assert_eq!(outcome("taken_over"), 1.0);
    for none in ["failed", "fence_lost"] {
        assert_eq!(outcome(none), 0.0, "{none}");
    }
    assert_eq!(
        after.delta(&before, "nexo_transfers_posted_total", &[]),
        2.0
    );
    let rejected = |r| after.delta(&before, "nexo_transfers_rejected_total", &[("reason", r)]);
    assert_eq!(rejected("insufficient-funds"), 1.0);
    assert_eq!(rejected("same-account"), 1.0);

    let requests = |status| {
        after.delta(
            &before,
            "nexo_http_requests_total",
            &[
                ("method", "POST"),
                ("route", "/transfers"),
                ("status", status),
            ],
        )
    };
    assert_eq!(requests("201"), 3.0, "two transfers and a replay");
    assert_eq!(requests("422"), 3.0);
    assert_eq!(requests("409"), 1.0);
    let timed = after.delta(
        &before,
        "nexo_http_request_duration_seconds_count",
        &[("route", "/transfers"), ("status", "201")],
    );
    assert_eq!(timed, 3.0);
    assert!(
        after
            .0
            .contains("nexo_http_request_duration_seconds_bucket{method=\"POST\",route=\"/transfers\",status=\"201\",le=\"0.005\"}"),
        "a true histogram with buckets"
    );

    // The counters agree with the ledger: two postings moved the money.
    assert_eq!(app.balance(B_USD).await, 250 + 125);
    assert_eq!(customer_transfer_count(&app.pool).await, 2);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn labels_carry_route_templates_never_ids_keys_or_tokens(pool: PgPool) {
    let _turn = SERIAL.lock().await;
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let created = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 5, "USD"))
        .await;
    let id = created.json()["transfer_id"].as_str().unwrap().to_owned();
    let before = app.metrics().await;
    assert_eq!(
        app.get(TOKEN_A, &format!("/transfers/{id}")).await.status,
        200
    );
    assert_eq!(app.get(TOKEN_A, "/no/such/path/42").await.status, 404);
    let odd_method = app
        .client
        .request(
            reqwest::Method::from_bytes(b"BREW").unwrap(),
            app.url("/transfers"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(odd_method.status(), 405);

    let after = app.metrics().await;
    let by_route = |method, route, status| {
        after.delta(
            &before,
            "nexo_http_requests_total",
            &[("method", method), ("route", route), ("status", status)],
        )
    };
    assert_eq!(by_route("GET", "/transfers/{transfer_id}", "200"), 1.0);
    assert_eq!(by_route("GET", "unmatched", "404"), 1.0);
    assert_eq!(by_route("other", "/transfers", "405"), 1.0);
    for secret in [id.as_str(), key.as_str(), TOKEN_A, "/no/such/path", "BREW"] {
        assert!(!after.0.contains(secret), "{secret} leaked into /metrics");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_pool_is_sampled_and_purges_are_counted(pool: PgPool) {
    let _turn = SERIAL.lock().await;
    let app = TestApp::spawn(pool).await;
    let before = app.metrics().await;
    let max = f64::from(app.pool.options().get_max_connections());
    assert_eq!(before.value("nexo_db_pool_max_connections", &[]), max);
    let in_use = before.value("nexo_db_pool_connections", &[("state", "in_use")]);
    let idle = before.value("nexo_db_pool_connections", &[("state", "idle")]);
    assert!(
        in_use + idle >= 1.0 && in_use + idle <= max,
        "{in_use} + {idle}"
    );

    let expired = new_key();
    claim_for_a(&app.pool, &expired, &transfer(A_USD, B_USD, 5, "USD")).await;
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 days',
                                     expires_at = now() - interval '1 day',
                                     locked_until = now() - interval '1 day'
         WHERE idempotency_key = $1",
    )
    .bind(&expired)
    .execute(&app.pool)
    .await
    .unwrap();
    let deleted = idempotency::store::purge_expired(&app.pool, 100)
        .await
        .unwrap();
    assert_eq!((deleted.compacted, deleted.deleted), (0, 1));
    assert!(key_rows(&app.pool, &expired).await.is_empty());

    let after = app.metrics().await;
    assert_eq!(
        after.delta(
            &before,
            "nexo_idempotency_purge_runs_total",
            &[("result", "ok")]
        ),
        1.0
    );
    assert_eq!(
        after.delta(
            &before,
            "nexo_idempotency_keys_purged_total",
            &[("action", "deleted")]
        ),
        1.0
    );
}

/// `GET /admin/reconciliation` with a bearer token, or none.
async fn last_reconciliation(app: &TestApp, token: Option<&str>) -> Reply {
    let mut request = app.client.get(app.url("/admin/reconciliation"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    Reply::read(request.send().await.unwrap()).await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_scheduled_reconciliation_is_metered_and_shown_to_admins_only(pool: PgPool) {
    let _turn = SERIAL.lock().await;
    let every = Duration::from_millis(200);
    let cell = Arc::new(LastRunCell::new(Some(every)));
    let operations = Operations::new(Some(ADMIN_TOKEN), cell.clone()).unwrap();
    let app = TestApp::spawn_with_operations(pool, operations).await;
    let never = last_reconciliation(&app, Some(ADMIN_TOKEN)).await;
    assert_eq!(never.status, 200);
    assert_eq!(never.json()["result"], "never_run");

    // A claim whose process died: the run must report it.
    let stuck = new_key();
    claim_for_a(&app.pool, &stuck, &transfer(A_USD, B_USD, 5, "USD")).await;
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' WHERE idempotency_key = $1",
    )
    .bind(&stuck)
    .execute(&app.pool)
    .await
    .unwrap();
    let before = app.metrics().await;
    let schedule = tokio::spawn(nexo_transfers::cli::reconcile_periodically(
        app.pool.clone(),
        every,
        reconcile::Options {
            key_ttl: default_policy().ttl,
        },
        cell,
    ));
    // Bounded wait for the first scheduled run (due after `every`).
    let mut shown = None;
    for _ in 0..100 {
        let reply = last_reconciliation(&app, Some(ADMIN_TOKEN)).await;
        if reply.json()["result"] != "never_run" {
            shown = Some(reply.json());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    schedule.abort();
    let shown = shown.expect("a scheduled run within 5 s");
    assert_eq!(shown["result"], "completed", "{shown}");
    assert!(shown["scheduled_every_secs"].is_u64(), "{shown}");
    assert_eq!(shown["report"]["ok"], false);
    let stuck_check = shown["report"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "keys_stuck_in_progress")
        .expect("the stuck-key check is in the report");
    assert_eq!(
        stuck_check["discrepancies"][0]["ids"]["idempotency_key"],
        stuck
    );

    let after = app.metrics().await;
    assert!(
        after.delta(
            &before,
            "nexo_reconcile_runs_total",
            &[("result", "discrepancies")]
        ) >= 1.0
    );
    assert_eq!(
        after.value(
            "nexo_reconcile_last_run_discrepancies",
            &[("check", "keys_stuck_in_progress")]
        ),
        1.0
    );
    assert_eq!(
        after.value(
            "nexo_reconcile_last_run_discrepancies",
            &[("check", "transfer_entries")]
        ),
        0.0
    );
    let at = after.value("nexo_reconcile_last_run_timestamp_seconds", &[]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!((now - at).abs() < 60.0, "last run at {at}, now {now}");

    // Admin-only: no token, a principal's token or a wrong one get a 401.
    last_reconciliation(&app, None)
        .await
        .assert_problem(401, "unauthorized");
    last_reconciliation(&app, Some(TOKEN_A))
        .await
        .assert_problem(401, "unauthorized");
    last_reconciliation(&app, Some(&ADMIN_TOKEN.replace('0', "1")))
        .await
        .assert_problem(401, "unauthorized");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn without_an_admin_token_the_admin_endpoint_does_not_exist(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for token in [TOKEN_A, ADMIN_TOKEN] {
        last_reconciliation(&app, Some(token))
            .await
            .assert_problem(404, "not-found");
    }
    // Credentials are asked for first, as on every authenticated route.
    last_reconciliation(&app, None)
        .await
        .assert_problem(401, "unauthorized");
}

#[test]
fn admin_tokens_too_short_or_unprintable_are_refused_at_start_up() {
    let cell = Arc::new(LastRunCell::default());
    for bad in ["short", "has a space in it and is long enough to pass", ""] {
        assert!(Operations::new(Some(bad), cell.clone()).is_err(), "{bad:?}");
    }
    assert!(Operations::new(Some(ADMIN_TOKEN), cell.clone()).is_ok());
    assert!(Operations::new(None, cell).is_ok());
}
