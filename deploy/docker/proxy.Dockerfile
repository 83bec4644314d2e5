# kvmesh-proxy: the edge proxy. Build from the repository root:
#   docker build -f deploy/docker/proxy.Dockerfile -t kvmesh/kvmesh-proxy:0.1.0 .
# Runs as an unprivileged user; config at /etc/kvmesh/kvmesh.yaml (mount a file or a ConfigMap).

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
# cmake: pingora-core builds zlib-ng with it; protobuf-compiler and libprotobuf-dev:
# etcd-client compiles etcd's protos with protoc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvmesh-proxy \
 && install -m 0755 target/release/kvmesh-proxy /usr/local/bin/kvmesh-proxy

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvmesh
COPY --from=build /usr/local/bin/kvmesh-proxy /usr/local/bin/kvmesh-proxy
USER 10001:10001
# 8080 data (OpenAI HTTP), 8081 gRPC (KServe v2, when configured), 9002 endpoint picker (Envoy
# ext_proc, when configured), 9090 admin (/metrics, /health, /live).
EXPOSE 8080 8081 9002 9090
ENTRYPOINT ["/usr/local/bin/kvmesh-proxy"]
CMD ["--config", "/etc/kvmesh/kvmesh.yaml"]
