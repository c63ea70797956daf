#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The operations kit in `ops/` stays true to the code: every metric the
//! alerting rules and the Grafana dashboard query is one the process
//! exports (histograms through their `_bucket`, `_sum` and `_count`
//! series), the dashboard shows every exported metric, and each alert has
//! its section in `docs/operations.md`, which describes every metric and
//! links to the rules instead of keeping a copy of them. Whether Prometheus
//! itself accepts the rules, and fires them when it should, is checked by
//! promtool in `.ci/steps/15-ops.sh`.

use std::collections::{BTreeMap, BTreeSet};

use nexo_transfers::telemetry::METRICS;
use promql_parser::parser::{self, Expr};
use promql_parser::util::{ExprVisitor, walk_expr};
use serde::Deserialize;
use serde_json::Value;

const GUIDE: &str = include_str!("../docs/operations.md");
const RULES_PATH: &str = "ops/prometheus/alerts.yml";
const RULES: &str = include_str!("../ops/prometheus/alerts.yml");
const RULE_TESTS: &str = include_str!("../ops/prometheus/alerts.test.yml");
const DASHBOARD_PATH: &str = "ops/grafana/nexo-transfers.json";
const DASHBOARD: &str = include_str!("../ops/grafana/nexo-transfers.json");

const SEVERITIES: [&str; 2] = ["critical", "warning"];
const HISTOGRAM_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

/// Prometheus' rule file format; unknown fields are refused so that a
/// misspelt `annotations` or `for` is not silently ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    interval: Option<String>,
    rules: Vec<AlertRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AlertRule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    pending: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

/// The parts of promtool's unit test format this file looks at.
#[derive(Debug, Deserialize)]
struct RuleTestFile {
    rule_files: Vec<String>,
    tests: Vec<RuleTest>,
}

#[derive(Debug, Deserialize)]
struct RuleTest {
    #[serde(default)]
    alert_rule_test: Vec<AlertTestCase>,
}

#[derive(Debug, Deserialize)]
struct AlertTestCase {
    alertname: String,
    #[serde(default)]
    exp_alerts: Vec<serde_json::Map<String, Value>>,
}

fn alerts() -> Vec<AlertRule> {
    let file: RuleFile =
        serde_saphyr::from_str(RULES).unwrap_or_else(|e| panic!("{RULES_PATH}: {e}"));
    assert!(!file.groups.is_empty(), "{RULES_PATH} has no group");
    for group in &file.groups {
        assert!(
            !group.name.is_empty(),
            "a group of {RULES_PATH} has no name"
        );
        if let Some(interval) = &group.interval {
            promql_parser::util::parse_duration(interval)
                .unwrap_or_else(|e| panic!("group {}: interval {interval}: {e}", group.name));
        }
    }
    file.groups.into_iter().flat_map(|g| g.rules).collect()
}

fn dashboard() -> Value {
    serde_json::from_str(DASHBOARD).unwrap_or_else(|e| panic!("{DASHBOARD_PATH}: {e}"))
}

/// Metric name → type, from the guide's metrics table, whose rows start
/// with the name in backquotes and the type.
fn guide_metric_types() -> BTreeMap<&'static str, &'static str> {
    GUIDE
        .lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix('|')?.split('|').map(str::trim);
            let name = cells.next()?.strip_prefix('`')?.strip_suffix('`')?;
            let kind = cells.next()?;
            name.starts_with("nexo_").then_some((name, kind))
        })
        .collect()
}

/// The exported metric a series name belongs to: the name itself, or for a
/// histogram one of the series Prometheus derives from it. A histogram's
/// bare name, or a counter with a histogram suffix, is no series at all.
fn exported_metric(series: &str) -> Result<&'static str, String> {
    let types = guide_metric_types();
    let is_histogram = |metric: &str| types.get(metric) == Some(&"histogram");
    if let Some(metric) = METRICS.iter().find(|m| **m == series) {
        return if is_histogram(metric) {
            Err(format!(
                "{series} is a histogram: query its _bucket, _sum or _count series"
            ))
        } else {
            Ok(metric)
        };
    }
    HISTOGRAM_SUFFIXES
        .iter()
        .filter_map(|suffix| series.strip_suffix(suffix))
        .find_map(|base| METRICS.iter().find(|m| **m == base && is_histogram(m)))
        .copied()
        .ok_or_else(|| format!("{series} is not exported (src/telemetry.rs, METRICS)"))
}

