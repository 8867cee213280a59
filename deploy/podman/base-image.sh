#!/usr/bin/env bash
# Build the Debian base image of `make cluster` without any image registry: debootstrap a
# minimal Debian into a temporary directory and `podman import` it. It holds Python 3.11 with
# its venv module (the node image's build and runtime stages) and CA certificates; apt's lists
# and archives, documentation, man pages and locales are left out (as Debian's slim images do).
#
#   deploy/podman/base-image.sh IMAGE [SUITE]        (root; nothing is done if IMAGE exists)
#
# The packages come from the host's Debian mirror (its apt sources), or DEBIAN_MIRROR when set.
# Security updates are applied when the host's sources name the suite's security archive.
set -euo pipefail

image=${1:?usage: base-image.sh IMAGE [SUITE]}
suite=${2:-bookworm}

if podman image exists "$image"; then
    echo "base image: $image exists"
    exit 0
fi
command -v debootstrap > /dev/null || { echo "base image: error: debootstrap is not installed" >&2; exit 1; }

# The first URI of the host's apt sources (deb822 or one-line format) whose path ends in $1.
apt_uri() {
    { grep -hoE "https?://[^ ]+/$1/?( |\$)" /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        2>/dev/null || true; } | head -n 1 | tr -d ' '
}
mirror=${DEBIAN_MIRROR:-$(apt_uri debian)}
[ -n "$mirror" ] || { echo "base image: error: no Debian mirror in /etc/apt; set DEBIAN_MIRROR" >&2; exit 1; }

root=$(mktemp -d /var/tmp/lowcomm-rootfs.XXXXXX)
log="$root.log"
trap 'rm -rf "$root" "$log"' EXIT
# Runs a step with its output in the log; shows the log's end when the step fails.
quiet() { "$@" >> "$log" 2>&1 || { tail -n 20 "$log" >&2; echo "base image: error: $* failed" >&2; exit 1; }; }
# Runs a command inside the new root with a clean environment: the caller's variables name
# host paths that do not exist in there (a TMPDIR of the caller's made ca-certificates'
# post-install script fail in `apt-get upgrade`).
in_root() {
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
        chroot "$root" "$@"
}

echo "base image: debootstrap $suite from $mirror"
quiet env -u TMPDIR debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror"

# The image's later apt installs (the Prometheus image) skip documentation too, like Debian's
# slim images; copyright files stay.
cat > "$root/etc/dpkg/dpkg.cfg.d/lowcomm-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
# The same apt sources as the host (mirror and security archive), in the image.
printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" "$suite" "$suite" > "$root/etc/apt/sources.list.d/debian.sources"
security=$(apt_uri debian-security)
if [ -n "$security" ]; then
    printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$security" "$suite" >> "$root/etc/apt/sources.list.d/debian.sources"
fi
rm -f "$root/etc/apt/sources.list"
cp /etc/resolv.conf "$root/etc/resolv.conf"
quiet in_root apt-get update
quiet in_root apt-get upgrade -y
quiet in_root apt-get clean
: > "$root/etc/resolv.conf"

find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
       "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/*.log "$root"/tmp/*

version=$(cat "$root/etc/debian_version")
tar --numeric-owner -C "$root" -c . | podman import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.opencontainers.image.title=lowcomm-base org.opencontainers.image.version=$version" \
    --message "debootstrap --variant=minbase $suite ($version) from $mirror" \
    - "$image" > /dev/null 2>> "$log"
echo "base image: $image (Debian $version, $(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec))"
