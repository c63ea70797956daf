//! A TCP proxy on 127.0.0.1 that stands between a client and a server and
//! misbehaves on demand: it drops HTTP responses after the server wrote
//! them, hangs up once the request is delivered, or goes away entirely
//! (refusing new connections and cutting live ones) and comes back.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// What the proxy does with the next connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Copies bytes both ways.
    Forward,
    /// HTTP: delivers the request, reads the whole response from the server,
    /// keeps it, and closes the client's connection without sending it.
    DropResponse,
    /// HTTP: delivers the request, waits this long and closes both
    /// connections, before or while the server works on it.
    HangUpAfterRequest(std::time::Duration),
}

pub struct TcpProxy {
    pub addr: SocketAddr,
    upstream: SocketAddr,
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    behaviour: Behaviour,
    /// How many more connections get `behaviour`; then `Forward`.
    remaining: usize,
    accept_task: Option<JoinHandle<()>>,
    connections: Vec<AbortHandle>,
    /// Responses the proxy read from the server and did not deliver.
    dropped_responses: Vec<Bytes>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let proxy = Self {
            addr,
            upstream,
            inner: Arc::new(Mutex::new(Inner {
                behaviour: Behaviour::Forward,
                remaining: 0,
                accept_task: None,
                connections: Vec::new(),
                dropped_responses: Vec::new(),
            })),
        };
        proxy.serve(listener);
        proxy
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next `count` connections get `behaviour`.
    pub fn misbehave(&self, behaviour: Behaviour, count: usize) {
        let mut inner = self.inner.lock().unwrap();
        inner.behaviour = behaviour;
        inner.remaining = count;
    }

    pub fn dropped_responses(&self) -> Vec<Bytes> {
        self.inner.lock().unwrap().dropped_responses.clone()
    }

    /// Stops listening (new connections are refused) and cuts every live
    /// connection, as a server that crashed or restarted would.
    pub fn go_down(&self) {
        let mut inner = self.inner.lock().unwrap();
        if let Some(task) = inner.accept_task.take() {
            task.abort();
        }
        for connection in inner.connections.drain(..) {
            connection.abort();
        }
    }

    /// Listens again on the same address.
    pub async fn come_back(&self) {
        // The aborted accept task drops its listener at its next poll; retry
        // the bind briefly until the port is free again.
        for _ in 0..100 {
            if let Ok(listener) = TcpListener::bind(self.addr).await {
                self.serve(listener);
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("the proxy could not listen on {} again", self.addr);
    }

    fn serve(&self, listener: TcpListener) {
        let inner = self.inner.clone();
        let upstream = self.upstream;
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let behaviour = {
                    let mut state = inner.lock().unwrap();
                    if state.remaining > 0 {
                        state.remaining -= 1;
                        state.behaviour
                    } else {
                        Behaviour::Forward
                    }
                };
                let connection = tokio::spawn(relay(client, upstream, behaviour, inner.clone()));
                let mut state = inner.lock().unwrap();
                state.connections.retain(|c| !c.is_finished());
                state.connections.push(connection.abort_handle());
            }
        });
        self.inner.lock().unwrap().accept_task = Some(task);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.go_down();
    }
}

async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    behaviour: Behaviour,
    inner: Arc<Mutex<Inner>>,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    match behaviour {
        Behaviour::Forward => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
        Behaviour::DropResponse => {
            let Some(request) = read_http_message(&mut client).await else {
                return;
            };
            if server.write_all(&request).await.is_err() {
                return;
            }
            if let Some(response) = read_http_message(&mut server).await {
                inner.lock().unwrap().dropped_responses.push(response);
            }
            // Both sockets close here; the client never sees the answer.
        }
        Behaviour::HangUpAfterRequest(delay) => {
            if let Some(request) = read_http_message(&mut client).await {
                let _ = server.write_all(&request).await;
                let _ = server.flush().await;
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Reads one HTTP/1.1 message with a `Content-Length` body (what reqwest
/// sends and what the server answers here), returning its exact bytes.
pub async fn read_http_message(stream: &mut (impl AsyncRead + Unpin)) -> Option<Bytes> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = find(&buffer, b"\r\n\r\n") {
            break at + 4;
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap_or(0));
    while buffer.len() < head_end + length {
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    buffer.truncate(head_end + length);
    Some(Bytes::from(buffer))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The body of a raw HTTP message.
pub fn http_body(message: &[u8]) -> &[u8] {
    find(message, b"\r\n\r\n").map_or(&[], |at| &message[at + 4..])
}

/// Sends `request` as raw bytes on a new connection and reads one response:
/// for requests an HTTP client refuses to build (control characters or
/// non-ASCII bytes in headers, chunked bodies, repeated headers in odd forms).
pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> super::Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("request written");
    let message = read_http_message(&mut stream)
        .await
        .expect("the server answers with a whole HTTP response");
    let head_end = find(&message, b"\r\n\r\n").expect("a head") + 4;
    let head = String::from_utf8_lossy(&message[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let mut headers = reqwest::header::HeaderMap::new();
    for line in lines.filter(|l| !l.is_empty()) {
        if let Some((name, value)) = line.split_once(':')
            && let (Ok(name), Ok(value)) = (
                reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()),
                reqwest::header::HeaderValue::from_str(value.trim()),
            )
        {
            headers.append(name, value);
        }
    }
    super::Reply {
        status,
        headers,
        body: message.slice(head_end..),
    }
}
