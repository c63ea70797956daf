//! The real `nexo-transfers` binary as a child process, for the tests where
//! the process itself must die (SIGKILL), stop (SIGTERM) or run several
//! times against one database.

use std::net::SocketAddr;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use super::Reply;

/// How long a child may take from spawn to listening: migrations and demo
/// fixtures on a loaded 2-core CI machine take a few seconds at worst.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections per child: several children and the rest of the suite share
/// one PostgreSQL capped at 100 connections.
pub const CHILD_POOL_MAX: &str = "4";

/// The URL of the database behind `pool` (a `#[sqlx::test]` database), with
/// the credentials and host of `DATABASE_URL`.
pub fn database_url(pool: &PgPool) -> String {
    let options = pool.connect_options();
    let name = options
        .get_database()
        .expect("test pool names its database");
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for the tests");
    let mut url = url::Url::parse(&base).expect("DATABASE_URL is a URL");
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// The same URL pointing at another port of the same host (a proxy).
pub fn database_url_via(pool: &PgPool, port: u16) -> String {
    let mut url = url::Url::parse(&database_url(pool)).expect("URL");
    url.set_host(Some("127.0.0.1")).expect("host");
    url.set_port(Some(port)).expect("port");
    url.to_string()
}

/// One running `nexo-transfers serve --demo` on 127.0.0.1 and a port the
/// kernel picked, read back from its `listening` log line.
pub struct ServerProcess {
    child: Child,
    pub addr: SocketAddr,
    pub base: String,
    logs: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Starts the binary with `DATABASE_URL` and extra environment, waits
    /// until it listens. Logs are JSON lines, kept for inspection.
    pub async fn start(database_url: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_nexo-transfers"));
        command
            .args(["serve", "--demo", "--bind", "127.0.0.1:0"])
            .env("DATABASE_URL", database_url)
            .env("NEXO_LOG_FORMAT", "json")
            .env("NEXO_DB_POOL_MAX", CHILD_POOL_MAX)
            .env_remove("FAILPOINTS")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("the server binary starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = oneshot::channel::<SocketAddr>();
        let sink = logs.clone();
        tokio::spawn(async move {
            let mut addr_tx = Some(addr_tx);
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = listening_addr(&line)
                    && let Some(tx) = addr_tx.take()
                {
                    let _ = tx.send(addr);
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = match tokio::time::timeout(START_TIMEOUT, addr_rx).await {
            Ok(Ok(addr)) => addr,
            _ => {
                let _ = child.start_kill();
                panic!(
                    "the server did not start listening; its log:\n{}",
                    logs.lock().unwrap().join("\n")
                );
            }
        };
        Self {
            child,
            addr,
            base: format!("http://{addr}"),
            logs,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id().expect("the child is running") as i32)
    }

    /// SIGKILL: no shutdown, no flush, open transactions die with the socket.
    pub async fn kill(mut self) -> Vec<String> {
        self.child.start_kill().expect("SIGKILL sent");
        self.child.wait().await.expect("the child is reaped");
        self.logs()
    }

    /// SIGTERM: the graceful path.
    pub fn terminate(&self) {
        signal::kill(self.pid(), Signal::SIGTERM).expect("SIGTERM sent");
    }

    /// Waits for the process to exit by itself, at most `limit`.
    pub async fn wait(&mut self, limit: Duration) -> ExitStatus {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("the child is reaped"),
            Err(_) => panic!("the server did not exit within {limit:?}"),
        }
    }

    /// Every log line written so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }
}

fn listening_addr(line: &str) -> Option<SocketAddr> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    let fields = value.get("fields")?;
    if fields.get("message")?.as_str()? != "listening" {
        return None;
    }
    fields.get("addr")?.as_str()?.parse().ok()
}

/// A client for fault tests: no connection reuse (a killed server leaves
/// dead pooled connections behind) and a bounded wait per request.
pub fn fault_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

/// `POST /transfers` that reports transport failures instead of panicking:
/// in these tests a refused or cut connection is an expected outcome.
pub async fn try_post_transfer(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    key: &str,
    body: &serde_json::Value,
) -> Result<Reply, reqwest::Error> {
    let response = client
        .post(format!("{base}/transfers"))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?;
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// Sends the same intent (same key, same body) until it gets a definitive
/// answer: a 409 waits its `Retry-After`, a 5xx or a transport failure a
/// moment, as a well-behaved client would. Panics past `deadline`.
pub async fn send_until_answered(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    key: &str,
    body: &serde_json::Value,
    deadline: tokio::time::Instant,
) -> Reply {
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "intent {key} got no definitive answer in time"
        );
        match try_post_transfer(client, base, token, key, body).await {
            Ok(reply) if reply.status == 409 || reply.status >= 500 => {
                let wait = reply
                    .header("retry-after")
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(1);
                tokio::time::sleep(Duration::from_secs(wait)).await;
            }
            Ok(reply) => return reply,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// One intent sent by a [`TransferStream`] and what came back the first time.
#[derive(Debug, Clone)]
pub struct Sent {
    pub key: String,
    pub body: serde_json::Value,
    pub amount: i64,
    pub sent_at: tokio::time::Instant,
    /// The first answer, or `None` when the connection failed.
    pub first: Option<Reply>,
    pub answered_at: Option<tokio::time::Instant>,
}

/// Concurrent clients that each send fresh intents (a new key each, A to B
/// in USD, 1 to 100 cents) one after another to whatever server is current,
/// recording every answer; bounded by an intent count.
pub struct TransferStream {
    target: Arc<std::sync::RwLock<Option<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    clients: Vec<tokio::task::JoinHandle<Vec<Sent>>>,
}

impl TransferStream {
    pub fn start(base: &str, clients: usize, pace: Duration, intents_max: usize) -> Self {
        use rand::Rng;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let target = Arc::new(std::sync::RwLock::new(Some(base.to_owned())));
        let stop = Arc::new(AtomicBool::new(false));
        let counter = Arc::new(AtomicUsize::new(0));
        let clients = (0..clients)
            .map(|_| {
                let (target, stop, counter) = (target.clone(), stop.clone(), counter.clone());
                tokio::spawn(async move {
                    let client = fault_client(Duration::from_secs(30));
                    let mut sent = Vec::new();
                    while !stop.load(Ordering::SeqCst) {
                        let Some(base) = target.read().unwrap().clone() else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        if counter.fetch_add(1, Ordering::SeqCst) >= intents_max {
                            break;
                        }
                        let amount = rand::rng().random_range(1..=100);
                        let (key, body) = (
                            super::new_key(),
                            super::transfer(super::A_USD, super::B_USD, amount, "USD"),
                        );
                        let sent_at = tokio::time::Instant::now();
                        let first = try_post_transfer(&client, &base, super::TOKEN_A, &key, &body)
                            .await
                            .ok();
                        let answered_at = first.as_ref().map(|_| tokio::time::Instant::now());
                        sent.push(Sent {
                            key,
                            body,
                            amount,
                            sent_at,
                            first,
                            answered_at,
                        });
                        tokio::time::sleep(pace).await;
                    }
                    sent
                })
            })
            .collect();
        Self {
            target,
            stop,
            clients,
        }
    }

    /// New intents wait until [`retarget`](Self::retarget).
    pub fn pause(&self) {
        *self.target.write().unwrap() = None;
    }

    pub fn retarget(&self, base: &str) {
        *self.target.write().unwrap() = Some(base.to_owned());
    }

    pub async fn stop(self) -> Vec<Sent> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut all = Vec::new();
        for client in self.clients {
            all.extend(client.await.expect("a stream client panicked"));
        }
        all
    }
}

/// Sends every intent again until answered: an intent answered 201 before
/// must replay those exact bytes, and one that got no answer, or a 5xx, must
/// now get its one result. Returns every 201 seen per key, for
/// [`super::assert_each_intent_moved_once`].
pub async fn retry_all(sent: &[Sent], base: &str) -> Vec<(String, Vec<Reply>)> {
    let client = fault_client(Duration::from_secs(30));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let retries =
        futures::future::join_all(sent.iter().map(|s| {
            send_until_answered(&client, base, super::TOKEN_A, &s.key, &s.body, deadline)
        }))
        .await;
    sent.iter()
        .zip(retries)
        .map(|(s, retry)| {
            let mut replies = vec![retry.clone()];
            if let Some(first) = s.first.as_ref().filter(|r| r.status == 201) {
                assert!(retry.replayed(), "{} executed twice", s.key);
                assert_eq!(
                    first.body, retry.body,
                    "a replay differs from the first answer"
                );
                replies.push(first.clone());
            }
            (s.key.clone(), replies)
        })
        .collect()
}

/// Total amount of the intents, which is what must have moved A to B.
pub fn total_amount(sent: &[Sent]) -> i64 {
    sent.iter().map(|s| s.amount).sum()
}

/// `GET path` with a bearer token, read whole; panics on a transport error.
pub async fn get_with(client: &reqwest::Client, url: &str, token: &str) -> Reply {
    let response = client
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .expect("answered");
    Reply::read(response).await
}
