# syntax=docker/dockerfile:1
#
# One small image, both entry points:
#   serve-health-aggregator (the default command) and serve-health-agent (sidecar or DaemonSet).
#
#   docker build -t ghcr.io/ray-serve-health/ray-serve-health:0.2.0 .
#   docker run --rm ghcr.io/ray-serve-health/ray-serve-health:0.2.0 serve-health-agent --help
#
# Multi-arch (linux/amd64 and linux/arm64), pushing, pinning the result by digest, refreshing
# the locks: docs/building.md.
#
# Runs as UID/GID 65532 (non-root, numeric so that runAsNonRoot can verify it) and writes nothing
# at run time: the code and its bytecode are compiled at build time and owned by root, so the
# container works with readOnlyRootFilesystem (mount an emptyDir at /tmp if anything needs one).
#
# Reproducible inputs: the base image is pinned by tag and by the digest of its multi-arch index
# (the same digest on every platform; docs/building.md says how to read a newer one with
# `docker buildx imagetools inspect`), and every dependency is installed from
# requirements/image.txt (exact versions with sha256 hashes, made by scripts/lock-image).
# Both stages use the same base: the virtual environment's python is a symlink to the base
# image's /usr/local/bin/python3.11. This digest is the tag's index as built on 2026-01-13
# (docker-library's repo-info, repos/python/remote/3.11.14-slim-trixie.md); it ships pip and
# setuptools 79.0.1, which builds the project's wheel below.

FROM python:3.11.14-slim-trixie@sha256:5be45dbade29bebd6886af6b438fd7e0b4eb7b611f39ba62b430263f82de36d2 AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# The locked dependencies first, in a layer of their own that a change of code does not rebuild.
# pip checks every file against the hashes in the lock (--require-hashes) and takes nothing the
# lock does not name (--no-deps); wheels only: every pin has them for both platforms
# (tests/deploy/test_image_lock.py installs the lock for linux x86_64 and aarch64). The runtime
# venv is made without pip; the base image's pip installs into it.
COPY requirements/image.txt requirements/image.txt
RUN python -m venv --without-pip /opt/venv \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --no-compile \
        --require-hashes --no-deps --only-binary :all: -r requirements/image.txt

COPY pyproject.toml README.md LICENSE ./
COPY proto/ proto/
COPY servehealth_common/ servehealth_common/
COPY aggregator/ aggregator/
COPY node_agent/ node_agent/

# Then the project itself, with --no-deps (its dependencies are the locked ones above; `pip
# check` proves they satisfy it). Its wheel is built without build isolation, by the
# setuptools the base image ships (pinned with it by the digest), so that the build downloads
# nothing unlocked. kubernetes>=37 also ships an asyncio copy of the whole client
# (kubernetes/aio, ~70 MB) that nothing here imports (servehealth_common/kube/client.py uses the
# synchronous client): it is removed. The bytecode is compiled once, checked by hash rather
# than by file time, so that it stays valid whatever times the copy to the final stage gives
# the files. The smoke test at the end proves that every command (pyproject.toml's
# [project.scripts]) still loads.
RUN python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /tmp/dist /src \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --no-compile \
        --no-deps /tmp/dist/ray_serve_health-*.whl \
    && python -m pip --python /opt/venv/bin/python check \
    && rm -rf /opt/venv/lib/python3.11/site-packages/kubernetes/aio \
    && /opt/venv/bin/python -m compileall -q -f -j 0 --invalidation-mode unchecked-hash /opt/venv/lib \
    && /opt/venv/bin/python -c "import aggregator.server, node_agent.agent, kubernetes.client, kubernetes.watch" \
    && /opt/venv/bin/serve-health-aggregator --help > /dev/null \
    && /opt/venv/bin/serve-health-agent --help > /dev/null \
    && /opt/venv/bin/serve-health-cleanup --help > /dev/null


FROM python:3.11.14-slim-trixie@sha256:5be45dbade29bebd6886af6b438fd7e0b4eb7b611f39ba62b430263f82de36d2

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
