#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Hostile and malformed input, case by case: each gets a clear 4xx
//! problem+json (or, for bytes HTTP itself forbids, the HTTP layer's bare
//! 400), nothing panics, nothing changes in the database, and no token shows
//! up in the logs, captured here at TRACE level from every crate.
mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use common::proxy::raw_exchange;
use common::*;
use serde_json::json;
use sqlx::PgPool;

/// Every log line of this test binary, at TRACE.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = LogSink(logs.clone());
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .init();
        logs
    })
    .clone()
}

#[derive(Clone)]
struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the database holds, to compare before and after the attacks.
async fn snapshot(pool: &PgPool) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(' | ',
             (SELECT count(*) FROM idempotency_keys),
             (SELECT count(*) FROM transfers),
             (SELECT count(*) FROM ledger_entries),
             (SELECT string_agg(id || '=' || balance_minor, ',' ORDER BY id) FROM accounts),
             (SELECT count(*) FROM principals))",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A request built piece by piece, every piece optional.
struct Post<'a> {
    path: &'a str,
    method: reqwest::Method,
    authorization: Vec<&'a str>,
    keys: Vec<&'a str>,
    content_types: Vec<&'a str>,
    body: Vec<u8>,
}

impl<'a> Post<'a> {
    fn transfer(body: impl Into<Vec<u8>>) -> Self {
        Self {
            path: "/transfers",
            method: reqwest::Method::POST,
            authorization: vec!["Bearer tok_test_A"],
            keys: vec![],
            content_types: vec!["application/json"],
            body: body.into(),
        }
    }

    fn get(path: &'a str, token: &'a str) -> Self {
        Self {
            path,
            method: reqwest::Method::GET,
            authorization: vec![token],
            keys: vec![],
            content_types: vec![],
            body: vec![],
        }
    }

    async fn send(self, app: &TestApp) -> Reply {
        let mut request = app.client.request(self.method, app.url(self.path));
        for value in self.authorization {
            request = request.header("Authorization", value);
        }
        for key in self.keys {
            request = request.header("Idempotency-Key", key);
        }
        for content_type in self.content_types {
            request = request.header("Content-Type", content_type);
        }
        Reply::read(request.body(self.body).send().await.expect("answered")).await
    }
}

fn valid() -> serde_json::Value {
    transfer(A_USD, B_USD, 100, "USD")
}

