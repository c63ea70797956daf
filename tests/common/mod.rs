#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step should stop the test loudly
//! Shared test helpers: a real server on a real socket over a fresh,
//! migrated database (one per test, from `#[sqlx::test]`), and assertions
//! that read the ledger itself, not only HTTP statuses.
#![allow(dead_code)] // each test binary uses its own subset

pub mod process;
pub mod proxy;
pub mod receiver;
pub mod tls_front;

use std::net::SocketAddr;
use std::time::Duration;

use nexo_transfers::config::{HttpConfig, PostingConfig, RateLimitConfig};
use nexo_transfers::http::operations::Operations;
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
        retention: Duration::from_secs(400 * 24 * 3600),
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

    /// A second instance on the same database: it remembers no answer in
    /// memory, so what it answers comes from the database.
    pub async fn another_instance(&self) -> Self {
        Self::spawn(self.pool.clone()).await
    }

    pub async fn spawn_with(pool: PgPool, policy: Policy, http: HttpConfig) -> Self {
        Self::spawn_configured(pool, policy, http, RateLimitConfig::default()).await
    }

    /// With the operator side set: an admin token and the cell the
    /// scheduled reconciliation writes to.
    pub async fn spawn_with_operations(pool: PgPool, operations: Operations) -> Self {
        Self::spawn_full(
            pool,
            default_policy(),
            default_http(),
            RateLimitConfig::default(),
            Some(operations),
            PostingConfig::default(),
        )
        .await
    }

    /// With the posting layer's settings (bounds, replication) set.
    pub async fn spawn_with_posting(pool: PgPool, posting: PostingConfig) -> Self {
        Self::spawn_full(
            pool,
            default_policy(),
            default_http(),
            RateLimitConfig::default(),
            None,
            posting,
        )
        .await
    }

    pub async fn spawn_configured(
        pool: PgPool,
        policy: Policy,
        http: HttpConfig,
        rate_limit: RateLimitConfig,
    ) -> Self {
        Self::spawn_full(
            pool,
            policy,
            http,
            rate_limit,
            None,
            PostingConfig::default(),
        )
        .await
    }

    async fn spawn_full(
        pool: PgPool,
        policy: Policy,
        http: HttpConfig,
        rate_limit: RateLimitConfig,
        operations: Option<Operations>,
        posting: PostingConfig,
    ) -> Self {
        nexo_transfers::admin::load_demo(&pool)
            .await
            .expect("demo fixtures load");
        let mut state = AppState::new(
            pool.clone(),
            AppConfig {
                idempotency: policy,
                http,
                posting,
            },
        )
        .await
        .expect("state builds")
        .with_rate_limit(rate_limit);
        if let Some(operations) = operations {
            state = state.with_operations(operations);
        }
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

    /// A keyed `POST` of a JSON body to any path.
    pub async fn post_json(&self, token: &str, key: &str, path: &str, body: &Value) -> Reply {
        let response = self
            .client
            .post(self.url(path))
            .bearer_auth(token)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body.to_string())
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

    /// A transfer of ten times A's opening balance: refused, and stored as
    /// refused under its key.
    pub async fn post_beyond_balance(&self) {
        let body = transfer(A_USD, B_USD, OPENING_BALANCE * 10, "USD");
        self.post_transfer(TOKEN_A, &new_key(), &body)
            .await
            .assert_problem(422, "insufficient-funds");
    }

    /// `GET /metrics`, parsed.
    pub async fn metrics(&self) -> Metrics {
        let response = self
            .client
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics scraped");
        assert_eq!(response.status(), 200);
        Metrics(response.text().await.expect("metrics read"))
    }
}

/// A Prometheus text exposition. The recorder is global to the test
/// process, so tests compare two scrapes rather than read absolute values.
#[derive(Debug, Clone)]
pub struct Metrics(pub String);

impl Metrics {
    /// The sum of every series of `name` whose labels include all of
    /// `labels`; 0 when there is none.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| line.rsplit_once(' '))
            .filter(|(series, _)| {
                let (series_name, series_labels) = series
                    .split_once('{')
                    .map_or((*series, ""), |(n, l)| (n, l.trim_end_matches('}')));
                series_name == name
                    && labels.iter().all(|(k, v)| {
                        series_labels
                            .split(',')
                            .any(|l| l == format!("{k}=\"{v}\""))
                    })
            })
            .map(|(_, value)| value.parse::<f64>().expect("a metric value"))
            .sum()
    }

    /// How much `name{labels}` grew since `before`.
    pub fn delta(&self, before: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels) - before.value(name, labels)
    }

    pub fn has(&self, name: &str) -> bool {
        self.0
            .lines()
            .any(|line| line.starts_with(name) && !line.starts_with('#'))
    }
}

