# kvbrokerd as a container image: the daemon and its runtime dependencies only (`pip install '.[server]'`, as the
# README's set-up), run as a non-root user, healthy when grpc.health.v1.Health says SERVING.
#
#   docker build -t kvbroker .
#   docker run --rm -e KVBROKER_CLUSTER_ID=1 -p 7100:7100 --shm-size=1g \
#       -v kvbroker-sock:/run/kvbroker kvbroker
#
# The model server shares the socket volume (/run/kvbroker) and /dev/shm with the daemon: in Kubernetes, see
# deploy/kubernetes/; with docker, `--ipc=shareable` here and `--ipc=container:<this one>` on the model server.
# Any flag can be appended (`docker run ... kvbroker --log-level debug`); every flag also has a KVBROKER_* variable.
#
# PYTHON_IMAGE: any Debian-based image with python3 (>= 3.10) and its venv module, e.g. a mirror of python:3.11-slim.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: the wheel, then a virtual environment with kvbroker[server] and nothing else -----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for kvbrokerd._safecopy (the fault-safe memmove; only libc at run time). Where none can be installed
# (no package mirror), or Python's headers are missing, the wheel is built without it and the daemon copies
# model-server memory through the kernel, about 3x slower: the last step below and the daemon's log say which.
RUN if ! command -v cc > /dev/null; then \
      { apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev; } \
        || echo "WARNING: no C compiler: kvbrokerd._safecopy will not be built"; \
      rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
# WITH_TRACING=1 adds OpenTelemetry (kvbroker[trace]) for --otlp-traces-endpoint (docs/tracing.md).
ARG WITH_TRACING=0
RUN python3 -m venv /opt/kvbroker \
 && /opt/kvbroker/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/kvbroker/bin/pip install --find-links /wheels 'kvbroker[server]' \
      $(if [ "$WITH_TRACING" = 1 ]; then echo 'kvbroker[trace]'; fi) \
 && /opt/kvbroker/bin/kvbrokerd --help > /dev/null \
 && /opt/kvbroker/bin/python -c "from kvbrokerd.backends.common import memcopy; print(memcopy.copy_path()[1])"

# ---- runtime ----------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvbroker" \
      org.opencontainers.image.description="kvbrokerd: KV-cache block transfers between LLM serving nodes" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvbroker \
 && useradd --system --uid 10001 --gid kvbroker --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin kvbroker \
 && install -d -o kvbroker -g kvbroker -m 0750 /run/kvbroker
COPY --from=build /opt/kvbroker /opt/kvbroker
ENV PATH=/opt/kvbroker/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVBROKER_LISTEN=unix:///run/kvbroker/kvbroker.sock \
    KVBROKER_PEER_LISTEN=0.0.0.0:7100 \
    KVBROKER_BACKENDS=shm,tcp \
    KVBROKER_SHM_DIR=/dev/shm \
    KVBROKER_LOG_FORMAT=json
USER 10001:10001
WORKDIR /run/kvbroker
# The socket directory is meant to be shared with the model server (and stays writable under --read-only).
VOLUME ["/run/kvbroker"]
EXPOSE 7100
# Asks the daemon's own health service on its local listener (no extra tool: grpcio-health-checking is a runtime
# dependency). Exit 0 only when the answer is SERVING.
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 CMD ["python3", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; t = os.environ.get('KVBROKER_LISTEN', 'unix:///run/kvbroker/kvbroker.sock'); s = g.HealthStub(grpc.insecure_channel(t)).Check(h.HealthCheckRequest(), timeout=3).status; sys.exit(s != h.HealthCheckResponse.SERVING)"]
# KVBROKER_CLUSTER_ID (or --cluster-id) is required: one id per daemon, unique among the daemons that link.
ENTRYPOINT ["kvbrokerd"]
CMD []
