//! Where the database is: one host, or several of which one is the
//! primary (libpq's multi-host form, `postgres://h1:p1,h2:p2/db?
//! target_session_attrs=read-write`, which sqlx does not parse), and which
//! host is the primary now.
//!
//! TLS settings in the query (`sslmode`, `sslrootcert`) apply to every
//! host; each host's certificate is checked against its own name.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

/// How long probing one host may take before the next is tried.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The hosts of a `DATABASE_URL`, each as a single-host URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    pub urls: Vec<String>,
    /// Connect only to a server that accepts writes (libpq's
    /// `target_session_attrs=read-write` or `primary`). The default with
    /// several hosts: this service writes.
    pub read_write: bool,
    /// The CA file that server certificates are verified against, when the
    /// URL's `sslmode` verifies them and `sslrootcert` names a file (not
    /// inline PEM): [`Self::find_primary`] opens it first, so that a wrong
    /// path is reported as such and not as a failed connection.
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointsError {
    #[error("DATABASE_URL must look like postgres://user@host:port/database")]
    NotAUrl,
    #[error("DATABASE_URL must be a postgres:// or postgresql:// URL, not {0}://")]
    NotPostgres(String),
    #[error("DATABASE_URL lists an empty host")]
    EmptyHost,
    #[error("target_session_attrs={0} is not supported (use read-write, primary or any)")]
    SessionAttrs(String),
}

impl Endpoints {
    pub fn parse(url: &str) -> Result<Self, EndpointsError> {
        let (scheme, rest) = url.split_once("://").ok_or(EndpointsError::NotAUrl)?;
        // A mysql:// URL otherwise reaches a MariaDB and fails mid-protocol
        // with a message about neither.
        if !matches!(scheme, "postgres" | "postgresql") {
            return Err(EndpointsError::NotPostgres(
                scheme.chars().take(32).collect(),
            ));
        }
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let several = hosts.contains(',');
        let mut read_write = several;
        let mut kept = Vec::new();
        let mut ssl_mode = None;
        let mut root_cert = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    read_write = match value {
                        "read-write" | "primary" => true,
                        "any" => false,
                        other => return Err(EndpointsError::SessionAttrs(other.to_owned())),
                    }
                }
                // The spellings sqlx accepts besides libpq's.
                Some(("sslmode" | "ssl-mode", value)) => {
                    ssl_mode = Some((kept.len(), value));
                    kept.push(pair);
                }
                Some(("sslrootcert" | "ssl-root-cert" | "ssl-ca", value)) => {
                    root_cert = Some(value);
                    kept.push(pair);
                }
                _ => kept.push(pair),
            }
        }
        // libpq checks the server's CA under `require` when a root
        // certificate is given, and sqlx would not: an operator who names
        // a CA expects it to be checked.
        if let (Some((at, "require")), Some(_)) = (ssl_mode, root_cert) {
            kept[at] = "sslmode=verify-ca";
            ssl_mode = Some((at, "verify-ca"));
        }
        let verifies = matches!(ssl_mode, Some((_, "verify-ca" | "verify-full")));
        let ca_file = root_cert
            .filter(|_| verifies)
            .map(percent_decoded)
            .filter(|path| !path.trim_start().starts_with("-----BEGIN"))
            .map(PathBuf::from);
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let urls = hosts
            .split(',')
            .map(|host| {
                if host.is_empty() && several {
                    Err(EndpointsError::EmptyHost)
                } else {
                    Ok(format!("{scheme}://{userinfo}{host}{path}{query}"))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            urls,
            read_write,
            ca_file,
        })
    }

    pub fn is_single(&self) -> bool {
        self.urls.len() == 1
    }

    /// The first host that answers and, when writes are required, is not
    /// in recovery: its URL. Probed on the `postgres` database, which
    /// exists before ours is created.
    pub async fn find_primary(&self) -> Result<&str, sqlx::Error> {
        // sqlx reads the file only while connecting, and a missing one then
        // reads as "error communicating with database: No such file".
        if let Some(path) = &self.ca_file
            && let Err(e) = std::fs::File::open(path)
        {
            return Err(sqlx::Error::Configuration(
                format!("sslrootcert {}: {e}", path.display()).into(),
            ));
        }
        if self.is_single() || !self.read_write {
            return Ok(&self.urls[0]);
        }
        let mut last_error = sqlx::Error::PoolTimedOut;
        for url in &self.urls {
            let options = PgConnectOptions::from_str(url)?.database("postgres");
            let probe = async {
                let mut conn = PgConnection::connect_with(&options).await?;
                let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                    .fetch_one(&mut conn)
                    .await?;
                let _ = conn.close().await;
                Ok::<bool, sqlx::Error>(in_recovery)
            };
            match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                Ok(Ok(false)) => return Ok(url),
                Ok(Ok(true)) => {}
                Ok(Err(e)) => last_error = e,
                Err(_) => last_error = sqlx::Error::PoolTimedOut,
            }
        }
        Err(last_error)
    }
}

