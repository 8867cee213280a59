#!/usr/bin/env bash
# The compose cluster of deploy/docker-compose.yml on a host with podman and no image registry
# (what `make cluster`, `make cluster-down` and tests/test_containers.py run).
#
#   deploy/podman/cluster.sh setup     install podman, runc, catatonit, the CNI DNS plugin and
#                                      debootstrap from Debian where missing (root)
#   deploy/podman/cluster.sh images    build the base, Prometheus and node images (cached)
#   deploy/podman/cluster.sh up        start bootstrap + Prometheus, wait until the bootstrap
#                                      is healthy, then start $PEERS peers
#   deploy/podman/cluster.sh status    `lowcomm-node status` of every node container
#   deploy/podman/cluster.sh down      remove the containers, the network and (unless
#                                      KEEP_VOLUMES=1) the volumes
#
# Run from the repository root. Settings (environment, Makefile variables of the same name):
#   PROJECT          compose project name (lowcomm); container, network and volume prefix
#   PEERS            peer containers next to the bootstrap (3)
#   PODMAN_COMPOSE   the podman-compose program (podman-compose)
#   PIP              the host's pip that fills deploy/wheelhouse (pip)
#   TORCH_SPEC, TORCH_VARIANT   torch requirement (torch==2.13.0) and build (cpu)
#   BASE_IMAGE_LOCAL, NODE_IMAGE, PROMETHEUS_IMAGE   image names (see the defaults below)
#   PROMETHEUS_PORT  host port of Prometheus on 127.0.0.1 (9090)
#
# Podman settings live in deploy/podman/containers.conf (runc, ulimits, init) and podman's
# compose additions in deploy/podman/compose.podman.yml; the compose file is Docker's.
set -euo pipefail

here=deploy/podman
PROJECT=${PROJECT:-lowcomm}
PEERS=${PEERS:-3}
PODMAN_COMPOSE=${PODMAN_COMPOSE:-podman-compose}
PIP=${PIP:-pip}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
BASE_IMAGE_LOCAL=${BASE_IMAGE_LOCAL:-localhost/lowcomm-base:bookworm}
NODE_IMAGE=${NODE_IMAGE:-localhost/lowcomm:$VERSION-$TORCH_VARIANT}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-localhost/lowcomm-prometheus:bookworm}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
export CONTAINERS_CONF="$PWD/$here/containers.conf"
# Read by the compose file's interpolation.
export NODE_IMAGE PROMETHEUS_IMAGE PROMETHEUS_PORT

die() { echo "cluster: error: $*" >&2; exit 1; }

# Without systemd podman logs an error for every container with a healthcheck (it cannot add
# the timer); the checks run through wait_healthy instead, so that line is dropped.
compose() {
    "$PODMAN_COMPOSE" --podman-path podman --in-pod false -p "$PROJECT" \
        -f deploy/docker-compose.yml -f "$here/compose.podman.yml" "$@" \
        2> >(grep -v 'unable to get systemd connection to .* healthchecks' >&2)
}

# Containers of one compose service of this project, oldest first.
service_containers() {
    podman ps --filter "label=io.podman.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | sort
}

cmd_setup() {
    local packages=(podman runc catatonit golang-github-containernetworking-plugin-dnsname debootstrap)
    local missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || die "needs root to install ${missing[*]} (apt-get install ${missing[*]})"
        echo "cluster: installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
    fi
    command -v "$PODMAN_COMPOSE" > /dev/null || die "$PODMAN_COMPOSE not found (pip install podman-compose)"
}

cmd_images() {
    local start=$SECONDS
    "$here/base-image.sh" "$BASE_IMAGE_LOCAL"
    "$here/wheelhouse.sh" "$PIP" "$TORCH_SPEC" "$TORCH_VARIANT"
    echo "cluster: building $PROMETHEUS_IMAGE"
    podman build --quiet --format docker --build-arg BASE_IMAGE="$BASE_IMAGE_LOCAL" \
        -f "$here/prometheus.Containerfile" -t "$PROMETHEUS_IMAGE" "$here" > /dev/null
    echo "cluster: building $NODE_IMAGE (deploy/Dockerfile, offline from deploy/wheelhouse)"
    # The docker format keeps HEALTHCHECK (the OCI format has no such field).
    podman build --quiet --format docker \
        --build-arg PYTHON_IMAGE="$BASE_IMAGE_LOCAL" --build-arg BASE_IMAGE="$BASE_IMAGE_LOCAL" \
        --build-arg TORCH_SPEC="$TORCH_SPEC" --build-arg WHEELS_ONLY=1 \
        -f deploy/Dockerfile -t "$NODE_IMAGE" . > /dev/null
    podman images --filter "reference=$BASE_IMAGE_LOCAL" --filter "reference=$NODE_IMAGE" \
        --filter "reference=$PROMETHEUS_IMAGE" --format '  {{.Repository}}:{{.Tag}}  {{.Size}}'
    echo "cluster: images ready in $((SECONDS - start)) s"
}

