//! The operations guide stays true to the code: every metric the process
//! exports is described in it, and every starter alert in it is valid
//! PromQL that names only metrics that exist.

use nexo_transfers::telemetry::METRICS;

const GUIDE: &str = include_str!("../docs/operations.md");

/// The `expr:` values of the guide's YAML blocks (one line each).
fn alert_expressions() -> Vec<&'static str> {
    let mut in_yaml = false;
    let mut exprs = Vec::new();
    for line in GUIDE.lines() {
        match line.trim() {
            "```yaml" => in_yaml = true,
            "```" => in_yaml = false,
            other if in_yaml => {
                if let Some(expr) = other.strip_prefix("expr:") {
                    exprs.push(expr.trim());
                }
            }
            _ => {}
        }
    }
    exprs
}

/// `nexo_…` names in an expression, histogram suffixes folded back.
fn metric_names(expr: &str) -> Vec<&str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("nexo_"))
        .map(|word| {
            ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| word.strip_suffix(suffix))
                .filter(|base| METRICS.contains(base))
                .unwrap_or(word)
        })
        .collect()
}

#[test]
fn every_exported_metric_is_described_in_the_guide() {
    for metric in METRICS {
        assert!(
            GUIDE.contains(&format!("| `{metric}` |")),
            "{metric} is missing from the metrics table of docs/operations.md"
        );
    }
}

#[test]
fn every_starter_alert_parses_and_names_existing_metrics() {
    let exprs = alert_expressions();
    assert!(exprs.len() >= 2, "the guide has starter alerts: {exprs:?}");
    assert!(
        promql_parser::parser::parse("sum(rate(nexo_http_requests_total[5m])").is_err(),
        "the parser refuses broken PromQL"
    );
    for expr in exprs {
        if let Err(e) = promql_parser::parser::parse(expr) {
            panic!("not PromQL: {expr}\n{e}");
        }
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{expr} uses no metric");
        for name in names {
            assert!(
                METRICS.contains(&name),
                "{expr} names {name}, which is not exported"
            );
        }
    }
}

#[test]
fn the_alerts_cover_reconciliation_failures_and_stuck_keys() {
    let exprs = alert_expressions().join("\n");
    assert!(exprs.contains("nexo_reconcile_runs_total{result=\"error\"}"));
    assert!(
        exprs.contains("nexo_reconcile_last_run_discrepancies{check=\"keys_stuck_in_progress\"}")
    );
    assert!(
        exprs.contains("nexo_reconcile_last_run_discrepancies{check!=\"keys_stuck_in_progress\"}")
    );
}
