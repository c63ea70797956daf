# syntax=docker/dockerfile:1
# The nexo-transfers server in two stages. The build stage compiles the
# binary CI tests, with the same command (`cargo build --release --locked
# --bin nexo-transfers`) and no database: every query is checked at run
# time, and SQLX_OFFLINE makes sure no macro ever tries to connect. The
# runtime stage is a slim Debian holding only that binary, run as an
# unprivileged user. tests/docker_files.rs checks these promises.

# At least Cargo.toml's rust-version.
ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
ENV SQLX_OFFLINE=true
COPY . .
# The cache mounts keep downloaded crates and compiled dependencies between
# builds; the binary is copied out because the target cache is not kept in
# the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin nexo-transfers \
    && install -D -m 0755 target/release/nexo-transfers /out/nexo-transfers

FROM debian:bookworm-slim AS runtime
RUN groupadd --system --gid 10001 nexo \
    && useradd --system --uid 10001 --gid nexo --no-create-home --shell /usr/sbin/nologin nexo
COPY --from=build /out/nexo-transfers /usr/local/bin/nexo-transfers
USER 10001:10001
# Inside a container the server must listen on every interface; which host
# interface reaches it is decided where the port is published.
ENV NEXO_BIND=0.0.0.0:8080 \
    NEXO_LOG_FORMAT=json
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/nexo-transfers"]
CMD ["serve"]