# Waits until `podman healthcheck run` passes in a container. Podman runs no healthcheck
# timers without systemd, so the checks run here, which also updates the container's status.
wait_healthy() {
    local container=$1 deadline=$((SECONDS + HEALTH_TIMEOUT))
    until podman healthcheck run "$container" > /dev/null 2>&1; do
        [ "$(podman inspect --format '{{.State.Running}}' "$container" 2>/dev/null)" = true ] \
            || { podman logs --tail 20 "$container" >&2 || true; die "$container is not running"; }
        [ $SECONDS -lt $deadline ] || die "$container not healthy after $HEALTH_TIMEOUT s (podman logs $container)"
        sleep 3
    done
}

cmd_up() {
    podman image exists "$NODE_IMAGE" || die "no image $NODE_IMAGE: run 'make cluster' (or $0 images)"
    podman image exists "$PROMETHEUS_IMAGE" || die "no image $PROMETHEUS_IMAGE: run 'make cluster'"
    echo "cluster: Grafana is not started here: it has no Debian package and no registry is" \
         "reachable (the compose file's grafana service runs with Docker: --profile grafana)"
    # podman 4.3 cannot wait for depends_on's service_healthy (podman-compose skips it with a
    # warning), so the bootstrap comes first and the peers only once it serves.
    compose up -d bootstrap prometheus > /dev/null
    local bootstrap
    bootstrap=$(service_containers bootstrap | head -n 1)
    [ -n "$bootstrap" ] || die "the bootstrap container did not start (podman-compose up)"
    echo "cluster: waiting for $bootstrap to be healthy"
    wait_healthy "$bootstrap"
    compose up -d --no-deps --scale "peer=$PEERS" peer > /dev/null
    echo "cluster: $PEERS peers and the bootstrap are running (project $PROJECT)"
    echo "  Prometheus:   http://127.0.0.1:$PROMETHEUS_PORT/targets"
    echo "  node status:  $0 status   (podman exec $bootstrap lowcomm-node status)"
    echo "  node logs:    podman logs -f $bootstrap"
    echo "  stop:         make cluster-down"
}

cmd_status() {
    local found=0
    for service in bootstrap peer; do
        for container in $(service_containers "$service"); do
            found=1
            echo "== $container"
            podman exec "$container" lowcomm-node status || true
        done
    done
    [ $found = 1 ] || echo "cluster: no node container of project $PROJECT is running"
}

cmd_down() {
    local volumes=(-v)
    [ "${KEEP_VOLUMES:-0}" = 1 ] && volumes=()
    compose down "${volumes[@]}" --remove-orphans > /dev/null 2>&1 || true
    # What podman-compose leaves when a run was interrupted half way: this project's objects only.
    local left=()
    mapfile -t left < <(podman ps -a -q --filter "label=io.podman.compose.project=$PROJECT")
    [ ${#left[@]} -eq 0 ] || podman rm -f -t 40 "${left[@]}" > /dev/null
    if [ ${#volumes[@]} -gt 0 ]; then
        mapfile -t left < <(podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT")
        [ ${#left[@]} -eq 0 ] || podman volume rm -f "${left[@]}" > /dev/null
    fi
    podman network exists "${PROJECT}_default" && podman network rm -f "${PROJECT}_default" > /dev/null
    if [ ${#volumes[@]} -gt 0 ]; then
        echo "cluster: project $PROJECT is down (containers, network and volumes removed)"
    else
        echo "cluster: project $PROJECT is down (volumes kept: KEEP_VOLUMES=1)"
    fi
}

case "${1:-}" in
    setup | images | up | status | down) "cmd_$1" ;;
    *) die "usage: $0 setup|images|up|status|down" ;;
esac
