#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Webhooks: registered endpoints get every event their principal may see,
//! at least once, in the feed's order, signed, with the feed's own bodies;
//! failures, hangs and slow answers are retried with backoff and recorded;
//! an endpoint failing past the retry window is disabled and resumes when
//! enabled; redelivery of one event and of a range; two instances never
//! have two attempts of one endpoint in flight at once, nor the same
//! attempt twice; bad registrations are refused and create nothing.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::receiver::{Mode, Receiver};
use common::tls_front::TlsFront;
use common::*;
use nexo_transfers::webhooks::client::DeliveryClient;
use nexo_transfers::webhooks::worker::{self, Settings};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::oneshot;

/// The feed (and so delivery) holds an event back while any older
/// transaction of the shared database server runs.
const WITHIN: Duration = Duration::from_secs(60);

fn settings() -> Settings {
    Settings {
        interval: Duration::from_millis(50),
        timeout: Duration::from_millis(500),
        backoff_max: Duration::from_millis(200),
        retry_window: Duration::from_secs(3600),
        concurrency: 4,
    }
}

/// A delivery worker on the test's database, stopped when dropped.
struct Worker(Option<oneshot::Sender<()>>);

impl Worker {
    fn spawn(pool: &PgPool, settings: Settings) -> Self {
        Self::spawn_trusting(pool, settings, None)
    }

    /// With the certificates of `ca_file` trusted beside the public roots.
    fn spawn_trusting(pool: &PgPool, settings: Settings, ca_file: Option<&Path>) -> Self {
        let client = DeliveryClient::new(ca_file, settings.timeout).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(worker::run(pool.clone(), settings, client, async move {
            let _ = stopped.await;
        }));
        Self(Some(stop))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(stop) = self.0.take() {
            let _ = stop.send(());
        }
    }
}

