#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `GET /transfers`: the caller's transfers (either side), newest first, in
//! keyset pages that stay stable while transfers are added; filters; and
//! nothing of another principal's.
mod common;

use common::*;
use serde_json::Value;

const AMOUNT: i64 = 700;

async fn send(app: &TestApp, token: &str, from: &str, to: &str) -> (String, String) {
    let key = new_key();
    let reply = app
        .post_transfer(token, &key, &transfer(from, to, AMOUNT, "USD"))
        .await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    (
        key,
        reply.json()["transfer_id"].as_str().unwrap().to_owned(),
    )
}

fn ids(page: &Value) -> Vec<String> {
    page["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["transfer_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every page of `path`, following `next_cursor`.
async fn all_pages(app: &TestApp, token: &str, path: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let mut next = path.to_owned();
    loop {
        let reply = app.get(token, &next).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let page = reply.json();
        seen.extend(ids(&page));
        match page["next_cursor"].as_str() {
            Some(cursor) => next = format!("{path}&cursor={cursor}"),
            None => return seen,
        }
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn both_sides_see_a_transfer_newest_first_in_pages_that_skip_and_repeat_nothing(
    pool: sqlx::PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let mut sent = Vec::new();
    for _ in 0..7 {
        sent.push(send(&app, TOKEN_A, A_USD, B_USD).await.1);
    }
    sent.reverse();
    assert_eq!(
        all_pages(&app, TOKEN_B, "/transfers?limit=3").await,
        sent,
        "the receiver sees them"
    );
    // The sender sees them too, before the two older opening deposits that
    // credited its demo accounts.
    let sender = all_pages(&app, TOKEN_A, "/transfers?limit=3").await;
    assert_eq!(sender[..7], sent);
    assert_eq!(sender.len(), 9);
    let first = app.get(TOKEN_A, "/transfers?limit=3").await.json();
    assert_eq!(first["transfers"][0]["amount_minor"], AMOUNT);
    assert_eq!(first["transfers"][0]["from"], A_USD);
    assert!(first["transfers"][0]["receipt"]["receipt_id"].is_string());
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn pages_stay_stable_while_transfers_are_added(pool: sqlx::PgPool) {
    let app = TestApp::spawn(pool).await;
    let mut before = Vec::new();
    for _ in 0..6 {
        before.push(send(&app, TOKEN_A, A_USD, B_USD).await.1);
    }
    before.reverse();
    let first = app.get(TOKEN_B, "/transfers?limit=3").await.json();
    assert_eq!(ids(&first), before[..3]);
    let cursor = first["next_cursor"].as_str().unwrap().to_owned();
    // Inserted between the two pages, concurrently.
    let added = futures::future::join_all((0..5).map(|_| send(&app, TOKEN_A, A_USD, B_USD))).await;
    let second = app
        .get(TOKEN_B, &format!("/transfers?limit=3&cursor={cursor}"))
        .await
        .json();
    assert_eq!(ids(&second), before[3..], "the older page is unchanged");
    assert_eq!(second["next_cursor"], Value::Null);
    let newest = all_pages(&app, TOKEN_B, "/transfers?limit=50").await;
    assert_eq!(newest.len(), 11);
    for (_, id) in &added {
        assert!(newest[..5].contains(id), "the new ones come first");
    }
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn filters_narrow_the_list_and_never_widen_it(pool: sqlx::PgPool) {
    let app = TestApp::spawn(pool).await;
    let (key, id) = send(&app, TOKEN_A, A_USD, B_USD).await;
    let later = send(&app, TOKEN_A, A_USD, B_USD).await.1;
    let by_key = app
        .get(TOKEN_A, &format!("/transfers?idempotency_key={key}"))
        .await
        .json();
    assert_eq!(ids(&by_key), std::slice::from_ref(&id));
    // The key is the sender's: the receiver has no transfer under it.
    let receiver = app
        .get(TOKEN_B, &format!("/transfers?idempotency_key={key}"))
        .await
        .json();
    assert!(ids(&receiver).is_empty());
    let by_account = app
        .get(TOKEN_B, &format!("/transfers?account={B_USD}"))
        .await
        .json();
    assert_eq!(ids(&by_account), [later.clone(), id.clone()]);
    assert!(
        ids(&app
            .get(TOKEN_B, &format!("/transfers?account={B_EUR}"))
            .await
            .json())
        .is_empty()
    );
    app.get(TOKEN_B, &format!("/transfers?account={A_USD}"))
        .await
        .assert_problem(404, "not-found");
    let created_at = by_key["transfers"][0]["created_at"]
        .as_str()
        .unwrap()
        .to_owned();
    let after = app
        .get(TOKEN_A, &format!("/transfers?created_after={created_at}"))
        .await
        .json();
    assert_eq!(ids(&after), [later]);
    let before = app
        .get(TOKEN_A, &format!("/transfers?created_before={created_at}"))
        .await
        .json();
    assert!(!ids(&before).contains(&id), "strictly before");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn another_principal_s_transfers_are_never_listed(pool: sqlx::PgPool) {
    use nexo_transfers::admin;
    let app = TestApp::spawn(pool).await;
    let c = admin::create_principal(&app.pool, "lister-c")
        .await
        .unwrap();
    for id in ["acc_listc1", "acc_listc2"] {
        admin::open_account(&app.pool, "lister-c", "USD", Some(id))
            .await
            .unwrap();
    }
    admin::deposit(&app.pool, "acc_listc1", 10_000, "listc-opening")
        .await
        .unwrap();
    let (_, theirs) = send(&app, &c.token, "acc_listc1", "acc_listc2").await;
    send(&app, TOKEN_A, A_USD, B_USD).await;
    for token in [TOKEN_A, TOKEN_B] {
        let listed = all_pages(&app, token, "/transfers?limit=200").await;
        assert!(!listed.contains(&theirs));
    }
    assert_eq!(
        all_pages(&app, TOKEN_B, "/transfers?limit=200").await.len(),
        1
    );
    // The deposit that funded C's first account, and C's own transfer.
    let own = all_pages(&app, &c.token, "/transfers?limit=200").await;
    assert_eq!(own.len(), 2);
    assert_eq!(own[0], theirs);
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn malformed_queries_are_refused_with_a_problem(pool: sqlx::PgPool) {
    let app = TestApp::spawn(pool).await;
    for query in [
        "limit=0",
        "limit=201",
        "limit=ten",
        "cursor=e42",
        "cursor=tnothex",
        "created_after=yesterday",
        "created_before=2026-11-30",
        "idempotency_key=%22unterminated",
        "colour=blue",
    ] {
        app.get(TOKEN_A, &format!("/transfers?{query}"))
            .await
            .assert_problem(400, "invalid-query");
    }
    app.get("tok_nobody", "/transfers")
        .await
        .assert_problem(401, "unauthorized");
}

/// Holds are listed in every status beside the transfers, each exactly as
/// `GET /transfers/{id}` shows it (a posted hold once, with its hold and
/// receipt), in the same newest-first pages; the key filter finds a hold
/// by the key that made it and by the one that posted it.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn holds_in_every_status_are_listed_as_they_are_shown(pool: sqlx::PgPool) {
    let app = TestApp::spawn(pool).await;
    let make_hold = async |amount: i64| {
        let key = new_key();
        let mut body = transfer(A_USD, B_USD, amount, "USD");
        body["mode"] = "pending".into();
        let reply = app.post_transfer(TOKEN_A, &key, &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        (
            key,
            reply.json()["transfer_id"].as_str().unwrap().to_owned(),
        )
    };
    let (_, before) = send(&app, TOKEN_A, A_USD, B_USD).await;
    let (_, pending) = make_hold(100).await;
    let (_, voided) = make_hold(200).await;
    let (posted_key, posted) = make_hold(300).await;
    let (_, after) = send(&app, TOKEN_A, A_USD, B_USD).await;
    let void = app
        .post_json(
            TOKEN_A,
            &new_key(),
            &format!("/transfers/{voided}/void"),
            &serde_json::json!({}),
        )
        .await;
    assert_eq!(void.status, 200, "{:?}", void.body);
    let post_key = new_key();
    let post = app
        .post_json(
            TOKEN_A,
            &post_key,
            &format!("/transfers/{posted}/post"),
            &serde_json::json!({"amount_minor": 250}),
        )
        .await;
    assert_eq!(post.status, 200, "{:?}", post.body);

    let newest_first = [&after, &posted, &voided, &pending, &before];
    for token in [TOKEN_A, TOKEN_B] {
        let listed = all_pages(&app, token, "/transfers?limit=2").await;
        let ours: Vec<&String> = listed
            .iter()
            .filter(|id| newest_first.contains(id))
            .collect();
        assert_eq!(ours, newest_first, "one page walk, each once, newest first");
    }
    let page = app.get(TOKEN_A, "/transfers?limit=200").await.json();
    for id in newest_first {
        let listed = page["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["transfer_id"] == id.as_str())
            .unwrap();
        let shown = app.get(TOKEN_A, &format!("/transfers/{id}")).await.json();
        assert_eq!(listed, &shown, "{id} is listed as it is shown");
    }
    let status = |id: &str| {
        page["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["transfer_id"] == id)
            .map(|t| (t["status"].clone(), t["amount_minor"].clone()))
            .unwrap()
    };
    assert_eq!(status(&pending), ("pending".into(), 100.into()));
    assert_eq!(status(&voided), ("voided".into(), 200.into()));
    assert_eq!(status(&posted), ("posted".into(), 250.into()));

    for key in [&posted_key, &post_key] {
        let found = app
            .get(TOKEN_A, &format!("/transfers?idempotency_key={key}"))
            .await
            .json();
        assert_eq!(ids(&found), [posted.as_str()], "found by {key}");
    }
}
