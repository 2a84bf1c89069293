# syntax=docker/dockerfile:1
# One image for every kvgate component: `kvgate router`, `worker`, `sink`, `agent`, `engine`…
# Multi-stage (build the virtualenv, copy only it), non-root, read-only-root-filesystem friendly:
# everything kvgate writes goes under /tmp (mount an emptyDir or tmpfs there).
#   docker build -t kvgate .
#   docker run --rm -p 8000:8000 kvgate router --host 0.0.0.0
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgate
WORKDIR /src
COPY pyproject.toml README.md ./
COPY admission ./admission
COPY agents ./agents
COPY analytics ./analytics
COPY deploy ./deploy
COPY router ./router
COPY streams ./streams
RUN /opt/kvgate/bin/pip install ".[all]" \
 && bash deploy/otel-protos.sh /opt/kvgate/bin/python \
 && /opt/kvgate/bin/kvgate --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG UID=10001
RUN groupadd --system --gid ${UID} kvgate \
 && useradd --system --uid ${UID} --gid ${UID} --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib \
    KVGATE_LOCAL=/tmp/kvgate \
    KVGATE_WORKER__DATA_DIR=/tmp/kvgate/worker \
    KVGATE_CLICKHOUSE__PATH=/tmp/kvgate/clickhouse
USER ${UID}:${UID}
WORKDIR /tmp
# router 8000 (admin 8001), simulated engine 8100, worker web 6066
EXPOSE 8000 8001 8100 6066
# KVGATE_HEALTH_URL: the component's /health (unset for components without HTTP)
HEALTHCHECK --interval=10s --timeout=4s --start-period=30s --retries=3 \
  CMD ["python", "-m", "deploy.healthcheck"]
ENTRYPOINT ["kvgate"]
CMD ["--help"]
