#!/usr/bin/env bash
# The compose stack on a real container engine, as a new user runs it: build the image, bring the stack up with the
# gateway (and Prometheus), and check what the README says works. Prints a table with timings at the end (also when
# a check fails). Not part of `make test`: it needs a Docker engine and several minutes.
#
#   deploy/compose-smoke.sh
#   BASE_IMAGE=pagedkv-base:bookworm TORCH_SPEC="torch==2.13.0 --find-links http://172.17.0.1:8765/ ..." \
#       deploy/compose-smoke.sh                                  # the engine of ../shared/docker/local-engine.sh
#
# Environment (all optional):
#   BASE_IMAGE TORCH_INDEX_URL TORCH_SPEC EXTRAS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST
#   PIP_CERT_PEM COMPILER_PACKAGES PRELOAD_MODEL HTTP_PROXY HTTPS_PROXY NO_PROXY   the Dockerfile's build arguments,
#                                                  passed to `docker build` when set
#   COMPOSE            the compose command [docker-compose if installed, else docker compose]
#   SMOKE_PYTHON       a Python that imports pagedkv and openai (pip install -e '.[dev]') [.venv/bin/python, python3]
#   SMOKE_PROJECT      the compose project name, apart from a stack of yours in this directory [pagedkv-smoke]
#   SMOKE_METRICS=0    leave Prometheus out (else PAGEDKV_PROMETHEUS_IMAGE, or prom/prometheus if it can be
#                      pulled, or one built from Debian's package with deploy/prometheus.Dockerfile)
#   SMOKE_KEEP=1       leave the stack up at the end (no `down -v`)
#   SMOKE_NO_CACHE=1   build without the engine's cache (the build time of a first build)
#   PAGEDKV_MODEL      the executors' model [smollm2-135m-instruct: the gateway check needs a chat template]
#   PAGEDKV_EXECUTOR_THREADS  each executor's torch threads [1 below 4 cores, else 0: torch's default]
# The kill -9 check signals an executor container's main process from the host: run as root (or as a user allowed
# to signal the container's processes, uid 10001).
# Checks: build; health of every service (and no model download at the first start); a TLS gRPC generate and a
# plaintext refusal; an openai SDK chat through the gateway; Prometheus scraping every service; scale executor-2
# to 0 during 2 streams (both finish) and back (both executors used); kill -9 of the executor holding a stream
# (the stream completes identically, the container restarts); `stop` during 4 streams (all 4 finish; the scheduler
# is stopped while gRPC ones still run); a second start (no model conversion or kernel build); `down -v` (nothing
# left).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
read -r -a COMPOSE_CMD <<< "${COMPOSE:-$(command -v docker-compose >/dev/null && echo docker-compose || echo docker compose)}"
export COMPOSE_PROJECT_NAME=${SMOKE_PROJECT:-pagedkv-smoke}
export COMPOSE_FILE=docker-compose.yml
export COMPOSE_PROFILES=http
[ "${SMOKE_METRICS:-1}" = 0 ] || COMPOSE_PROFILES=http,metrics
export PAGEDKV_MODEL=${PAGEDKV_MODEL:-smollm2-135m-instruct}
# two executors on few cores: one torch thread each (two OpenMP threads stall behind any other process)
export PAGEDKV_EXECUTOR_THREADS=${PAGEDKV_EXECUTOR_THREADS:-$([ "$(nproc)" -lt 4 ] && echo 1 || echo 0)}
PY=${SMOKE_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}  # the checkout's pagedkv, for the clients
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-smoke.XXXXXX")
ca=$tmp/ca.pem
rows=()
failed=0

