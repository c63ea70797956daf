#![allow(clippy::unwrap_used, clippy::expect_used)]
//! TLS to PostgreSQL, against a private PostgreSQL cluster whose
//! pg_hba.conf accepts only TLS connections, with a certificate signed by a
//! CA made for the test: every `sslmode` does what libpq's does, a CA given
//! with `sslrootcert` is checked, and the server binary runs its whole
//! path (create, migrate, post a transfer) over a verified connection.
//!
//! Needs the PostgreSQL server binaries (`PG_BIN`, by default those of
//! PostgreSQL 15) and the `openssl` command. As root, the cluster runs as
//! the `postgres` user. The shared server of `DATABASE_URL` is not used.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::*;
use common::*;
use nexo_transfers::config::DbConfig;
use sqlx::PgPool;

const DEFAULT_PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A PostgreSQL cluster of its own in a temporary directory, with
/// `ssl = on` and only `hostssl` connections allowed. Stopped and removed
/// when dropped, also when the test fails.
struct TlsCluster {
    dir: PathBuf,
    port: u16,
    pg_bin: PathBuf,
    /// The CA that signed the server's certificate (SAN `localhost`).
    ca: PathBuf,
    /// A CA that signed nothing the server shows.
    other_ca: PathBuf,
}

impl TlsCluster {
    fn start(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("nexo-pg-tls-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("certs")).unwrap();
        let cluster = Self {
            port: free_port(),
            pg_bin: std::env::var_os("PG_BIN").map_or_else(|| DEFAULT_PG_BIN.into(), PathBuf::from),
            ca: dir.join("certs/ca.crt"),
            other_ca: dir.join("certs/other-ca.crt"),
            dir,
        };
        cluster.make_certificates();
        if running_as_root() {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&cluster.dir));
        }
        let data = cluster.dir.join("data");
        run(cluster
            .as_postgres("initdb")
            .args([
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(&data));
        let certs = cluster.dir.join("certs");
        let settings = format!(
            "listen_addresses = '127.0.0.1'\n\
             port = {port}\n\
             unix_socket_directories = '{dir}'\n\
             ssl = on\n\
             ssl_cert_file = '{certs}/server.crt'\n\
             ssl_key_file = '{certs}/server.key'\n\
             fsync = off\n\
             max_connections = 40\n",
            port = cluster.port,
            dir = cluster.dir.display(),
            certs = certs.display(),
        );
        append(&data.join("postgresql.conf"), &settings);
        // Replaces initdb's file: TLS or nothing over TCP.
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all 127.0.0.1/32 reject\n",
        )
        .unwrap();
        run(cluster
            .as_postgres("pg_ctl")
            .args(["-w", "-t", "60", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(cluster.dir.join("postgres.log"))
            .arg("start"));
        cluster
    }

    /// A self-signed CA, a server key and certificate it signs, and a second
    /// CA that signs nothing. EC keys: generated in milliseconds.
    fn make_certificates(&self) {
        let certs = self.dir.join("certs");
        let openssl = |args: &str| {
            run(Command::new("openssl")
                .current_dir(&certs)
                .args(args.split_whitespace()));
        };
        const EC: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for name in ["ca", "other-ca"] {
            openssl(&format!(
                "req -x509 -new {EC} -days 2 -subj /CN={name} \
                 -addext basicConstraints=critical,CA:TRUE \
                 -addext keyUsage=critical,keyCertSign,cRLSign \
                 -keyout {name}.key -out {name}.crt"
            ));
        }
        std::fs::write(
            certs.join("server.ext"),
            "subjectAltName = DNS:localhost\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature\n\
             extendedKeyUsage = serverAuth\n",
        )
        .unwrap();
        openssl(&format!(
            "req -new {EC} -subj /CN=localhost -keyout server.key -out server.csr"
        ));
        openssl(
            "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
             -extfile server.ext -out server.crt",
        );
        // PostgreSQL refuses a key that others may read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            certs.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
    }

    fn as_postgres(&self, program: &str) -> Command {
        let program = self.pg_bin.join(program);
        if running_as_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    /// The database `nexo_transfers` on this cluster, through `host`.
    fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/nexo_transfers?{query}",
            self.port
        )
    }

    fn ca(&self) -> String {
        self.ca.display().to_string()
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        let _ = self
            .as_postgres("pg_ctl")
            .args(["-w", "-m", "immediate", "-D"])
            .arg(self.dir.join("data"))
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn running_as_root() -> bool {
    let id = Command::new("id").arg("-u").output().unwrap();
    String::from_utf8_lossy(&id.stdout).trim() == "0"
}

fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    file.write_all(text.as_bytes()).unwrap();
}

/// The service's own way in: endpoints, database creation, the pool.
async fn connect(database_url: &str) -> Result<PgPool, nexo_transfers::db::ConnectError> {
    nexo_transfers::db::connect(
        &DbConfig {
            database_url: database_url.to_owned(),
            db_pool_max: 2,
            db_acquire_timeout: Duration::from_secs(10),
        },
        nexo_transfers::db::MissingDatabase::Create,
    )
    .await
}

/// Whether the connection that runs the query is encrypted, seen by the
/// server, and with which protocol.
async fn ssl_of_session(pool: &PgPool) -> (bool, String) {
    sqlx::query_as(
        "SELECT ssl, coalesce(version, '') FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn assert_encrypted(url: &str) -> PgPool {
    let pool = connect(url)
        .await
        .unwrap_or_else(|e| panic!("{url} connects: {e}"));
    let (ssl, version) = ssl_of_session(&pool).await;
    assert!(ssl, "{url}: the session is encrypted");
    assert!(version.starts_with("TLSv1."), "{url}: {version}");
    pool
}

async fn refused(url: &str) -> String {
    match connect(url).await {
        Ok(_) => panic!("{url} connected"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn every_sslmode_does_what_libpq_does_against_a_tls_only_server() {
    let started = Instant::now();
    let cluster = TlsCluster::start("modes");
    let ca = cluster.ca();

    // Encrypted, certificate unchecked. The first connection also creates
    // the database, through the `postgres` maintenance database over TLS.
    assert_encrypted(&cluster.url("127.0.0.1", "sslmode=require")).await;
    // The default: TLS when the server offers it.
    assert_encrypted(&cluster.url("127.0.0.1", "sslmode=prefer")).await;
    assert_encrypted(&cluster.url("127.0.0.1", "")).await;
    // The CA is checked, the name is not: 127.0.0.1 is not in the SAN.
    assert_encrypted(&cluster.url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}")))
        .await;
    // CA and name.
    assert_encrypted(&cluster.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;

    let error = refused(&cluster.url(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert!(
        error.contains(r#"certificate not valid for name "127.0.0.1""#),
        "a name not in the certificate: {error}"
    );

    let other = cluster.other_ca.display();
    let error = refused(&cluster.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={other}"),
    ))
    .await;
    assert!(
        error.contains("invalid peer certificate") && error.contains("UnknownIssuer"),
        "a CA that did not sign the server's certificate: {error}"
    );
    // As with libpq, `require` with a CA checks it.
    let error =
        refused(&cluster.url("localhost", &format!("sslmode=require&sslrootcert={other}"))).await;
    assert!(
        error.contains("UnknownIssuer"),
        "require with a CA: {error}"
    );

    let error = refused(&cluster.url("127.0.0.1", "sslmode=disable")).await;
    assert!(
        error.contains("pg_hba.conf rejects connection") && error.contains("no encryption"),
        "the server refuses a connection without TLS: {error}"
    );

    // Several hosts: the TLS settings reach each one, and each is checked
    // against its own name. The first fails verify-full, the second is
    // the primary found.
    let pool = assert_encrypted(&format!(
        "postgres://postgres@127.0.0.1:{port},localhost:{port}/nexo_transfers?sslmode=verify-full&sslrootcert={ca}",
        port = cluster.port
    ))
    .await;
    assert_eq!(pool.connect_options().get_host(), "localhost");
    pool.close().await;

    eprintln!("TLS modes checked in {:?}", started.elapsed());
}

#[tokio::test]
async fn the_server_posts_a_transfer_over_a_verified_connection() {
    let started = Instant::now();
    let cluster = TlsCluster::start("serve");
    let url = cluster.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", cluster.ca()),
    );

    // Creates the database, migrates and loads the demo fixtures over TLS.
    let server = ServerProcess::start(&url, &[]).await;
    let pool = assert_encrypted(&url).await;
    let before = (balance(&pool, A_USD).await, balance(&pool, B_USD).await);

    let key = new_key();
    let reply = try_post_transfer(
        &reqwest::Client::new(),
        &server.base,
        TOKEN_A,
        &key,
        &transfer(A_USD, B_USD, 1_234, "USD"),
    )
    .await
    .unwrap();
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );

    assert_eq!(transfers_under(&pool, &key).await, 1);
    assert_eq!(
        (balance(&pool, A_USD).await, balance(&pool, B_USD).await),
        (before.0 - 1_234, before.1 + 1_234)
    );
    assert_ledger_consistent(&pool).await;
    let plain = scalar(
        &pool,
        "SELECT count(*) FROM pg_stat_activity JOIN pg_stat_ssl USING (pid) \
         WHERE datname = 'nexo_transfers' AND NOT ssl",
    )
    .await;
    let encrypted = scalar(
        &pool,
        "SELECT count(*) FROM pg_stat_activity JOIN pg_stat_ssl USING (pid) \
         WHERE datname = 'nexo_transfers' AND ssl AND pid <> pg_backend_pid()",
    )
    .await;
    assert_eq!(plain, 0, "no session of the database is in the clear");
    assert!(encrypted >= 1, "the server's sessions are encrypted");

    drop(server);
    pool.close().await;
    eprintln!("transfer over TLS checked in {:?}", started.elapsed());
}
