#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step should stop the test loudly
//! The retry loop against a scripted HTTP server: each connection gets the
//! next scripted answer (or is closed without one), and every request is
//! recorded, so the tests see exactly what went over the wire and when.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nexo_client::{
    AttemptResult, Client, Error, GiveUpReason, IdempotencyKey, NextStep, PageQuery, ProblemType,
    RetryPolicy, TransferIntent, TransferQuery, TransferRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const TRANSFER: &str = r#"{"transfer_id":"01a22a45-1c5e-77cc-b464-f70d8dff5602","status":"posted","from":"acc_00001","to":"acc_00002","amount_minor":10000,"currency":"USD","description":null,"created_at":"2026-11-30T02:25:02.046486Z","receipt":{"receipt_id":"rcpt_d02a75d76350467f8fdaed825def0943","debit_entry_id":5,"credit_entry_id":6,"issued_at":"2026-11-30T02:25:02.046486Z"}}"#;

#[derive(Clone)]
enum Script {
    /// Writes this whole response, then closes.
    Respond(String),
    /// Reads the request and closes without answering: a lost answer.
    Close,
}

fn created(replayed: bool) -> Script {
    let replayed = if replayed {
        "idempotent-replayed: true\r\n"
    } else {
        ""
    };
    Script::Respond(format!(
        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nlocation: /transfers/01a22a45-1c5e-77cc-b464-f70d8dff5602\r\n{replayed}content-length: {}\r\nconnection: close\r\n\r\n{TRANSFER}",
        TRANSFER.len()
    ))
}

fn problem(status: u16, slug: &str, extra_headers: &str) -> Script {
    let body = format!(
        r#"{{"type":"/problems/{slug}","title":"T","status":{status},"detail":"d","request_id":"req-{slug}"}}"#
    );
    Script::Respond(format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/problem+json\r\n{extra_headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ))
}

fn json(body: &str) -> Script {
    Script::Respond(format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ))
}

/// A request as the server received it.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    head: String,
    body: Vec<u8>,
}

impl Seen {
    fn request_line(&self) -> &str {
        self.head.lines().next().unwrap_or_default()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }
}

struct Scripted {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    async fn start(script: Vec<Script>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let script = Arc::new(Mutex::new(VecDeque::from(script)));
        let recorded = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (script, recorded) = (script.clone(), recorded.clone());
                tokio::spawn(async move {
                    let Some((head, body)) = read_request(&mut stream).await else {
                        return;
                    };
                    recorded.lock().unwrap().push(Seen {
                        at: Instant::now(),
                        head,
                        body,
                    });
                    let next = script.lock().unwrap().pop_front();
                    if let Some(Script::Respond(response)) = next {
                        let _ = stream.write_all(response.as_bytes()).await;
                        let _ = stream.shutdown().await;
                    }
                });
            }
        });
        Self { addr, seen }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buffer.len() < head_end + length {
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    Some((head, buffer[head_end..head_end + length].to_vec()))
}

/// Fast backoff, so tests that retry without `Retry-After` take no time.
fn quick() -> RetryPolicy {
    RetryPolicy {
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        ..RetryPolicy::default()
    }
}

