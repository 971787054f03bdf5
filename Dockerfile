# Spillway images, one Dockerfile, three targets:
#
#   docker build --target operator -t spillway-operator:0.1.0 .   # the operator and spillway-router (chart: image.*)
#   docker build --target engine   -t spillway-engine:0.1.0 .     # the GPU pod (spec.engine.image)
#   docker build --target engine-cpu -t spillway-engine:0.1.0-cpu .  # the same pod, vLLM from PyPI
#
# Base images are pinned by tag (pin by digest too in a release pipeline). With no image
# registry, tools/images.sh builds `operator` and `engine-cpu` on a Debian base of its own
# (--build-arg PYTHON_IMAGE=spillway-base:bookworm) and tests/images runs them.
# The Python packages are pinned to the project's tested venv (tools/images/constraints.txt,
# its pip freeze) and installed before Spillway's own code, so a change to the code
# rebuilds only the small layer that installs the wheel.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

# ------------------------------------------------------------------ wheel
# Build the spillway wheel once; every image installs it. No engine extra here:
# the engine images get vLLM and torch on their own layer.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The build backend on a layer of its own (no download per build of the code).
RUN python -m pip install "setuptools>=69" wheel
WORKDIR /src
# No README: the package needs none, and a README edit would rebuild every image and
# reload the engine image into the nodes.
COPY pyproject.toml ./
COPY operator/ operator/
COPY engine/ engine/
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# ------------------------------------------------------------------ operator
# `spillway operator run` and `spillway-router`: kopf, the Kubernetes client, the planner
# and the router's extra (pyzmq, msgspec, transformers, cbor2); no vLLM, no torch.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin spillway
# Dependencies (pyproject.toml's, and the router extra's) at the tested versions.
COPY pyproject.toml tools/images/requirements.py tools/images/constraints.txt /tmp/deps/
RUN python /tmp/deps/requirements.py /tmp/deps/pyproject.toml router > /tmp/deps/requirements.txt \
 && python -m pip install --constraint /tmp/deps/constraints.txt --requirement /tmp/deps/requirements.txt \
 && rm -rf /tmp/deps
# Spillway's code: the only layer a code change rebuilds.
COPY --from=wheel /wheels /wheels
RUN python -m pip install --no-deps /wheels/*.whl \
 && python -m pip check \
 && rm -rf /wheels
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

# ------------------------------------------------------------------ engine-cpu
# The engine pod's image without vLLM's GPU image: vLLM and torch from PyPI at the tested
# versions on PYTHON_IMAGE, less the CUDA kernels, compilers and libraries the emulated
# GPU never loads, then Spillway's wheel; the same user, HOME and Hugging Face cache as
# `engine`. It serves `spillway-engine serve --emulate-gpu` (tests/images); on a GPU
# node, use `engine`.
FROM ${PYTHON_IMAGE} AS engine-cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 spillway \
 && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin spillway \
 && mkdir -p /home/spillway/.cache/huggingface /models-cache \
 && chown -R 1000:1000 /home/spillway /models-cache
# vLLM and torch: their versions, and every package they pull in, are the constraints'
# (pyproject.toml's engine extra, as installed in the tested venv). About 9.5 GB as
# installed; in the same layer (so they never reach one) tools/images/prune.py removes
# the 3.8 GB that tools/images/engine-cpu-prune.txt lists, and records what it removed in
# /usr/local/share/spillway/engine-cpu-pruned.txt. This layer depends on those files alone.
COPY tools/images/constraints.txt tools/images/engine-cpu-prune.txt tools/images/prune.py /tmp/deps/
RUN python -m pip install --constraint /tmp/deps/constraints.txt vllm torch \
 && mkdir -p /usr/local/share/spillway \
 && python /tmp/deps/prune.py /tmp/deps/engine-cpu-prune.txt \
      --record /usr/local/share/spillway/engine-cpu-pruned.txt
# Spillway's own dependencies that vLLM does not bring (kopf, kubernetes, ...).
COPY pyproject.toml tools/images/requirements.py /tmp/deps/
RUN python /tmp/deps/requirements.py /tmp/deps/pyproject.toml > /tmp/deps/requirements.txt \
 && python -m pip install --constraint /tmp/deps/constraints.txt --requirement /tmp/deps/requirements.txt \
 && rm -rf /tmp/deps
# Spillway's code: the only layer a code change rebuilds.
COPY --from=wheel /wheels /wheels
RUN python -m pip install --no-deps /wheels/*.whl \
 && python -m pip check \
 && rm -rf /wheels
ENV HOME=/home/spillway \
    XDG_CACHE_HOME=/home/spillway/.cache \
    HF_HOME=/home/spillway/.cache/huggingface
WORKDIR /home/spillway
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["spillway-engine"]
CMD ["--help"]
