#!/usr/bin/env bash
# Build the xlaserve image and check it end to end (docs/deployment.md, "The container test").
#
#   deploy/test-container.sh            # from the repository root, as root (podman) or a docker user
#
# 1. builds the image with podman (or docker, when podman is absent and a docker daemon answers)
#    from a local base image, making one with debootstrap when it is missing (no registry needed);
# 2. builds the example bundles on the host (examples/export_examples.py) and mounts them at
#    /models, read-only;
# 3. runs the image's entrypoint (`xlaserve run`) with a node file that is deploy/node.yaml plus a
#    batch_delay_seconds hold on mlp (so a request can be caught in flight), waits for /readyz,
#    runs the image's HEALTHCHECK, checks the server does not run as root, queries simple, mlp and
#    cnn with the Triton client from the host and compares them with examples/reference.py; with
#    TRACING=otel (the default) the node traces every request to a JSON-lines file (the image's
#    OpenTelemetry SDK), and the file must hold the queries' xlaserve.infer spans;
# 4. runs the standalone gateway of deploy/k8s/gateway.yaml from the same image, read-only, on a
#    container network where the node answers to the DNS name xlaserve-workers, queries the models
#    through it, and stops it with SIGTERM (exit status 0);
# 5. sends SIGTERM to the node while an mlp request is held in the queue: the request must still be
#    answered, and the container must exit with status 0;
# 6. runs a node of two workers (deploy/node.yaml with gpus: 2, as the cuda image is on a machine
#    with two GPUs): PID 1 is then the supervisor with the embedded gateway; queries it, sends
#    SIGTERM, expects exit status 0 and both workers' "stopped" lines;
# 7. prints the image's size and removes the containers and the network (the image stays, for
#    layer caching).
#
# Environment: PYTHON (an interpreter with xlaserve's bench extra; default .venv/bin/python),
# BASE (default localhost/debian:bookworm-min; made with debootstrap if missing), IMAGE (default
# localhost/xlaserve:test), VARIANT (cpu; cuda builds but cannot run without a GPU), TRACING
# (otel, the default: the image has the otel extra, checked by importing it; none: it must not),
# ENGINE (podman or docker), OCI_RUNTIME (podman's runtime, default runc where installed).
# Not part of the pytest suite: it needs root or a container engine, and minutes.
set -euo pipefail

cd "$(dirname "$0")/.."
checkout=$(pwd)
PYTHON=${PYTHON:-$checkout/.venv/bin/python}
BASE=${BASE:-localhost/debian:bookworm-min}
IMAGE=${IMAGE:-localhost/xlaserve:test}
VARIANT=${VARIANT:-cpu}
TRACING=${TRACING:-otel}
ready_timeout=${READY_TIMEOUT:-300}
work=$(mktemp -d "${TMPDIR:-/tmp}/xlaserve-container-test.XXXXXX")
name=xlaserve-test-$$
gateway_name=xlaserve-test-gateway-$$
supervisor_name=xlaserve-test-supervisor-$$
network=xlaserve-test-$$
started=$(date +%s)