/// Claims `key` for principal A with `body`'s fingerprint, as a request
/// that is still running (or whose process died) would hold it.
pub async fn claim_for_a(pool: &PgPool, key: &str, body: &Value) {
    use nexo_transfers::db::KeyPool;
    use nexo_transfers::idempotency::{ClaimOutcome, IdempotencyKey, store};
    use nexo_transfers::transfers::intent::{TransferBody, TransferIntent};
    let body: TransferBody = serde_json::from_value(body.clone()).expect("a transfer body");
    let outcome = store::claim(
        &KeyPool::beside(pool),
        default_policy(),
        principal_a(pool).await,
        &IdempotencyKey::from_inner(key.to_owned()).expect("a valid key"),
        "POST",
        "/transfers",
        &TransferIntent::parse(&body)
            .expect("a valid transfer")
            .fingerprint(),
    )
    .await
    .expect("claim");
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
}

/// Principal A's id (the idempotency scope of `TOKEN_A`).
pub async fn principal_a(pool: &PgPool) -> nexo_transfers::principal::PrincipalId {
    nexo_transfers::auth::principal_for_token(pool, TOKEN_A)
        .await
        .expect("principal lookup")
        .expect("principal A exists")
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
            format!("/problems/{slug}"),
            "problem: {problem}"
        );
        assert_eq!(problem["status"], status);
        assert!(problem["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
        assert!(
            problem["request_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty()),
            "every problem names its request: {problem}"
        );
    }
}

impl Reply {
    /// Whether the same request, sent again, may be answered otherwise:
    /// another request with its key is in flight, or the server could not
    /// serve it just now.
    pub fn is_transient(&self) -> bool {
        self.status >= 500
            || self.status == 409 && self.json()["type"] == "/problems/request-in-flight"
    }
}

/// Sends one request through `send` (`None`: no answer came back) until
/// its answer is final, pausing between tries; fails the test when
/// `within` runs out first.
pub async fn until_final<F, Fut>(
    what: &str,
    within: Duration,
    pause: Duration,
    mut send: F,
) -> Reply
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<Reply>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: no final answer within {within:?}"
        );
        if let Some(reply) = send().await
            && !reply.is_transient()
        {
            return reply;
        }
        tokio::time::sleep(pause).await;
    }
}

/// How long an in-process request may stay in flight or unavailable
/// before a test gives up on it.
pub const FINAL_ANSWER_WITHIN: Duration = Duration::from_secs(30);

impl TestApp {
    /// [`TestApp::post_json`] until its answer is final.
    pub async fn post_json_until_final(
        &self,
        token: &str,
        key: &str,
        path: &str,
        body: &Value,
    ) -> Reply {
        until_final(
            path,
            FINAL_ANSWER_WITHIN,
            Duration::from_millis(50),
            || async { Some(self.post_json(token, key, path, body).await) },
        )
        .await
    }

    /// A duplicate storm: every (key, path, body) sent `copies` times at
    /// once, each copy until its answer is final. Every copy of a key must
    /// get the same final bytes; returns that answer per key.
    pub async fn duplicate_storm(
        &self,
        token: &str,
        requests: &[(String, String, Value)],
        copies: usize,
    ) -> std::collections::HashMap<String, Reply> {
        let sends = requests.iter().flat_map(|(key, path, body)| {
            (0..copies).map(move |_| async move {
                (
                    key.clone(),
                    self.post_json_until_final(token, key, path, body).await,
                )
            })
        });
        let mut by_key = std::collections::HashMap::<String, Reply>::new();
        for (key, reply) in futures::future::join_all(sends).await {
            match by_key.get(&key) {
                Some(first) => assert_eq!(
                    (first.status, &first.body),
                    (reply.status, &reply.body),
                    "copies of one request got different answers"
                ),
                None => {
                    by_key.insert(key, reply);
                }
            }
        }
        by_key
    }
}

/// The reconciliation's checks that found something, with their totals.
pub fn failing_checks(
    report: &nexo_transfers::reconcile::Report,
) -> Vec<(nexo_transfers::reconcile::Check, u64)> {
    report
        .checks
        .iter()
        .filter(|c| !c.holds())
        .map(|c| (c.check, c.discrepancies_total))
        .collect()
}

