#![allow(clippy::unwrap_used, clippy::expect_used)]
//! What can be checked of `docker-compose.yml`, `Dockerfile` and
//! `.dockerignore` without a Docker engine: the compose file parses and
//! holds the services, health check, volume, wiring and ports the README
//! promises; the Dockerfile builds, in a multi-stage build, the same binary
//! with the same command CI uses and runs it as a non-root user on a slim
//! image; and nothing the build reads is left out of the build context.
//! Whether the images build and start is not exercised here (README, "Docker
//! Compose", says so).

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn compose() -> Value {
    serde_saphyr::from_str(&read("docker-compose.yml")).expect("docker-compose.yml parses")
}

/// (default host port, container port) of a `ports` entry such as
/// `127.0.0.1:${NEXO_PORT:-8080}:8080`.
fn port_mapping(entry: &str) -> (u16, u16) {
    let (front, container) = entry.rsplit_once(':').unwrap();
    let host = match front.rsplit_once(":-") {
        Some((_, default)) => default.trim_end_matches('}'),
        None => front.rsplit(':').next().unwrap(),
    };
    (
        host.parse()
            .unwrap_or_else(|_| panic!("host port of {entry}")),
        container
            .parse()
            .unwrap_or_else(|_| panic!("container port of {entry}")),
    )
}

fn published_ports(service: &Value) -> Vec<(u16, u16)> {
    service["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| port_mapping(p.as_str().unwrap()))
        .collect()
}

fn env_of<'a>(service: &'a Value, name: &str) -> &'a str {
    service["environment"][name]
        .as_str()
        .unwrap_or_else(|| panic!("environment {name} is not set"))
}

#[test]
fn postgres_runs_with_a_health_check_and_a_named_volume() {
    let compose = compose();
    let db = &compose["services"]["db"];
    assert!(db["image"].as_str().unwrap().starts_with("postgres:"));
    let check = db["healthcheck"]["test"].to_string();
    assert!(check.contains("pg_isready"), "{check}");
    let volume = db["volumes"][0].as_str().unwrap();
    let (name, mount) = volume.split_once(':').unwrap();
    assert_eq!(mount, "/var/lib/postgresql/data");
    assert!(
        compose["volumes"].as_object().unwrap().contains_key(name),
        "{name} is declared as a named volume"
    );
    assert_eq!(
        published_ports(db),
        [(5432, 5432)],
        "published for cargo test on the host"
    );
}

#[test]
fn the_service_is_built_from_the_dockerfile_and_wired_to_the_database() {
    let compose = compose();
    let api = &compose["services"]["api"];
    assert_eq!(api["build"]["context"], ".");
    assert_eq!(api["build"]["dockerfile"], "Dockerfile");
    assert_eq!(api["depends_on"]["db"]["condition"], "service_healthy");

    let command: Vec<&str> = api["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(command, ["serve", "--demo"]);

    let db = &compose["services"]["db"];
    let url = url::Url::parse(env_of(api, "DATABASE_URL")).unwrap();
    assert_eq!(url.host_str(), Some("db"), "the compose service name");
    assert_eq!(url.port(), Some(5432));
    assert_eq!(url.username(), env_of(db, "POSTGRES_USER"));
    assert_eq!(url.password(), Some(env_of(db, "POSTGRES_PASSWORD")));
    assert_eq!(url.path(), format!("/{}", env_of(db, "POSTGRES_DB")));

    assert_eq!(env_of(api, "NEXO_BIND"), "0.0.0.0:8080");
    assert_eq!(published_ports(api), [(8080, 8080)]);
}

/// The Dockerfile as instructions (continuation lines joined, comments
/// dropped), grouped by stage.
fn dockerfile_stages() -> Vec<Vec<String>> {
    let text = read("Dockerfile").replace("\\\n", " ");
    let mut stages: Vec<Vec<String>> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
        if line.starts_with("FROM ") {
            stages.push(Vec::new());
        }
        if let Some(stage) = stages.last_mut() {
            stage.push(line);
        }
    }
    stages
}

fn package_name() -> String {
    let manifest = read("Cargo.toml");
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("name = "))
        .unwrap()
        .trim_matches('"')
        .to_owned()
}