fn client(server: &Scripted, policy: RetryPolicy) -> Client {
    Client::builder(server.base())
        .token("tok_test_A")
        .retry_policy(policy)
        .attempt_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn intent() -> TransferIntent {
    TransferIntent::new(TransferRequest::new(
        "acc_00001",
        "acc_00002",
        10_000,
        "USD",
    ))
}

#[tokio::test]
async fn a_lost_answer_is_retried_with_the_same_key_and_body() {
    let server = Scripted::start(vec![Script::Close, Script::Close, created(true)]).await;
    let intent = intent();

    let outcome = client(&server, quick())
        .send_transfer(&intent)
        .await
        .unwrap();

    assert!(outcome.replayed);
    assert_eq!(outcome.status, 201);
    assert_eq!(outcome.body, TRANSFER.as_bytes());
    assert_eq!(outcome.attempts.len(), 3);
    assert!(matches!(
        outcome.attempts[0].result,
        AttemptResult::NoAnswer { .. }
    ));
    assert!(matches!(outcome.attempts[0].next, NextStep::RetryIn(_)));
    assert_eq!(outcome.attempts[2].next, NextStep::Done);
    let seen = server.seen();
    assert_eq!(seen.len(), 3);
    for request in &seen {
        assert_eq!(request.request_line(), "POST /transfers HTTP/1.1");
        assert_eq!(
            request.header("idempotency-key").as_deref(),
            Some(intent.key().as_str())
        );
        assert_eq!(request.body, intent.body().as_ref());
        assert_eq!(
            request.header("authorization").as_deref(),
            Some("Bearer tok_test_A")
        );
    }
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let server = Scripted::start(vec![
        problem(503, "service-unavailable", "retry-after: 1\r\n"),
        problem(409, "request-in-flight", "retry-after: 1\r\n"),
        created(false),
    ])
    .await;

    let outcome = client(&server, quick())
        .send_transfer(&intent())
        .await
        .unwrap();

    assert!(!outcome.replayed);
    let seen = server.seen();
    assert_eq!(seen.len(), 3);
    for pair in seen.windows(2) {
        assert!(
            pair[1].at - pair[0].at >= Duration::from_secs(1),
            "retried {:?} after the answer asked for 1 s",
            pair[1].at - pair[0].at
        );
    }
    assert_eq!(
        outcome.attempts[1].result,
        AttemptResult::Answer {
            status: 409,
            replayed: false,
            problem: Some(ProblemType::RequestInFlight)
        }
    );
}

#[tokio::test]
async fn refusals_are_final_and_typed() {
    for (status, slug, kind) in [
        (422, "insufficient-funds", ProblemType::InsufficientFunds),
        (
            422,
            "idempotency-key-reused",
            ProblemType::IdempotencyKeyReused,
        ),
        (400, "malformed-request", ProblemType::MalformedRequest),
        (401, "unauthorized", ProblemType::Unauthorized),
        (404, "not-found", ProblemType::NotFound),
        (409, "intent-cancelled", ProblemType::IntentCancelled),
    ] {
        let server = Scripted::start(vec![
            problem(status, slug, "idempotent-replayed: true\r\n"),
            created(false),
        ])
        .await;

        let error = client(&server, quick())
            .send_transfer(&intent())
            .await
            .unwrap_err();

        assert_eq!(server.seen().len(), 1, "{slug} was retried");
        let Error::Problem(problem) = &error else {
            panic!("{slug}: {error:?}");
        };
        assert_eq!(problem.status, status);
        assert_eq!(problem.problem.problem_type(), kind);
        assert_eq!(
            problem.problem.request_id.as_deref(),
            Some(format!("req-{slug}").as_str())
        );
        assert!(problem.replayed, "the replay header is reported");
        assert!(!error.is_retryable());
    }
}

#[tokio::test]
async fn attempts_are_bounded() {
    let server = Scripted::start(vec![
        problem(503, "service-unavailable", ""),
        problem(500, "internal-error", ""),
        problem(429, "rate-limited", ""),
        created(false),
    ])
    .await;
    let policy = RetryPolicy {
        max_attempts: 3,
        ..quick()
    };

    let error = client(&server, policy)
        .send_transfer(&intent())
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 3);
    let Error::GaveUp { attempts, last, .. } = &error else {
        panic!("{error:?}");
    };
    assert_eq!(*attempts, 3);
    assert_eq!(last.problem_type(), Some(ProblemType::RateLimited));
    assert_eq!(error.problem_type(), Some(ProblemType::RateLimited));
}

#[tokio::test]
async fn a_retry_after_past_the_time_bound_ends_the_call_instead_of_being_cut_short() {
    let server = Scripted::start(vec![
        problem(503, "service-unavailable", "retry-after: 3600\r\n"),
        created(false),
    ])
    .await;
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let observed = attempts.clone();
    let client = Client::builder(server.base())
        .retry_policy(quick())
        .on_attempt(move |a| observed.lock().unwrap().push(a.clone()))
        .build()
        .unwrap();
    let started = Instant::now();

    let error = client.send_transfer(&intent()).await.unwrap_err();

    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(server.seen().len(), 1);
    assert!(
        matches!(error, Error::GaveUp { attempts: 1, .. }),
        "{error:?}"
    );
    let attempts = attempts.lock().unwrap();
    assert_eq!(
        attempts[0].next,
        NextStep::GiveUp(GiveUpReason::TimeExhausted)
    );
}

