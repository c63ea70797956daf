//! Dependencies point one way, downward: nothing below the HTTP layer
//! imports it, so the domain is reached by a test or a fuzz target without
//! HTTP, and following a request never climbs back up a floor.

use std::path::Path;

/// The modules below `http`, each a file or a folder under `src/`.
const BELOW_HTTP: &[&str] = &[
    "transfers",
    "feed.rs",
    "ledger",
    "idempotency",
    "caches.rs",
    "db",
    "principal.rs",
    "problem.rs",
    "auth.rs",
    "reconcile.rs",
    "telemetry.rs",
    "webhooks",
];

fn rust_files(path: &Path, found: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .filter_map(Result::ok)
            .map(|e| e.path())
            .collect();
        entries.sort();
        for entry in entries {
            rust_files(&entry, found);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        found.push(path.to_owned());
    }
}

#[test]
fn nothing_below_http_imports_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for module in BELOW_HTTP {
        rust_files(&src.join(module), &mut files);
    }
    assert!(files.len() > 10, "the modules were found: {files:?}");
    let offenders: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let text =
                std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            text.lines()
                .find(|line| line.contains("crate::http") || line.contains("super::http"))
                .map(|line| format!("{}: {}", file.display(), line.trim()))
        })
        .collect();
    assert!(offenders.is_empty(), "{offenders:#?}");
}

#[test]
fn the_reconciliation_does_not_call_back_into_telemetry() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/reconcile.rs");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !text.contains("telemetry"),
        "telemetry depends on reconcile, so reconcile must not depend on telemetry"
    );
}
