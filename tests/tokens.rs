#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Bearer tokens are rotated with no downtime and revoked within a known
//! bound on every instance: a principal holds several tokens (only their
//! SHA-256 stored), `create-token`, `revoke-token` and `list-tokens` manage
//! them, and operators list principals and show accounts without SQL.
mod common;

use std::time::{Duration, Instant};

use common::*;
use nexo_transfers::caches::PRINCIPAL_CACHE_TTL;
use serde_json::Value;
use sqlx::PgPool;

async fn cli_json(url: &str, args: &[&str]) -> Value {
    let (code, out, err) = run_cli(url, args).await;
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {out}"))
}

/// Whether `token` authenticates on `app` (the account is the principal's).
async fn accepted(app: &TestApp, token: &str, account: &str) -> bool {
    let reply = app.get(token, &format!("/accounts/{account}")).await;
    match reply.status {
        200 => true,
        401 => false,
        other => panic!("unexpected {other}: {:?}", reply.body),
    }
}

/// Two instances both serve a principal's old token (each remembers it).
/// A new token is created and works at once on both; the old one is
/// revoked and stops working on both within PRINCIPAL_CACHE_TTL, while the
/// new one never fails: the rotation needs no downtime.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_token_is_rotated_with_no_downtime_and_revoked_on_every_instance(pool: PgPool) {
    let url = database_url_for(&pool);
    let created = cli_json(&url, &["create-principal", "--name", "payroll"]).await;
    let old = created["token"].as_str().unwrap().to_owned();
    assert_eq!(created["token_label"], "initial");
    cli_json(
        &url,
        &[
            "open-account",
            "--owner",
            "payroll",
            "--currency",
            "usd",
            "--id",
            "acc_pay1",
        ],
    )
    .await;
    let (first, second) = (
        TestApp::spawn(pool.clone()).await,
        TestApp::spawn(pool.clone()).await,
    );
    for app in [&first, &second] {
        assert!(accepted(app, &old, "acc_pay1").await);
    }

    let rotated = cli_json(
        &url,
        &[
            "create-token",
            "--principal",
            "payroll",
            "--label",
            "2026-12",
        ],
    )
    .await;
    let new = rotated["token"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    for app in [&first, &second] {
        assert!(
            accepted(app, &new, "acc_pay1").await,
            "the new token works at once"
        );
        assert!(
            accepted(app, &old, "acc_pay1").await,
            "and the old one still does"
        );
    }

    let revoked = cli_json(
        &url,
        &[
            "revoke-token",
            "--principal",
            "payroll",
            "--label",
            "initial",
        ],
    )
    .await;
    assert!(revoked["revoked_at"].is_string());
    let revoked_at = Instant::now();
    // Both instances remembered the old token a moment ago: that memory is
    // the window the documented bound covers.
    let mut refused_after = [None, None];
    while refused_after.iter().any(Option::is_none) {
        assert!(
            revoked_at.elapsed() < PRINCIPAL_CACHE_TTL + Duration::from_secs(5),
            "the revoked token still works after {:?}",
            revoked_at.elapsed()
        );
        for (i, app) in [&first, &second].into_iter().enumerate() {
            assert!(
                accepted(app, &new, "acc_pay1").await,
                "no downtime for the new token"
            );
            if refused_after[i].is_none() && !accepted(app, &old, "acc_pay1").await {
                refused_after[i] = Some(revoked_at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("revoked token refused after {refused_after:?} (bound {PRINCIPAL_CACHE_TTL:?})");
    // A third instance, which never remembered it, refuses it at once.
    assert!(!accepted(&TestApp::spawn(pool.clone()).await, &old, "acc_pay1").await);

    let tokens = cli_json(&url, &["list-tokens", "--principal", "payroll"]).await;
    let tokens = tokens.as_array().unwrap();
    assert_eq!(tokens.len(), 2);
    assert_eq!(tokens[0]["label"], "initial");
    assert!(tokens[0]["revoked_at"].is_string());
    assert_eq!(tokens[1]["label"], "2026-12");
    assert!(tokens[1]["revoked_at"].is_null());
    for token in tokens {
        assert!(token["last_used_at"].is_string(), "both were used: {token}");
    }
    let listing = serde_json::to_string(&tokens).unwrap();
    assert!(
        !listing.contains(&old) && !listing.contains(&new),
        "never the tokens themselves"
    );
}

/// Mistakes are one-line errors that change nothing: revoking a token that
/// is not live, reusing a live label, an unknown principal.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn token_commands_refuse_mistakes_clearly(pool: PgPool) {
    let url = database_url_for(&pool);
    cli_json(&url, &["create-principal", "--name", "ops"]).await;
    for (args, says) in [
        (
            vec!["revoke-token", "--principal", "ops", "--label", "nope"],
            "no live token labelled \"nope\"",
        ),
        (
            vec!["create-token", "--principal", "ops", "--label", "initial"],
            "already has a live token labelled \"initial\"",
        ),
        (
            vec!["create-token", "--principal", "nobody", "--label", "x"],
            "no principal named \"nobody\"",
        ),
        (
            vec!["create-token", "--principal", "ops", "--label", "two words"],
            "token labels are 1 to 64 visible ASCII characters",
        ),
    ] {
        let (code, _, err) = run_cli(&url, &args).await;
        assert_eq!(code, 1, "{args:?}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    cli_json(
        &url,
        &["revoke-token", "--principal", "ops", "--label", "initial"],
    )
    .await;
    let (code, _, err) = run_cli(
        &url,
        &["revoke-token", "--principal", "ops", "--label", "initial"],
    )
    .await;
    assert_eq!(code, 1, "revoking twice says the token was not live: {err}");
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM principal_tokens WHERE revoked_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(live, 0);
}

/// Operators see principals and accounts without SQL: names, live tokens,
/// accounts, balances and ledger activity, as the ledger has them.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn operators_list_principals_and_show_accounts(pool: PgPool) {
    let url = database_url_for(&pool);
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let app = TestApp::spawn(pool.clone()).await;
    let moved = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 1_234, "USD"))
        .await;
    assert_eq!(moved.status, 201);

    let principals = cli_json(&url, &["list-principals"]).await;
    let demo_a = principals
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "demo-a")
        .unwrap();
    assert_eq!(demo_a["live_tokens"], 1);
    assert!(demo_a["accounts"].as_i64().unwrap() >= 1);

    let account = cli_json(&url, &["show-account", "--account", B_USD]).await;
    assert_eq!(account["owner"], "demo-b");
    assert_eq!(account["currency"], "USD");
    assert_eq!(account["balance_minor"], app.balance(B_USD).await);
    assert_eq!(account["entries"], entry_count(&pool, B_USD).await);
    let (code, _, err) = run_cli(&url, &["show-account", "--account", "acc_none"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("acc_none"), "{err}");
}

/// Authentication is a read: on a server that turned read-only (a standby
/// in a failover's window, a full disk on a managed service) a token is
/// still found, where a lookup that also wrote failed with 25006; noting
/// the use, done off the request path, is what fails there, harmlessly.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn authentication_works_on_a_read_only_server(pool: PgPool) {
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET default_transaction_read_only = on")
        .execute(&mut *conn)
        .await
        .unwrap();
    let write = sqlx::query("UPDATE principals SET name = name")
        .execute(&mut *conn)
        .await;
    assert!(write.is_err(), "the session refuses writes");
    let found = nexo_transfers::auth::principal_for_token(&mut *conn, TOKEN_A)
        .await
        .unwrap();
    assert!(found.is_some());
    assert!(
        nexo_transfers::auth::note_token_use(&mut *conn, TOKEN_A)
            .await
            .is_err()
    );
    assert!(
        nexo_transfers::auth::principal_for_token(&mut *conn, "tok_nobody")
            .await
            .unwrap()
            .is_none()
    );
}

/// A token revoked here stops working on an instance of the previous
/// version too, which reads the principal's old column.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_revoked_token_is_cleared_from_the_old_column(pool: PgPool) {
    let url = database_url_for(&pool);
    let created = cli_json(&url, &["create-principal", "--name", "legacy"]).await;
    let token = created["token"].as_str().unwrap().to_owned();
    // As migration 0005 left a principal made before it.
    sqlx::query(
        "UPDATE principals SET token_sha256 = sha256(convert_to($1, 'UTF8')) WHERE name = 'legacy'",
    )
    .bind(&token)
    .execute(&pool)
    .await
    .unwrap();
    cli_json(
        &url,
        &[
            "revoke-token",
            "--principal",
            "legacy",
            "--label",
            "initial",
        ],
    )
    .await;
    let old_column: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT token_sha256 FROM principals WHERE name = 'legacy'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(old_column, None);
}