say() { echo "test-container: $*"; }
fail() {
    echo "test-container: FAILED: $*" >&2
    if [ -n "${engine:-}" ] && "${engine[@]}" inspect "$name" >/dev/null 2>&1; then
        echo "test-container: the container's last lines:" >&2
        "${engine[@]}" logs --tail 30 "$name" >&2 || true
    fi
    exit 1
}
cleanup() {
    if [ -n "${engine:-}" ]; then
        for container in "$gateway_name" "$supervisor_name" "$name"; do
            "${engine[@]}" rm -f -t 0 "$container" >/dev/null 2>&1 || "${engine[@]}" rm -f "$container" >/dev/null 2>&1 || true
        done
        "${engine[@]}" network rm "$network" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
# Whether container $1's log has a line matching $2, looked for again (5 times at most, 0.5 s
# apart) in case the engine's log file lags the container's exit (podman's conmon writes it). Once,
# right after the two-worker node exited, its log lacked worker1's "stopped" line; eight later
# runs had it at once, and the cause was not found. A line that was never written still fails.
logs_have() {
    local try
    for try in 1 2 3 4 5; do
        "${engine[@]}" logs "$1" 2>&1 | grep -q -- "$2" && return 0
        sleep 0.5
    done
    return 1
}
trap 'fail "interrupted"' INT TERM

[ -x "$PYTHON" ] || fail "PYTHON=$PYTHON is not an interpreter; make the venv: python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
"$PYTHON" -c 'import tritonclient.grpc' 2>/dev/null || fail "$PYTHON lacks tritonclient[grpc] (pip install -e '.[bench]')"

# --- the engine ----------------------------------------------------------------------------------
choice=${ENGINE:-}
if [ -z "$choice" ]; then
    if command -v podman >/dev/null; then choice=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then choice=docker
    else fail "neither podman nor a working docker (a client whose daemon answers 'docker info') was found"
    fi
fi
case $choice in
    podman)
        engine=(podman)
        runtime=${OCI_RUNTIME:-$(command -v runc >/dev/null && echo runc || true)}
        [ -n "$runtime" ] && engine+=(--runtime "$runtime")
        # A machine without a containers.conf of its own gets the one that works on a container
        # host without systemd: cgroupfs, and no default ulimits (setrlimit is refused there).
        if [ -z "${CONTAINERS_CONF:-}" ] && [ ! -e /etc/containers/containers.conf ]; then
            printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\n' > "$work/containers.conf"
            export CONTAINERS_CONF=$work/containers.conf
            say "no /etc/containers/containers.conf: using cgroupfs and no default ulimits ($CONTAINERS_CONF)"
        fi
        ;;
    docker) engine=(docker) ;;
    *) fail "ENGINE must be podman or docker, got '$choice'" ;;
esac
say "engine: ${engine[*]} ($("${engine[@]}" --version))"

# --- the base image ------------------------------------------------------------------------------
if ! "${engine[@]}" image inspect "$BASE" >/dev/null 2>&1; then
    case $BASE in
        localhost/debian:bookworm-min)
            command -v debootstrap >/dev/null || fail "base $BASE is missing and debootstrap is not installed (apt-get install debootstrap)"
            [ "$(id -u)" = 0 ] || fail "base $BASE is missing; making it with debootstrap needs root"
            say "making the base image $BASE with debootstrap (minbase bookworm)"
            debootstrap --variant=minbase bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 \
                || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
            tar -C "$work/rootfs" -c . | "${engine[@]}" import - "$BASE" >/dev/null 2>&1 || fail "importing the base failed"
            rm -rf "$work/rootfs"
            ;;
        *) fail "base image $BASE is not present; pull or import it first" ;;
    esac
fi

# --- build ---------------------------------------------------------------------------------------
build=("${engine[@]}" build --build-arg "BASE=$BASE" --build-arg "VARIANT=$VARIANT" --build-arg "TRACING=$TRACING"
       -t "$IMAGE" -f Containerfile)
if [ "$choice" = podman ]; then
    # HEALTHCHECK is a docker-format field (the OCI format drops it); and pip inside the build
    # trusts the host's certificate authorities, for machines whose PyPI route needs them.
    build+=(--format docker)
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        build+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro --build-arg PIP_CERT=/etc/ssl/host-ca.crt)
    fi
fi
say "building $IMAGE (BASE=$BASE, VARIANT=$VARIANT, TRACING=$TRACING)"
t0=$(date +%s)
"${build[@]}" . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; fail "the build failed"; }
say "built in $(( $(date +%s) - t0 )) s"
if [ "$VARIANT" != cpu ]; then
    say "VARIANT=$VARIANT built; it needs a GPU to run, so the run checks are skipped"
    "${engine[@]}" image inspect --format 'image size: {{.Size}} bytes' "$IMAGE"
    exit 0
fi

