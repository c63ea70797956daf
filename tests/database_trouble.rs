#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The database goes away in the middle of a load: the real binary reaches
//! PostgreSQL through a proxy that is taken down (new connections refused,
//! live ones cut, as in a PostgreSQL restart) and brought back; or the
//! service's backends are killed with `pg_terminate_backend`, again and
//! again. Only this test's own database is touched: other tests share the
//! PostgreSQL server.
mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::process::*;
use common::proxy::TcpProxy;
use common::*;
use sqlx::PgPool;
use tokio::time::Instant;

const CLIENTS: usize = 6;
const PACE: Duration = Duration::from_millis(20);
const INTENTS_MAX: usize = 3_000;
/// Short enough that claims orphaned by the outage free up quickly.
const SERVER_ENV: [(&str, &str); 2] = [
    ("NEXO_DB_ACQUIRE_TIMEOUT", "1s"),
    ("NEXO_IDEMPOTENCY_LEASE", "2s"),
];

async fn postgres_addr(pool: &PgPool) -> SocketAddr {
    let options = pool.connect_options();
    let target = format!("{}:{}", options.get_host(), options.get_port());
    tokio::net::lookup_host(&target)
        .await
        .expect("the database host resolves")
        .find(SocketAddr::is_ipv4)
        .expect("an IPv4 address for the database")
}

async fn readyz(client: &reqwest::Client, server: &ServerProcess) -> Option<Reply> {
    let response = client.get(server.url("/readyz")).send().await.ok()?;
    Some(Reply::read(response).await)
}

/// What every first answer must be while the database comes and goes: the
/// transfer, or a retryable 503 problem. Returns how many were 503.
fn assert_created_or_unavailable(sent: &[Sent]) -> usize {
    let mut unavailable = 0;
    for reply in sent.iter().filter_map(|s| s.first.as_ref()) {
        match reply.status {
            201 => {}
            503 => {
                reply.assert_problem(503, "service-unavailable");
                assert!(
                    reply.header("retry-after").is_some(),
                    "503 without Retry-After"
                );
                unavailable += 1;
            }
            other => panic!("{other} while the database was away: {:?}", reply.body),
        }
    }
    unavailable
}

/// Nothing half-done: a key is COMPLETED exactly when its transfer exists;
/// the other keys (FAILED, or IN_PROGRESS left by a cut connection) moved
/// no money and are free to retry once their lease ends.
async fn assert_nothing_half_done(pool: &PgPool) -> Vec<(String, i64)> {
    let half_done = scalar(
        pool,
        "SELECT count(*) FROM idempotency_keys k
         FULL JOIN (SELECT * FROM transfers WHERE principal_id IS NOT NULL) t
           ON t.principal_id = k.principal_id AND t.idempotency_key = k.idempotency_key
         WHERE (k.status = 'COMPLETED') IS DISTINCT FROM (t.id IS NOT NULL)
            OR (k.status = 'COMPLETED' AND k.transfer_id IS DISTINCT FROM t.id)",
    )
    .await;
    assert_eq!(half_done, 0, "keys and transfers disagree");
    assert_ledger_consistent(pool).await;
    key_status_counts(pool).await
}