async fn post(app: &TestApp, token: &str, path: &str, body: &Value) -> Reply {
    let response = app
        .client
        .post(app.url(path))
        .bearer_auth(token)
        .header("Content-Type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("sent");
    Reply::read(response).await
}

/// Registers `path` of the receiver for A and tells the receiver its
/// secret. Returns the endpoint as created.
async fn register(app: &TestApp, receiver: &Receiver, path: &str, types: &[&str]) -> Value {
    register_url(app, receiver, &receiver.url(path), path, types).await
}

/// As [`register`], with the receiver's `path` reached at `url`.
async fn register_url(
    app: &TestApp,
    receiver: &Receiver,
    url: &str,
    path: &str,
    types: &[&str],
) -> Value {
    let reply = post(
        app,
        TOKEN_A,
        "/webhook-endpoints",
        &json!({"url": url, "event_types": types}),
    )
    .await;
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let endpoint = reply.json();
    let secret = endpoint["secret"].as_str().expect("secret shown once");
    assert!(secret.starts_with("whsec_"));
    receiver.set_secret(path, &[secret]);
    endpoint
}

async fn transfers(app: &TestApp, n: usize) {
    for _ in 0..n {
        let reply = app
            .post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
            .await;
        assert_eq!(reply.status, 201);
    }
}

/// The feed's events for A after `cursor`, once the `n` transfers of the
/// test are among them. Events of the fixtures may come first: an endpoint
/// starts at the database server's horizon, which another test's open
/// transaction may hold back.
async fn feed_after(app: &TestApp, cursor: &str, n: usize) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let page = app
            .get(TOKEN_A, &format!("/events?after={cursor}&limit=1000"))
            .await
            .json();
        let events = page["events"].as_array().cloned().unwrap_or_default();
        let ours = events
            .iter()
            .filter(|e| e["type"] == "transfer.posted" && e["resource"]["amount_minor"] == 100)
            .count();
        if ours >= n {
            return events;
        }
        assert!(started.elapsed() < WITHIN, "the feed shows {events:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `done` holds for what the receiver saw on `path`.
async fn until(
    receiver: &Receiver,
    path: &str,
    what: &str,
    done: impl Fn(&[common::receiver::Delivery]) -> bool,
) {
    let started = Instant::now();
    loop {
        let seen = receiver.deliveries(path);
        if done(&seen) {
            return;
        }
        assert!(
            started.elapsed() < WITHIN,
            "{what}: the receiver saw {seen:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn delivered_ids(seen: &[common::receiver::Delivery]) -> Vec<String> {
    let mut ids = Vec::new();
    for d in seen.iter().filter(|d| d.answered == 200) {
        if !ids.contains(&d.event_id) {
            ids.push(d.event_id.clone());
        }
    }
    ids
}

fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn shown(app: &TestApp, id: &str) -> Value {
    let reply = app.get(TOKEN_A, &format!("/webhook-endpoints/{id}")).await;
    assert_eq!(reply.status, 200);
    reply.json()
}

async fn attempts(app: &TestApp, id: &str) -> Vec<Value> {
    let reply = app
        .get(
            TOKEN_A,
            &format!("/webhook-endpoints/{id}/attempts?limit=200"),
        )
        .await;
    assert_eq!(reply.status, 200);
    reply.json()["attempts"].as_array().cloned().unwrap()
}

#[sqlx::test]
async fn every_event_is_delivered_once_in_feed_order_signed_with_the_feeds_body(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/a", &[]).await;
    let _worker = Worker::spawn(&pool, settings());
    transfers(&app, 8).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 8).await;

    until(&receiver, "/a", "all delivered", |seen| {
        seen.len() >= feed.len()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = receiver.deliveries("/a");
    assert_eq!(seen.len(), feed.len(), "each event once: {seen:#?}");
    assert!(seen.iter().all(|d| d.signature_ok && d.attempt == 1));
    let bodies: Vec<Value> = seen.iter().map(|d| d.body.clone()).collect();
    assert_eq!(bodies, feed, "the feed's events, in the feed's order");
    assert_eq!(
        seen.iter().map(|d| d.event_id.clone()).collect::<Vec<_>>(),
        ids(&feed)
    );
    assert_eq!(receiver.max_in_flight("/a"), 1);
    let shown = shown(&app, endpoint["id"].as_str().unwrap()).await;
    let (cursor, last) = (
        shown["cursor"].as_str().unwrap(),
        feed[feed.len() - 1]["cursor"].as_str().unwrap(),
    );
    assert!(
        cursor >= last,
        "the cursor passed the last event: {cursor} < {last}"
    );
    assert!(
        shown.get("secret").is_none(),
        "the secret is shown only once"
    );
    assert_eq!(shown["last_attempt"]["outcome"], "delivered");
}

#[sqlx::test]
async fn https_endpoints_get_deliveries_over_tls_only_from_an_authority_trusted(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let front = TlsFront::start(receiver.addr).await;
    let endpoint = register_url(&app, &receiver, &front.url("/tls"), "/tls", &[]).await;
    let id = endpoint["id"].as_str().unwrap().to_owned();
    transfers(&app, 3).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 3).await;

    // The public roots alone do not vouch for the receiver's certificate.
    let untrusting = Worker::spawn(&pool, settings());
    let started = Instant::now();
    let refused = loop {
        let tried = attempts(&app, &id).await;
        if tried.iter().any(|a| a["finished_at"].is_string()) {
            break tried;
        }
        assert!(started.elapsed() < WITHIN, "no attempt: {tried:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(untrusting);
    let finished: Vec<&Value> = refused
        .iter()
        .filter(|a| a["finished_at"].is_string())
        .collect();
    assert!(
        finished.iter().all(|a| a["outcome"] == "connect_error"
            && a["error"]
                .as_str()
                .is_some_and(|e| e.contains("UnknownIssuer"))),
        "{finished:#?}"
    );
    assert!(front.refused() >= 1, "the handshake was tried and failed");
    assert_eq!(front.handshakes(), 0);
    assert!(
        receiver.deliveries("/tls").is_empty(),
        "nothing went past the TLS front"
    );

    // With the authority trusted (NEXO_WEBHOOK_CA_FILE), every event
    // arrives, through the TLS front only.
    let _worker = Worker::spawn_trusting(&pool, settings(), Some(&front.ca_file));
    until(&receiver, "/tls", "all delivered over TLS", |seen| {
        delivered_ids(seen).len() >= feed.len()
    })
    .await;
    let seen = receiver.deliveries("/tls");
    assert!(seen.iter().all(|d| d.signature_ok));
    assert_eq!(delivered_ids(&seen), ids(&feed));
    assert!(
        front.handshakes() >= seen.len(),
        "the receiver closes each connection, so each delivery had a handshake of its own: {} for {}",
        front.handshakes(),
        seen.len()
    );
}

#[sqlx::test]
async fn failures_and_hangs_are_retried_until_every_event_is_delivered_in_order(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/flaky", &[]).await;
    let id = endpoint["id"].as_str().unwrap().to_owned();
    receiver.set_mode("/flaky", Mode::Fail);
    let _worker = Worker::spawn(&pool, settings());
    transfers(&app, 4).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 4).await;

    until(&receiver, "/flaky", "failures", |seen| seen.len() >= 3).await;
    receiver.set_mode("/flaky", Mode::Hang);
    until(&receiver, "/flaky", "a hang", |seen| {
        seen.iter().any(|d| d.answered == 0)
    })
    .await;
    receiver.set_mode("/flaky", Mode::Slow(Duration::from_millis(100)));
    until(&receiver, "/flaky", "all delivered", |seen| {
        delivered_ids(seen).len() >= feed.len()
    })
    .await;

    let seen = receiver.deliveries("/flaky");
    assert!(seen.iter().any(|d| d.answered == 500), "a failure happened");
    assert_eq!(delivered_ids(&seen), ids(&feed), "in the feed's order");
    assert!(seen.iter().all(|d| d.signature_ok));
    assert!(seen.iter().any(|d| d.attempt > 1), "retries are numbered");
    assert_eq!(receiver.max_in_flight("/flaky"), 1);
    let recorded = attempts(&app, &id).await;
    let outcomes: HashSet<&str> = recorded
        .iter()
        .filter_map(|a| a["outcome"].as_str())
        .collect();
    for outcome in ["http_error", "timeout", "delivered"] {
        assert!(
            outcomes.contains(outcome),
            "{outcome} recorded: {recorded:#?}"
        );
    }
    let shown = self::shown(&app, &id).await;
    assert_eq!(shown["status"], "enabled");
    assert_eq!(shown["consecutive_failures"], 0);
}

#[sqlx::test]
async fn an_endpoint_failing_past_the_retry_window_is_disabled_and_enabling_resumes(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/down", &[]).await;
    let id = endpoint["id"].as_str().unwrap().to_owned();
    // Another endpoint of the owner, for the notice alone.
    register(&app, &receiver, "/watch", &["webhook_endpoint.disabled"]).await;
    receiver.set_mode("/down", Mode::Fail);
    let before = app.metrics().await;
    let _worker = Worker::spawn(
        &pool,
        Settings {
            retry_window: Duration::from_millis(300),
            ..settings()
        },
    );
    transfers(&app, 2).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 2).await;

    let started = Instant::now();
    let disabled = loop {
        let shown = self::shown(&app, &id).await;
        if shown["status"] == "disabled" {
            break shown;
        }
        assert!(started.elapsed() < WITHIN, "never disabled: {shown}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        disabled["disabled_reason"]
            .as_str()
            .is_some_and(|r| r.contains(feed[0]["id"].as_str().unwrap()))
    );
    assert!(disabled["disabled_at"].is_string());
    assert!(disabled["consecutive_failures"].as_i64().unwrap() >= 2);
    assert!(
        receiver
            .deliveries("/down")
            .iter()
            .all(|d| d.answered == 500),
        "only failures before it was disabled"
    );
    assert!(
        app.metrics()
            .await
            .delta(&before, "nexo_webhook_endpoints_disabled_total", &[])
            >= 1.0
    );
    let tried = receiver.deliveries("/down").len();

    // The feed says so, with the endpoint as it was disabled, in the
    // transaction that disabled it; the owner's other endpoint gets it.
    let last_transfer = feed[feed.len() - 1]["cursor"].as_str().unwrap();
    let started = Instant::now();
    let notice = loop {
        let page = app
            .get(
                TOKEN_A,
                &format!("/events?after={last_transfer}&limit=1000"),
            )
            .await
            .json();
        let found = page["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| {
                e["type"] == "webhook_endpoint.disabled" && e["resource"]["id"] == id.as_str()
            })
            .cloned();
        if let Some(notice) = found {
            break notice;
        }
        assert!(started.elapsed() < WITHIN, "no notice in the feed: {page}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(notice["resource"]["status"], "disabled");
    assert_eq!(
        notice["resource"]["disabled_reason"],
        disabled["disabled_reason"]
    );
    assert_eq!(notice["resource"]["disabled_at"], disabled["disabled_at"]);
    assert_eq!(notice["occurred_at"], disabled["disabled_at"]);
    assert!(notice["resource"].get("secret").is_none());
    assert_eq!(notice["sequences"], json!({}), "it moved no account");
    let notice_id = notice["id"].as_str().unwrap().to_owned();
    until(&receiver, "/watch", "the notice delivered", |seen| {
        delivered_ids(seen) == [notice_id.clone()]
    })
    .await;
    assert!(receiver.deliveries("/watch").iter().all(|d| d.signature_ok));
    assert_eq!(
        app.get(TOKEN_B, "/events?limit=1000").await.json()["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["id"] == notice["id"])
            .count(),
        0,
        "another principal does not see it"
    );
    assert_reconciles(&pool).await;

    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        receiver.deliveries("/down").len(),
        tried,
        "a disabled endpoint gets nothing"
    );

    receiver.set_mode("/down", Mode::Ok);
    let reply = post(
        &app,
        TOKEN_A,
        &format!("/webhook-endpoints/{id}/enable"),
        &json!({}),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["status"], "enabled");
    // Resumed where it stopped: the events it missed, then the notice
    // of its own disabling (it asked for every type).
    let mut missed = ids(&feed);
    missed.push(notice_id);
    until(&receiver, "/down", "resumed", |seen| {
        delivered_ids(seen).len() >= missed.len()
    })
    .await;
    assert_eq!(delivered_ids(&receiver.deliveries("/down")), missed);
}

#[sqlx::test]
async fn one_event_and_a_range_are_redelivered_on_request(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/r", &[]).await;
    let id = endpoint["id"].as_str().unwrap().to_owned();
    let _worker = Worker::spawn(&pool, settings());
    transfers(&app, 3).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 3).await;
    let m = feed.len();
    until(&receiver, "/r", "delivered", |seen| seen.len() >= m).await;

    let path = format!("/webhook-endpoints/{id}/redeliver");
    let reply = post(&app, TOKEN_A, &path, &json!({"event_id": feed[1]["id"]})).await;
    assert_eq!(
        reply.status,
        202,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    until(&receiver, "/r", "one redelivered", |seen| seen.len() > m).await;
    let again = &receiver.deliveries("/r")[m];
    assert_eq!(again.event_id, feed[1]["id"].as_str().unwrap());
    assert_eq!(again.attempt, 2, "a redelivery is the event's next attempt");
    assert!(again.signature_ok);

    let reply = post(&app, TOKEN_A, &path, &json!({"after": feed[0]["cursor"]})).await;
    assert_eq!(reply.status, 202);
    until(&receiver, "/r", "the range redelivered", |seen| {
        seen.len() >= 6
    })
    .await;
    let range: Vec<String> = receiver.deliveries("/r")[4..]
        .iter()
        .map(|d| d.event_id.clone())
        .collect();
    assert_eq!(range, ids(&feed[1..]));

    // Neither an unknown event, nor a bad cursor, nor both at once.
    let unknown = json!({"event_id": uuid::Uuid::new_v4()});
    post(&app, TOKEN_A, &path, &unknown)
        .await
        .assert_problem(422, "invalid-redelivery");
    post(&app, TOKEN_A, &path, &json!({"after": "x1"}))
        .await
        .assert_problem(400, "invalid-event-cursor");
    post(&app, TOKEN_A, &path, &json!({}))
        .await
        .assert_problem(422, "invalid-redelivery");
    // Another principal's endpoint is not found.
    post(&app, TOKEN_B, &path, &json!({"event_id": feed[1]["id"]}))
        .await
        .assert_problem(404, "not-found");
}

#[sqlx::test]
async fn two_instances_never_overlap_attempts_of_one_endpoint_nor_repeat_one(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let paths = ["/one", "/two"];
    for path in paths {
        register(&app, &receiver, path, &[]).await;
        receiver.set_mode(path, Mode::Slow(Duration::from_millis(30)));
    }
    let fast = Settings {
        interval: Duration::from_millis(10),
        ..settings()
    };
    // Some failures first, so attempts are numbered past 1.
    receiver.set_mode("/two", Mode::Fail);
    let _first = Worker::spawn(&pool, fast);
    let _second = Worker::spawn(&pool, fast);
    transfers(&app, 12).await;
    until(&receiver, "/two", "a failure", |seen| {
        seen.iter().any(|d| d.answered == 500)
    })
    .await;
    receiver.set_mode("/two", Mode::Slow(Duration::from_millis(30)));
    for path in paths {
        until(&receiver, path, "all delivered", |seen| {
            delivered_ids(seen).len() >= 12
        })
        .await;
        let seen = receiver.deliveries(path);
        assert_eq!(
            receiver.max_in_flight(path),
            1,
            "{path}: one attempt in flight at a time"
        );
        let mut made = HashMap::new();
        for d in &seen {
            assert!(
                made.insert((d.event_id.clone(), d.attempt), d.at).is_none(),
                "{path}: attempt {} of {} made twice",
                d.attempt,
                d.event_id
            );
        }
    }
    assert!(
        receiver
            .deliveries("/two")
            .iter()
            .any(|d| d.answered == 500),
        "the second endpoint really failed"
    );
}

#[sqlx::test]
async fn bad_registrations_are_refused_and_create_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let create = |body: Value| {
        let app = &app;
        async move { post(app, TOKEN_A, "/webhook-endpoints", &body).await }
    };
    for url in [
        "not a url",
        "ftp://example.com/",
        "https://u:p@example.com/",
        "",
    ] {
        create(json!({"url": url}))
            .await
            .assert_problem(422, "invalid-webhook-endpoint");
    }
    let long = format!("https://example.com/{}", "a".repeat(2_048));
    create(json!({"url": long}))
        .await
        .assert_problem(422, "invalid-webhook-endpoint");
    create(json!({"url": "https://example.com/", "event_types": ["transfer.created"]}))
        .await
        .assert_problem(422, "invalid-webhook-endpoint");
    create(json!({"url": "https://example.com/", "secret": "mine"}))
        .await
        .assert_problem(400, "malformed-request");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_endpoints").await,
        0
    );

    let first = create(json!({"url": "https://example.com/0"})).await;
    assert_eq!(first.status, 201);
    let duplicate = create(json!({"url": "https://example.com/0"})).await;
    duplicate.assert_problem(409, "webhook-endpoint-exists");
    let existing = first.json()["id"].as_str().unwrap().to_owned();
    assert!(
        duplicate.json()["detail"]
            .as_str()
            .unwrap()
            .contains(&existing)
    );
    for n in 1..10 {
        let reply = create(json!({"url": format!("https://example.com/{n}")})).await;
        assert_eq!(reply.status, 201);
    }
    create(json!({"url": "https://example.com/10"}))
        .await
        .assert_problem(422, "too-many-webhook-endpoints");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_endpoints").await,
        10
    );

    // Another principal neither sees nor touches them.
    let listed = app.get(TOKEN_B, "/webhook-endpoints").await.json();
    assert_eq!(listed["webhook_endpoints"], json!([]));
    app.get(TOKEN_B, &format!("/webhook-endpoints/{existing}"))
        .await
        .assert_problem(404, "not-found");
    let listed = app.get(TOKEN_A, "/webhook-endpoints").await.json();
    assert_eq!(listed["webhook_endpoints"].as_array().unwrap().len(), 10);
    assert!(listed["webhook_endpoints"][0].get("secret").is_none());

    // Rotation shows the new secret once; deletion removes the endpoint.
    let rotated = post(
        &app,
        TOKEN_A,
        &format!("/webhook-endpoints/{existing}/rotate-secret"),
        &json!({}),
    )
    .await;
    assert_eq!(rotated.status, 200);
    assert_ne!(rotated.json()["secret"], first.json()["secret"]);
    let response = app
        .client
        .delete(app.url(&format!("/webhook-endpoints/{existing}")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    app.get(TOKEN_A, &format!("/webhook-endpoints/{existing}"))
        .await
        .assert_problem(404, "not-found");
}

#[sqlx::test]
async fn a_receiver_down_for_a_minute_gets_every_event_once_it_is_back(pool: PgPool) {
    const DOWN_FOR: Duration = Duration::from_secs(60);
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/gone", &[]).await;
    let id = endpoint["id"].as_str().unwrap().to_owned();
    receiver.go_down();
    let _worker = Worker::spawn(&pool, settings());
    transfers(&app, 3).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 3).await;

    tokio::time::sleep(DOWN_FOR).await;
    assert!(
        receiver.deliveries("/gone").is_empty(),
        "nothing reached it"
    );
    let refused = attempts(&app, &id)
        .await
        .iter()
        .filter(|a| a["outcome"] == "connect_error")
        .count();
    assert!(
        refused >= 10,
        "it was retried all along: {refused} attempts"
    );
    assert_eq!(shown(&app, &id).await["status"], "enabled");

    receiver.come_back().await;
    until(&receiver, "/gone", "all delivered", |seen| {
        delivered_ids(seen).len() >= feed.len()
    })
    .await;
    let seen = receiver.deliveries("/gone");
    assert_eq!(delivered_ids(&seen), ids(&feed));
    assert!(seen.iter().all(|d| d.signature_ok));
    assert!(
        seen[0].attempt > 1,
        "the first event's earlier attempts were refused"
    );
}

/// The real binary, killed with SIGKILL while a delivery is in flight and
/// started again on the same database: every event still arrives, in
/// order, once the lease of the dead instance has run out.
#[sqlx::test]
async fn sigkill_mid_delivery_then_restart_still_delivers_every_event(pool: PgPool) {
    use common::process::{ServerProcess, database_url};
    const KILLS: usize = 2;
    let url = database_url(&pool);
    let env = [
        ("NEXO_WEBHOOK_INTERVAL", "50ms"),
        ("NEXO_WEBHOOK_TIMEOUT", "1s"),
        ("NEXO_WEBHOOK_BACKOFF_MAX", "200ms"),
    ];
    let mut server = ServerProcess::start(&url, &env).await;
    let client = reqwest::Client::new();
    let receiver = Receiver::start().await;
    receiver.set_mode("/k", Mode::Slow(Duration::from_millis(300)));
    let created = client
        .post(server.url("/webhook-endpoints"))
        .bearer_auth(TOKEN_A)
        .json(&json!({"url": receiver.url("/k")}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let endpoint: Value = created.json().await.unwrap();
    receiver.set_secret("/k", &[endpoint["secret"].as_str().unwrap()]);
    for _ in 0..6 {
        let reply = client
            .post(server.url("/transfers"))
            .bearer_auth(TOKEN_A)
            .header("Idempotency-Key", new_key())
            .json(&transfer(A_USD, B_USD, 100, "USD"))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 201);
    }

    for kill in 0..KILLS {
        let before = receiver.deliveries("/k").len();
        until(&receiver, "/k", "a delivery in flight", |seen| {
            seen.len() > before
        })
        .await;
        server.kill().await;
        server = ServerProcess::start(&url, &env).await;
        if kill + 1 == KILLS {
            receiver.set_mode("/k", Mode::Ok);
        }
    }
    let cursor = endpoint["cursor"].as_str().unwrap();
    let page: Value = client
        .get(server.url(&format!("/events?after={cursor}&limit=1000")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let feed = page["events"].as_array().cloned().unwrap();
    assert!(feed.len() >= 6, "{page}");
    until(&receiver, "/k", "all delivered", |seen| {
        delivered_ids(seen).len() >= feed.len()
    })
    .await;
    let seen = receiver.deliveries("/k");
    assert_eq!(delivered_ids(&seen), ids(&feed), "in the feed's order");
    assert!(seen.iter().all(|d| d.signature_ok));
    assert_eq!(receiver.max_in_flight("/k"), 1);
    server.kill().await;
}

/// The purge keeps what an enabled endpoint has not had yet, whatever its
/// age, and deletes it once delivered (the endpoint's cursor then moves to
/// the horizon, so a caught-up endpoint holds nothing back).
#[sqlx::test]
async fn the_purge_keeps_events_an_enabled_endpoint_has_not_had_yet(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let receiver = Receiver::start().await;
    let endpoint = register(&app, &receiver, "/slow", &[]).await;
    receiver.set_mode("/slow", Mode::Fail);
    let _worker = Worker::spawn(&pool, settings());
    transfers(&app, 3).await;
    let feed = feed_after(&app, endpoint["cursor"].as_str().unwrap(), 3).await;
    until(&receiver, "/slow", "a failure", |seen| !seen.is_empty()).await;
    let ours = ids(&feed);
    let kept = |pool: PgPool, ours: Vec<String>| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events WHERE id::text = ANY($1)")
            .bind(ours)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    sqlx::query("UPDATE events SET occurred_at = occurred_at - interval '2 days'")
        .execute(&pool)
        .await
        .unwrap();
    let retention = Duration::from_secs(24 * 3600);
    nexo_transfers::cli::purge_events(&pool, retention, 1_000)
        .await
        .unwrap();
    // Every event after the endpoint's starting cursor: the three
    // transfers', and any older one that was not yet visible when it was
    // registered.
    assert_eq!(
        kept(pool.clone(), ours.clone()).await,
        i64::try_from(ours.len()).unwrap(),
        "kept while undelivered"
    );

    receiver.set_mode("/slow", Mode::Ok);
    until(&receiver, "/slow", "all delivered", |seen| {
        delivered_ids(seen).len() >= feed.len()
    })
    .await;
    let started = Instant::now();
    loop {
        nexo_transfers::cli::purge_events(&pool, retention, 1_000)
            .await
            .unwrap();
        if kept(pool.clone(), ours.clone()).await == 0 {
            break;
        }
        assert!(
            started.elapsed() < WITHIN,
            "delivered events are purged in the end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(scalar(&pool, "SELECT count(*) FROM webhook_attempts").await > 0);
    sqlx::query("UPDATE webhook_attempts SET started_at = started_at - interval '2 days'")
        .execute(&pool)
        .await
        .unwrap();
    nexo_transfers::cli::purge_events(&pool, retention, 1_000)
        .await
        .unwrap();
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_attempts").await,
        0,
        "attempts go with the retention too"
    );
}