# --- the image's metadata ------------------------------------------------------------------------
user=$("${engine[@]}" image inspect --format '{{.Config.User}}' "$IMAGE")
case $user in ""|root|0|root:*|0:*) fail "the image's USER is '$user': it would run as root" ;; esac
health=$("${engine[@]}" image inspect --format '{{if .Config.Healthcheck}}{{json .Config.Healthcheck.Test}}{{end}}' "$IMAGE")
[ -n "$health" ] || fail "the image has no HEALTHCHECK (built in OCI format?)"
say "image: USER $user, HEALTHCHECK $health"
"${engine[@]}" run --rm --entrypoint python3 "$IMAGE" -c \
    'from xlaserve.config import load_node_config; import os; n = load_node_config("/etc/xlaserve/node.yaml", os.environ); print(f"test-container: the shipped node file loads: model_repo {n.model_repo}, gpus {n.gpus}, backend {n.runtime.backend}, listen {n.listen.grpc} {n.listen.http}")' \
    || fail "the image's /etc/xlaserve/node.yaml does not load"
otel_import='import opentelemetry.sdk.trace; from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter'
if [ "$TRACING" = otel ]; then
    "${engine[@]}" run --rm --entrypoint python3 "$IMAGE" -c "$otel_import" \
        || fail "TRACING=otel, but the image cannot import the OpenTelemetry SDK and its OTLP exporter"
    say "the otel extra is installed: the OpenTelemetry SDK and the OTLP/HTTP exporter import"
elif "${engine[@]}" run --rm --entrypoint python3 "$IMAGE" -c "$otel_import" 2>/dev/null; then
    fail "TRACING=$TRACING, but the image has the otel extra"
else
    say "TRACING=$TRACING: the otel extra is not installed (the OpenTelemetry SDK does not import)"
fi

# --- the model repository and the test's node file -----------------------------------------------
say "building the example bundles into $work/models"
"$PYTHON" examples/export_examples.py "$work/models" >"$work/export.log" 2>&1 \
    || { tail -20 "$work/export.log" >&2; fail "examples/export_examples.py failed"; }
chmod -R a+rX "$work/models"
"$PYTHON" - "$checkout/deploy/node.yaml" "$work/drain-test.yaml" <<'EOF'
import sys, yaml
node = yaml.safe_load(open(sys.argv[1]))
# mlp's oldest request waits up to 4 s for more rows: long enough to send SIGTERM while it is queued
node["global"].setdefault("scheduler", {})["models"] = {"mlp": {"batch_delay_seconds": 4}}
with open(sys.argv[2], "w") as f:
    f.write("# deploy/node.yaml plus a hold on mlp, for the drain check of deploy/test-container.sh\n")
    yaml.safe_dump(node, f, sort_keys=False)
EOF
chmod a+r "$work/drain-test.yaml"

# --- run -----------------------------------------------------------------------------------------
say "starting $name"
if [ "$choice" = podman ] && [ ! -S /run/systemd/private ]; then
    # podman schedules periodic health checks with systemd timers; without systemd it logs two
    # errors at each start and schedules none, so this script runs the check itself (below).
    say "no systemd: podman will not run the HEALTHCHECK on a timer (it says so below); this script runs it once"
fi
"${engine[@]}" network create "$network" >/dev/null || fail "cannot create the network $network"
tracing_env=()
if [ "$TRACING" = otel ]; then
    # the node file's tracing block (off) turned on by the environment, every request traced
    tracing_env=(-e INFERENCE_SERVER_TRACING_ENABLED=true -e INFERENCE_SERVER_TRACING_SAMPLING_RATIO=1
                 -e INFERENCE_SERVER_TRACING_EXPORTER=file -e INFERENCE_SERVER_TRACING_FILE=/var/lib/xlaserve/spans.jsonl)
fi
"${engine[@]}" run -d --name "$name" --network "$network" --network-alias xlaserve-workers \
    -p 127.0.0.1::8001 -p 127.0.0.1::8002 "${tracing_env[@]}" \
    -v "$work/models:/models:ro" -v "$work/drain-test.yaml:/etc/xlaserve/drain-test.yaml:ro" \
    "$IMAGE" /etc/xlaserve/drain-test.yaml >/dev/null || fail "the container did not start"
grpc=$("${engine[@]}" port "$name" 8001/tcp | head -1)
http=$("${engine[@]}" port "$name" 8002/tcp | head -1)
say "published: gRPC $grpc, HTTP $http (loopback only)"
t0=$(date +%s)
"$PYTHON" deploy/container_check.py ready "$http" --timeout "$ready_timeout" || fail "not ready"
say "ready $(( $(date +%s) - t0 )) s after start"

