use std::io::IsTerminal;
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

/// What is logged without `RUST_LOG`: this service's own events from INFO,
/// dependencies' only from WARN (sqlx's notices, hyper's and tower's
/// chatter are not an operator's business).
const DEFAULT_LOG_FILTER: &str = "warn,nexo_transfers=info";

/// Human-readable logs by default, JSON with `NEXO_LOG_FORMAT=json`; the
/// level comes from `RUST_LOG` (default [`DEFAULT_LOG_FILTER`]). Logs go to
/// stderr so that command output on stdout stays machine-readable, and are
/// coloured only when stderr is a terminal and `NO_COLOR` is unset
/// (no-color.org), so files and pipes get plain text.
fn init_tracing() {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    if std::env::var("NEXO_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
        builder.json().init();
    } else {
        builder.init();
    }
}