/// The metric names of every selector of an expression.
struct Selectors(Vec<Option<String>>);

impl ExprVisitor for Selectors {
    type Error = ();

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, ()> {
        match expr {
            Expr::VectorSelector(vs) => self.0.push(vs.name.clone()),
            Expr::MatrixSelector(ms) => self.0.push(ms.vs.name.clone()),
            _ => {}
        }
        Ok(true)
    }
}

/// Parses `expr` as PromQL and returns the exported metrics it queries;
/// panics, naming `origin`, on anything else.
fn queried_metrics(origin: &str, expr: &str) -> BTreeSet<&'static str> {
    let ast = parser::parse(expr).unwrap_or_else(|e| panic!("{origin}: not PromQL: {expr}\n{e}"));
    let mut selectors = Selectors(Vec::new());
    walk_expr(&mut selectors, &ast).expect("the walk never fails");
    assert!(
        !selectors.0.is_empty(),
        "{origin}: {expr} queries no metric"
    );
    selectors
        .0
        .into_iter()
        .map(|name| {
            let name = name.unwrap_or_else(|| panic!("{origin}: a selector of {expr} has no name"));
            exported_metric(&name).unwrap_or_else(|e| panic!("{origin}: {e}"))
        })
        .collect()
}

/// A GitHub heading anchor: lower case, punctuation dropped, spaces to
/// hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn guide_anchors() -> BTreeSet<String> {
    GUIDE
        .lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| anchor(heading.trim_start_matches('#')))
        .collect()
}

/// A Grafana query with its template variables replaced by values of the
/// same shape, so that it parses as the PromQL Grafana sends: intervals
/// become durations, the other variables (used in `=~` matchers) `.*`.
fn substitute_variables(query: &str) -> String {
    let mut out = String::with_capacity(query.len());
    let mut rest = query;
    while let Some(dollar) = rest.find('$') {
        out.push_str(&rest[..dollar]);
        let after = &rest[dollar + 1..];
        let (name, tail) = match after.strip_prefix('{') {
            Some(braced) => {
                let end = braced.find('}').expect("an unclosed ${…}");
                (&braced[..end], &braced[end + 1..])
            }
            None => {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..end], &after[end..])
            }
        };
        out.push_str(match name {
            "__rate_interval" | "__interval" => "5m",
            "__range" => "1h",
            _ => ".*",
        });
        rest = tail;
    }
    out.push_str(rest);
    out
}

fn panels(dashboard: &Value) -> &Vec<Value> {
    dashboard["panels"]
        .as_array()
        .expect("the dashboard has panels")
}

fn panel_title(panel: &Value) -> &str {
    panel["title"].as_str().unwrap_or("(untitled panel)")
}

/// (where, query) for every PromQL query of the dashboard: panel targets,
/// and the selectors of its `label_values(…)` template variables.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {:?}: a target without expr", panel_title(panel)));
            let origin = format!("panel {:?} target {}", panel_title(panel), target["refId"]);
            queries.push((origin, substitute_variables(expr)));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]
            .as_str()
            .or_else(|| variable["query"]["query"].as_str())
            .expect("a query variable has a query");
        let selector = query
            .strip_prefix("label_values(")
            .and_then(|args| args.rsplit_once(','))
            .map(|(selector, _label)| selector)
            .unwrap_or_else(|| {
                panic!(
                    "variable {}: not label_values(selector, label): {query}",
                    variable["name"]
                )
            });
        queries.push((
            format!("variable {}", variable["name"]),
            substitute_variables(selector),
        ));
    }
    queries
}