/// A query value as the URL parser that sqlx uses reads it: `+` is a
/// space, a `%` not followed by two hex digits stays as it is.
fn percent_decoded(raw: &str) -> String {
    let mut bytes = Vec::with_capacity(raw.len());
    let mut rest = raw.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        let escaped = tail
            .split_at_checked(2)
            .filter(|(hex, _)| first == b'%' && hex.iter().all(u8::is_ascii_hexdigit))
            .and_then(|(hex, after)| {
                let hex = std::str::from_utf8(hex).ok()?;
                Some((u8::from_str_radix(hex, 16).ok()?, after))
            });
        match (escaped, first) {
            (Some((byte, after)), _) => {
                bytes.push(byte);
                rest = after;
            }
            (None, b'+') => {
                bytes.push(b' ');
                rest = tail;
            }
            (None, other) => {
                bytes.push(other);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_host_url_is_kept_as_it_is() {
        let url = "postgres://postgres:pw@localhost:5432/nexo?sslmode=disable";
        let endpoints = Endpoints::parse(url).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(endpoints.urls, [url]);
        assert!(!endpoints.read_write);
    }

    #[test]
    fn a_multi_host_url_becomes_one_url_per_host_targeting_the_primary() {
        let endpoints = Endpoints::parse(
            "postgres://app@10.0.0.1:5432,10.0.0.2:5433/nexo?target_session_attrs=read-write&application_name=x",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            endpoints.urls,
            [
                "postgres://app@10.0.0.1:5432/nexo?application_name=x",
                "postgres://app@10.0.0.2:5433/nexo?application_name=x"
            ]
        );
        assert!(endpoints.read_write);
        let any = Endpoints::parse("postgres://a:1,b:2/db?target_session_attrs=any")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!any.read_write);
        assert!(Endpoints::parse("postgres://a:1,b:2/db").is_ok_and(|e| e.read_write));
    }

    fn options(url: &str) -> PgConnectOptions {
        PgConnectOptions::from_str(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn every_sslmode_and_the_ca_reach_every_host() {
        // PgSslMode has no PartialEq: its Debug names the variant.
        for (mode, expected) in [
            ("disable", "Disable"),
            ("prefer", "Prefer"),
            ("require", "Require"),
            ("verify-ca", "VerifyCa"),
            ("verify-full", "VerifyFull"),
        ] {
            let endpoints = Endpoints::parse(&format!(
                "postgres://app:pw@db1.example:5432,db2.example:5433/nexo?sslmode={mode}&target_session_attrs=read-write"
            ))
            .unwrap_or_else(|e| panic!("{e}"));
            let hosts: Vec<_> = endpoints.urls.iter().map(|url| options(url)).collect();
            let expected_hosts = [("db1.example", 5432), ("db2.example", 5433)];
            assert_eq!(hosts.len(), expected_hosts.len());
            for (host, (name, port)) in hosts.iter().zip(expected_hosts) {
                assert_eq!(format!("{:?}", host.get_ssl_mode()), expected, "{name}");
                // verify-full checks each host's certificate against its own name.
                assert_eq!((host.get_host(), host.get_port()), (name, port));
                assert_eq!(host.get_database(), Some("nexo"));
            }
        }

        let endpoints = Endpoints::parse(
            "postgres://app@db1.example,db2.example/nexo?sslmode=verify-full&sslrootcert=/etc/nexo/ca.pem",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            endpoints.urls,
            [
                "postgres://app@db1.example/nexo?sslmode=verify-full&sslrootcert=/etc/nexo/ca.pem",
                "postgres://app@db2.example/nexo?sslmode=verify-full&sslrootcert=/etc/nexo/ca.pem"
            ]
        );
        assert_eq!(endpoints.ca_file, Some(PathBuf::from("/etc/nexo/ca.pem")));
    }

    #[test]
    fn require_with_a_root_certificate_checks_the_ca_as_libpq_does() {
        let endpoints = Endpoints::parse(
            "postgres://app@a:1,b:2/nexo?sslmode=require&application_name=x&sslrootcert=/ca.pem",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            endpoints.urls,
            [
                "postgres://app@a:1/nexo?sslmode=verify-ca&application_name=x&sslrootcert=/ca.pem",
                "postgres://app@b:2/nexo?sslmode=verify-ca&application_name=x&sslrootcert=/ca.pem"
            ]
        );
        assert_eq!(endpoints.ca_file, Some(PathBuf::from("/ca.pem")));

        let without_ca = Endpoints::parse("postgres://app@a:1/nexo?sslmode=require")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(without_ca.urls, ["postgres://app@a:1/nexo?sslmode=require"]);
        assert_eq!(without_ca.ca_file, None);

        // Neither prefer nor the default checks certificates: the CA is unused.
        for url in [
            "postgres://app@a:1/nexo?sslmode=prefer&sslrootcert=/ca.pem",
            "postgres://app@a:1/nexo?sslrootcert=/ca.pem",
        ] {
            let endpoints = Endpoints::parse(url).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(endpoints.urls, [url]);
            assert_eq!(endpoints.ca_file, None);
        }
    }

    #[test]
    fn the_ca_file_is_read_as_sqlx_reads_it_and_inline_pem_is_no_file() {
        let encoded = Endpoints::parse(
            "postgres://a:1/db?ssl-mode=verify-ca&ssl-ca=%2Fsecrets%2Fmy+ca%2b1.pem",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(encoded.ca_file, Some(PathBuf::from("/secrets/my ca+1.pem")));
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("%zz%+1%41"), "%zz% 1A");
        assert_eq!(percent_decoded("caf%C3%A9"), "café");

        let inline = Endpoints::parse(
            "postgres://a:1/db?sslmode=verify-full&sslrootcert=-----BEGIN%20CERTIFICATE-----%0AMIIB%0A-----END%20CERTIFICATE-----",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(inline.ca_file, None);
    }

    #[tokio::test]
    async fn a_missing_ca_file_is_reported_by_its_path_before_any_connection() {
        // One host: without the check its URL would come back unprobed.
        let endpoints = Endpoints::parse(
            "postgres://nowhere.invalid:1/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let error = match endpoints.find_primary().await {
            Ok(url) => panic!("{url} was returned"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains("sslrootcert /nonexistent/ca.pem: No such file or directory"),
            "{error}"
        );
    }

    #[test]
    fn malformed_urls_and_unknown_session_attributes_are_refused() {
        assert_eq!(Endpoints::parse("not-a-url"), Err(EndpointsError::NotAUrl));
        assert_eq!(
            Endpoints::parse("mysql://root@localhost:3306/nexo"),
            Err(EndpointsError::NotPostgres("mysql".to_owned()))
        );
        assert!(Endpoints::parse("postgresql://u@h:5432/d").is_ok());
        assert_eq!(
            Endpoints::parse("postgres://a:1,,b:2/db"),
            Err(EndpointsError::EmptyHost)
        );
        assert_eq!(
            Endpoints::parse("postgres://a:1,b:2/db?target_session_attrs=standby"),
            Err(EndpointsError::SessionAttrs("standby".to_owned()))
        );
    }
}
