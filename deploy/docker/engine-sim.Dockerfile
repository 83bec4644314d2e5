# kvmesh-engine-sim: a simulated vLLM engine (OpenAI API, vLLM metrics, KV events over ZMQ)
# for trying kvmesh without GPUs. Build from the repository root:
#   docker build -f deploy/docker/engine-sim.Dockerfile -t kvmesh/kvmesh-engine-sim:0.1.0 .

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvmesh-engine-sim \
 && install -m 0755 target/release/kvmesh-engine-sim /usr/local/bin/kvmesh-engine-sim

FROM debian:bookworm-slim AS runtime
RUN groupadd --system --gid 10001 kvmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvmesh
COPY --from=build /usr/local/bin/kvmesh-engine-sim /usr/local/bin/kvmesh-engine-sim
USER 10001:10001
# 8000: OpenAI API, /health, /metrics; 5557/5558: KV events (PUB) and replay (ROUTER) when enabled.
EXPOSE 8000 5557 5558
ENTRYPOINT ["/usr/local/bin/kvmesh-engine-sim"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