if [ "$choice" = podman ]; then
    "${engine[@]}" healthcheck run "$name" >/dev/null || fail "the HEALTHCHECK reports unhealthy"
    say "HEALTHCHECK: healthy (podman healthcheck run)"
else
    say "HEALTHCHECK: $("${engine[@]}" inspect --format '{{.State.Health.Status}}' "$name") (docker runs it every 30 s)"
fi
uid=$("${engine[@]}" exec "$name" id -u)
pid1=$("${engine[@]}" exec "$name" sh -c 'tr "\0" " " < /proc/1/cmdline; echo; awk "/^Uid:/ {print \$2}" /proc/1/status')
[ "$uid" != 0 ] || fail "the container runs as root"
[ "$(echo "$pid1" | tail -1)" != 0 ] || fail "PID 1 runs as root"
say "user: $("${engine[@]}" exec "$name" id) (not root); PID 1: $(echo "$pid1" | head -1)"

"$PYTHON" deploy/container_check.py query "$grpc" || fail "a query failed"
if [ "$TRACING" = otel ]; then
    spans=0
    for try in 1 2 3 4 5 6 7 8 9 10; do      # exported every export_interval_seconds (1 s)
        spans=$("${engine[@]}" exec "$name" sh -c 'grep -c "\"name\": *\"xlaserve.infer\"" /var/lib/xlaserve/spans.jsonl' || true)
        [ "${spans:-0}" -gt 0 ] && break
        sleep 1
    done
    [ "${spans:-0}" -gt 0 ] || fail "tracing was on, but /var/lib/xlaserve/spans.jsonl has no xlaserve.infer span"
    say "traces: $spans xlaserve.infer spans in the container's /var/lib/xlaserve/spans.jsonl"
fi

# The standalone gateway of deploy/k8s/gateway.yaml in front of it, as in Kubernetes: its file from
# the ConfigMap with the endpoint's DNS name made this network's alias of the node, and a
# read-only root filesystem, as the Deployment sets.
"$PYTHON" - "$checkout/deploy/k8s/gateway.yaml" "$work/gateway.yaml" <<'EOF2'
import sys, yaml
(configmap,) = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "ConfigMap"]
gateway = yaml.safe_load(configmap["data"]["gateway.yaml"])
port = gateway["endpoints"][0].rsplit(":", 1)[1]
gateway["endpoints"] = [f"xlaserve-workers:{port}"]     # the network alias of the node container
with open(sys.argv[2], "w") as f:
    yaml.safe_dump(gateway, f, sort_keys=False)
EOF2
chmod a+r "$work/gateway.yaml"
"${engine[@]}" run -d --name "$gateway_name" --network "$network" --read-only \
    -p 127.0.0.1::8001 -p 127.0.0.1::8002 -v "$work/gateway.yaml:/etc/xlaserve/gateway/gateway.yaml:ro" \
    --entrypoint xlaserve "$IMAGE" gateway /etc/xlaserve/gateway/gateway.yaml >/dev/null 2>&1 \
    || fail "the gateway container did not start"
gateway_grpc=$("${engine[@]}" port "$gateway_name" 8001/tcp | head -1)
gateway_http=$("${engine[@]}" port "$gateway_name" 8002/tcp | head -1)
"$PYTHON" deploy/container_check.py ready "$gateway_http" --timeout 60 \
    || { "${engine[@]}" logs --tail 20 "$gateway_name" >&2; fail "the gateway is not ready"; }
"$PYTHON" deploy/container_check.py query "$gateway_grpc" \
    || { "${engine[@]}" logs --tail 20 "$gateway_name" >&2; fail "a query through the gateway failed"; }
say "gateway (deploy/k8s/gateway.yaml, read-only root, endpoint xlaserve-workers:8001 by DNS): the queries above went through it"
"${engine[@]}" kill --signal TERM "$gateway_name" >/dev/null
code=$("${engine[@]}" wait "$gateway_name")
[ "$code" = 0 ] || { "${engine[@]}" logs --tail 20 "$gateway_name" >&2; fail "the gateway exited with status $code after SIGTERM"; }
say "gateway: exit status 0 after SIGTERM"
say "memory after the queries: $("${engine[@]}" stats --no-stream --format '{{.MemUsage}}' "$name" 2>/dev/null || echo 'not available from this engine')"

