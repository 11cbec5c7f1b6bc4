#!/usr/bin/env bash
# Train the digits example on the jax backend on GPU and print the run's summary.
#
# Needs crosstrain and this package installed, and a CUDA build of jax:
#   pip install -e . -e examples/crosstrain-jax "jax[cuda12]"
# Usage (from anywhere):
#   examples/crosstrain-jax/bench_gpu.sh [NPROC] [more `crosstrain run` arguments]
#   examples/crosstrain-jax/bench_gpu.sh 2 --set train.precision="'bf16'"
# NPROC GPUs of one machine are driven by one process (default 1).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
plan="${here}/../digits_mlp.toml"
nproc="${1:-1}"
shift $(( $# > 0 ? 1 : 0 ))
out="$(mktemp -d "${TMPDIR:-/tmp}/crosstrain-jax-gpu.XXXXXX")"

crosstrain -p no:tf backends
crosstrain run "${plan}" --backend jax --device gpu --nproc "${nproc}" --out "${out}" "$@"
echo "--- ${out}/summary.json"
cat "${out}/summary.json"
