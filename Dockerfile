# syntax=docker/dockerfile:1.7
# Spillway images, one Dockerfile, two targets:
#
#   docker build --target operator -t spillway-operator:0.1.0 .   # the operator (chart: image.*)
#   docker build --target engine   -t spillway-engine:0.1.0 .     # the GPU pod (spec.engine.image)
#
# Base images are pinned by tag (pin by digest too in a release pipeline).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

# ------------------------------------------------------------------ wheel
# Build the spillway wheel once; both images install it. No engine extra here:
# the engine image gets vLLM and torch from vLLM's own image.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY engine/ engine/
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# ------------------------------------------------------------------ operator
# `spillway operator run`: kopf, the Kubernetes client and the planner; no vLLM, no torch.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN python -m pip install /wheels/*.whl \
 && rm -rf /wheels \
 && groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin spillway
# The chart runs it with a read-only root filesystem and an emptyDir on /tmp.
ENV HOME=/tmp
USER 1000:1000
EXPOSE 8080 8081
ENTRYPOINT ["spillway", "operator", "run"]
CMD ["--all-namespaces"]

# ------------------------------------------------------------------ engine
# `spillway-engine serve` in the GPU pod: vLLM 0.33.0 from vLLM's image, Spillway on top
# (the patched chunked offloader and its vLLM general-plugin entry point come with the
# wheel). vLLM's own pins are kept: every package the image already has is a constraint,
# so installing Spillway only adds what is missing (kopf, kubernetes, ...).
FROM ${VLLM_IMAGE} AS engine
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
USER root
COPY --from=wheel /wheels /wheels
RUN python3 -m pip freeze | grep -E '^[A-Za-z0-9_.-]+==' > /tmp/image-constraints.txt \
 && python3 -m pip install --constraint /tmp/image-constraints.txt /wheels/*.whl \
 && rm -rf /wheels /tmp/image-constraints.txt \
 && if ! getent group 1000 >/dev/null; then groupadd --gid 1000 spillway; fi \
 && if ! getent passwd 1000 >/dev/null; then \
      useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin spillway; fi \
 && mkdir -p /home/spillway/.cache/huggingface /models-cache \
 && chown -R 1000:1000 /home/spillway /models-cache
# HOME and the Hugging Face cache writable by user 1000 (the operator mounts its model
# cache on /models-cache and points HF_HOME there; this default serves `docker run`).
ENV HOME=/home/spillway \
    XDG_CACHE_HOME=/home/spillway/.cache \
    HF_HOME=/home/spillway/.cache/huggingface
WORKDIR /home/spillway
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["spillway-engine"]
CMD ["--help"]
