#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step should stop the test loudly
//! Shared test helpers: a real server on a real socket over a fresh,
//! migrated database (one per test, from `#[sqlx::test]`), and assertions
//! that read the ledger itself, not only HTTP statuses.
#![allow(dead_code)] // each test binary uses its own subset

use std::net::SocketAddr;
use std::time::Duration;

use nexo_transfers::config::HttpConfig;
use nexo_transfers::http::{AppConfig, AppState};
use nexo_transfers::idempotency::Policy;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::oneshot;

pub const TOKEN_A: &str = "tok_test_A";
pub const TOKEN_B: &str = "tok_test_B";
pub const A_USD: &str = "acc_00001";
pub const B_USD: &str = "acc_00002";
pub const A_EUR: &str = "acc_00003";
pub const B_EUR: &str = "acc_00004";
pub const OPENING_BALANCE: i64 = 100_000_000;

pub fn default_policy() -> Policy {
    Policy {
        ttl: Duration::from_secs(24 * 3600),
        lease: Duration::from_secs(30),
    }
}

pub fn default_http() -> HttpConfig {
    HttpConfig {
        body_limit_bytes: 16 * 1024,
        request_timeout: Duration::from_secs(10),
    }
}

/// A server bound to 127.0.0.1:0 before it serves (no sleeps), with the demo
/// fixtures loaded. Stops when dropped.
pub struct TestApp {
    pub addr: SocketAddr,
    pub base: String,
    pub pool: PgPool,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
}

impl TestApp {
    pub async fn spawn(pool: PgPool) -> Self {
        Self::spawn_with(pool, default_policy(), default_http()).await
    }

    pub async fn spawn_with(pool: PgPool, policy: Policy, http: HttpConfig) -> Self {
        nexo_transfers::admin::load_demo(&pool)
            .await
            .expect("demo fixtures load");
        let state = AppState::new(
            pool.clone(),
            AppConfig {
                idempotency: policy,
                http,
            },
        )
        .await
        .expect("state builds");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(nexo_transfers::http::serve(listener, state, async move {
            let _ = rx.await;
        }));
        Self {
            addr,
            base: format!("http://{addr}"),
            pool,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("client"),
            shutdown: Some(tx),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `POST /transfers` with a bearer token, a key and a JSON body.
    pub async fn post_transfer(&self, token: &str, key: &str, body: &Value) -> Reply {
        self.post_transfer_raw(token, key, body.to_string()).await
    }

    pub async fn post_transfer_raw(&self, token: &str, key: &str, body: String) -> Reply {
        let response = self
            .client
            .post(self.url("/transfers"))
            .bearer_auth(token)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request sent");
        Reply::read(response).await
    }

    pub async fn get(&self, token: &str, path: &str) -> Reply {
        let response = self
            .client
            .get(self.url(path))
            .bearer_auth(token)
            .send()
            .await
            .expect("request sent");
        Reply::read(response).await
    }

    pub async fn balance(&self, account: &str) -> i64 {
        balance(&self.pool, account).await
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A response read whole: status, headers and the exact body bytes.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Reply {
    pub async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("body read");
        Self {
            status,
            headers,
            body,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem+json answer of this status and problem type slug.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let problem = self.json();
        assert_eq!(
            problem["type"],
            format!("https://nexo-transfers.example/problems/{slug}"),
            "problem: {problem}"
        );
        assert_eq!(problem["status"], status);
        assert!(problem["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
}

pub fn transfer(from: &str, to: &str, amount_minor: i64, currency: &str) -> Value {
    json!({"from": from, "to": to, "amount_minor": amount_minor, "currency": currency})
}

pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

pub async fn balance(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT balance_minor FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .expect("balance read")
}

/// Transfers created by a principal's requests (deposits excluded).
pub async fn customer_transfer_count(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM transfers WHERE principal_id IS NOT NULL",
    )
    .await
}

pub async fn entry_count(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger_entries WHERE account_id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .expect("entry count")
}

pub async fn key_rows(pool: &PgPool, key: &str) -> Vec<(String, Option<i16>)> {
    sqlx::query_as(
        "SELECT status, response_status FROM idempotency_keys WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_all(pool)
    .await
    .expect("key rows")
}

pub async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The ledger's invariants, checked on the rows (see
/// `nexo_transfers::ledger::audit`): each transfer has exactly one debit and
/// one credit of its amount, every balance equals the sum of its entries,
/// each currency sums to zero, and no customer balance is negative.
pub async fn assert_ledger_consistent(pool: &PgPool) {
    let found = nexo_transfers::ledger::audit::reconcile(pool)
        .await
        .expect("reconciliation runs");
    assert_eq!(
        found.transfers_not_double_entry, 0,
        "transfers without exactly one debit and one credit"
    );
    assert_eq!(
        found.balances_drifted, 0,
        "balances that differ from the sum of their entries"
    );
    assert_eq!(
        found.currencies_unbalanced, 0,
        "currencies whose balances do not sum to zero"
    );
    assert_eq!(
        found.customer_balances_negative, 0,
        "customer accounts below zero"
    );
}
