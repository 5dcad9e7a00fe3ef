#!/usr/bin/env bash
# Regenerate the stored outputs of the notebooks, in place (they are committed with outputs, so
# GitHub shows every figure):
#
#   scripts/run_notebooks.sh                                 # every notebook, then the Chinese twins (notebooks/zh/)
#   scripts/run_notebooks.sh notebooks/01_kv_cache_math.ipynb  # just the ones named
#
# On a machine without a CUDA GPU the Triton kernels run in Triton's interpreter, which has to
# be chosen before triton is first imported: TRITON_INTERPRET=1 is exported for the kernels.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$#" -eq 0 ]; then
    # The Chinese twins (notebooks/zh/, scripts/zh_twins.py) run their own code cells, so their
    # outputs are their own.
    shopt -s nullglob
    set -- notebooks/*.ipynb notebooks/zh/*.ipynb
    shopt -u nullglob
fi
if [ -z "${TRITON_INTERPRET:-}" ] && ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    export TRITON_INTERPRET=1
    echo "no CUDA GPU: Triton kernels run in the interpreter (TRITON_INTERPRET=1)"
fi

for notebook in "$@"; do
    start=$(date +%s)
    jupyter nbconvert --to notebook --execute --inplace \
        --ExecutePreprocessor.timeout=600 "$notebook"
    echo "$notebook: $(( $(date +%s) - start )) s"
done
