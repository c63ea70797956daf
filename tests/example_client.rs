#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The example command line (`examples/transfer_client.rs`, compiled in
//! here as is) against the real server: a response lost on the way back is
//! retried with the same key and the command prints the replay of the one
//! transfer; its exit statuses are those its header documents (0 for a
//! 2xx, 1 for another final answer, 2 when it gave up), and `--key`
//! resumes an intent without moving the money again. The retry behaviour
//! itself is the library's, tested in tests/client_library.rs.

mod common;

#[allow(dead_code)] // its `main` is for `cargo run --example`
#[path = "../examples/transfer_client.rs"]
mod transfer_client;

use std::io::Write;
use std::sync::{Arc, Mutex};

use clap::Parser;
use common::proxy::{Behaviour, TcpProxy, http_body};
use common::*;
use sqlx::PgPool;
use transfer_client::{Args, Finished};

/// The lines the command wrote to its log.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// Runs the command with these arguments (after the program name).
async fn run(args: &[&str]) -> (Finished, String) {
    let args = Args::try_parse_from(std::iter::once("transfer_client").chain(args.iter().copied()))
        .unwrap();
    let log = Log::default();
    let finished = transfer_client::run(args, Arc::new(Mutex::new(log.clone()))).await;
    (finished, log.text())
}

fn transfer_args<'a>(base: &'a str, amount: &'a str) -> Vec<&'a str> {
    vec![
        "--base-url",
        base,
        "--token",
        TOKEN_A,
        "--from",
        A_USD,
        "--to",
        B_USD,
        "--amount-minor",
        amount,
        "--currency",
        "USD",
    ]
}

/// The seed's story: the first attempt reaches the server, which moves the
/// money, but the answer is lost. The command retries with the same key,
/// prints the original transfer and receipt, replayed, and exits 0; the
/// ledger holds one transfer.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_lost_response_is_retried_into_the_replay_of_the_one_transfer(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let proxy = TcpProxy::start(app.addr).await;
    proxy.misbehave(Behaviour::DropResponse, 1);
    let base = proxy.base();

    let (finished, log) = run(&transfer_args(&base, "10000")).await;

    assert_eq!(finished.status, 0, "{log}");
    let lost = proxy.dropped_responses();
    assert_eq!(lost.len(), 1, "the proxy lost exactly the first answer");
    assert!(lost[0].starts_with(b"HTTP/1.1 201"));
    let outcome = finished.outcome.expect("a transfer");
    assert!(outcome.replayed, "the final answer is the replay: {log}");
    assert_eq!(
        finished.body.as_deref(),
        Some(http_body(&lost[0])),
        "it prints, byte for byte, the answer that was lost"
    );
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "a line per attempt: {log}");
    assert!(
        lines.iter().all(|l| l.contains(finished.key.as_str())),
        "{log}"
    );
    assert!(lines[0].contains("retrying in"), "{log}");
    assert!(lines[1].contains("HTTP 201 (replayed): final"), "{log}");

    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_eq!(entry_count(&app.pool, B_USD).await, 1);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE - 10_000);
    assert_eq!(app.balance(B_USD).await, 10_000);
    assert_ledger_consistent(&app.pool).await;

    // Resuming the intent with its key learns its outcome and moves nothing.
    let mut resume = transfer_args(&app.base, "10000");
    let key = finished.key.to_string();
    resume.extend(["--key", key.as_str()]);
    let (again, log) = run(&resume).await;
    assert_eq!(again.status, 0, "{log}");
    assert!(again.outcome.expect("a transfer").replayed);
    assert_eq!(again.body.as_deref(), Some(http_body(&lost[0])));
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
}

/// A final refusal is printed as it came and exits 1; it is not retried.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_refusal_exits_1_after_one_attempt(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let amount = (OPENING_BALANCE * 10).to_string();

    let (finished, log) = run(&transfer_args(&app.base, &amount)).await;

    assert_eq!(finished.status, 1, "{log}");
    let body: serde_json::Value = serde_json::from_slice(&finished.body.unwrap()).unwrap();
    assert_eq!(body["type"], "/problems/insufficient-funds");
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.contains("HTTP 422 insufficient-funds: final"), "{log}");
    assert_eq!(customer_transfer_count(&app.pool).await, 0);
}

/// No answer within the attempts: exit 2, and the key to resume with.
#[tokio::test]
async fn giving_up_exits_2_and_names_the_key_to_resume_with() {
    let base = format!("http://127.0.0.1:{}", free_port());
    let mut args = transfer_args(&base, "100");
    args.extend(["--attempts-max", "2", "--timeout", "1s"]);

    let (finished, log) = run(&args).await;

    assert_eq!(finished.status, 2, "{log}");
    assert!(finished.body.is_none());
    assert_eq!(log.lines().count(), 3, "two attempts and the error: {log}");
    assert!(log.contains("no attempts left"), "{log}");
    assert!(
        log.contains(&format!("resume with --key {}", finished.key)),
        "{log}"
    );
}

#[test]
fn a_key_the_server_would_refuse_is_a_usage_error() {
    let mut args = vec!["transfer_client"];
    args.extend(transfer_args("http://127.0.0.1:1", "1"));
    args.extend(["--key", "two words"]);
    let error = Args::try_parse_from(args).unwrap_err();
    assert_eq!(error.exit_code(), 2);
}

/// `--pending` makes a hold: the amount is reserved on the source, nothing
/// moves, and the hold expires when asked; `--expires-in-seconds` alone is
/// refused before anything is sent.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn pending_makes_a_hold_that_moves_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let mut args = transfer_args(&app.base, "2500");
    args.extend(["--pending", "--expires-in-seconds", "600"]);

    let (finished, log) = run(&args).await;

    assert_eq!(finished.status, 0, "{log}");
    let hold = finished.outcome.expect("a hold").transfer;
    assert_eq!(hold.status, nexo_client::TransferStatus::Pending);
    let reserved = hold.hold.expect("the hold's terms");
    assert_eq!(reserved.amount_minor, 2_500);
    let lasts = reserved.expires_at - hold.created_at;
    assert_eq!(lasts.num_seconds(), 600);
    let held: i64 = sqlx::query_scalar("SELECT held_minor FROM accounts WHERE id = $1")
        .bind(A_USD)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(held, 2_500);
    assert_eq!(app.balance(A_USD).await, OPENING_BALANCE);
    assert_eq!(customer_transfer_count(&app.pool).await, 0);

    let mut alone = transfer_args(&app.base, "2500");
    alone.extend(["--expires-in-seconds", "600"]);
    let refused =
        Args::try_parse_from(std::iter::once("transfer_client").chain(alone.iter().copied()));
    assert!(refused.is_err(), "an expiry without --pending is refused");
    assert_reconciles(&app.pool).await;
}
