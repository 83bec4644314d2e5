# kvmesh-agent: the worker sidecar beside each engine (KV events, etcd registration, load).
# Build from the repository root:
#   docker build -f deploy/docker/agent.Dockerfile -t kvmesh/kvmesh-agent:0.1.0 .

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
# cmake: pingora-core (a workspace member) builds zlib-ng with it when the lockfile is resolved;
# protobuf-compiler and libprotobuf-dev: etcd-client compiles etcd's protos with protoc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvmesh-agent \
 && install -m 0755 target/release/kvmesh-agent /usr/local/bin/kvmesh-agent

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvmesh
COPY --from=build /usr/local/bin/kvmesh-agent /usr/local/bin/kvmesh-agent
USER 10001:10001
# 9100: the agent's own /health and /metrics (--listen); 8100: the inbound listener that
# prefill and decode workers put in front of their engine (--inbound-listen, when configured).
EXPOSE 8100 9100
ENTRYPOINT ["/usr/local/bin/kvmesh-agent"]
