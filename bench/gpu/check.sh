#!/usr/bin/env bash
# The GPU checks of the training step, each one command that ends inside the device tool's 10 minutes
# (every part is stopped at its --part-timeout and reported so; the rest go on):
#
#   bash bench/gpu/check.sh speed     # throughput of base and big: the step by default (eager, exact shapes)
#                                     # and compiled + captured (CUDA graphs) against MarianMT; profiles of both
#   bash bench/gpu/check.sh quality   # fp32 / bf16 / captured bf16 loss curves on the same batches, then the
#                                     # Multi30k GPU preset end to end
#
# Each is planned at 8 to 10 minutes (start-up, data, compiling); a session's 15 minutes of device time
# hold one of them with its machine's start, so run speed first and quality in a later session.
# Figures land in $OUT (or ./gpu-check) as JSON and markdown, and in bench/results/ for docs/performance.md.
# The GPU machine lacks sacremoses (the clean stage's): carry its wheels in .whl (the device README says
# how: sacremoses, click, joblib); this script installs whatever .whl holds first.
set -euo pipefail
what=${1:?speed or quality}
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
case $what in
  speed) python3 -m bench.gpu --parts throughput,profile --systems ours,captured,marian --part-timeout 120 \
           --out "$out/speed.json" ;;
  quality) python3 -m bench.gpu --parts curves,multi30k --part-timeout 420 --out "$out/quality.json" ;;
  *) echo "check.sh: $what is not speed or quality" >&2; exit 2 ;;
esac
cp bench/results/gpu--*.json "$out/" 2>/dev/null || true
