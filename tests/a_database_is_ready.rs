//! The first integration test cargo runs: it checks that the database the
//! tests' harness connects to (`DATABASE_URL`, default in
//! `.cargo/config.toml`) exists and accepts us, and otherwise says in one
//! sentence what to do. Without it, every database test panics with the
//! same raw driver error.

use std::process::ExitCode;
use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

fn main() -> ExitCode {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!(
            "The tests need DATABASE_URL (e.g. postgres://postgres:postgres@localhost:5432/nexo_transfers); \
             `cargo test` from the repository sets it from .cargo/config.toml."
        );
        return ExitCode::FAILURE;
    };
    let options = match PgConnectOptions::from_str(&url) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("DATABASE_URL is not a PostgreSQL URL the tests can use: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (host, port, user) = (
        options.get_host().to_owned(),
        options.get_port(),
        options.get_username().to_owned(),
    );
    let database = options.get_database().unwrap_or("postgres").to_owned();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start a runtime to check the database: {e}");
            return ExitCode::FAILURE;
        }
    };
    let connected = runtime.block_on(async {
        let conn = PgConnection::connect_with(&options).await?;
        conn.close().await
    });
    let Err(error) = connected else {
        println!("database {database:?} on {host}:{port} is ready for the tests");
        return ExitCode::SUCCESS;
    };
    let code = error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    match code.as_deref() {
        Some("3D000") => eprintln!(
            "The tests need the database {database:?} on {host}:{port}: create it with \
             `createdb -h {host} -p {port} -U {user} {database}` (or `cargo run -- migrate`), then run `cargo test` again."
        ),
        Some("28P01" | "28000") => eprintln!(
            "PostgreSQL on {host}:{port} refused user {user:?} ({error}): set DATABASE_URL to a user and \
             password it accepts."
        ),
        _ => eprintln!(
            "PostgreSQL is not reachable at {host}:{port} for the tests ({error}): start it, or set \
             DATABASE_URL to a server that is running."
        ),
    }
    ExitCode::FAILURE
}
