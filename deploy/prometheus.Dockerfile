# Prometheus from Debian's package (2.42), for an engine that cannot pull Docker Hub's prom/prometheus:
#   docker build -f deploy/prometheus.Dockerfile -t pagedkv-prometheus:debian deploy
#   PAGEDKV_PROMETHEUS_IMAGE=pagedkv-prometheus:debian COMPOSE_PROFILES=http,metrics docker-compose up -d
# It runs as the official image does: config in /etc/prometheus/prometheus.yml (the compose file mounts
# deploy/prometheus.yml there), data in /prometheus, the UI and API on :9090, as an unprivileged user.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"]