compose() { "${COMPOSE_CMD[@]}" "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
row() {  # check, PASS|FAIL, seconds, detail
  rows+=("$1|$2|$3|$4")
  printf '%-36s %-4s %7s s  %s\n' "$1" "$2" "$3" "$4" >&2
  if [ "$2" != PASS ]; then
    failed=1
    echo "--- $1: the services' last log lines (more in $tmp) ---" >&2
    compose logs --no-color --tail 20 >&2 2>/dev/null || true
  fi
}
summary() { tail -n 1 "$1" | cut -c1-"${2:-120}"; }  # the client's line for the table
services_of() {  # a ready file's executor addresses -> their services
  local a svc names=""
  for a in $("$PY" -c 'import json, sys; print(" ".join(e["address"].rsplit(":", 1)[0] for e in json.load(open(sys.argv[1]))))' "$1"); do
    for svc in executor-1 executor-2; do
      [ "$(ip_of "$(container "$svc")")" = "$a" ] && names+="${names:+, }$svc"
    done
  done
  echo "${names:-?}"
}
client() { "$PY" deploy/compose_smoke.py --ca "$ca" "$@"; }
container() { compose ps -q "$1" | head -n 1; }  # the (first) container of a service
ip_of() { docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1"; }
health_of() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$1"; }

table() {
  echo
  echo "compose smoke: $(date -u +%Y-%m-%dT%H:%MZ), ${COMPOSE_CMD[*]} $(compose version --short 2>/dev/null)," \
    "docker $(docker version -f '{{.Server.Version}}' 2>/dev/null), base ${BASE_IMAGE:-python:3.11-slim}"
  echo "| check | result | seconds | detail |"
  echo "|---|---|---|---|"
  local r
  for r in "${rows[@]}"; do echo "| ${r//|/ | } |"; done
}

finish() {
  local code=$?
  if [ "${SMOKE_KEEP:-0}" != 1 ] && [ -z "${downed:-}" ]; then compose down -v >/dev/null 2>&1 || true; fi
  table
  if [ "$failed" = 0 ] && [ "$code" = 0 ]; then rm -rf "$tmp"; else echo "(outputs kept in $tmp)"; fi
  [ "$failed" = 0 ] && [ "$code" = 0 ]
}
trap finish EXIT

wait_healthy() {  # services... ; the seconds it took, or fails after 900 s
  local t0 svc c state deadline=$(( $(date +%s) + 900 ))
  t0=$(now)
  for svc in "$@"; do
    while :; do
      c=$(container "$svc")
      state=$([ -n "$c" ] && health_of "$c")
      [ "$state" = healthy ] && break
      if [ "$(date +%s)" -gt "$deadline" ]; then echo "$svc: $state after 900 s" >&2; return 1; fi
      sleep 1
    done
  done
  since "$t0"
}

wait_file() {  # path, pid of the process that writes it; fails if that process ends first or after 300 s
  local i
  for i in $(seq 1 600); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

"$PY" -c "import openai, pagedkv.client" 2>/dev/null \
  || { echo "$PY cannot import pagedkv and openai: pip install -e '.[dev]' (or set SMOKE_PYTHON)"; exit 2; }
"${COMPOSE_CMD[@]}" version >/dev/null || { echo "no compose command: install docker-compose, or set COMPOSE"; exit 2; }
compose down -v >/dev/null 2>&1  # a smoke run's leftovers

# --- build ---------------------------------------------------------------------------------------------------------
build_args=()
if [ -n "${PIP_FIND_LINKS:-}" ]; then  # a local directory of this machine's pip settings is not in the build
  links=$(tr ' ' '\n' <<< "$PIP_FIND_LINKS" | grep -E '^(https?)://' | tr '\n' ' ')
  [ "${links% }" = "$PIP_FIND_LINKS" ] || echo "PIP_FIND_LINKS: left out of the build: $(tr ' ' '\n' \
    <<< "$PIP_FIND_LINKS" | grep -vE '^(https?)://' | tr '\n' ' ')(serve it over HTTP, as local-engine.sh does)" >&2
  PIP_FIND_LINKS=${links% }; [ -n "$PIP_FIND_LINKS" ] || unset PIP_FIND_LINKS
fi
for a in BASE_IMAGE TORCH_INDEX_URL TORCH_SPEC EXTRAS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS \
         PIP_TRUSTED_HOST PIP_CERT_PEM COMPILER_PACKAGES PRELOAD_MODEL HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [ -n "${!a+set}" ] && build_args+=(--build-arg "$a=${!a}")
done
t0=$(now)
[ "${SMOKE_NO_CACHE:-0}" = 1 ] && build_args+=(--no-cache)
if docker build "${build_args[@]}" -t pagedkv:latest . > "$tmp/build.log" 2>&1; then
  size=$(docker image inspect -f '{{.Size}}' pagedkv:latest | awk '{ printf "%.2f GB", $1 / 1e9 }')
  compiler=$(docker history --no-trunc --format '{{.Size}} {{.CreatedBy}}' pagedkv:latest \
             | awk '/apt-get install/ { print $1; exit }')
  row "build pagedkv:latest" PASS "$(since "$t0")" \
    "image $size (compiler layer ${compiler:-none}); steps from the cache: $(grep -cE 'Using cache|CACHED' "$tmp/build.log")$([ "${SMOKE_NO_CACHE:-0}" = 1 ] && echo " (--no-cache)")"
else
  row "build pagedkv:latest" FAIL "$(since "$t0")" "$(tail -n 3 "$tmp/build.log" | tr '\n' ' ')"; exit 1
fi
if [[ $COMPOSE_PROFILES == *metrics* ]]; then
  t0=$(now)
  prom=${PAGEDKV_PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}
  if ! docker image inspect "$prom" >/dev/null 2>&1 && ! docker pull -q "$prom" >/dev/null 2>&1; then
    prom=pagedkv-prometheus:debian
    docker build ${BASE_IMAGE:+--build-arg "BASE_IMAGE=$BASE_IMAGE"} -f deploy/prometheus.Dockerfile -t "$prom" deploy \
      > "$tmp/prometheus-build.log" 2>&1 \
      || { row "build Prometheus" FAIL "$(since "$t0")" "deploy/prometheus.Dockerfile failed"; exit 1; }
  fi
  export PAGEDKV_PROMETHEUS_IMAGE=$prom
  row "Prometheus image" PASS "$(since "$t0")" "$prom $(docker image inspect -f '{{.Size}}' "$prom" \
    | awk '{ printf "%.2f GB", $1 / 1e9 }')"
fi

# --- up and healthy --------------------------------------------------------------------------------------------------
t0=$(now)
compose up -d > "$tmp/up.log" 2>&1 || { row "up -d" FAIL "$(since "$t0")" "$(tail -n 2 "$tmp/up.log")"; exit 1; }
if secs=$(wait_healthy scheduler executor-1 executor-2 gateway); then
  logs=$(compose logs --no-color executor-1 executor-2)
  fetched=$(grep -c '"model_fetch"' <<< "$logs")
  converted=$(grep -c '"model_converted"' <<< "$logs")
  row "up -d: all healthy (first start)" "$([ "$fetched" = 0 ] && echo PASS || echo FAIL)" "$(since "$t0")" \
    "scheduler, executor-1, executor-2, gateway; model downloads: $fetched, conversions: $converted"
else
  row "up -d: all healthy (first start)" FAIL "$(since "$t0")" "see the logs above"; exit 1
fi
user=$(docker inspect -f '{{.Config.User}}' "$(container scheduler)")
row "services run as non-root" "$([ "$user" = 10001:10001 ] && echo PASS || echo FAIL)" 0 "user $user"

# --- TLS gRPC and the gateway ----------------------------------------------------------------------------------------
compose exec -T scheduler cat /certs/ca.pem > "$ca"
t0=$(now)
out=$("$PY" -m pagedkv generate "Hello" --address 127.0.0.1:50051 --tls-ca "$ca" --max-tokens 16 2>"$tmp/gen.err")
code=$?
plain=$("$PY" -m pagedkv health --address 127.0.0.1:50051 --timeout 5 2>&1)
refused=$?
row "TLS gRPC generate" "$([ $code = 0 ] && [ -n "$out" ] && [ $refused != 0 ] && echo PASS || echo FAIL)" \
  "$(since "$t0")" "$(tr '\n' ' ' < "$tmp/gen.err" | cut -c1-60); plaintext refused: ${plain:0:50}"
t0=$(now)
out=$(client chat 2>&1)
row "openai SDK chat via the gateway" "$([ $? = 0 ] && echo PASS || echo FAIL)" "$(since "$t0")" "${out:0:110}"

# --- Prometheus ------------------------------------------------------------------------------------------------------
if [[ $COMPOSE_PROFILES == *metrics* ]]; then
  t0=$(now)
  for i in $(seq 1 60); do
    up=$(curl -s http://127.0.0.1:9090/api/v1/targets \
         | "$PY" -c 'import json, sys; t = json.load(sys.stdin)["data"]["activeTargets"]; print(sum(x["health"] == "up" for x in t), len(t))' 2>/dev/null)
    [ "$up" = "4 4" ] && break
    sleep 2
  done
  row "Prometheus scrapes every service" "$([ "$up" = "4 4" ] && echo PASS || echo FAIL)" "$(since "$t0")" \
    "targets up/all: ${up:-none} (scheduler, 2 executors, gateway)"
fi

# --- scale executor-2 to 0 during 2 streams, then back to 1 ------------------------------------------------------
t0=$(now)
client streams --count 2 --max-tokens 64 --ready-file "$tmp/scale.ready" > "$tmp/scale.out" 2>&1 &
pid=$!
if wait_file "$tmp/scale.ready" $pid; then
  held=$(services_of "$tmp/scale.ready")
  compose up -d --scale executor-2=0 > "$tmp/scale.log" 2>&1
fi
wait $pid; code=$?
down_s=$(since "$t0")
left=$(client executors)
# (executor-2 must hold one of them: its drain is what this checks)
row "scale executor-2=0 during 2 streams" "$([ $code = 0 ] && [[ ${held:-} == *executor-2* ]] && echo PASS || echo FAIL)" \
  "$down_s" \
  "streams on ${held:-?}: $(summary "$tmp/scale.out" 60); executors up after: $(grep -o '"state": "up"' <<< "$left" | wc -l)"
t0=$(now)
compose up -d --scale executor-2=1 > "$tmp/scale.log" 2>&1
for i in $(seq 1 120); do
  [ "$(client executors | grep -o '"state": "up"' | wc -l)" = 2 ] && break
  sleep 1
done
joined=$(since "$t0")
before=$(client executors)
client streams --count 6 --max-tokens 8 > "$tmp/scale2.out" 2>&1; code=$?  # least load first: spread
after=$(client executors)
used=$("$PY" -c 'import json, sys
b = {e["address"]: e["placed"] for e in json.loads(sys.argv[1])}
a = [e for e in json.loads(sys.argv[2]) if e["state"] == "up"]
print(sum(e["placed"] > b.get(e["address"], 0) for e in a), len(a))' "$before" "$after")
row "scale executor-2=1: both used" "$([ $code = 0 ] && [ "$used" = "2 2" ] && echo PASS || echo FAIL)" \
  "$joined" "picked up in ${joined} s; executors that took requests/up: $used"

# --- kill -9 of the executor holding a stream ------------------------------------------------------------------------
t0=$(now)
client streams --count 1 --max-tokens 64 --reference --ready-file "$tmp/kill.ready" > "$tmp/kill.out" 2>&1 &
pid=$!
victim=""
if wait_file "$tmp/kill.ready" $pid; then
  address=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[0]["address"].rsplit(":", 1)[0])' \
            "$tmp/kill.ready")
  for svc in executor-1 executor-2; do
    c=$(container "$svc"); [ "$(ip_of "$c")" = "$address" ] && victim=$svc && vc=$c
  done
fi
if [ -n "$victim" ]; then
  restarts=$(docker inspect -f '{{.RestartCount}}' "$vc")
  main=$(docker inspect -f '{{.State.Pid}}' "$vc")
  killed_at=$(now)
  kill -9 "$main" 2>/dev/null || sudo -n kill -9 "$main"
fi
wait $pid; code=$?
stream_s=$(since "$t0")
[ -n "$victim" ] && wait_healthy "$victim" >/dev/null && healthy=$(since "$killed_at")
after=$([ -n "$victim" ] && docker inspect -f '{{.RestartCount}}' "$vc")
row "kill -9 executor mid-stream" \
  "$([ $code = 0 ] && [ -n "$victim" ] && [ "${after:-0}" -gt "${restarts:-0}" ] && echo PASS || echo FAIL)" \
  "$stream_s" "killed ${victim:-nothing}'s main process: $(summary "$tmp/kill.out" 90); restarts ${restarts:-?} -> ${after:-?}, healthy ${healthy:-?} s after the kill"

# --- stop during 4 streams (2 through the gateway, 2 longer ones over gRPC) ---------------------------------------
# Compose stops the gateway first (it waits for its streams), then the scheduler, then the executors: the gRPC streams
# outlast the gateway's, so the scheduler is stopped while they run and must let them finish (live_streams > 0 below).
t0=$(now)
client streams --count 4 --via both --max-tokens 32 --grpc-max-tokens 160 --ready-file "$tmp/stop.ready" \
  > "$tmp/stop.out" 2>&1 &
pid=$!
stop_s="?"
if wait_file "$tmp/stop.ready" $pid; then
  t1=$(now)
  compose stop > "$tmp/stop.log" 2>&1
  stop_s=$(since "$t1")
fi
wait $pid; code=$?
scheduler_log=$(compose logs --no-color scheduler)
live=$(grep '"scheduler_draining"' <<< "$scheduler_log" | tail -n 1 | grep -o '"live_streams": *[0-9]*' | grep -o '[0-9]*$')
unfinished=$(grep '"scheduler_stopped"' <<< "$scheduler_log" | tail -n 1 \
             | grep -o '"unfinished_streams": *[0-9]*' | grep -o '[0-9]*$')
row "stop during 4 streams" \
  "$([ $code = 0 ] && [ "$unfinished" = 0 ] && [ "${live:-0}" -gt 0 ] && echo PASS || echo FAIL)" "$(since "$t0")" \
  "$(summary "$tmp/stop.out" 110); stop took ${stop_s} s; the scheduler stopped with ${live:-?} streams live, unfinished ${unfinished:-?}"

# --- a second start: the model and the kernels are in the volume --------------------------------------------------
t0=$(now)
since_ts=$(date -u +%Y-%m-%dT%H:%M:%SZ)
compose up -d > "$tmp/up2.log" 2>&1
if secs=$(wait_healthy scheduler executor-1 executor-2 gateway); then
  logs=$(docker logs --since "$since_ts" "$(container executor-1)" 2>&1; docker logs --since "$since_ts" "$(container executor-2)" 2>&1)
  work=$(grep -c -E '"model_(fetch|convert)"|"cpu_attention_kernel".*"built": *true' <<< "$logs")
  row "second start: all healthy" "$([ "$work" = 0 ] && echo PASS || echo FAIL)" "$(since "$t0")" \
    "downloads, conversions and kernel builds: $work"
else
  row "second start: all healthy" FAIL "$(since "$t0")" "see the logs above"
fi

# --- down -v -------------------------------------------------------------------------------------------------------
[ "${SMOKE_KEEP:-0}" = 1 ] && exit 0
t0=$(now)
compose down -v > "$tmp/down.log" 2>&1; code=$?
downed=1
left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | wc -l)
vols=$(docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | wc -l)
row "down -v" "$([ $code = 0 ] && [ "$left" = 0 ] && [ "$vols" = 0 ] && echo PASS || echo FAIL)" "$(since "$t0")" \
  "containers left: $left, volumes left: $vols"
