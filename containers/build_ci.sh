#!/usr/bin/env bash
# CI's image step (.ci/run, after `make test`): the CPU image built with podman, then its test
# stage, which starts a 1P1D mesh inside the image and serves a completion through Envoy
# (containers/smoke_test.py), failing the build if the answer is wrong; the image's size is
# printed and held under IMAGE_MAX_GB.
#
# CI machines reach no container registry and cannot start a container (no OCI runtime may set
# rlimits there), so the base is made here from Debian's packages (debootstrap, `podman import`)
# and the build runs with --isolation=chroot, whose RUN steps serve on 127.0.0.1. The base is
# made once per run and used by both builds (DISTSERVE_IMAGE_BASE=<image> reuses one instead).
# Where podman or debootstrap cannot be had (not root, no apt-get), the step says so and skips.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_MAX_GB=${IMAGE_MAX_GB:-1.5}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
start=$SECONDS

skip() {
    echo "image step skipped: $*" >&2
    exit 0
}

[ "$(id -u)" = 0 ] || skip "needs root (debootstrap, podman's root storage); 'make image' \
builds where podman or docker works"
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || skip "needs ${missing[*]}, and apt-get is not here to install"
    echo "installing ${missing[*]} (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        >/dev/null || skip "apt-get could not install ${missing[*]}"
fi

base=${DISTSERVE_IMAGE_BASE:-}
if [ -z "$base" ]; then
    base=localhost/distserve-ci-base:bookworm
    work=$(mktemp -d /var/tmp/distserve-image.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    echo "base: debootstrap bookworm (minbase, python3, python3-venv) from $DEBIAN_MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$work/rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    # This host's own certificate authorities (e.g. a TLS-inspecting proxy's), so that pip in
    # the build reaches PyPI as this host does.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$work/rootfs/usr/local/share/ca-certificates/"
        chroot "$work/rootfs" update-ca-certificates >/dev/null 2>&1
    fi
    # Slim, as the usual python:3.11-slim is: no package lists or caches, docs or translations.
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
        "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* \
        "$work"/rootfs/usr/share/locale/*
    tar -C "$work/rootfs" -c . | podman import --quiet - "$base" >/dev/null
    rm -rf "$work/rootfs"
    echo "base: $base made in $((SECONDS - start)) s"
fi

version=$(python3 -c "import distserve; print(distserve.__version__)")
make image-test CONTAINER=podman IMAGE_BASE="$base" IMAGE_FLAGS="--isolation=chroot"
podman rmi "distserve-mesh-test:$version" >/dev/null

bytes=$(podman image inspect --format '{{.Size}}' "distserve-mesh:$version")
echo "image distserve-mesh:$version: $(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1e9}') GB" \
    "(target under $IMAGE_MAX_GB GB); built and tested in $((SECONDS - start)) s"
awk -v b="$bytes" -v max="$IMAGE_MAX_GB" 'BEGIN {exit !(b <= max * 1e9)}' \
    || { echo "the image is over $IMAGE_MAX_GB GB" >&2; exit 1; }