#[test]
fn every_exported_metric_is_described_in_the_guide() {
    let types = guide_metric_types();
    for metric in METRICS {
        assert!(
            GUIDE.contains(&format!("| `{metric}` |")),
            "{metric} is missing from the metrics table of docs/operations.md"
        );
        assert!(
            ["counter", "gauge", "histogram"].contains(&types[metric]),
            "{metric}: type {:?} in docs/operations.md",
            types[metric]
        );
    }
}

#[test]
fn every_alert_is_complete_valid_promql_and_names_exported_metrics() {
    let alerts = alerts();
    assert!(alerts.len() >= 2, "{RULES_PATH} has starter alerts");
    assert!(
        parser::parse("sum(rate(nexo_http_requests_total[5m])").is_err(),
        "the parser refuses broken PromQL"
    );
    let mut names = BTreeSet::new();
    for alert in &alerts {
        let name = &alert.alert;
        assert!(names.insert(name), "two alerts are named {name}");
        assert!(name.starts_with("Nexo"), "{name}: alerts are named Nexo…");
        queried_metrics(name, &alert.expr);
        let pending = alert
            .pending
            .as_deref()
            .unwrap_or_else(|| panic!("{name} has no `for`: say how long it may be pending"));
        // Prometheus takes a zero `for` (fire at once); the parser's
        // durations, made for ranges, do not.
        if !["0s", "0m"].contains(&pending) {
            promql_parser::util::parse_duration(pending)
                .unwrap_or_else(|e| panic!("{name}: for: {pending}: {e}"));
        }
        let severity = alert.labels.get("severity").map(String::as_str);
        assert!(
            severity.is_some_and(|s| SEVERITIES.contains(&s)),
            "{name}: severity {severity:?}, not one of {SEVERITIES:?}"
        );
        for annotation in ["summary", "description", "runbook_url"] {
            assert!(
                alert
                    .annotations
                    .get(annotation)
                    .is_some_and(|text| !text.trim().is_empty()),
                "{name} has no {annotation} annotation"
            );
        }
    }
}

#[test]
fn every_alert_links_to_its_section_of_the_guide() {
    let anchors = guide_anchors();
    for alert in alerts() {
        let url = &alert.annotations["runbook_url"];
        let expected = format!("docs/operations.md#{}", anchor(&alert.alert));
        assert_eq!(url, &expected, "{}: runbook_url", alert.alert);
        assert!(
            anchors.contains(&anchor(&alert.alert)),
            "docs/operations.md has no section headed {} for {url}",
            alert.alert
        );
    }
}

#[test]
fn the_guide_links_to_the_rules_instead_of_copying_them() {
    assert!(
        GUIDE.contains(RULES_PATH) && GUIDE.contains(DASHBOARD_PATH),
        "docs/operations.md links to {RULES_PATH} and {DASHBOARD_PATH}"
    );
    let copied: Vec<_> = GUIDE
        .lines()
        .filter(|line| line.trim_start().starts_with("expr:"))
        .collect();
    assert!(
        copied.is_empty(),
        "docs/operations.md keeps alert expressions of its own, which would drift from \
         {RULES_PATH}: {copied:?}"
    );
}

#[test]
fn the_alerts_cover_reconciliation_failures_stuck_keys_and_purge_errors() {
    let exprs: Vec<String> = alerts().into_iter().map(|a| a.expr).collect();
    let exprs = exprs.join("\n");
    for selector in [
        r#"nexo_reconcile_runs_total{result="error"}"#,
        r#"nexo_reconcile_last_run_discrepancies{check="keys_stuck_in_progress"}"#,
        r#"nexo_reconcile_last_run_discrepancies{check!="keys_stuck_in_progress"}"#,
        r#"nexo_idempotency_purge_runs_total{result="error"}"#,
        "nexo_db_pool_acquire_timeouts_total",
    ] {
        assert!(exprs.contains(selector), "no alert watches {selector}");
    }
}