#[tokio::test]
async fn an_error_page_without_a_problem_document_is_retried() {
    let page = "<html>bad gateway</html>";
    let server = Scripted::start(vec![
        Script::Respond(format!(
            "HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
            page.len()
        )),
        created(false),
    ])
    .await;

    let outcome = client(&server, quick())
        .send_transfer(&intent())
        .await
        .unwrap();

    assert_eq!(outcome.attempts.len(), 2);
    assert_eq!(
        outcome.attempts[0].result,
        AttemptResult::Answer {
            status: 502,
            replayed: false,
            problem: None
        }
    );
}

#[tokio::test]
async fn a_single_attempt_returns_the_answer_itself() {
    let server = Scripted::start(vec![
        problem(503, "service-unavailable", "retry-after: 1\r\n"),
        created(false),
    ])
    .await;

    let error = client(&server, quick())
        .send_transfer_once(&intent())
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 1);
    let problem = error.problem().unwrap();
    assert_eq!(problem.status, 503);
    assert_eq!(problem.retry_after, Some(Duration::from_secs(1)));
}

#[tokio::test]
async fn keys_and_queries_are_encoded() {
    let state = r#"{"idempotency_key":"a/b?c#d%e","state":"failed","answer":null,"retry_after_seconds":null,"response_status":null,"transfer_id":null,"transfer_url":null,"completed_at":null,"cancelled_at":null,"expires_at":null,"retained_until":null}"#;
    let server = Scripted::start(vec![
        json(state),
        json(state),
        json(r#"{"transfers":[],"next_cursor":null}"#),
        json(r#"{"entries":[],"next_cursor":null}"#),
    ])
    .await;
    let client = client(&server, quick());
    let key = IdempotencyKey::parse("a/b?c#d%e").unwrap();

    client.get_idempotency_key(&key).await.unwrap();
    client.cancel_intent(&key).await.unwrap();
    client
        .list_transfers(
            &TransferQuery::default()
                .limit(2)
                .cursor("t0123")
                .idempotency_key("x y&z"),
        )
        .await
        .unwrap();
    client
        .list_entries("acc_00001", &PageQuery::default().limit(3))
        .await
        .unwrap();

    let lines: Vec<String> = server
        .seen()
        .iter()
        .map(|s| s.request_line().to_owned())
        .collect();
    assert_eq!(
        lines,
        [
            "GET /idempotency-keys/a%2Fb%3Fc%23d%25e HTTP/1.1",
            "POST /idempotency-keys/a%2Fb%3Fc%23d%25e/cancel HTTP/1.1",
            "GET /transfers?limit=2&cursor=t0123&idempotency_key=x+y%26z HTTP/1.1",
            "GET /accounts/acc_00001/entries?limit=3 HTTP/1.1",
        ]
    );
}

#[tokio::test]
async fn no_server_is_a_transport_error_after_the_retries() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = Client::builder(format!("http://{addr}"))
        .retry_policy(RetryPolicy {
            max_attempts: 2,
            ..quick()
        })
        .build()
        .unwrap();

    let error = client.send_transfer(&intent()).await.unwrap_err();

    let Error::GaveUp {
        attempts: 2, last, ..
    } = &error
    else {
        panic!("{error:?}");
    };
    let Error::Transport(transport) = last.as_ref() else {
        panic!("{last:?}");
    };
    assert_eq!(
        transport.kind(),
        nexo_client::TransportErrorKind::Connect,
        "{transport}"
    );
}

#[test]
fn a_base_url_that_takes_no_path_is_refused() {
    for base in ["mailto:someone@example.com", "not a url", "ftp://host/"] {
        assert!(
            matches!(Client::builder(base).build(), Err(Error::Request(_))),
            "{base}"
        );
    }
}