#[test]
fn the_dockerfile_builds_the_binary_ci_tests_in_a_multi_stage_build() {
    let stages = dockerfile_stages();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let (build, runtime) = (&stages[0], &stages[1]);
    let binary = package_name();

    assert!(build[0].contains(" AS build"), "{}", build[0]);
    assert!(
        build.iter().any(|i| i.starts_with("RUN ")
            && i.contains(&format!("cargo build --release --locked --bin {binary}"))),
        "the build stage runs `cargo build --release --locked --bin {binary}`"
    );
    assert!(
        build.iter().any(|i| i == "COPY . ."),
        "the build sees the whole context"
    );
    assert!(
        build.iter().any(|i| i == "ENV SQLX_OFFLINE=true"),
        "no database at build time"
    );
    assert!(
        runtime
            .iter()
            .any(|i| i.starts_with("COPY --from=build ") && i.ends_with(&format!("/{binary}"))),
        "the runtime stage takes the built binary"
    );
    assert!(
        runtime
            .iter()
            .any(|i| i.starts_with("ENTRYPOINT ") && i.contains(&format!("/{binary}\""))),
        "and runs it"
    );

    let toolchain = read("Dockerfile")
        .lines()
        .find_map(|l| l.strip_prefix("ARG RUST_VERSION="))
        .unwrap()
        .to_owned();
    let rust_version = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let minor = |v: &str| -> (u32, u32) {
        let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap());
        (parts.next().unwrap(), parts.next().unwrap())
    };
    assert!(
        minor(&toolchain) >= minor(&rust_version),
        "the image's Rust {toolchain} is older than Cargo.toml's rust-version {rust_version}"
    );
}

#[test]
fn the_runtime_image_is_slim_and_runs_as_a_non_root_user() {
    let stages = dockerfile_stages();
    let runtime = &stages[1];
    assert!(
        runtime[0].starts_with("FROM debian:") && runtime[0].contains("-slim"),
        "{}",
        runtime[0]
    );
    let user = runtime
        .iter()
        .rev()
        .find_map(|i| i.strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap();
    assert!(uid != "root" && uid != "0", "runs as {user}, which is root");
    assert!(
        runtime
            .iter()
            .any(|i| i.starts_with("ENV ") && i.contains("NEXO_BIND=0.0.0.0:8080")),
        "listens on every interface inside the container"
    );
    assert!(runtime.iter().any(|i| i == "EXPOSE 8080"));
}

/// Files the compiler reads besides `src/`: the arguments of include_str!
/// and include_bytes! (relative to their source file) and `migrations/`;
/// and `crates/`, where the other workspace members are: cargo loads every
/// member's manifest before it builds any one binary.
fn files_the_build_reads() -> Vec<PathBuf> {
    let mut files = vec![
        PathBuf::from("Cargo.toml"),
        PathBuf::from("Cargo.lock"),
        PathBuf::from("src"),
        PathBuf::from("migrations"),
        PathBuf::from("crates"),
    ];
    let mut stack = vec![PathBuf::from("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(Path::new(ROOT).join(&dir)).unwrap() {
            let entry = entry.unwrap();
            let relative = dir.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                stack.push(relative);
                continue;
            }
            let source = std::fs::read_to_string(entry.path()).unwrap();
            for mac in ["include_str!(\"", "include_bytes!(\""] {
                for piece in source.split(mac).skip(1) {
                    let target = piece.split('"').next().unwrap();
                    let resolved = normalise(&relative.parent().unwrap().join(target));
                    assert!(
                        Path::new(ROOT).join(&resolved).exists(),
                        "{} includes {target}, which does not exist",
                        relative.display()
                    );
                    files.push(resolved);
                }
            }
        }
    }
    files
}

fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn nothing_the_build_reads_is_excluded_from_the_build_context() {
    let ignored: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_end_matches('/').to_owned())
        .collect();
    for pattern in &ignored {
        assert!(
            !pattern.contains(['*', '?', '[', '!']),
            ".dockerignore pattern {pattern:?}: only plain paths are understood here"
        );
    }
    let files = files_the_build_reads();
    assert!(
        files.iter().any(|f| f.ends_with("openapi.yaml")),
        "the reader found the included files: {files:?}"
    );
    for file in files {
        for pattern in &ignored {
            assert!(
                !file.starts_with(pattern),
                "{} is read by the build but .dockerignore excludes {pattern}",
                file.display()
            );
        }
    }
}

#[test]
fn the_readme_tells_how_to_use_the_compose_file() {
    let readme = read("README.md");
    assert!(readme.contains("docker compose up"));
    let compose = compose();
    let db = &compose["services"]["db"];
    let (host_port, _) = published_ports(db)[0];
    let test_url = format!(
        "postgres://{}:{}@localhost:{host_port}/{}",
        env_of(db, "POSTGRES_USER"),
        env_of(db, "POSTGRES_PASSWORD"),
        env_of(db, "POSTGRES_DB"),
    );
    assert!(
        readme.contains(&test_url),
        "the README shows cargo test the compose database at {test_url}"
    );
    let (api_port, _) = published_ports(&compose["services"]["api"])[0];
    assert!(readme.contains(&format!("http://localhost:{api_port}/docs")));
}