#[test]
fn every_alert_has_a_unit_test_and_some_fire() {
    let file: RuleTestFile = serde_saphyr::from_str(RULE_TESTS)
        .unwrap_or_else(|e| panic!("ops/prometheus/alerts.test.yml: {e}"));
    assert_eq!(file.rule_files, ["alerts.yml"]);
    let cases: Vec<_> = file.tests.iter().flat_map(|t| &t.alert_rule_test).collect();
    let firing: BTreeSet<_> = cases
        .iter()
        .filter(|c| !c.exp_alerts.is_empty())
        .map(|c| c.alertname.as_str())
        .collect();
    let silent: BTreeSet<_> = cases
        .iter()
        .filter(|c| c.exp_alerts.is_empty())
        .map(|c| c.alertname.as_str())
        .collect();
    assert!(
        firing.len() >= 2,
        "the unit tests make alerts fire: {firing:?}"
    );
    for alert in alerts() {
        let name = alert.alert.as_str();
        assert!(
            firing.contains(name) && silent.contains(name),
            "{name}: ops/prometheus/alerts.test.yml shows it neither firing nor silent"
        );
    }
}

#[test]
fn the_dashboard_is_a_grafana_model_whose_panels_all_query_a_datasource() {
    let dashboard = dashboard();
    let schema = dashboard["schemaVersion"].as_u64().expect("schemaVersion");
    assert!(
        (36..=41).contains(&schema),
        "schemaVersion {schema}: Grafana 9 to 11"
    );
    for field in ["uid", "title"] {
        assert!(
            dashboard[field].as_str().is_some_and(|s| !s.is_empty()),
            "the dashboard has no {field}"
        );
    }
    assert!(
        dashboard["id"].is_null(),
        "id belongs to the Grafana that stored it"
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let datasource = variables
        .iter()
        .find(|v| v["type"] == "datasource" && v["query"] == "prometheus")
        .expect("a Prometheus datasource variable, so the dashboard imports into any Grafana");
    let datasource_uid = format!("${{{}}}", datasource["name"].as_str().expect("its name"));

    let mut ids = BTreeSet::new();
    assert!(!panels(&dashboard).is_empty(), "the dashboard has panels");
    for panel in panels(&dashboard) {
        let title = panel_title(panel);
        assert!(
            panel["title"].as_str().is_some_and(|t| !t.is_empty()),
            "a panel has no title: {panel}"
        );
        assert!(
            ids.insert(panel["id"].as_u64().expect("a panel id")),
            "two panels with id {}",
            panel["id"]
        );
        assert!(panel["type"].is_string(), "{title}: no type");
        for field in ["h", "w", "x", "y"] {
            assert!(panel["gridPos"][field].is_u64(), "{title}: gridPos.{field}");
        }
        assert_eq!(
            panel["datasource"]["uid"], datasource_uid,
            "{title}: datasource"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no target");
        let mut refs = BTreeSet::new();
        for target in targets {
            let reference = target["refId"].as_str().expect("a refId");
            assert!(refs.insert(reference), "{title}: two targets {reference}");
            assert!(
                target["expr"].as_str().is_some_and(|e| !e.is_empty()),
                "{title} target {reference}: no expr"
            );
        }
    }
}

#[test]
fn every_dashboard_query_is_promql_on_exported_metrics() {
    let queries = dashboard_queries(&dashboard());
    assert!(!queries.is_empty());
    assert_eq!(
        substitute_variables(r#"rate(x{instance=~"${instance}"}[$__rate_interval])"#),
        r#"rate(x{instance=~".*"}[5m])"#
    );
    for (origin, query) in queries {
        queried_metrics(&origin, &query);
    }
}

#[test]
fn the_dashboard_shows_every_exported_metric() {
    let shown: BTreeSet<_> = dashboard_queries(&dashboard())
        .iter()
        .flat_map(|(origin, query)| queried_metrics(origin, query))
        .collect();
    let missing: Vec<_> = METRICS.iter().filter(|m| !shown.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "{DASHBOARD_PATH} shows no panel for {missing:?}"
    );
}
