#!/usr/bin/env bash
# Fill deploy/wheelhouse/ with every wheel the node image needs, so that its build runs offline
# (deploy/Dockerfile with WHEELS_ONLY=1): torch (TORCH_SPEC), the project's dependencies and its
# build requirements. The host's pip and its configuration choose where each one comes from
# (its index, find-links directories): a host whose pip finds the CPU build of torch gives the
# image that build. Nothing is done when the inputs (pyproject.toml, TORCH_SPEC) are unchanged.
#
#   deploy/podman/wheelhouse.sh PIP TORCH_SPEC TORCH_VARIANT     (run from the repository root)
#
# TORCH_VARIANT=cpu (the default image) refuses a torch wheel that is not a +cpu build: the
# plain Linux wheel pulls several GB of CUDA libraries into the image.
set -euo pipefail

pip=${1:?usage: wheelhouse.sh PIP TORCH_SPEC TORCH_VARIANT}
torch_spec=${2:?missing TORCH_SPEC}
variant=${3:-cpu}
house=deploy/wheelhouse
stamp="$house/.inputs"

inputs="$(printf '%s\n%s\n' "$torch_spec" "$variant"; sha256sum pyproject.toml)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
    echo "wheelhouse: up to date ($house)"
    exit 0
fi

rm -f "$house"/*.whl "$house"/*.tar.gz "$house"/*.zip "$stamp"
echo "wheelhouse: downloading $torch_spec and the dependencies of pyproject.toml into $house"
# `.` resolves the project's dependencies without saving the project itself (it is built from
# source in the image); the build backend's requirements come along for the offline build.
"$pip" download --quiet --dest "$house" "$torch_spec" "setuptools>=77" wheel .
rm -f "$house"/lowcomm-*

# A few dependencies exist only as source distributions (pure Python): build their wheels here,
# so that the image build needs no build backend for them.
shopt -s nullglob
sdists=("$house"/*.tar.gz "$house"/*.zip)
if [ ${#sdists[@]} -gt 0 ]; then
    "$pip" wheel --quiet --no-deps --wheel-dir "$house" "${sdists[@]}"
    rm -f "${sdists[@]}"
fi

torch_wheels=("$house"/torch-*.whl)
if [ ${#torch_wheels[@]} -ne 1 ]; then
    echo "wheelhouse: error: expected one torch wheel in $house, found ${#torch_wheels[@]}" >&2
    exit 1
fi
if [ "$variant" = cpu ] && [[ "${torch_wheels[0]##*/}" != torch-*+cpu-* ]]; then
    echo "wheelhouse: error: pip resolved $torch_spec to ${torch_wheels[0]##*/}, not a CPU (+cpu)" \
         "build; give pip the CPU wheel (pip config: find-links, or PyTorch's CPU index as" \
         "--index-url) or set TORCH_VARIANT=cuda for a CUDA image" >&2
    exit 1
fi
printf '%s\n' "$inputs" > "$stamp"
wheels=("$house"/*.whl)
echo "wheelhouse: ${#wheels[@]} wheels, $(du -sh "$house" | cut -f1), torch: ${torch_wheels[0]##*/}"
