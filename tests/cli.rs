#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The real binary: onboarding without SQL, clear configuration errors,
//! idempotent demo fixtures, and a graceful stop.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;
use sqlx::PgPool;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn operators_onboard_a_principal_open_an_account_and_deposit_once(pool: PgPool) {
    let url = database_url_for(&pool);

    let (code, out, _) = run_cli(&url, &["create-principal", "--name", "acme"]).await;
    assert_eq!(code, 0);
    let created: Value = serde_json::from_str(&out).unwrap();
    let token = created["token"].as_str().unwrap().to_owned();
    let stored: Vec<u8> = sqlx::query_scalar(
        "SELECT t.token_sha256 FROM principal_tokens t JOIN principals p ON p.id = t.principal_id
         WHERE p.name = 'acme'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored.len(), 32, "only the hash is stored");
    assert_ne!(stored, token.as_bytes());

    let (code, out, _) = run_cli(
        &url,
        &[
            "open-account",
            "--owner",
            "acme",
            "--currency",
            "USD",
            "--id",
            "acc_acme1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    for _ in 0..2 {
        let (code, out, err) = run_cli(
            &url,
            &[
                "deposit",
                "--account",
                "acc_acme1",
                "--amount-minor",
                "500000",
                "--reference",
                "wire-1",
            ],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("\"amount_minor\": 500000"));
    }
    assert_eq!(
        balance(&pool, "acc_acme1").await,
        500_000,
        "one reference, one deposit"
    );
    assert_eq!(balance(&pool, "sys_funding_usd").await, -500_000);

    let (code, _, err) = run_cli(
        &url,
        &[
            "deposit",
            "--account",
            "acc_acme1",
            "--amount-minor",
            "7",
            "--reference",
            "wire-1",
        ],
    )
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("already used"), "{err}");

    // The printed token works against the API.
    let app = TestApp::spawn(pool).await;
    let account = app.get(&token, "/accounts/acc_acme1").await;
    assert_eq!(account.json()["balance_minor"], 500_000);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_bad_setting_is_a_one_line_error_naming_it(pool: PgPool) {
    let url = database_url_for(&pool);
    let output = tokio::process::Command::new(BIN)
        .args(["serve"])
        .env("DATABASE_URL", &url)
        .env("NEXO_IDEMPOTENCY_TTL", "forever")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("NEXO_IDEMPOTENCY_TTL"), "{stderr}");

    let (code, _, err) = run_cli(&url, &["serve", "--idempotency-lease", "2d"]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("NEXO_IDEMPOTENCY_TTL must be longer than NEXO_IDEMPOTENCY_LEASE"),
        "{err}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn demo_fixtures_load_idempotently_and_the_server_stops_gracefully(pool: PgPool) {
    let url = database_url_for(&pool);
    // The second start binds by host name.
    for host in ["127.0.0.1", "localhost"] {
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let mut child = tokio::process::Command::new(BIN)
            .args(["serve", "--demo", "--bind", &format!("{host}:{port}")])
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        assert!(wait_until_healthy(&base, Duration::from_secs(20)).await);
        let id = child.id().unwrap();
        nix_kill(id, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("stops within 10s")
            .unwrap();
        assert!(status.success(), "{status:?}");
    }
    assert_eq!(
        balance(&pool, A_USD).await,
        OPENING_BALANCE,
        "loaded twice, funded once"
    );
    assert_eq!(balance(&pool, A_EUR).await, OPENING_BALANCE);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM principals").await, 2);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM transfers").await, 2);
    assert_ledger_consistent(&pool).await;
}

