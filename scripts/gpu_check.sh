#!/usr/bin/env bash
# Everything that needs a GPU, in one command, on a machine with an NVIDIA GPU:
#
#   scripts/gpu_check.sh            # results and logs in ./gpu_results (or in $OUT if set)
#
#   1. the whole test suite, GPU-marked tests included (they skip only where there is no GPU);
#   2. every notebook under nbval (skipped, and said so, where nbval/jupyter are not installed);
#   3. the benchmarks: decode-attention kernels, then offline throughput against transformers
#      plus decode latency vs the bandwidth floor (benchmarks/throughput.py all ...);
#   4. the headline benchmark (benchmarks/nano_vllm_workload.py: nano-vllm's bench.py with LLM()
#      defaults at temperature 0.6 as the headline, labelled extra rows, prefill attention,
#      batch-1 latency, serving vs offline) into $OUT/nano_vllm_workload/, about 8 minutes.
#
# It keeps going after a failure and exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0

python -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1
if ! python -c "import minivllm.kernels" 2>/dev/null; then
    # No editable install (it needs setuptools >= 64 when pip cannot fetch one): put a link to
    # the package on the path instead, never the repository root (see pyproject: `kernels` must
    # not be importable). tests/test_architecture.py's layout test then fails, rightly: this is
    # not the layout an install gives.
    echo "pip install -e failed (see $OUT/pip.log): using a path link instead"
    site=$(mktemp -d)
    ln -s "$PWD/minivllm" "$site/minivllm"
    [ -e minivllm/kernels ] || ln -s ../kernels minivllm/kernels
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    python -c "import minivllm.kernels" || { echo "cannot import minivllm"; exit 1; }
fi

# addopts names nbval's options; without the plugin pytest would refuse them, so reset them.
if python -c "import nbval" 2>/dev/null; then
    pytest tests notebooks -q 2>&1 | tee "$OUT/tests.log" || status=1
else
    echo "nbval is not installed: notebooks skipped" | tee "$OUT/tests.log"
    pytest -o addopts="" --import-mode=importlib -p no:cacheprovider tests -q 2>&1 | tee -a "$OUT/tests.log" || status=1
fi

python benchmarks/kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" || status=1
python benchmarks/throughput.py all --out "$OUT" --decode-latency --profile-dir "$OUT" 2>&1 \
    | tee "$OUT/throughput.log" || status=1
python benchmarks/nano_vllm_workload.py run --out "$OUT/nano_vllm_workload" 2>&1 \
    | tee "$OUT/nano_vllm_workload.log" || status=1

echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) (results in $OUT)"
exit $status
