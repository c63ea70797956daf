#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Reconciliation: the real binary's exit statuses on a healthy and on a
//! deliberately broken ledger, and each kind of discrepancy found, by id,
//! through the library.
mod common;

use std::time::Duration;

use common::*;
use nexo_transfers::reconcile::{self, Check, DISCREPANCIES_LISTED_MAX, Options, Report};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

const OPTIONS: Options = Options {
    key_ttl: Duration::from_secs(24 * 3600),
};

/// Some ordinary traffic: transfers, a replay, a rejection, a mismatch.
/// Returns the id of the first transfer.
async fn ordinary_traffic(app: &TestApp) -> Uuid {
    let key = new_key();
    let body = transfer(A_USD, B_USD, 1_500, "USD");
    let first = app.post_transfer(TOKEN_A, &key, &body).await;
    assert_eq!(first.status, 201);
    assert!(app.post_transfer(TOKEN_A, &key, &body).await.replayed());
    app.post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 9, "USD"))
        .await
        .assert_problem(422, "idempotency-key-reused");
    let eur = app
        .post_transfer(TOKEN_A, &new_key(), &transfer(A_EUR, B_EUR, 700, "EUR"))
        .await;
    assert_eq!(eur.status, 201);
    app.post_beyond_balance().await;
    first.json()["transfer_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

async fn reconcile(pool: &PgPool) -> Report {
    reconcile::run(pool, OPTIONS)
        .await
        .expect("reconciliation ran")
}

/// Breaks the ledger on purpose: one statement, bound to one value.
async fn tamper(pool: &PgPool, sql: &'static str, value: &str) {
    sqlx::query(sql)
        .bind(value)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Asserts that `check` is the only one failing, with one discrepancy,
/// and returns it.
#[track_caller]
fn sole_failure(report: &Report, check: Check) -> &reconcile::Discrepancy {
    assert_eq!(failing_checks(report), [(check, 1)], "{report}");
    only_discrepancy(report, check)
}

#[track_caller]
fn only_discrepancy(report: &Report, check: Check) -> &reconcile::Discrepancy {
    let found = report.check(check).expect("the check ran");
    assert_eq!(found.discrepancies.len(), 1, "{report}");
    &found.discrepancies[0]
}

// The binary.

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_healthy_ledger_reconciles_with_exit_status_0(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    ordinary_traffic(&app).await;
    let url = database_url_for(&app.pool);

    let (code, human, _) = run_cli(&url, &["reconcile"]).await;
    assert_eq!(code, 0, "{human}");
    assert!(human.contains("all checks hold"));

    let (code, json, _) = run_cli(&url, &["reconcile", "--json"]).await;
    assert_eq!(code, 0);
    let report: Value = serde_json::from_str(&json).expect("a JSON report");
    assert_eq!(report["ok"], true);
    assert_eq!(report["checks"].as_array().unwrap().len(), Check::ALL.len());
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_stray_entry_makes_reconcile_exit_1_naming_it(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let transfer_id = ordinary_traffic(&app).await;
    // A third entry on a transfer that already has its two, on an account
    // whose balance is not touched: as a buggy or hand-made insert would.
    let stray_entry_id: i64 = sqlx::query_scalar(
        "INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
         VALUES ($1, 'sys_funding_usd', 'USD', 1500, 0) RETURNING id",
    )
    .bind(transfer_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let url = database_url_for(&app.pool);

    let (code, text, _) = run_cli(&url, &["reconcile"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("FAIL transfer_entries"), "{text}");
    assert!(
        text.contains(&format!("transfer_id={transfer_id}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("(entry {stray_entry_id})")),
        "{text}"
    );
    assert!(text.contains("account_id=sys_funding_usd"), "{text}");

    let (code, json, _) = run_cli(&url, &["reconcile", "--json"]).await;
    assert_eq!(code, 1);
    let report: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["ok"], false);
    let entries = &report["checks"][0];
    assert_eq!(entries["check"], "transfer_entries");
    assert_eq!(entries["discrepancies_total"], 1);
    let listed = &entries["discrepancies"][0];
    assert_eq!(listed["ids"]["transfer_id"], transfer_id.to_string());
    assert_eq!(
        listed["expected"],
        "a debit of -1500 on acc_00001 and a credit of 1500 on acc_00002"
    );
    assert!(
        listed["found"].as_str().unwrap().starts_with("3 entries: "),
        "{listed}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn reconcile_exits_2_when_it_cannot_run(pool: PgPool) {
    // Short: PostgreSQL cuts names at 63 bytes, and a test database's name
    // plus a suffix would be cut back to the test database itself.
    let missing = format!(
        "nexo_missing_{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    let mut url = url::Url::parse(&database_url_for(&pool)).unwrap();
    url.set_path(&missing);
    let (code, _, stderr) = run_cli(url.as_str(), &["reconcile"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("cannot connect"), "{stderr}");
    // A check never creates what it checks.
    let created: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&missing)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!created);
}

// Each kind of discrepancy, through the library.

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn ordinary_traffic_leaves_nothing_to_report(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    ordinary_traffic(&app).await;
    let report = reconcile(&app.pool).await;
    assert!(report.ok, "{report}");
    assert_eq!(report.discrepancies_total(), 0);
    assert_eq!(report.checks.len(), Check::ALL.len());
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_missing_credit_is_a_broken_transfer_and_a_drifted_balance(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let transfer_id = ordinary_traffic(&app).await;
    tamper(
        &app.pool,
        "DELETE FROM ledger_entries WHERE transfer_id = $1::uuid AND amount_minor > 0",
        &transfer_id.to_string(),
    )
    .await;

    let report = reconcile(&app.pool).await;
    assert_eq!(
        failing_checks(&report),
        [(Check::TransferEntries, 1), (Check::AccountBalances, 1)],
        "{report}"
    );
    let broken = only_discrepancy(&report, Check::TransferEntries);
    assert_eq!(broken.ids["transfer_id"], transfer_id.to_string());
    assert!(
        broken.found.starts_with("1 entries: -1500 on acc_00001"),
        "{broken:?}"
    );
    let drifted = only_discrepancy(&report, Check::AccountBalances);
    assert_eq!(drifted.ids["account_id"], B_USD);
    let balance = app.balance(B_USD).await;
    assert_eq!(drifted.found, format!("balance {balance}"));
    assert_eq!(
        drifted.expected,
        format!("balance {} (the sum of its entries)", balance - 1_500)
    );
}

/// A statement line that tells another story than the entries: the balance
/// is right, the entry's recorded balance after is not.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn an_entry_whose_balance_after_is_not_the_running_sum_is_found(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let transfer_id = ordinary_traffic(&app).await;
    let credit_entry_id: i64 = sqlx::query_scalar(
        "SELECT id FROM ledger_entries WHERE transfer_id = $1 AND amount_minor > 0",
    )
    .bind(transfer_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    tamper(
        &app.pool,
        "UPDATE ledger_entries SET balance_after_minor = balance_after_minor + 7 WHERE id = $1::bigint",
        &credit_entry_id.to_string(),
    )
    .await;

    let report = reconcile(&app.pool).await;
    let found = sole_failure(&report, Check::EntryBalances);
    assert_eq!(found.ids["entry_id"], credit_entry_id.to_string());
    assert_eq!(found.ids["account_id"], B_USD);
    assert_eq!(
        found.expected,
        "balance after 1500 (the sum of the account's entries up to this one)"
    );
    assert_eq!(found.found, "balance after 1507");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_balance_edited_by_hand_breaks_its_account_and_its_currency(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    ordinary_traffic(&app).await;
    tamper(
        &app.pool,
        "UPDATE accounts SET balance_minor = balance_minor + 1 WHERE id = $1",
        B_EUR,
    )
    .await;

    let report = reconcile(&app.pool).await;
    assert_eq!(
        failing_checks(&report),
        [(Check::AccountBalances, 1), (Check::CurrencyTotals, 1)],
        "{report}"
    );
    assert_eq!(
        only_discrepancy(&report, Check::AccountBalances).ids["account_id"],
        B_EUR
    );
    let currency = only_discrepancy(&report, Check::CurrencyTotals);
    assert_eq!(currency.ids["currency"], "EUR");
    assert_eq!(currency.expected, "balances summing to 0");
    assert!(
        currency.found.starts_with("balances summing to 1 over "),
        "{currency:?}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_key_record_naming_another_keys_transfer_maps_a_key_twice(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (first_key, second_key) = (new_key(), new_key());
    let first = app
        .post_transfer(TOKEN_A, &first_key, &transfer(A_USD, B_USD, 10, "USD"))
        .await;
    let second = app
        .post_transfer(TOKEN_A, &second_key, &transfer(A_USD, B_USD, 20, "USD"))
        .await;
    let second_id = second.json()["transfer_id"].as_str().unwrap().to_owned();
    assert_eq!((first.status, second.status), (201, 201));
    sqlx::query("UPDATE idempotency_keys SET transfer_id = $1::uuid WHERE idempotency_key = $2")
        .bind(&second_id)
        .bind(&first_key)
        .execute(&app.pool)
        .await
        .unwrap();

    let report = reconcile(&app.pool).await;
    let crossed = sole_failure(&report, Check::KeyTransfers);
    assert_eq!(crossed.ids["idempotency_key"], first_key);
    assert_eq!(
        crossed.ids["principal_id"],
        principal_a(&app.pool).await.to_string()
    );
    assert!(crossed.found.contains(&second_id), "{crossed:?}");
    assert!(crossed.found.contains(&second_key), "{crossed:?}");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn two_transfers_under_one_key_are_found_when_the_unique_constraint_is_gone(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = new_key();
    let reply = app
        .post_transfer(TOKEN_A, &key, &transfer(A_USD, B_USD, 10, "USD"))
        .await;
    let original: Uuid = reply.json()["transfer_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    // The constraint is what normally makes this impossible; the check is
    // for a ledger whose constraint was dropped or never there.
    sqlx::query("ALTER TABLE transfers DROP CONSTRAINT transfers_principal_key_unique")
        .execute(&app.pool)
        .await
        .unwrap();
    // Nor could the copy commit without entries while the double-entry
    // trigger is there.
    sqlx::query("ALTER TABLE transfers DISABLE TRIGGER transfers_double_entry")
        .execute(&app.pool)
        .await
        .unwrap();
    let copy = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                                to_account, currency, amount_minor, receipt_id)
         SELECT $2, principal_id, idempotency_key, request_fingerprint, from_account, to_account,
                currency, amount_minor, 'rcpt_copy'
         FROM transfers WHERE id = $1",
    )
    .bind(original)
    .bind(copy)
    .execute(&app.pool)
    .await
    .unwrap();

    let report = reconcile(&app.pool).await;
    let shared = only_discrepancy(&report, Check::KeyTransfers);
    assert_eq!(shared.ids["idempotency_key"], key);
    assert_eq!(shared.expected, "one transfer");
    assert!(shared.found.starts_with("2 transfers: "), "{shared:?}");
    assert!(shared.found.contains(&original.to_string()));
    assert!(shared.found.contains(&copy.to_string()));
    // The copy has no entries either.
    assert_eq!(
        report.check(Check::TransferEntries).unwrap().discrepancies[0].ids["transfer_id"],
        copy.to_string()
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_stored_success_without_its_transfer_is_found(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (lost, cleared) = (new_key(), new_key());
    for key in [&lost, &cleared] {
        let reply = app
            .post_transfer(TOKEN_A, key, &transfer(A_USD, B_USD, 10, "USD"))
            .await;
        assert_eq!(reply.status, 201);
    }
    let nowhere = Uuid::now_v7();
    sqlx::query("UPDATE idempotency_keys SET transfer_id = $1 WHERE idempotency_key = $2")
        .bind(nowhere)
        .bind(&lost)
        .execute(&app.pool)
        .await
        .unwrap();
    tamper(
        &app.pool,
        "UPDATE idempotency_keys SET transfer_id = NULL WHERE idempotency_key = $1",
        &cleared,
    )
    .await;

    let report = reconcile(&app.pool).await;
    let check = report.check(Check::CompletedKeyTransfer).unwrap();
    assert_eq!(check.discrepancies_total, 2, "{report}");
    let by_key = |key: &str| {
        check
            .discrepancies
            .iter()
            .find(|d| d.ids["idempotency_key"] == key)
            .unwrap_or_else(|| panic!("{key} listed in {report}"))
    };
    assert_eq!(by_key(&lost).expected, format!("transfer {nowhere}"));
    assert_eq!(by_key(&lost).found, "no such transfer (status 201 stored)");
    assert_eq!(
        by_key(&cleared).found,
        "status 201 stored without a transfer id"
    );
    // A stored rejection has no transfer, rightly: not listed.
    assert!(check.discrepancies.iter().all(|d| d.found.contains("201")));
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn a_young_transfer_without_its_key_record_is_found_an_old_one_is_not(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (young, old) = (new_key(), new_key());
    let mut ids = Vec::new();
    for key in [&young, &old] {
        let reply = app
            .post_transfer(TOKEN_A, key, &transfer(A_USD, B_USD, 10, "USD"))
            .await;
        ids.push(reply.json()["transfer_id"].as_str().unwrap().to_owned());
    }
    sqlx::query("DELETE FROM idempotency_keys WHERE idempotency_key = ANY($1)")
        .bind([young.as_str(), old.as_str()].as_slice())
        .execute(&app.pool)
        .await
        .unwrap();
    // Older than the TTL: its record may rightly have been purged.
    tamper(
        &app.pool,
        "UPDATE transfers SET created_at = now() - interval '25 hours' WHERE idempotency_key = $1",
        &old,
    )
    .await;

    let report = reconcile(&app.pool).await;
    let missing = sole_failure(&report, Check::TransferKeyRecord);
    assert_eq!(missing.ids["transfer_id"], ids[0]);
    assert_eq!(missing.ids["idempotency_key"], young);
    assert_eq!(missing.expected, "the idempotency record of its key");

    // With a TTL shorter than the young transfer's age, nothing is expected.
    tamper(
        &app.pool,
        "UPDATE transfers SET created_at = now() - interval '2 hours' WHERE idempotency_key = $1",
        &young,
    )
    .await;
    let short_ttl = reconcile::run(
        &app.pool,
        Options {
            key_ttl: Duration::from_secs(3600),
        },
    )
    .await
    .unwrap();
    assert!(short_ttl.ok, "{short_ttl}");
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn keys_past_their_lease_are_stuck_and_live_ones_are_not(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let (stuck, live) = (new_key(), new_key());
    claim_for_a(&app.pool, &stuck, &transfer(A_USD, B_USD, 10, "USD")).await;
    claim_for_a(&app.pool, &live, &transfer(A_USD, B_USD, 10, "USD")).await;
    // The process holding it died a minute after its lease ran out.
    tamper(&app.pool, "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' WHERE idempotency_key = $1", &stuck).await;

    let report = reconcile(&app.pool).await;
    let found = sole_failure(&report, Check::KeysStuckInProgress);
    assert_eq!(found.ids["idempotency_key"], stuck);
    assert!(
        found.found.starts_with("IN_PROGRESS, lease ended at "),
        "{found:?}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_discrepancy_is_counted_but_only_the_first_ones_are_listed(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let stuck = DISCREPANCIES_LISTED_MAX as usize + 5;
    for n in 0..stuck {
        claim_for_a(
            &app.pool,
            &format!("stuck-{n:02}"),
            &transfer(A_USD, B_USD, 10, "USD"),
        )
        .await;
    }
    sqlx::query("UPDATE idempotency_keys SET locked_until = now() - interval '1 minute'")
        .execute(&app.pool)
        .await
        .unwrap();

    let report = reconcile(&app.pool).await;
    let check = report.check(Check::KeysStuckInProgress).unwrap();
    assert_eq!(check.discrepancies_total, stuck as u64);
    assert_eq!(check.discrepancies.len(), DISCREPANCIES_LISTED_MAX as usize);
    assert!(
        report.to_string().contains("… and 5 more not listed"),
        "{report}"
    );
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn serve_refuses_a_back_to_back_schedule_and_a_guessable_admin_token(pool: PgPool) {
    let url = database_url_for(&pool);
    let (code, _, stderr) = run_cli(
        &url,
        &[
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--reconcile-interval",
            "5s",
        ],
    )
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("NEXO_RECONCILE_INTERVAL"), "{stderr}");
    let (code, _, stderr) = run_cli(
        &url,
        &["serve", "--bind", "127.0.0.1:0", "--admin-token", "hunter2"],
    )
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("NEXO_ADMIN_TOKEN"), "{stderr}");
    assert!(
        !stderr.contains("hunter2"),
        "the token is not echoed: {stderr}"
    );
}

/// The ledger's checks alone (what the tests' ledger assertion and the load
/// generator run) judge the money only: a stuck key record does not fail
/// them, a missing credit does.
#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_ledger_checks_alone_ignore_key_records_and_find_broken_money(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let transfer_id = ordinary_traffic(&app).await;
    let stuck = new_key();
    claim_for_a(&app.pool, &stuck, &transfer(A_USD, B_USD, 10, "USD")).await;
    tamper(&app.pool, "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' WHERE idempotency_key = $1", &stuck).await;

    let healthy = reconcile::run_ledger_checks(&app.pool).await.unwrap();
    assert!(healthy.ok, "{healthy}");
    let checked: Vec<Check> = healthy.checks.iter().map(|c| c.check).collect();
    assert_eq!(checked, Check::LEDGER);
    assert!(
        !reconcile(&app.pool).await.ok,
        "the full run sees the stuck key"
    );

    tamper(
        &app.pool,
        "DELETE FROM ledger_entries WHERE transfer_id = $1::uuid AND amount_minor > 0",
        &transfer_id.to_string(),
    )
    .await;
    let broken = reconcile::run_ledger_checks(&app.pool).await.unwrap();
    assert_eq!(
        failing_checks(&broken),
        [(Check::TransferEntries, 1), (Check::AccountBalances, 1)],
        "{broken}"
    );
}