fn with_amount(raw: &str) -> String {
    format!(r#"{{"from":"{A_USD}","to":"{B_USD}","amount_minor":{raw},"currency":"USD"}}"#)
}

fn with(field: &str, value: serde_json::Value) -> String {
    let mut body = valid();
    body[field] = value;
    body.to_string()
}

/// (case, request, expected status, expected problem type)
type Case<'a> = (String, Post<'a>, u16, &'static str);

fn body_cases() -> Vec<Case<'static>> {
    let mut cases: Vec<Case> = Vec::new();
    let mut add = |name: &str, post: Post<'static>, status, slug| {
        cases.push((name.to_owned(), post, status, slug));
    };
    let padded = format!("{}{}", valid(), " ".repeat(17 * 1024));
    add(
        "body over the 16 KiB limit",
        Post::transfer(padded),
        413,
        "payload-too-large",
    );
    let mut post = Post::transfer(valid().to_string());
    post.content_types = vec!["text/plain"];
    add("text/plain body", post, 415, "unsupported-media-type");
    let mut post = Post::transfer(valid().to_string());
    post.content_types = vec![];
    add("no Content-Type", post, 415, "unsupported-media-type");
    let mut post = Post::transfer(valid().to_string());
    post.content_types = vec!["application/json", "application/json"];
    add(
        "two Content-Type headers",
        post,
        415,
        "unsupported-media-type",
    );
    let mut post = Post::transfer(valid().to_string());
    post.content_types = vec!["application/jsonp"];
    add("application/jsonp", post, 415, "unsupported-media-type");
    let mut post = Post::transfer(valid().to_string());
    post.content_types = vec!["application/x-www-form-urlencoded"];
    add("form encoding", post, 415, "unsupported-media-type");

    for (name, body) in [
        ("malformed JSON", r#"{"from": "acc_00001",,}"#.to_owned()),
        ("truncated JSON", r#"{"from":"acc_00001","to":"acc_0000"#.to_owned()),
        ("empty body", String::new()),
        ("JSON array", "[]".to_owned()),
        ("JSON null", "null".to_owned()),
        ("JSON string", r#""transfer""#.to_owned()),
        ("byte order mark", format!("\u{feff}{}", valid())),
        (
            "duplicated field",
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":1,"amount_minor":100000,"currency":"USD"}"#.to_owned(),
        ),
        ("unknown field", with("memo", json!("x"))),
        ("unknown field named like SQL", with("1; DROP TABLE transfers", json!(1))),
        ("missing field", r#"{"from":"acc_00001","to":"acc_00002","currency":"USD"}"#.to_owned()),
        // serde_json reads -0 as the float -0.0.
        ("negative zero amount", with_amount("-0")),
        ("float amount", with_amount("100.5")),
        ("integral float amount", with_amount("100.0")),
        ("exponent amount", with_amount("1e3")),
        ("capital exponent amount", with_amount("1E2")),
        ("string amount", with_amount(r#""100""#)),
        ("amount beyond i64", with_amount("9223372036854775808")),
        ("amount below i64", with_amount("-9223372036854775809")),
        ("huge exponent amount", with_amount("1e400")),
        ("null amount", with_amount("null")),
        ("boolean amount", with_amount("true")),
        ("object amount", with_amount("{}")),
        ("hex amount", with_amount("0x10")),
        ("amount with leading zero", with_amount("0100")),
        ("amount with plus sign", with_amount("+100")),
        ("NaN amount", with_amount("NaN")),
        ("account as number", with("from", json!(1))),
        ("description as object", with("description", json!({"a": 1}))),
        (
            "description nested 8,000 deep",
            with_amount(&format!("1,\"description\":{}{}", "[".repeat(8_000), "]".repeat(8_000))),
        ),
    ] {
        add(name, Post::transfer(body), 400, "malformed-request");
    }
    add(
        "invalid UTF-8",
        Post::transfer(b"{\"from\":\"acc_\xff\xfe\"}".to_vec()),
        400,
        "malformed-request",
    );

    for (name, body, slug) in [
        ("zero amount", with_amount("0"), "invalid-amount"),
        ("negative amount", with_amount("-5"), "invalid-amount"),
        (
            "amount above the maximum",
            with_amount("100000000000001"),
            "invalid-amount",
        ),
        (
            "NUL in description",
            with("description", json!("a\u{0}b")),
            "invalid-description",
        ),
        (
            "newline in description",
            with("description", json!("a\nb")),
            "invalid-description",
        ),
        (
            "description of 141 characters",
            with("description", json!("é".repeat(141))),
            "invalid-description",
        ),
        (
            "SQL in an account id",
            with("from", json!("acc_00001' OR '1'='1")),
            "invalid-account-id",
        ),
        (
            "full-width digits in an account id",
            with("from", json!("acc_０００１")),
            "invalid-account-id",
        ),
        (
            "a system account as source",
            with("from", json!("sys_funding_usd")),
            "invalid-account-id",
        ),
        (
            "a system account as destination",
            with("to", json!("sys_funding_usd")),
            "invalid-account-id",
        ),
        (
            "overlong account id",
            with("to", json!(format!("acc_{}", "9".repeat(41)))),
            "invalid-account-id",
        ),
        (
            "unknown destination",
            with("to", json!("acc_99999")),
            "unknown-destination",
        ),
        (
            "a digit in the currency",
            with("currency", json!("U5D")),
            "unsupported-currency",
        ),
        (
            "unknown currency",
            with("currency", json!("XXX")),
            "unsupported-currency",
        ),
        (
            "SQL as currency",
            with("currency", json!("'; --")),
            "unsupported-currency",
        ),
        (
            "currency of other accounts",
            with("currency", json!("EUR")),
            "currency-mismatch",
        ),
        (
            "same account twice",
            with("to", json!(A_USD)),
            "same-account",
        ),
    ] {
        add(name, Post::transfer(body), 422, slug);
    }
    // Moving money out of someone else's account (BOLA): a plain 404.
    add(
        "another principal's account as source",
        Post::transfer(transfer(B_USD, A_USD, 1, "USD").to_string()),
        404,
        "not-found",
    );
    cases
}

fn key_cases() -> Vec<Case<'static>> {
    let long: &'static str = Box::leak("k".repeat(256).into_boxed_str());
    let quoted_long: &'static str = Box::leak(format!("\"{}\"", "k".repeat(256)).into_boxed_str());
    let huge: &'static str = Box::leak("k".repeat(10_000).into_boxed_str());
    let mut cases: Vec<Case> = Vec::new();
    for (name, keys, slug) in [
        ("no Idempotency-Key", vec![], "missing-idempotency-key"),
        ("empty key", vec![""], "invalid-idempotency-key"),
        ("empty quoted key", vec!["\"\""], "invalid-idempotency-key"),
        (
            "key of 256 characters",
            vec![long],
            "invalid-idempotency-key",
        ),
        (
            "quoted key of 256 characters",
            vec![quoted_long],
            "invalid-idempotency-key",
        ),
        (
            "key of 10,000 characters",
            vec![huge],
            "invalid-idempotency-key",
        ),
        (
            "bare key with a space",
            vec!["a b"],
            "invalid-idempotency-key",
        ),
        ("key with a tab", vec!["a\tb"], "invalid-idempotency-key"),
        (
            "key with parameters",
            vec!["\"k\";a=1"],
            "invalid-idempotency-key",
        ),
        (
            "unterminated quoted key",
            vec!["\"abc"],
            "invalid-idempotency-key",
        ),
        (
            "two Idempotency-Key headers",
            vec!["k-1", "k-2"],
            "invalid-idempotency-key",
        ),
        (
            "the same key twice",
            vec!["k-1", "k-1"],
            "invalid-idempotency-key",
        ),
    ] {
        let mut post = Post::transfer(valid().to_string());
        post.keys = keys;
        cases.push((name.to_owned(), post, 400, slug));
    }
    cases
}

fn token_cases() -> Vec<Case<'static>> {
    let long: &'static str = Box::leak(format!("Bearer {}", "t".repeat(300)).into_boxed_str());
    let mut cases: Vec<Case> = Vec::new();
    for (name, authorization) in [
        ("no Authorization", vec![]),
        ("token in another case", vec!["Bearer tok_test_a"]),
        ("token with one more character", vec!["Bearer tok_test_AA"]),
        ("token missing its last character", vec!["Bearer tok_test_"]),
        ("token with a prefix", vec!["Bearer xtok_test_A"]),
        ("scheme alone", vec!["Bearer"]),
        ("Basic scheme", vec!["Basic dG9rX3Rlc3RfQTo="]),
        ("other scheme with a valid token", vec!["Token tok_test_A"]),
        (
            "two tokens in one header",
            vec!["Bearer tok_test_A tok_test_B"],
        ),
        (
            "two Authorization headers",
            vec!["Bearer tok_test_A", "Bearer tok_test_B"],
        ),
        ("token of 300 characters", vec![long]),
        ("SQL as token", vec!["Bearer ' OR '1'='1"]),
    ] {
        let mut post = Post::transfer(valid().to_string());
        post.authorization = authorization;
        cases.push((name.to_owned(), post, 401, "unauthorized"));
    }
    cases
}

fn read_cases(foreign_transfer: &'static str) -> Vec<Case<'static>> {
    let mut cases: Vec<Case> = Vec::new();
    for (name, path, token) in [
        (
            "another principal's account",
            "/accounts/acc_00002",
            "Bearer tok_test_A",
        ),
        (
            "another principal's entries",
            "/accounts/acc_00002/entries",
            "Bearer tok_test_A",
        ),
        (
            "A's account read by B",
            "/accounts/acc_00001",
            "Bearer tok_test_B",
        ),
        (
            "a funding account",
            "/accounts/sys_funding_usd",
            "Bearer tok_test_A",
        ),
        (
            "a transfer between others",
            foreign_transfer,
            "Bearer tok_test_A",
        ),
        (
            "a transfer id that is not a UUID",
            "/transfers/not-a-uuid",
            "Bearer tok_test_A",
        ),
        (
            "SQL in a transfer id",
            "/transfers/'%20OR%201=1",
            "Bearer tok_test_A",
        ),
        (
            "path traversal",
            "/accounts/..%2F..%2Fetc%2Fpasswd",
            "Bearer tok_test_A",
        ),
        ("an unknown route", "/admin", "Bearer tok_test_A"),
    ] {
        cases.push((name.to_owned(), Post::get(path, token), 404, "not-found"));
    }
    for query in [
        "limit=0",
        "limit=201",
        "limit=abc",
        "limit=99999999999999999999",
        "cursor=zzz",
        "cursor=e-1",
        "other=1",
    ] {
        let path: &'static str =
            Box::leak(format!("/accounts/acc_00001/entries?{query}").into_boxed_str());
        cases.push((
            format!("entries with {query}"),
            Post::get(path, "Bearer tok_test_A"),
            400,
            "invalid-query",
        ));
    }
    let mut delete = Post::get("/transfers", "Bearer tok_test_A");
    delete.method = reqwest::Method::DELETE;
    cases.push((
        "DELETE /transfers".to_owned(),
        delete,
        405,
        "method-not-allowed",
    ));
    cases
}

/// A transfer that principal A must not see: C pays B.
async fn transfer_between_others(app: &TestApp) -> &'static str {
    let c = nexo_transfers::admin::create_principal(&app.pool, "principal-c")
        .await
        .unwrap();
    nexo_transfers::admin::open_account(&app.pool, "principal-c", "USD", Some("acc_c0001"))
        .await
        .unwrap();
    nexo_transfers::admin::deposit(&app.pool, "acc_c0001", 5_000, "c-opening")
        .await
        .unwrap();
    let reply = app
        .post_transfer(
            &c.token,
            &new_key(),
            &transfer("acc_c0001", B_USD, 1_000, "USD"),
        )
        .await;
    assert_eq!(reply.status, 201);
    Box::leak(
        format!(
            "/transfers/{}",
            reply.json()["transfer_id"].as_str().unwrap()
        )
        .into_boxed_str(),
    )
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn every_hostile_request_gets_a_clear_4xx_and_changes_nothing(pool: PgPool) {
    let logs = captured_logs();
    let app = TestApp::spawn(pool).await;
    let foreign = transfer_between_others(&app).await;
    let before = snapshot(&app.pool).await;

    let mut cases = body_cases();
    cases.extend(key_cases());
    cases.extend(token_cases());
    cases.extend(read_cases(foreign));
    let count = cases.len();
    for (name, mut post, status, slug) in cases {
        if post.method == reqwest::Method::POST
            && post.keys.is_empty()
            && slug != "missing-idempotency-key"
        {
            post.keys = vec![Box::leak(new_key().into_boxed_str())];
        }
        let reply = post.send(&app).await;
        assert_eq!(
            reply.status,
            status,
            "{name}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        reply.assert_problem(status, slug);
        if status == 401 {
            assert!(reply.header("www-authenticate").is_some(), "{name}");
        }
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.chars().count() <= 301, "{name}: detail not bounded");
        assert_eq!(
            snapshot(&app.pool).await,
            before,
            "{name} changed the database"
        );
    }

    // Bytes that HTTP forbids in a header never reach the service: hyper
    // answers a bare 400 itself.
    let raw_cases: [(&str, Vec<u8>); 3] = [
        ("control character in the key", b"k\x01y".to_vec()),
        ("NUL in the key", b"k\x00y".to_vec()),
        ("DEL in the key", b"k\x7fy".to_vec()),
    ];
    for (name, key) in &raw_cases {
        let reply = raw_post(&app, key, b"tok_test_A").await;
        assert_eq!(reply.status, 400, "{name}");
        assert_eq!(
            snapshot(&app.pool).await,
            before,
            "{name} changed the database"
        );
    }
    // Non-ASCII bytes are legal in a header value; the service refuses them.
    for (name, key, token, status, slug) in [
        (
            "UTF-8 key",
            "clé".as_bytes(),
            b"tok_test_A".as_slice(),
            400,
            "invalid-idempotency-key",
        ),
        (
            "Latin-1 key",
            b"cl\xe9".as_slice(),
            b"tok_test_A".as_slice(),
            400,
            "invalid-idempotency-key",
        ),
        (
            "homoglyph token",
            b"k-homoglyph".as_slice(),
            "tok_test_А".as_bytes(),
            401,
            "unauthorized",
        ),
    ] {
        let reply = raw_post(&app, key, token).await;
        reply.assert_problem(status, slug);
        assert_eq!(
            snapshot(&app.pool).await,
            before,
            "{name} changed the database"
        );
    }
    let chunked = format!(
        "POST /transfers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok_test_A\r\n\
         Idempotency-Key: chunked\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n4800\r\n{}\r\n0\r\n\r\n",
        " ".repeat(0x4800)
    );
    raw_exchange(app.addr, chunked.as_bytes())
        .await
        .assert_problem(413, "payload-too-large");
    assert_eq!(snapshot(&app.pool).await, before);

    // The server is still healthy and the ledger whole.
    let ok = app.post_transfer(TOKEN_A, &new_key(), &valid()).await;
    assert_eq!(ok.status, 201);
    assert_ledger_consistent(&app.pool).await;

    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(logs.contains("response"), "the request logs were captured");
    for secret in ["tok_test_", "Bearer", &"t".repeat(300)] {
        assert!(!logs.contains(secret), "{secret:?} appears in the logs");
    }
    println!(
        "hostile input: {} cases, each a 4xx problem+json (hyper's bare 400 for the {} with \
         bytes HTTP forbids), database unchanged, no token in {} bytes of TRACE logs",
        count + raw_cases.len() + 4,
        raw_cases.len(),
        logs.len()
    );
}

async fn raw_post(app: &TestApp, key: &[u8], token: &[u8]) -> Reply {
    let body = valid().to_string();
    let mut request = Vec::new();
    request.extend_from_slice(b"POST /transfers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ");
    request.extend_from_slice(token);
    request.extend_from_slice(b"\r\nIdempotency-Key: ");
    request.extend_from_slice(key);
    request.extend_from_slice(
        format!(
            "\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    raw_exchange(app.addr, &request).await
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn sql_and_unicode_in_text_fields_are_stored_verbatim(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let texts = [
        "'); DROP TABLE accounts; --",
        "Robert'); DELETE FROM ledger_entries WHERE ('1'='1",
        "💸 transferencia — ñandú 中文",
        "\u{202e}evil\u{202c} and zero\u{200d}width",
        "%s%s%n {0} ${jndi:ldap://x} <script>alert(1)</script>",
    ];
    for text in texts {
        let body = json!({"from": A_USD, "to": B_USD, "amount_minor": 1, "currency": "USD", "description": text});
        let reply = app.post_transfer(TOKEN_A, &new_key(), &body).await;
        assert_eq!(reply.status, 201, "{text}");
        assert_eq!(reply.json()["description"], text);
        let stored: String =
            sqlx::query_scalar("SELECT description FROM transfers WHERE id = $1::uuid")
                .bind(reply.json()["transfer_id"].as_str().unwrap())
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(stored, text);
    }
    // A key is any printable ASCII in its quoted form, SQL included.
    let key = r#""'; DROP TABLE transfers; --""#;
    let reply = app.post_transfer(TOKEN_A, key, &valid()).await;
    assert_eq!(reply.status, 201);
    let again = app.post_transfer(TOKEN_A, key, &valid()).await;
    assert!(again.replayed());
    assert_eq!(
        key_rows(&app.pool, "'; DROP TABLE transfers; --")
            .await
            .len(),
        1
    );
    assert_eq!(
        customer_transfer_count(&app.pool).await,
        texts.len() as i64 + 1
    );
    assert_ledger_consistent(&app.pool).await;
}

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn another_principals_key_gets_its_own_execution_never_the_others_answer(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let key = "shared-key-1";
    let a_body = transfer(A_USD, B_USD, 5_000, "USD");
    let a_first = app.post_transfer(TOKEN_A, key, &a_body).await;
    assert_eq!(a_first.status, 201);

    // B replays A's exact request with A's key: A's account is not B's, so
    // it is a 404, never A's stored 201.
    let b_as_a = app.post_transfer(TOKEN_B, key, &a_body).await;
    b_as_a.assert_problem(404, "not-found");
    assert!(!b_as_a.replayed());

    // B's own intent under the same key string is B's own execution.
    let b_body = transfer(B_USD, A_USD, 1_000, "USD");
    let b_first = app.post_transfer(TOKEN_B, key, &b_body).await;
    assert_eq!(b_first.status, 201);
    assert!(!b_first.replayed());
    assert_ne!(b_first.json()["transfer_id"], a_first.json()["transfer_id"]);
    let b_again = app.post_transfer(TOKEN_B, key, &b_body).await;
    assert_eq!(b_again.body, b_first.body);
    let a_again = app.post_transfer(TOKEN_A, key, &a_body).await;
    assert_eq!(a_again.body, a_first.body);

    assert_eq!(
        key_rows(&app.pool, key).await.len(),
        2,
        "one record per principal"
    );
    assert_eq!(customer_transfer_count(&app.pool).await, 2);
    assert_eq!(app.balance(B_USD).await, 4_000);
    assert_ledger_consistent(&app.pool).await;
}