/// After the trouble: every intent retried until answered moved once.
async fn assert_every_intent_moved_once(pool: &PgPool, sent: &[Sent], base: &str) {
    let answers = retry_all(sent, base).await;
    assert_each_intent_moved_once(pool, &answers).await;
    assert_eq!(balance(pool, B_USD).await, total_amount(sent));
    assert_ledger_consistent(pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn while_the_database_is_away_the_service_answers_503_and_recovers_by_itself(pool: PgPool) {
    let proxy = TcpProxy::start(postgres_addr(&pool).await).await;
    let url = database_url_via(&pool, proxy.addr.port());
    let server = ServerProcess::start(&url, &SERVER_ENV).await;
    let client = fault_client(Duration::from_secs(10));
    let stream = TransferStream::start(&server.base, CLIENTS, PACE, INTENTS_MAX);
    tokio::time::sleep(Duration::from_secs(1)).await;

    proxy.go_down();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    readyz(&client, &server)
        .await
        .expect("the process still answers")
        .assert_problem(503, "service-unavailable");
    tokio::time::sleep(Duration::from_millis(1000)).await;

    proxy.come_back().await;
    let back_at = Instant::now();
    loop {
        if readyz(&client, &server)
            .await
            .is_some_and(|r| r.status == 200)
        {
            break;
        }
        assert!(back_at.elapsed() < Duration::from_secs(20), "no recovery");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let recovered_in = back_at.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sent = stream.stop().await;

    let unavailable = assert_created_or_unavailable(&sent);
    assert!(unavailable > 0, "no request met the outage");
    let created_after = sent
        .iter()
        .filter(|s| s.first.as_ref().is_some_and(|r| r.status == 201))
        .filter(|s| s.sent_at > back_at)
        .count();
    assert!(
        created_after > 0,
        "nothing was served after the database came back"
    );
    let states = assert_nothing_half_done(&pool).await;
    assert_every_intent_moved_once(&pool, &sent, &server.base).await;
    println!(
        "database away 2.5 s: {} intents, {unavailable} answered 503 problem+json, {} unanswered, \
         /readyz 503 while away and 200 again {recovered_in:?} after it came back, \
         {created_after} created after; records before retries: {states:?}",
        sent.len(),
        sent.iter().filter(|s| s.first.is_none()).count(),
    );
}

/// Rounds of `pg_terminate_backend` during the load.
const TERMINATIONS: usize = 8;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn backends_terminated_mid_load_leave_nothing_half_done(pool: PgPool) {
    let server = ServerProcess::start(&database_url(&pool), &SERVER_ENV).await;
    let stream = TransferStream::start(&server.base, CLIENTS, PACE, INTENTS_MAX);
    let mut terminated = 0;
    for _ in 0..TERMINATIONS {
        tokio::time::sleep(Duration::from_millis(250)).await;
        terminated += scalar(
            &pool,
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                                   WHERE datname = current_database()
                                     AND pid <> pg_backend_pid()) killed",
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = stream.stop().await;

    let unavailable = assert_created_or_unavailable(&sent);
    let states = assert_nothing_half_done(&pool).await;
    assert_every_intent_moved_once(&pool, &sent, &server.base).await;
    println!(
        "pg_terminate_backend: {TERMINATIONS} rounds, {terminated} backends killed, {} intents, \
         {unavailable} answered 503 problem+json, {} unanswered; records before retries: {states:?}",
        sent.len(),
        sent.iter().filter(|s| s.first.is_none()).count(),
    );
    assert!(terminated > 0, "no backend was terminated");
}

/// A connection that sat idle past `ALIVE_CHECK_AFTER_IDLE` is pinged before
/// it is handed out, and replaced if dead: backends cut while the service
/// was quiet (a restart at night, an idle-session killer) cost no request.
/// (One in steady use is not pinged; if cut, its next statement fails and
/// the request gets a retryable 503, as the test above shows.)
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn connections_cut_while_idle_are_replaced_before_a_request_meets_them(pool: PgPool) {
    let server = ServerProcess::start(&database_url(&pool), &SERVER_ENV).await;
    let client = reqwest::Client::new();
    let body = transfer(A_USD, B_USD, 1, "USD");
    let send = |key: String| {
        let (client, body, base) = (client.clone(), body.clone(), server.base.clone());
        async move {
            try_post_transfer(&client, &base, TOKEN_A, &key, &body)
                .await
                .unwrap()
        }
    };
    // The service's pools (main and keys) hold connections.
    let mut keys = Vec::new();
    for _ in 0..4 {
        let key = new_key();
        assert_eq!(send(key.clone()).await.status, 201);
        keys.push(key);
    }
    let before = balance(&pool, A_USD).await;
    let killed = scalar(
        &pool,
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                               WHERE datname = current_database() AND backend_type = 'client backend'
                                 AND pid <> pg_backend_pid()) killed",
    )
    .await;
    assert!(
        killed >= 2,
        "the service's idle connections were cut ({killed})"
    );
    tokio::time::sleep(nexo_transfers::db::ALIVE_CHECK_AFTER_IDLE + Duration::from_millis(200))
        .await;

    for _ in 0..4 {
        let key = new_key();
        let reply = send(key.clone()).await;
        assert_eq!(
            reply.status,
            201,
            "no request meets a dead connection: {}",
            String::from_utf8_lossy(&reply.body)
        );
        keys.push(key);
    }
    assert_eq!(before - balance(&pool, A_USD).await, 4);
    for key in &keys {
        assert_eq!(transfers_under(&pool, key).await, 1, "{key} executed once");
    }
    assert_ledger_consistent(&pool).await;
}
