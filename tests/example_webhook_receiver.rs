#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The example receiver (`examples/webhook_receiver.rs`) over real HTTP:
//! a signed event is taken once however often it arrives; a forged, a
//! tampered, a replayed (too old) and an unsigned delivery are refused and
//! never printed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;

#[allow(dead_code)] // its `main` is for `cargo run --example`
#[path = "../examples/webhook_receiver.rs"]
mod webhook_receiver;

use webhook_receiver::{Args, Receiver};

const SECRET: &str = "whsec_example_secret";
const PATH: &str = "/webhooks/nexo";

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

struct Running {
    url: String,
    out: Lines,
    log: Lines,
}

async fn start(secrets: &str) -> Running {
    let args = Args::try_parse_from(["webhook_receiver", "--secret", secrets]).unwrap();
    let (out, log) = (Lines::default(), Lines::default());
    let receiver = Arc::new(Receiver::new(
        &args,
        Arc::new(Mutex::new(out.clone())),
        Arc::new(Mutex::new(log.clone())),
    ));
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, webhook_receiver::router(receiver, PATH)).into_future());
    Running {
        url: format!("http://{addr}{PATH}"),
        out,
        log,
    }
}

fn now() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    )
    .unwrap()
}

async fn deliver(url: &str, signature: Option<String>, body: &str) -> (u16, String) {
    let mut request = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(signature) = signature {
        request = request.header(nexo_signature::HEADER, signature);
    }
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn event(id: &str) -> String {
    format!(r#"{{"id":"{id}","type":"transfer.posted","data":{{"amount_minor":100}}}}"#)
}

#[tokio::test]
async fn a_signed_event_is_taken_once_however_often_it_arrives() {
    let receiver = start(SECRET).await;
    let body = event("evt_1");
    for _ in 0..3 {
        // A retry is signed afresh; the id is what makes it a duplicate.
        let signature = nexo_signature::sign(&[SECRET.as_bytes()], now(), body.as_bytes());
        let (status, _) = deliver(&receiver.url, Some(signature), &body).await;
        assert_eq!(status, 200);
    }
    assert_eq!(receiver.out.lines(), [body]);
    let duplicates = receiver.log.lines();
    assert_eq!(duplicates.len(), 2, "{duplicates:?}");
    assert!(duplicates.iter().all(|l| l.starts_with("duplicate evt_1")));
}

#[tokio::test]
async fn forged_tampered_replayed_and_unsigned_deliveries_are_refused() {
    let receiver = start(SECRET).await;
    let body = event("evt_2");
    let forged = nexo_signature::sign(&[b"whsec_guessed".as_slice()], now(), body.as_bytes());
    let genuine = nexo_signature::sign(&[SECRET.as_bytes()], now(), body.as_bytes());
    let recorded_long_ago =
        nexo_signature::sign(&[SECRET.as_bytes()], now() - 301, body.as_bytes());
    let tampered = body.replace("100", "100000");

    for (what, signature, sent) in [
        ("forged", Some(forged), body.as_str()),
        ("tampered", Some(genuine.clone()), tampered.as_str()),
        ("replayed", Some(recorded_long_ago), body.as_str()),
        ("unsigned", None, body.as_str()),
    ] {
        let (status, reason) = deliver(&receiver.url, signature, sent).await;
        assert_eq!(status, 400, "{what}: {reason}");
    }
    assert!(receiver.out.lines().is_empty(), "nothing refused was taken");
    let log = receiver.log.lines();
    assert_eq!(log.len(), 4, "{log:?}");
    assert!(log[0].starts_with("refused (forged)"), "{log:?}");
    assert!(
        log[1].starts_with("refused (forged)"),
        "a tampered body fails like a forgery"
    );
    assert!(log[2].starts_with("refused (replayed or late)"), "{log:?}");
    assert!(log[3].starts_with("refused (unsigned)"), "{log:?}");

    // The genuine delivery, untouched, is still taken: the refusals left
    // nothing behind.
    let (status, _) = deliver(&receiver.url, Some(genuine), &body).await;
    assert_eq!(status, 200);
    assert_eq!(receiver.out.lines(), [body]);
}

#[tokio::test]
async fn either_secret_is_accepted_while_one_is_being_rotated() {
    let receiver = start("whsec_old,whsec_new").await;
    for (n, secret) in ["whsec_old", "whsec_new"].into_iter().enumerate() {
        let body = event(&format!("evt_rot_{n}"));
        let signature = nexo_signature::sign(&[secret.as_bytes()], now(), body.as_bytes());
        assert_eq!(deliver(&receiver.url, Some(signature), &body).await.0, 200);
    }
    assert_eq!(receiver.out.lines().len(), 2);
}
