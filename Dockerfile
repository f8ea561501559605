# syntax=docker/dockerfile:1
#
# One small image, both entry points:
#   serve-health-aggregator (the default command) and serve-health-agent (sidecar or DaemonSet).
#
#   docker build -t ghcr.io/ray-serve-health/ray-serve-health:0.2.0 .
#   docker run --rm ghcr.io/ray-serve-health/ray-serve-health:0.2.0 serve-health-agent --help
#
# Runs as UID/GID 65532 (non-root, numeric so that runAsNonRoot can verify it) and writes nothing
# at run time: the code and its bytecode are compiled at build time and owned by root, so the
# container works with readOnlyRootFilesystem (mount an emptyDir at /tmp if anything needs one).
#
# Both stages use the same pinned base image: the virtual environment's python is a symlink to
# the base image's /usr/local/bin/python3.11. Pin the digest too (python:3.11.14-slim-trixie@sha256:...)
# for byte-for-byte reproducible builds.

FROM python:3.11.14-slim-trixie AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY servehealth_common/ servehealth_common/
COPY aggregator/ aggregator/
COPY node_agent/ node_agent/

# Every dependency ships binary wheels, so no compiler is needed, in either stage. The runtime
# venv is made without pip; the base image's pip installs the project into it (not editable).
# kubernetes>=37 also ships an asyncio copy of the whole client (kubernetes/aio, ~70 MB) that
# nothing here imports (servehealth_common/kube/client.py uses the synchronous client): it is
# removed. The bytecode is compiled once, checked by hash rather than by file time, so that it
# stays valid whatever times the copy to the final stage gives the files. The smoke test at the
# end proves that both commands still load.
RUN python -m venv --without-pip /opt/venv \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --no-compile /src \
    && rm -rf /opt/venv/lib/python3.11/site-packages/kubernetes/aio \
    && /opt/venv/bin/python -m compileall -q -f -j 0 --invalidation-mode unchecked-hash /opt/venv/lib \
    && /opt/venv/bin/python -c "import aggregator.server, node_agent.agent, kubernetes.client, kubernetes.watch" \
    && /opt/venv/bin/serve-health-aggregator --help > /dev/null \
    && /opt/venv/bin/serve-health-agent --help > /dev/null


FROM python:3.11.14-slim-trixie

LABEL org.opencontainers.image.title="ray-serve-health" \
      org.opencontainers.image.description="Push-based health aggregation for Ray Serve on Kubernetes: serve-health-aggregator and serve-health-agent" \
      org.opencontainers.image.source="https://github.com/ray-serve-health/ray-serve-health" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.2.0"

# No .pyc writes at run time (the root filesystem is read-only; bytecode was compiled at build
# time), unbuffered logs, and a HOME that exists and is writable when /tmp is an emptyDir
# (the user has no passwd entry; the kubernetes client looks for ~/.kube/config).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

COPY --from=builder /opt/venv /opt/venv

USER 65532:65532
WORKDIR /tmp

# 50051: gRPC (agent reports, inspection, grpc.health.v1, reflection); 9090: /metrics.
EXPOSE 50051 9090

# Both commands handle SIGTERM themselves (the aggregator drains, the agent stops), so they can
# run as PID 1 without an init. The agent: command ["serve-health-agent"] in the pod spec.
CMD ["serve-health-aggregator"]
