#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Security hygiene, checked on the running service: per-principal rate
//! limits, tokens kept only as hashes and never logged, and the limits
//! that bound a request (body size, request time, database pool and its
//! acquire timeout) taking effect from their settings.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use nexo_transfers::config::RateLimitConfig;
use sqlx::PgPool;
use tokio::time::Instant;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_principal_past_its_rate_gets_429_with_retry_after_and_no_one_else_does(pool: PgPool) {
    let limits = RateLimitConfig {
        rate_limit_per_second: 2,
        rate_limit_burst: 3,
    };
    let app = TestApp::spawn_configured(pool, default_policy(), default_http(), limits).await;
    let path = format!("/accounts/{A_USD}");
    let started = Instant::now();
    let replies = futures::future::join_all((0..8).map(|_| app.get(TOKEN_A, &path))).await;
    let elapsed = started.elapsed();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    let served = statuses.iter().filter(|s| **s == 200).count();
    // The burst, plus what the rate refilled while the requests ran.
    let allowed = 3 + (elapsed.as_secs_f64() * 2.0) as usize;
    assert!(
        (3..=allowed).contains(&served),
        "{statuses:?} in {elapsed:?}"
    );
    for reply in replies.iter().filter(|r| r.status != 200) {
        reply.assert_problem(429, "rate-limited");
    }
    assert!(served < 8, "nothing was throttled: {statuses:?}");

    // A throttled POST touches nothing: its key stays free.
    let (key, body) = (new_key(), transfer(A_USD, B_USD, 100, "USD"));
    let throttled = app.post_transfer(TOKEN_A, &key, &body).await;
    throttled.assert_problem(429, "rate-limited");
    let wait: u64 = throttled.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&wait), "Retry-After {wait}");
    assert!(key_rows(&app.pool, &key).await.is_empty());

    // B has a bucket of its own.
    assert_eq!(
        app.get(TOKEN_B, &format!("/accounts/{B_USD}")).await.status,
        200
    );

    tokio::time::sleep(Duration::from_secs(wait)).await;
    let later = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(later.status, 201);
    assert!(!later.replayed(), "the throttled attempt had not executed");
    assert_eq!(customer_transfer_count(&app.pool).await, 1);
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn tokens_are_stored_only_as_hashes(pool: PgPool) {
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let created = nexo_transfers::admin::create_principal(&pool, "hygiene")
        .await
        .unwrap();
    for token in [TOKEN_A, TOKEN_B, created.token.as_str()] {
        let (hashed, plain): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE t.token_sha256 = sha256(convert_to($1, 'UTF8'))),
                    count(*) FILTER (WHERE t::text LIKE '%' || $1 || '%'
                                        OR p::text LIKE '%' || $1 || '%')
             FROM principal_tokens t JOIN principals p ON p.id = t.principal_id",
        )
        .bind(token)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((hashed, plain), (1, 0), "{token}");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_binary_logs_no_token_even_at_trace(pool: PgPool) {
    // A real generated token, and near misses of it.
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let holder = nexo_transfers::admin::create_principal(&pool, "secret-holder")
        .await
        .unwrap();
    nexo_transfers::admin::open_account(&pool, "secret-holder", "USD", Some("acc_s0001"))
        .await
        .unwrap();
    nexo_transfers::admin::deposit(&pool, "acc_s0001", 10_000, "s-opening")
        .await
        .unwrap();
    let secret = holder.token.clone();
    let near_misses = [
        format!("{secret}0"),
        secret[..secret.len() - 1].to_owned(),
        secret.to_uppercase(),
    ];

    let server = ServerProcess::start(&database_url(&pool), &[("RUST_LOG", "trace")]).await;
    let client = fault_client(Duration::from_secs(10));
    let body = transfer("acc_s0001", B_USD, 100, "USD");
    let key = new_key();
    for token in std::iter::once(&secret).chain(&near_misses) {
        let reply = try_post_transfer(&client, &server.base, token, &key, &body)
            .await
            .unwrap();
        let expected = if *token == secret { 201 } else { 401 };
        assert_eq!(reply.status, expected);
    }
    let account = get_with(&client, &server.url("/accounts/acc_s0001"), &secret).await;
    assert_eq!(account.status, 200);
    let logs = server.kill().await.join("\n");
    assert!(
        logs.contains("\"status\":201"),
        "request logs were captured"
    );
    for needle in near_misses.iter().chain([&secret, &"Bearer".to_owned()]) {
        let leaks: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains(needle.as_str()))
            .collect();
        assert!(
            leaks.is_empty(),
            "{needle:?} appears in the logs: {leaks:#?}"
        );
    }
    // The public demo tokens are named once, in the start-up warning.
    let demo_mentions: Vec<&str> = logs.lines().filter(|l| l.contains("tok_test_")).collect();
    assert_eq!(demo_mentions.len(), 1, "{demo_mentions:#?}");
    assert!(demo_mentions[0].contains("never run --demo in production"));
    println!(
        "no token in {} bytes of the binary's TRACE logs",
        logs.len()
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn body_limit_request_timeout_and_pool_bound_come_from_the_settings(pool: PgPool) {
    let server = ServerProcess::start(
        &database_url(&pool),
        &[
            ("NEXO_BODY_LIMIT_BYTES", "1024"),
            ("NEXO_REQUEST_TIMEOUT", "3s"),
            ("NEXO_DB_POOL_MAX", "1"),
            ("NEXO_DB_ACQUIRE_TIMEOUT", "1s"),
        ],
    )
    .await;
    let client = fault_client(Duration::from_secs(30));

    // 1,500 bytes is far below the default limit, above the configured one.
    let padded = format!(
        "{}{}",
        transfer(A_USD, B_USD, 100, "USD"),
        " ".repeat(1_500)
    );
    let big = client
        .post(server.url("/transfers"))
        .bearer_auth(TOKEN_A)
        .header("Idempotency-Key", new_key())
        .header("Content-Type", "application/json")
        .body(padded)
        .send()
        .await
        .unwrap();
    Reply::read(big)
        .await
        .assert_problem(413, "payload-too-large");

    // Block the balance read behind a table lock (the token lookup may be
    // served from memory, the balance never is): the first request holds
    // the pool's only connection until the request timeout; the second
    // cannot get a connection and gives up at the acquire timeout.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE accounts IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let timed_get = |delay: u64| {
        let (client, url) = (client.clone(), server.url(&format!("/accounts/{A_USD}")));
        async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let started = Instant::now();
            (get_with(&client, &url, TOKEN_A).await, started.elapsed())
        }
    };
    let waiting_on_lock = async {
        // Samples, while both requests are in, how many of this database's
        // connections wait on the lock: the pool bound allows one.
        let mut most = 0;
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let waiting = scalar(
                &pool,
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await;
            most = most.max(waiting);
        }
        most
    };
    let ((held, held_for), (starved, starved_for), blocked_connections) =
        tokio::join!(timed_get(0), timed_get(200), waiting_on_lock);
    blocker.rollback().await.unwrap();

    held.assert_problem(503, "service-unavailable");
    starved.assert_problem(503, "service-unavailable");
    assert_eq!(
        blocked_connections, 1,
        "the pool opened more than NEXO_DB_POOL_MAX"
    );
    assert!(
        held_for >= Duration::from_secs(3) && held_for < Duration::from_secs(6),
        "request timeout: {held_for:?}"
    );
    assert!(
        starved_for >= Duration::from_secs(1) && starved_for < Duration::from_secs(3),
        "acquire timeout: {starved_for:?}"
    );

    // With the lock gone the service recovers by itself.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = get_with(&client, &server.url(&format!("/accounts/{A_USD}")), TOKEN_A).await;
        if reply.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery after the lock");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "limits from settings: 413 at 1,500 bytes with NEXO_BODY_LIMIT_BYTES=1024; 503 after \
         {held_for:?} (NEXO_REQUEST_TIMEOUT=3s) and {starved_for:?} (NEXO_DB_ACQUIRE_TIMEOUT=1s) \
         with one connection in use (NEXO_DB_POOL_MAX=1)"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_rate_limit_settings_reach_the_binary(pool: PgPool) {
    let server = ServerProcess::start(
        &database_url(&pool),
        &[
            ("NEXO_RATE_LIMIT_PER_SECOND", "1"),
            ("NEXO_RATE_LIMIT_BURST", "2"),
        ],
    )
    .await;
    let client = fault_client(Duration::from_secs(10));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let reply = get_with(&client, &server.url(&format!("/accounts/{A_USD}")), TOKEN_A).await;
        if reply.status == 429 {
            reply.assert_problem(429, "rate-limited");
            assert!(reply.header("retry-after").is_some());
        }
        statuses.push(reply.status);
    }
    // A burst of two, then throttled (a fourth request may find a token
    // refilled if the machine is slow).
    assert_eq!(statuses[..3], [200, 200, 429], "{statuses:?}");
}
