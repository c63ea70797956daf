//! The delivery worker's HTTP client: HTTP/1.1 over plain TCP or TLS.
//! TLS is rustls with the ring provider (the one sqlx already uses for the
//! database), built from our own configuration rather than a process-wide
//! default, trusting the compiled-in webpki roots (the runtime image has no
//! system store) plus the certificates of `NEXO_WEBHOOK_CA_FILE`, for
//! receivers behind a private CA. ADR-012.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The most of a receiver's answer that is read (and thrown away, so the
/// connection can serve the next delivery); only its status counts.
pub const RESPONSE_BODY_MAX: usize = 64 * 1024;
/// The largest `NEXO_WEBHOOK_CA_FILE` read: a bundle of a few hundred
/// certificates is well below it.
pub const CA_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// An idle connection to a receiver is closed after this; an endpoint
/// with a steady flow of events keeps its one connection.
pub const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// What a receiver made of one delivery.
#[derive(Debug)]
pub enum Answer {
    Status(u16),
    Timeout,
    /// No answer: the URL, the connection or TLS failed; the text says why.
    Failed(String),
}

#[derive(Clone)]
pub struct DeliveryClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl DeliveryClient {
    /// `connect_timeout` bounds the TCP connection alone; each
    /// [`post`](Self::post) bounds the whole exchange.
    pub fn new(ca_file: Option<&Path>, connect_timeout: Duration) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(path) = ca_file {
            for cert in read_ca_file(path)? {
                roots.add(cert).map_err(|e| {
                    format!(
                        "NEXO_WEBHOOK_CA_FILE {}: a certificate is not usable as a root: {e}",
                        path.display()
                    )
                })?;
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("the webhook client's TLS configuration: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut tcp = HttpConnector::new();
        // The https connector below decides the scheme.
        tcp.enforce_http(false);
        tcp.set_connect_timeout(Some(connect_timeout));
        tcp.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(IDLE_CONNECTION_TIMEOUT)
            // One request in flight per endpoint (the worker's lease).
            .pool_max_idle_per_host(1)
            .build(connector);
        Ok(Self { client })
    }

    /// POSTs `body` to `url`, following no redirect; the status is known
    /// (or the attempt a timeout) within `timeout`, connecting included.
    pub async fn post(
        &self,
        url: &str,
        headers: HeaderMap,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Answer {
        let uri = match request_uri(url) {
            Ok(uri) => uri,
            Err(why) => return Answer::Failed(why),
        };
        let mut request = http::Request::new(Full::new(Bytes::from(body)));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        request.headers_mut().insert(
            header::USER_AGENT,
            HeaderValue::from_static(concat!("nexo-transfers/", env!("CARGO_PKG_VERSION"))),
        );
        let deadline = tokio::time::Instant::now() + timeout;
        match tokio::time::timeout_at(deadline, self.client.request(request)).await {
            Err(_) => Answer::Timeout,
            Ok(Err(e)) => Answer::Failed(error_chain(&e)),
            Ok(Ok(response)) => {
                let status = response.status().as_u16();
                // Only read so the connection can be kept; whatever happens
                // to the rest of the answer, the status stands.
                let _ = tokio::time::timeout_at(
                    deadline,
                    Limited::new(response.into_body(), RESPONSE_BODY_MAX).collect(),
                )
                .await;
                Answer::Status(status)
            }
        }
    }
}

/// The URL as a browser would send it (punycode host, percent-encoded
/// path), in the form hyper takes; endpoints are checked with it when
/// they are registered, so the worker never meets one it cannot send to.
pub fn request_uri(raw: &str) -> Result<http::Uri, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("the URL is not valid: {e}"))?;
    url.as_str()
        .parse::<http::Uri>()
        .map_err(|e| format!("the URL is not valid: {e}"))
}

fn read_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let named = |why: String| format!("NEXO_WEBHOOK_CA_FILE {}: {why}", path.display());
    let size = std::fs::metadata(path)
        .map_err(|e| named(e.to_string()))?
        .len();
    if size > CA_FILE_BYTES_MAX {
        return Err(named(format!(
            "is {size} bytes, more than the {CA_FILE_BYTES_MAX} read"
        )));
    }
    let pem = std::fs::read(path).map_err(|e| named(e.to_string()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| named(format!("is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(named("holds no CERTIFICATE block".to_owned()));
    }
    Ok(certs)
}

/// The error and its causes: the outermost text alone ("client error
/// (Connect)") does not say what went wrong.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
