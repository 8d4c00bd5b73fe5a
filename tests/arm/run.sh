#!/usr/bin/env bash
# `make test-arm`: the aarch64 W4A8 kernels, cross-compiled from the headers the torch extension ships and run
# under qemu-user on three CPU models, each of which must dispatch to its own path:
#   max          (dotprod, i8mm, bf16, SVE2)  -> arm.i8mm
#   cortex-a76   (dotprod, no i8mm)           -> arm.dotprod
#   cortex-a72   (neither)                    -> cpu.portable
# Installs qemu-user and g++-aarch64-linux-gnu from Debian when they are missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/arm
CXX=aarch64-linux-gnu-g++

if ! command -v qemu-aarch64 >/dev/null || ! command -v "$CXX" >/dev/null; then
    echo "test-arm: installing qemu-user and g++-aarch64-linux-gnu (Debian packages)"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q qemu-user g++-aarch64-linux-gnu >/dev/null
fi

start=$(date +%s)
mkdir -p "$OUT"
# The extension's flags (-O3, -fno-math-errno), plus no fp contraction: every fused multiply-add in the Arm paths is
# written out (w4a8_tiles.h), so one the code forgot shows here as a mismatch instead of being fused silently.
"$CXX" -O3 -std=c++17 -fno-math-errno -ffp-contract=off -Wall -Wextra -pthread -static \
    -I anychip/kernels/csrc tests/arm/driver.cpp -o "$OUT/driver"
echo "test-arm: built $OUT/driver in $(( $(date +%s) - start )) s ($("$CXX" --version | head -1))"

status=0
for run in "max i8mm" "cortex-a76 dotprod" "cortex-a72 portable"; do
    set -- $run
    t0=$(date +%s)
    echo "== qemu-aarch64 -cpu $1 (expects $2)"
    if ! qemu-aarch64 -cpu "$1" "$OUT/driver" --expect "$2" --fixtures tests/fixtures/arm --threads 2; then
        status=1
    fi
    echo "== -cpu $1: $(( $(date +%s) - t0 )) s"
done
echo "test-arm: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $status
