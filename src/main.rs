use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    init_tracing();
    // Fault tests pick fail points through the FAILPOINTS environment
    // variable; the feature that compiles them in is for tests only.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    match nexo_transfers::cli::parse() {
        Ok(cli) => nexo_transfers::cli::run(cli).await,
        Err(code) => code,
    }
}

/// Human-readable logs by default, JSON with `NEXO_LOG_FORMAT=json`; the
/// level comes from `RUST_LOG` (default `info`). Logs go to stderr so that
/// command output on stdout stays machine-readable.
fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("NEXO_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
        builder.json().init();
    } else {
        builder.init();
    }
}
