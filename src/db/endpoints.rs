//! Where the database is: one host, or several of which one is the
//! primary (libpq's multi-host form, `postgres://h1:p1,h2:p2/db?
//! target_session_attrs=read-write`, which sqlx does not parse), and which
//! host is the primary now.

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
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointsError {
    #[error("DATABASE_URL must look like postgres://user@host:port/database")]
    NotAUrl,
    #[error("DATABASE_URL lists an empty host")]
    EmptyHost,
    #[error("target_session_attrs={0} is not supported (use read-write, primary or any)")]
    SessionAttrs(String),
}

impl Endpoints {
    pub fn parse(url: &str) -> Result<Self, EndpointsError> {
        let (scheme, rest) = url.split_once("://").ok_or(EndpointsError::NotAUrl)?;
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
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    read_write = match value {
                        "read-write" | "primary" => true,
                        "any" => false,
                        other => return Err(EndpointsError::SessionAttrs(other.to_owned())),
                    }
                }
                _ => kept.push(pair),
            }
        }
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
        Ok(Self { urls, read_write })
    }

    pub fn is_single(&self) -> bool {
        self.urls.len() == 1
    }

    /// The first host that answers and, when writes are required, is not
    /// in recovery: its URL. Probed on the `postgres` database, which
    /// exists before ours is created.
    pub async fn find_primary(&self) -> Result<&str, sqlx::Error> {
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

    #[test]
    fn malformed_urls_and_unknown_session_attributes_are_refused() {
        assert_eq!(Endpoints::parse("not-a-url"), Err(EndpointsError::NotAUrl));
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
