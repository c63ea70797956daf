#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The transactional outbox and its pull feed: every change to the ledger
//! writes exactly its event in its own transaction, showing the resource as
//! the API did; a principal reads only the events of its accounts; a cursor
//! resumes exactly, also while a transaction that took an earlier position
//! is still open; long polls end when an event arrives, when their wait
//! ends and at shutdown; every account's events are numbered without gaps;
//! the reconciliation and the purge keep to all of it.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use nexo_transfers::ledger::events::Cursor;
use nexo_transfers::ledger::{AmountMinor, Currency, PostingKind, PostingRequest, repo};
use nexo_transfers::reconcile::{self, Check};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// How long a test waits for the feed to show what committed. The feed
/// holds an event back while any older transaction of the database server
/// runs, and the server is shared with every other test.
const VISIBLE_WITHIN: Duration = Duration::from_secs(30);

const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /events` with a query string.
async fn feed(app: &TestApp, token: &str, query: &str) -> Reply {
    app.get(token, &format!("/events?{query}")).await
}

/// Reads the feed from `after` until `done` holds for everything read, a
/// page of at most `limit` at a time. Returns what was read and the cursor
/// to continue from.
async fn read_until(
    app: &TestApp,
    token: &str,
    after: &str,
    limit: i64,
    done: impl Fn(&[Value]) -> bool,
) -> (Vec<Value>, String) {
    let deadline = Instant::now() + VISIBLE_WITHIN;
    let mut cursor = after.to_owned();
    let mut read = Vec::new();
    loop {
        let page = feed(app, token, &format!("after={cursor}&limit={limit}")).await;
        assert_eq!(page.status, 200, "{}", String::from_utf8_lossy(&page.body));
        let page = page.json();
        let events = page["events"].as_array().unwrap().clone();
        let empty = events.is_empty();
        read.extend(events);
        cursor = page["next_after"].as_str().unwrap().to_owned();
        if done(&read) {
            return (read, cursor);
        }
        assert!(
            Instant::now() < deadline,
            "the feed did not show what was expected within {VISIBLE_WITHIN:?}; read {read:#?}"
        );
        if empty {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What the principal of `token` reads from the start of the feed, once at
/// least `expected` events are there.
async fn read_all(app: &TestApp, token: &str, expected: usize) -> (Vec<Value>, String) {
    read_until(app, token, &Cursor::START.encode(), 1_000, |read| {
        read.len() >= expected
    })
    .await
}

/// The events of one transfer or hold, as stored, in feed order.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Stored {
    id: Uuid,
    position: i64,
    txid: i64,
    #[sqlx(rename = "type")]
    event_type: String,
    resource: Value,
    from_seq: i64,
    to_seq: Option<i64>,
}

async fn stored(pool: &PgPool, resource_id: &str) -> Vec<Stored> {
    sqlx::query_as(
        "SELECT id, position, txid::text::int8 AS txid, type, resource, from_seq, to_seq
         FROM events WHERE resource_id = $1::uuid ORDER BY txid, position",
    )
    .bind(resource_id)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn event_count(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT count(*) FROM events").await
}

/// The row a change wrote, whose xmin names the transaction that wrote it.
#[derive(Debug, Clone, Copy)]
enum Row {
    Transfer,
    Hold,
}

/// The one event of `event_type` about `resource_id`, checked to have been
/// written by the transaction that last wrote its `row`.
async fn the_event(pool: &PgPool, resource_id: &str, event_type: &str, row: Row) -> Stored {
    let events: Vec<Stored> = stored(pool, resource_id)
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type)
        .collect();
    assert_eq!(events.len(), 1, "{event_type} of {resource_id}: {events:?}");
    let sql = match row {
        Row::Transfer => {
            "SELECT xid(e.txid) = r.xmin FROM events e JOIN transfers r ON r.id = e.resource_id
             WHERE e.id = $1"
        }
        Row::Hold => {
            "SELECT xid(e.txid) = r.xmin FROM events e JOIN holds r ON r.id = e.resource_id
             WHERE e.id = $1"
        }
    };
    let same: bool = sqlx::query_scalar(sql)
        .bind(events[0].id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(
        same,
        "{event_type} of {resource_id} was written by another transaction than its change"
    );
    events.into_iter().next().unwrap()
}

async fn event_seq(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT event_seq FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn pending(from: &str, to: &str, amount_minor: i64, expires_in_seconds: i64) -> Value {
    let mut body = transfer(from, to, amount_minor, "USD");
    body["mode"] = json!("pending");
    body["expires_in_seconds"] = json!(expires_in_seconds);
    body
}

fn id_of(reply: &Reply) -> String {
    assert!(
        reply.status == 200 || reply.status == 201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()["transfer_id"].as_str().unwrap().to_owned()
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_change_to_the_ledger_writes_exactly_its_event_in_its_own_transaction(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let before_metrics = app.metrics().await;

    // A transfer: its event shows what its 201 showed, and numbers the
    // change on both accounts.
    let key = new_key();
    let body = transfer(A_USD, B_USD, 1_000, "USD");
    let created = app.post_transfer(TOKEN_A, &key, &body).await;
    let transfer_id = id_of(&created);
    let posted = the_event(&pool, &transfer_id, "transfer.posted", Row::Transfer).await;
    assert_eq!(posted.resource, created.json());
    assert_eq!(posted.from_seq, event_seq(&pool, A_USD).await);
    assert_eq!(posted.to_seq, Some(event_seq(&pool, B_USD).await));

    // A replay and a refusal write nothing.
    let count = event_count(&pool).await;
    let replay = app.post_transfer(TOKEN_A, &key, &body).await;
    assert!(replay.replayed());
    app.post_beyond_balance().await;
    assert_eq!(
        event_count(&pool).await,
        count,
        "a replay or a refusal wrote an event"
    );

    // A hold: created, then posted in part.
    let created = app
        .post_transfer(TOKEN_A, &new_key(), &pending(A_USD, B_USD, 3_000, 3600))
        .await;
    let hold = id_of(&created);
    let event = the_event(&pool, &hold, "hold.created", Row::Hold).await;
    assert_eq!(event.resource, created.json());
    assert_eq!(event.to_seq, None, "a hold does not move its destination");
    let posted = app
        .post_json(
            TOKEN_A,
            &new_key(),
            &format!("/transfers/{hold}/post"),
            &json!({"amount_minor": 2_000}),
        )
        .await;
    assert_eq!(posted.status, 200);
    let event = the_event(&pool, &hold, "hold.posted", Row::Hold).await;
    assert_eq!(event.resource, posted.json());
    the_event(&pool, &hold, "hold.posted", Row::Transfer).await;
    assert_eq!(
        stored(&pool, &hold).await.len(),
        2,
        "no transfer.posted besides the hold's post"
    );

    // A hold voided.
    let voided = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &pending(A_USD, B_USD, 500, 3600))
            .await,
    );
    let void = app
        .post_json(
            TOKEN_A,
            &new_key(),
            &format!("/transfers/{voided}/void"),
            &json!({}),
        )
        .await;
    assert_eq!(void.status, 200);
    assert_eq!(
        the_event(&pool, &voided, "hold.voided", Row::Hold)
            .await
            .resource,
        void.json()
    );

    // A hold expired by the expiry task, as GET shows it afterwards.
    let expiring = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &pending(A_USD, B_USD, 700, 1))
            .await,
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let expired = nexo_transfers::transfers::lifecycle::expire_due_holds(&pool, LOCK_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(expired, 1);
    let shown = app.get(TOKEN_A, &format!("/transfers/{expiring}")).await;
    assert_eq!(shown.json()["status"], "expired");
    assert_eq!(
        the_event(&pool, &expiring, "hold.expired", Row::Hold)
            .await
            .resource,
        shown.json()
    );

    // A reversal, by the destination's owner: the reversal's own transfer.
    let reversal = app
        .post_json(
            TOKEN_B,
            &new_key(),
            &format!("/transfers/{transfer_id}/reverse"),
            &json!({"amount_minor": 400}),
        )
        .await;
    let reversal_id = id_of(&reversal);
    let event = the_event(&pool, &reversal_id, "transfer.reversed", Row::Transfer).await;
    assert_eq!(event.resource, reversal.json());
    assert_eq!(event.resource["reverses"], transfer_id.as_str());

    // An atomic batch: one event per leg, each as the batch showed it.
    let batch = app
        .post_json(
            TOKEN_A,
            &new_key(),
            "/transfer-batches",
            &json!({"transfers": [
                transfer(A_USD, B_USD, 10, "USD"),
                transfer(A_EUR, B_EUR, 20, "EUR"),
            ]}),
        )
        .await;
    assert_eq!(
        batch.status,
        201,
        "{}",
        String::from_utf8_lossy(&batch.body)
    );
    for leg in batch.json()["transfers"].as_array().unwrap() {
        let id = leg["transfer_id"].as_str().unwrap();
        let event = the_event(&pool, id, "transfer.posted", Row::Transfer).await;
        assert_eq!(&event.resource, leg);
        assert!(event.resource["batch_id"].is_string());
    }

    // Two opening deposits of the demo fixtures, then each change above.
    let by_type: BTreeMap<String, i64> =
        sqlx::query_as("SELECT type, count(*) FROM events GROUP BY type")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let expected: BTreeMap<String, i64> = [
        ("transfer.posted", 2 + 1 + 2),
        ("transfer.reversed", 1),
        ("hold.created", 3),
        ("hold.posted", 1),
        ("hold.voided", 1),
        ("hold.expired", 1),
    ]
    .into_iter()
    .map(|(t, n)| (t.to_owned(), n))
    .collect();
    assert_eq!(by_type, expected);
    assert_ledger_consistent(&pool).await;

    // Counted once committed, by type (the recorder is shared with the
    // other tests of this binary, so at least these).
    let after_metrics = app.metrics().await;
    for (event_type, written) in [
        ("transfer.posted", 3.0),
        ("transfer.reversed", 1.0),
        ("hold.created", 3.0),
        ("hold.posted", 1.0),
        ("hold.voided", 1.0),
        ("hold.expired", 1.0),
    ] {
        let delta = after_metrics.delta(
            &before_metrics,
            "nexo_events_written_total",
            &[("type", event_type)],
        );
        assert!(delta >= written, "{event_type}: {delta}");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_principal_reads_the_events_of_its_own_accounts_and_nothing_else(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    nexo_transfers::admin::open_account(&pool, "demo-a", "USD", Some("acc_a2"))
        .await
        .unwrap();
    let carol = nexo_transfers::admin::create_principal(&pool, "carol")
        .await
        .unwrap();
    nexo_transfers::admin::open_account(&pool, "carol", "USD", Some("acc_carol"))
        .await
        .unwrap();
    nexo_transfers::admin::deposit(&pool, "acc_carol", 5_000, "carol-opening")
        .await
        .unwrap();

    let to_b = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
            .await,
    );
    let held_for_b = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &pending(A_USD, B_USD, 50, 3600))
            .await,
    );
    let own = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, "acc_a2", 10, "USD"))
            .await,
    );

    // A: its two opening deposits, the transfer to B, the hold, and the
    // transfer between its own accounts once.
    let (a_events, _) = read_all(&app, TOKEN_A, 5).await;
    let ids = |events: &[Value]| -> Vec<String> {
        events
            .iter()
            .map(|e| e["resource"]["transfer_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let a_ids = ids(&a_events);
    assert_eq!(a_ids.len(), 5, "{a_events:#?}");
    assert_eq!(&a_ids[2..], [to_b.clone(), held_for_b.clone(), own.clone()]);
    // B: what reached its account, and the hold that will.
    let (b_events, _) = read_all(&app, TOKEN_B, 2).await;
    assert_eq!(ids(&b_events), [to_b.clone(), held_for_b.clone()]);
    // Carol: her deposit only.
    let (carol_events, _) = read_all(&app, &carol.token, 1).await;
    assert_eq!(carol_events.len(), 1);
    assert_eq!(carol_events[0]["resource"]["to"], "acc_carol");
    for (token, expected) in [(TOKEN_A, 5), (TOKEN_B, 2), (carol.token.as_str(), 1)] {
        let everything = feed(&app, token, "limit=1000").await.json();
        assert_eq!(
            everything["events"].as_array().unwrap().len(),
            expected,
            "nothing else, ever"
        );
    }

    // Each side sees the numbers of its own accounts only.
    let numbers = |events: &[Value], id: &str| {
        events
            .iter()
            .find(|e| e["resource"]["transfer_id"] == id)
            .map(|e| e["sequences"].clone())
            .unwrap()
    };
    assert_eq!(
        numbers(&a_events, &to_b),
        json!({A_USD: event_seq(&pool, A_USD).await - 2})
    );
    assert_eq!(numbers(&b_events, &to_b), json!({B_USD: 1}));
    assert_eq!(
        numbers(&b_events, &held_for_b),
        json!({}),
        "a hold does not move its destination"
    );
    assert_eq!(
        numbers(&a_events, &own),
        json!({A_USD: event_seq(&pool, A_USD).await, "acc_a2": 1})
    );
    // What each reads is what the table says it may.
    for (token, principal_sql) in [
        (
            TOKEN_A,
            "SELECT principal_id FROM accounts WHERE id = 'acc_00001'",
        ),
        (
            TOKEN_B,
            "SELECT principal_id FROM accounts WHERE id = 'acc_00002'",
        ),
    ] {
        let principal: Uuid = sqlx::query_scalar(principal_sql)
            .fetch_one(&pool)
            .await
            .unwrap();
        let visible: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM events WHERE from_principal = $1 OR to_principal = $1
             ORDER BY txid, position",
        )
        .bind(principal)
        .fetch_all(&pool)
        .await
        .unwrap();
        let read: Vec<Uuid> = feed(&app, token, "limit=1000").await.json()["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["id"].as_str().unwrap().parse().unwrap())
            .collect();
        assert_eq!(read, visible);
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_consumer_following_next_after_sees_every_event_once_while_sixteen_writers_post(
    pool: PgPool,
) {
    const WRITERS: usize = 16;
    const TRANSFERS_EACH: usize = 13;
    let app = std::sync::Arc::new(TestApp::spawn(pool.clone()).await);
    let (_, start) = read_all(&app, TOKEN_B, 0).await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let app = std::sync::Arc::clone(&app);
            tokio::spawn(async move {
                for n in 0..TRANSFERS_EACH {
                    let body = if (w + n) % 2 == 0 {
                        transfer(A_USD, B_USD, 1 + n as i64, "USD")
                    } else {
                        transfer(A_EUR, B_EUR, 1 + n as i64, "EUR")
                    };
                    let key = new_key();
                    let reply = app
                        .post_json_until_final(TOKEN_A, &key, "/transfers", &body)
                        .await;
                    assert_eq!(
                        reply.status,
                        201,
                        "{}",
                        String::from_utf8_lossy(&reply.body)
                    );
                }
            })
        })
        .collect();
    let expected = WRITERS * TRANSFERS_EACH;
    // The consumer tails the feed in small pages with short long polls
    // while the writers post, each page continuing from the last one's
    // next_after, as a consumer that saves it after each page would.
    let reader = {
        let app = std::sync::Arc::clone(&app);
        tokio::spawn(async move {
            let deadline = Instant::now() + VISIBLE_WITHIN * 4;
            let (mut cursor, mut read) = (start, Vec::<Value>::new());
            let mut pages = 0;
            while read.len() < expected {
                assert!(
                    Instant::now() < deadline,
                    "read {} of {expected}",
                    read.len()
                );
                let page = feed(&app, TOKEN_B, &format!("after={cursor}&limit=7&wait=1")).await;
                assert_eq!(page.status, 200);
                let page = page.json();
                let events = page["events"].as_array().unwrap();
                let next = page["next_after"].as_str().unwrap().to_owned();
                match events.last() {
                    Some(last) => assert_eq!(last["cursor"], next.as_str()),
                    None => assert_eq!(next, cursor, "nothing new: the cursor stays"),
                }
                assert!(next >= cursor, "cursors only move forward");
                read.extend(events.iter().cloned());
                cursor = next;
                pages += 1;
            }
            (read, pages)
        })
    };
    for writer in writers {
        writer.await.unwrap();
    }
    let (read, pages) = reader.await.unwrap();
    assert!(pages > expected / 7, "{pages} pages");

    let read_ids: Vec<Uuid> = read
        .iter()
        .map(|e| e["id"].as_str().unwrap().parse().unwrap())
        .collect();
    let unique: HashSet<&Uuid> = read_ids.iter().collect();
    assert_eq!(unique.len(), read_ids.len(), "an event was read twice");
    let b_principal: Uuid = sqlx::query_scalar("SELECT principal_id FROM accounts WHERE id = $1")
        .bind(B_USD)
        .fetch_one(&pool)
        .await
        .unwrap();
    let in_table: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM events WHERE to_principal = $1 ORDER BY txid, position")
            .bind(b_principal)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(in_table.len(), expected);
    assert_eq!(read_ids, in_table, "every event once, in feed order");
    assert_ledger_consistent(&pool).await;
}

/// The case that makes a position alone unsafe as a cursor: a transaction
/// takes a position, another takes a later one and commits first. A reader
/// that moved past the later one would never see the earlier. The feed
/// shows neither until the earlier transaction ends, then both, in order.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_open_transaction_that_took_an_earlier_position_holds_later_events_back(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let (_, caught_up) = read_all(&app, TOKEN_A, 2).await;

    // A deposit to A's EUR account, left open.
    let eur = Currency::parse("EUR").unwrap();
    let mut open = pool.begin().await.unwrap();
    let deposit = PostingRequest {
        principal_id: None,
        idempotency_key: "held-open",
        fingerprint: &[7; 32],
        from: "sys_funding_eur",
        to: A_EUR,
        amount: AmountMinor::parse(300).unwrap(),
        currency: &eur,
        description: None,
        kind: PostingKind::Transfer,
    };
    repo::post_transfer(&mut open, &deposit).await.unwrap();
    let (early_position, early_txid): (i64, i64) = sqlx::query_as(
        "SELECT position, txid::text::int8 FROM events WHERE from_account = 'sys_funding_eur'
         ORDER BY position DESC LIMIT 1",
    )
    .fetch_one(&mut *open)
    .await
    .unwrap();

    // Meanwhile a transfer of A's commits, with a later position.
    let later = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
            .await,
    );
    let committed = stored(&pool, &later).await;
    assert_eq!(committed.len(), 1);
    assert!(
        committed[0].position > early_position && committed[0].txid > early_txid,
        "the situation: the open transaction took the earlier position and transaction id"
    );

    // Committed, yet not shown: the open transaction could still add an
    // event before it.
    for _ in 0..10 {
        let page = feed(&app, TOKEN_A, &format!("after={caught_up}"))
            .await
            .json();
        assert_eq!(
            page["events"],
            json!([]),
            "shown before the older transaction ended"
        );
        assert_eq!(page["next_after"], caught_up.as_str());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    open.commit().await.unwrap();
    let (read, _) = read_until(&app, TOKEN_A, &caught_up, 1_000, |read| read.len() >= 2).await;
    let order: Vec<&str> = read
        .iter()
        .map(|e| e["resource"]["to"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        [A_EUR, B_USD],
        "both, the earlier transaction's first"
    );
    assert_eq!(read[1]["resource"]["transfer_id"], later.as_str());
    assert_ledger_consistent(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_long_poll_answers_when_an_event_arrives_and_empty_when_its_wait_ends(pool: PgPool) {
    let app = std::sync::Arc::new(TestApp::spawn(pool.clone()).await);
    let (_, caught_up) = read_all(&app, TOKEN_B, 0).await;

    let poll = {
        let app = std::sync::Arc::clone(&app);
        let after = caught_up.clone();
        tokio::spawn(async move {
            let asked = Instant::now();
            let reply = feed(&app, TOKEN_B, &format!("after={after}&wait=25")).await;
            (reply, asked.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    let sent = Instant::now();
    let id = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
            .await,
    );
    let (reply, waited) = poll.await.unwrap();
    let answered_after_commit = sent.elapsed();
    assert_eq!(reply.status, 200);
    let page = reply.json();
    assert_eq!(page["events"][0]["resource"]["transfer_id"], id.as_str());
    assert!(
        waited >= Duration::from_millis(700),
        "it waited: {waited:?}"
    );
    assert!(
        answered_after_commit < Duration::from_secs(15),
        "answered as the event arrived, not at the end of the wait: {answered_after_commit:?}"
    );

    // Nothing new: the answer comes when the wait ends, empty, and the
    // cursor stays.
    let after = page["next_after"].as_str().unwrap().to_owned();
    let asked = Instant::now();
    let empty = feed(&app, TOKEN_B, &format!("after={after}&wait=1")).await;
    let waited = asked.elapsed();
    assert_eq!(empty.status, 200);
    assert_eq!(empty.json(), json!({"events": [], "next_after": after}));
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_long_poll_outlasts_the_request_timeout_and_ends_at_shutdown(pool: PgPool) {
    // A request timeout shorter than the wait: the wait still runs out.
    let http = nexo_transfers::config::HttpConfig {
        request_timeout: Duration::from_secs(1),
        ..default_http()
    };
    let app = TestApp::spawn_with(pool.clone(), default_policy(), http).await;
    let (_, caught_up) = read_all(&app, TOKEN_B, 0).await;
    let asked = Instant::now();
    let reply = feed(&app, TOKEN_B, &format!("after={caught_up}&wait=2")).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(asked.elapsed() >= Duration::from_secs(2));

    // A shutdown ends every wait at once, with what there is.
    let (client, url) = (
        app.client.clone(),
        app.url(&format!("/events?after={caught_up}&wait=30")),
    );
    let poll = tokio::spawn(async move {
        let reply = Reply::read(client.get(url).bearer_auth(TOKEN_B).send().await.unwrap()).await;
        (reply, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopping = Instant::now();
    drop(app);
    let (reply, answered) = poll.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["events"], json!([]));
    assert!(
        answered.duration_since(stopping) < Duration::from_secs(5),
        "the long poll held the shutdown: {:?}",
        answered.duration_since(stopping)
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn bad_cursors_limits_and_waits_are_refused_with_a_problem_and_change_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
        .await;
    let (events, balances) = (event_count(&pool).await, app.balance(A_USD).await);
    let good = Cursor {
        txid: 1,
        position: 1,
    }
    .encode();
    for (query, slug, param) in [
        ("after=", "invalid-event-cursor", "after"),
        ("after=abc", "invalid-event-cursor", "after"),
        ("after=e5", "invalid-event-cursor", "after"),
        (
            &*format!("after={}", good.to_uppercase()),
            "invalid-event-cursor",
            "after",
        ),
        (&*format!("after={good}0"), "invalid-event-cursor", "after"),
        (
            &*format!("after=x8{}", &good[2..]),
            "invalid-event-cursor",
            "after",
        ),
        ("limit=0", "invalid-query", "limit"),
        ("limit=1001", "invalid-query", "limit"),
        ("limit=ten", "invalid-query", "limit"),
        ("wait=-1", "invalid-query", "wait"),
        ("wait=31", "invalid-query", "wait"),
        ("wait=1.5", "invalid-query", "wait"),
    ] {
        let reply = feed(&app, TOKEN_A, query).await;
        reply.assert_problem(400, slug);
        assert_eq!(reply.json()["param"], param, "{query}");
    }
    feed(&app, TOKEN_A, "cursor=x")
        .await
        .assert_problem(400, "invalid-query");
    let unauthenticated =
        Reply::read(app.client.get(app.url("/events")).send().await.unwrap()).await;
    unauthenticated.assert_problem(401, "unauthorized");
    assert_eq!(event_count(&pool).await, events);
    assert_eq!(app.balance(A_USD).await, balances);
    let fine = feed(&app, TOKEN_A, &format!("after={good}&limit=1000&wait=0")).await;
    assert_eq!(fine.status, 200);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_hot_accounts_events_are_numbered_without_gaps_under_concurrency(pool: PgPool) {
    const WRITERS: usize = 16;
    let app = std::sync::Arc::new(TestApp::spawn(pool.clone()).await);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let app = std::sync::Arc::clone(&app);
            tokio::spawn(async move {
                for n in 0..8 {
                    let body = transfer(A_USD, B_USD, 1 + (w * 8 + n) as i64, "USD");
                    let reply = app
                        .post_json_until_final(TOKEN_A, &new_key(), "/transfers", &body)
                        .await;
                    assert_eq!(reply.status, 201);
                }
                let hold = app
                    .post_json_until_final(
                        TOKEN_A,
                        &new_key(),
                        "/transfers",
                        &pending(A_USD, B_USD, 5, 3600),
                    )
                    .await;
                let hold = id_of(&hold);
                let end = if w % 2 == 0 { "post" } else { "void" };
                let ended = app
                    .post_json_until_final(
                        TOKEN_A,
                        &new_key(),
                        &format!("/transfers/{hold}/{end}"),
                        &json!({}),
                    )
                    .await;
                assert_eq!(
                    ended.status,
                    200,
                    "{}",
                    String::from_utf8_lossy(&ended.body)
                );
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    for account in [A_USD, B_USD] {
        let numbers: Vec<i64> = sqlx::query_scalar(
            "SELECT CASE WHEN from_account = $1 THEN from_seq ELSE to_seq END
             FROM events
             WHERE from_account = $1 OR (to_account = $1 AND to_seq IS NOT NULL)
             ORDER BY position",
        )
        .bind(account)
        .fetch_all(&pool)
        .await
        .unwrap();
        let last = event_seq(&pool, account).await;
        assert_eq!(
            numbers,
            (1..=last).collect::<Vec<_>>(),
            "{account}: numbered 1 to {last} in the order the events were written"
        );
    }
    // A: its opening deposit, 8 transfers and a hold with its end per writer.
    assert_eq!(event_seq(&pool, A_USD).await, 1 + WRITERS as i64 * 10);
    // B: 8 transfers per writer, and the holds posted to it.
    assert_eq!(
        event_seq(&pool, B_USD).await,
        WRITERS as i64 * 8 + WRITERS as i64 / 2
    );
    assert_ledger_consistent(&pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_reconciliation_finds_a_change_without_its_event_and_an_event_without_its_change(
    pool: PgPool,
) {
    let app = TestApp::spawn(pool.clone()).await;
    let id = id_of(
        &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 100, "USD"))
            .await,
    );
    app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, 200, "USD"))
        .await;
    let healthy = reconcile::run_ledger_checks(&pool).await.unwrap();
    assert!(healthy.ok, "{healthy}");

    // The first transfer's event deleted: the transfer lacks it, and both
    // accounts' numbers have a gap.
    sqlx::query("DELETE FROM events WHERE resource_id = $1::uuid")
        .bind(&id)
        .execute(&pool)
        .await
        .unwrap();
    let broken = reconcile::run_ledger_checks(&pool).await.unwrap();
    assert_eq!(
        failing_checks(&broken),
        [(Check::LedgerEvents, 1), (Check::EventSequences, 2)],
        "{broken}"
    );
    let missing = &broken.check(Check::LedgerEvents).unwrap().discrepancies[0];
    assert_eq!(missing.ids["transfer_id"], id);
    assert_eq!(missing.ids["type"], "transfer.posted");
    assert_eq!(
        (missing.expected.as_str(), missing.found.as_str()),
        ("exactly one event", "0 events")
    );
    let gap = &broken.check(Check::EventSequences).unwrap().discrepancies;
    assert_eq!(gap[0].ids["account_id"], A_USD);

    // And an event of nothing that happened.
    sqlx::query(
        "INSERT INTO events (type, resource_id, resource, from_account, to_account, from_seq, to_seq)
         VALUES ('transfer.posted', gen_random_uuid(), '{}', $1, $2, 99, 99)",
    )
    .bind(A_USD)
    .bind(B_USD)
    .execute(&pool)
    .await
    .unwrap();
    let report = reconcile::run_ledger_checks(&pool).await.unwrap();
    let events = report.check(Check::LedgerEvents).unwrap();
    assert_eq!(events.discrepancies_total, 2, "{report}");
    assert!(
        events
            .discrepancies
            .iter()
            .any(|d| d.expected == "no event: the ledger holds no such change"),
        "{report}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_purge_deletes_the_oldest_events_past_their_retention_in_batches(pool: PgPool) {
    let app = TestApp::spawn(pool.clone()).await;
    let before_metrics = app.metrics().await;
    let mut ids = Vec::new();
    for amount in 1..=5 {
        ids.push(id_of(
            &app.post_transfer(TOKEN_A, &new_key(), &transfer(A_USD, B_USD, amount, "USD"))
                .await,
        ));
    }
    // The two opening deposits and the first three transfers happened two
    // days ago (their events and their rows).
    let old: Vec<Uuid> =
        sqlx::query_scalar("SELECT resource_id FROM events ORDER BY position LIMIT 5")
            .fetch_all(&pool)
            .await
            .unwrap();
    for sql in [
        "UPDATE events SET occurred_at = occurred_at - interval '2 days' WHERE resource_id = ANY($1)",
        "UPDATE transfers SET created_at = created_at - interval '2 days' WHERE id = ANY($1)",
    ] {
        sqlx::query(sql).bind(&old).execute(&pool).await.unwrap();
    }
    assert_eq!(old[4].to_string(), ids[2]);

    let purged = nexo_transfers::cli::purge_events(&pool, Duration::from_secs(24 * 3600), 2)
        .await
        .unwrap();
    assert_eq!(
        purged.deleted, 5,
        "in batches of two until the first event kept"
    );
    let left: Vec<String> =
        sqlx::query_scalar("SELECT resource_id::text FROM events ORDER BY position")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, ids[3..]);
    let oldest_kept: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT occurred_at FROM events ORDER BY position LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(purged.oldest, Some(oldest_kept));
    let through_is_newest_deleted: bool = sqlx::query_scalar(
        "SELECT through = (SELECT max(created_at) FROM transfers WHERE id = ANY($1)) FROM events_purged",
    )
    .bind(&old)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(through_is_newest_deleted);

    // The changes whose events were purged no longer need them; the rest
    // do, and every account's numbers still run without a gap.
    assert_ledger_consistent(&pool).await;
    let again = nexo_transfers::cli::purge_events(&pool, Duration::from_secs(24 * 3600), 2)
        .await
        .unwrap();
    assert_eq!(again.deleted, 0);
    let (read, _) = read_all(&app, TOKEN_A, 2).await;
    assert_eq!(read[0]["resource"]["transfer_id"], ids[3].as_str());

    let after_metrics = app.metrics().await;
    assert!(after_metrics.delta(&before_metrics, "nexo_events_purged_total", &[]) >= 5.0);
    assert!(after_metrics.has("nexo_events_oldest_timestamp_seconds"));
}
