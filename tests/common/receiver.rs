//! A webhook receiver on a real socket whose behaviour a test switches at
//! runtime: answer 200, fail with 500, hang (never answer), answer slowly,
//! or be down (its listener closed, so connections are refused). It
//! records every request that reached it: which event, which attempt,
//! whether the signature verifies, when, and how many requests to the same
//! path were in flight at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::routing::post;
use serde_json::Value;
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ok,
    Fail,
    Hang,
    Slow(Duration),
}

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub path: String,
    pub event_id: String,
    pub attempt: i32,
    pub signature_ok: bool,
    pub at: Instant,
    pub body: Value,
    /// Requests to the same path in flight when this one arrived, itself
    /// included.
    pub in_flight: usize,
    /// What the receiver answered (0 for a hang).
    pub answered: u16,
}

#[derive(Default)]
struct Shared {
    mode: HashMap<String, Mode>,
    secrets: HashMap<String, Vec<String>>,
    deliveries: Vec<Delivery>,
    in_flight: HashMap<String, usize>,
    max_in_flight: HashMap<String, usize>,
}

#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    server: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Receiver {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let receiver = Self {
            addr,
            shared: Arc::default(),
            server: Arc::default(),
        };
        receiver.serve(listener);
        receiver
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let app = Router::new()
            .fallback(post(receive))
            .with_state(Arc::clone(&self.shared));
        let handle = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        *self.server.lock().unwrap() = Some(handle);
    }

    /// The URL of one endpoint on this receiver.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn set_secret(&self, path: &str, secrets: &[&str]) {
        self.shared.lock().unwrap().secrets.insert(
            path.to_owned(),
            secrets.iter().map(|s| (*s).to_owned()).collect(),
        );
    }

    pub fn set_mode(&self, path: &str, mode: Mode) {
        self.shared
            .lock()
            .unwrap()
            .mode
            .insert(path.to_owned(), mode);
    }

    /// Closes the listener: new connections are refused.
    pub fn go_down(&self) {
        if let Some(handle) = self.server.lock().unwrap().take() {
            handle.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn come_back(&self) {
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(listener) => break listener,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("rebinding {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    pub fn deliveries(&self, path: &str) -> Vec<Delivery> {
        self.shared
            .lock()
            .unwrap()
            .deliveries
            .iter()
            .filter(|d| d.path == path)
            .cloned()
            .collect()
    }

    pub fn max_in_flight(&self, path: &str) -> usize {
        self.shared
            .lock()
            .unwrap()
            .max_in_flight
            .get(path)
            .copied()
            .unwrap_or(0)
    }
}

/// Leaves the in-flight count when the request ends, however it ends (a
/// hung one ends when the client gives up and the connection closes).
struct InFlight {
    shared: Arc<Mutex<Shared>>,
    path: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut shared) = self.shared.lock()
            && let Some(n) = shared.in_flight.get_mut(&self.path)
        {
            *n = n.saturating_sub(1);
        }
    }
}

async fn receive(
    State(shared): State<Arc<Mutex<Shared>>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1]) {
    let path = uri.path().to_owned();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (mode, index) = {
        let mut s = shared.lock().unwrap();
        let secrets: Vec<String> = s.secrets.get(&path).cloned().unwrap_or_default();
        let keys: Vec<&[u8]> = secrets.iter().map(String::as_bytes).collect();
        let signature_ok = nexo_signature::verify(
            header(nexo_signature::HEADER).as_deref(),
            &body,
            &keys,
            chrono::Utc::now().timestamp(),
            nexo_signature::DEFAULT_TOLERANCE,
        )
        .is_ok();
        let in_flight = {
            let n = s.in_flight.entry(path.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let max = s.max_in_flight.entry(path.clone()).or_insert(0);
        *max = (*max).max(in_flight);
        let mode = s.mode.get(&path).copied().unwrap_or(Mode::Ok);
        s.deliveries.push(Delivery {
            path: path.clone(),
            event_id: header("nexo-event-id").unwrap_or_default(),
            attempt: header("nexo-delivery-attempt")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
            signature_ok,
            at: Instant::now(),
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            in_flight,
            answered: 0,
        });
        (mode, s.deliveries.len() - 1)
    };
    let _in_flight = InFlight {
        shared: Arc::clone(&shared),
        path,
    };
    let status = match mode {
        Mode::Ok => StatusCode::OK,
        Mode::Fail => StatusCode::INTERNAL_SERVER_ERROR,
        Mode::Slow(delay) => {
            tokio::time::sleep(delay).await;
            StatusCode::OK
        }
        Mode::Hang => {
            std::future::pending::<()>().await;
            StatusCode::OK
        }
    };
    shared.lock().unwrap().deliveries[index].answered = status.as_u16();
    // No connection outlives its request: a receiver that goes down must
    // not keep answering on a kept-alive connection.
    (status, [(header::CONNECTION, "close")])
}
