# One image for both services. CPU by default; for CUDA executors build with
#   --build-arg TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>" --build-arg EXTRAS=cuda
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG EXTRAS=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagedkv pagedkv
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels_cuda kernels_cuda
COPY proto proto
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
ENV PAGEDKV_CACHE_DIR=/models
VOLUME /models
ENTRYPOINT ["pagedkv"]