fn nix_kill(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// `reconcile --json | head -0`: the reader is gone before the report is
/// written; the command still ends with its own exit status, not a panic.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_closed_pipe_ends_a_command_with_its_own_status(pool: PgPool) {
    let url = database_url_for(&pool);
    let mut child = tokio::process::Command::new(BIN)
        .args(["reconcile", "--json"])
        .env("DATABASE_URL", &url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Closing the read end before the command has connected to the
    // database: every write it makes meets a closed pipe.
    drop(child.stdout.take());
    let output = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Logs written to a pipe or a file carry no colour codes, and the default
/// level shows the service's own events, not its dependencies' INFO
/// chatter (sqlx's notice that `_sqlx_migrations` exists). Each run
/// creates its database, so there is a log line to look at.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn logs_to_a_pipe_are_plain_and_quiet(pool: PgPool) {
    let full = database_url_for(&pool);
    let (server, _) = full.rsplit_once('/').unwrap();
    for no_color in [None, Some("1")] {
        let fresh = format!("nexo_logs_{}", uuid::Uuid::new_v4().simple());
        let url = format!("{server}/{fresh}");
        let mut command = tokio::process::Command::new(BIN);
        command
            .args(["migrate"])
            .env("DATABASE_URL", &url)
            .env_remove("RUST_LOG");
        if let Some(value) = no_color {
            command.env("NO_COLOR", value);
        }
        let output = command.output().await.unwrap();
        assert_eq!(output.status.code(), Some(0));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("created the database"),
            "a line was logged: {stderr:?}"
        );
        assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");
        assert!(!stderr.contains("_sqlx_migrations"), "{stderr}");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE \"{fresh}\" WITH (FORCE)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            "migrations applied"
        );
    }
}

async fn database_exists(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A typo in DATABASE_URL is an error naming the database, host and port,
/// never a new, empty database that a command then writes to; only `serve`
/// and `migrate` create one, and say so. A URL that is not PostgreSQL's, or
/// a server that is not there, is named as such, in one line.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn only_serve_and_migrate_create_a_database_and_errors_name_what_was_tried(pool: PgPool) {
    let url = database_url_for(&pool);
    let typo = format!("nexo_typo_{}", uuid::Uuid::new_v4().simple());
    let (server, _) = url.rsplit_once('/').unwrap();
    let typo_url = format!("{server}/{typo}");

    for args in [
        vec!["create-principal", "--name", "acme"],
        vec!["open-account", "--owner", "acme", "--currency", "USD"],
        vec!["deposit", "--account", "acc_00001", "--amount-minor", "1"],
        vec!["purge-expired"],
        vec!["list-principals"],
        vec!["reconcile"],
    ] {
        let (code, _, err) = run_cli(&typo_url, &args).await;
        assert_ne!(code, 0, "{args:?}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(&typo), "{args:?} names the database: {err}");
        assert!(
            err.contains("localhost:5432") || err.contains("127.0.0.1:5432"),
            "{err}"
        );
        assert!(!database_exists(&pool, &typo).await, "{args:?} created it");
    }

    // A port in use is reported before anything else happens.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (code, _, err) = run_cli(
        &typo_url,
        &["serve", "--bind", &format!("127.0.0.1:{port}")],
    )
    .await;
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot listen on") && err.contains("NEXO_BIND"),
        "{err}"
    );
    assert!(
        !database_exists(&pool, &typo).await,
        "nothing done before the bind"
    );
    drop(taken);

    // A CA file for webhooks that cannot be used stops the server before
    // it listens or touches the database.
    let not_pem = std::env::temp_dir().join(format!("nexo-not-pem-{}", uuid::Uuid::new_v4()));
    std::fs::write(&not_pem, "not a certificate").unwrap();
    for (file, says) in [
        (not_pem.to_str().unwrap(), "holds no CERTIFICATE block"),
        ("/nonexistent/ca.pem", "No such file"),
    ] {
        let port = free_port().to_string();
        let (code, _, err) = run_cli(
            &typo_url,
            &[
                "serve",
                "--bind",
                &format!("127.0.0.1:{port}"),
                "--webhook-ca-file",
                file,
            ],
        )
        .await;
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("NEXO_WEBHOOK_CA_FILE") && err.contains(file) && err.contains(says),
            "{err}"
        );
        assert!(!database_exists(&pool, &typo).await, "nothing done before");
    }
    let _ = std::fs::remove_file(&not_pem);

    let output = tokio::process::Command::new(BIN)
        .args(["migrate"])
        .env("DATABASE_URL", &typo_url)
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("created the database"),
        "migrate says so"
    );
    assert!(database_exists(&pool, &typo).await);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{typo}\" WITH (FORCE)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    for (bad, says) in [
        ("not-a-url", "must look like postgres://"),
        ("mysql://root@localhost:3306/nexo", "not mysql://"),
        (
            "postgres://postgres@127.0.0.1:1/nexo",
            "on 127.0.0.1:1 as postgres",
        ),
    ] {
        let (code, _, err) = run_cli(bad, &["list-principals"]).await;
        assert_eq!(code, 1, "{bad}");
        assert_eq!(err.trim().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
    }
}