t0=$(date +%s)
"$PYTHON" deploy/container_check.py drain "$grpc" "$http" -- "${engine[@]}" kill --signal TERM "$name" \
    || fail "the drain check failed"
code=$("${engine[@]}" wait "$name")
say "exit status $code, $(( $(date +%s) - t0 )) s after the drain check began"
[ "$code" = 0 ] || fail "the container exited with status $code after SIGTERM (expected 0)"
"${engine[@]}" logs "$name" 2>&1 | grep -E '"(draining|worker worker0 stopped)' | cut -c1-200 | sed 's/^/test-container: log: /'
logs_have "$name" 'worker worker0 stopped' || fail "the log has no 'worker worker0 stopped' line"

# A node of two workers, as the cuda image is on a machine with two GPUs: `xlaserve run` is then
# PID 1 as the supervisor, with the embedded gateway on 8001/8002 and a worker process each.
"$PYTHON" - "$checkout/deploy/node.yaml" "$work/two-workers.yaml" <<'EOF2'
import sys, yaml
node = yaml.safe_load(open(sys.argv[1]))
node["gpus"] = 2      # on the cpu backend: two worker processes
with open(sys.argv[2], "w") as f:
    f.write("# deploy/node.yaml with two workers, for deploy/test-container.sh\n")
    yaml.safe_dump(node, f, sort_keys=False)
EOF2
chmod a+r "$work/two-workers.yaml"
"${engine[@]}" run -d --name "$supervisor_name" -p 127.0.0.1::8001 -p 127.0.0.1::8002 \
    -v "$work/models:/models:ro" -v "$work/two-workers.yaml:/etc/xlaserve/two-workers.yaml:ro" \
    "$IMAGE" /etc/xlaserve/two-workers.yaml >/dev/null 2>&1 || fail "the two-worker container did not start"
supervisor_grpc=$("${engine[@]}" port "$supervisor_name" 8001/tcp | head -1)
supervisor_http=$("${engine[@]}" port "$supervisor_name" 8002/tcp | head -1)
"$PYTHON" deploy/container_check.py ready "$supervisor_http" --timeout "$ready_timeout" \
    || { "${engine[@]}" logs --tail 30 "$supervisor_name" >&2; fail "the two-worker node is not ready"; }
"$PYTHON" deploy/container_check.py query "$supervisor_grpc" \
    || { "${engine[@]}" logs --tail 30 "$supervisor_name" >&2; fail "a query to the two-worker node failed"; }
workers=$("${engine[@]}" exec "$supervisor_name" sh -c 'for p in /proc/[0-9]*; do tr "\0" " " < "$p/cmdline"; echo; done' | grep -c -- '-m xlaserve .* worker ' || true)
[ "$workers" = 2 ] || fail "the two-worker node runs $workers worker processes, not 2"
say "two workers: PID 1 is the supervisor, with $workers worker processes"
t0=$(date +%s)
"${engine[@]}" kill --signal TERM "$supervisor_name" >/dev/null
code=$("${engine[@]}" wait "$supervisor_name")
say "two workers: exit status $code, $(( $(date +%s) - t0 )) s after SIGTERM"
[ "$code" = 0 ] || { "${engine[@]}" logs --tail 30 "$supervisor_name" >&2; fail "the two-worker node exited with status $code after SIGTERM"; }
for worker in worker0 worker1; do
    logs_have "$supervisor_name" "worker $worker stopped" \
        || { "${engine[@]}" logs --tail 30 "$supervisor_name" >&2; fail "the two-worker node's log has no 'worker $worker stopped' line"; }
done
say "two workers: both logged 'stopped' (the supervisor drained the gateway, then signalled them)"

size=$("${engine[@]}" image inspect --format '{{.Size}}' "$IMAGE")
say "image $IMAGE: $size bytes ($(( size / 1000000 )) MB); base $BASE: $("${engine[@]}" image inspect --format '{{.Size}}' "$BASE") bytes"
say "PASSED in $(( $(date +%s) - started )) s"