/// A `DATABASE_URL` for the test's own database, for a child process (the
/// real binary) to use: the server of `DATABASE_URL`, the pool's database.
pub fn database_url_for(pool: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for tests");
    let database = pool
        .connect_options()
        .get_database()
        .expect("test pools name their database")
        .to_owned();
    let mut url = url::Url::parse(&base).expect("DATABASE_URL is a URL");
    url.set_path(&database);
    url.to_string()
}

/// The path of the server binary built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_nexo-transfers");

/// Runs the real binary with a command line against a database; returns
/// (exit code, stdout, stderr).
pub async fn run_cli(database_url: &str, args: &[&str]) -> (i32, String, String) {
    let output = tokio::process::Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("the binary runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A port that was free a moment ago, for a child server process.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Polls `GET /healthz` until the server answers, for at most `within`.
pub async fn wait_until_healthy(base: &str, within: Duration) -> bool {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if let Ok(r) = client.get(format!("{base}/healthz")).send().await
            && r.status().is_success()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Asserts that every reply is a 201, showing the body of the first that is not.
#[track_caller]
pub fn assert_all_created(replies: &[Reply]) {
    for reply in replies {
        assert_eq!(
            reply.status,
            201,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
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

/// Transfers created under a key, whoever's.
pub async fn transfers_under(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM transfers WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("transfers under a key")
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

/// The ledger's invariants, checked by the reconciliation's ledger checks:
/// each transfer has exactly one debit and one credit of its amount, every
/// balance equals the sum of its entries, and each currency sums to zero.
pub async fn assert_ledger_consistent(pool: &PgPool) {
    let report = nexo_transfers::reconcile::run_ledger_checks(pool)
        .await
        .expect("reconciliation runs");
    assert!(report.ok, "the ledger does not reconcile:\n{report}");
}

/// Every check the reconciliation runs (ledger, holds, reversals and key
/// records), with the default key TTL.
pub async fn assert_reconciles(pool: &PgPool) {
    let report = nexo_transfers::reconcile::run(
        pool,
        nexo_transfers::reconcile::Options {
            key_ttl: default_policy().ttl,
        },
    )
    .await
    .expect("reconciliation runs");
    assert!(report.ok, "the ledger does not reconcile:\n{report}");
}

/// Idempotency records by status, for the figures the fault tests print.
pub async fn key_status_counts(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT status, count(*) FROM idempotency_keys GROUP BY status ORDER BY status")
        .fetch_all(pool)
        .await
        .expect("status counts")
}

/// Asserts that each key has exactly one customer transfer, that every
/// answer seen for it names that transfer, that no other customer transfer
/// exists, and that every record is COMPLETED with that transfer.
pub async fn assert_each_intent_moved_once(pool: &PgPool, answers: &[(String, Vec<Reply>)]) {
    let transfers: Vec<(String, uuid::Uuid)> =
        sqlx::query_as("SELECT idempotency_key, id FROM transfers WHERE principal_id IS NOT NULL")
            .fetch_all(pool)
            .await
            .expect("transfers");
    let by_key: std::collections::HashMap<String, uuid::Uuid> = transfers.into_iter().collect();
    assert_eq!(
        by_key.len(),
        answers.len(),
        "customer transfers that no intent asked for, or intents without one"
    );
    for (key, replies) in answers {
        let id = by_key
            .get(key)
            .unwrap_or_else(|| panic!("intent {key} has no transfer"));
        assert!(!replies.is_empty(), "intent {key} was never answered");
        for reply in replies {
            assert_eq!(reply.status, 201, "intent {key}: {:?}", reply.body);
            assert_eq!(
                reply.json()["transfer_id"].as_str(),
                Some(id.to_string().as_str()),
                "an answer for {key} names another transfer"
            );
        }
    }
    let unfinished = scalar(
        pool,
        "SELECT count(*) FROM idempotency_keys k
         WHERE k.status <> 'COMPLETED'
            OR k.transfer_id IS DISTINCT FROM
               (SELECT t.id FROM transfers t WHERE t.principal_id = k.principal_id
                                              AND t.idempotency_key = k.idempotency_key)",
    )
    .await;
    assert_eq!(unfinished, 0, "records not COMPLETED with their transfer");
}
