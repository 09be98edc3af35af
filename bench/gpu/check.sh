#!/usr/bin/env bash
# The GPU checks, each one command planned to end within 8 minutes (bench.gpu's --budget stops the parts
# when their share is spent and reports those not begun; the machine's start is not counted):
#
#   bash bench/gpu/check.sh speed      # the CUDA test of the captured step's gradients against eager's; base:
#                                      # the step by default (compiled), eager, MarianMT of the same shape,
#                                      # compiled on bucket shapes, captured (CUDA graphs), a profile of the
#                                      # default; then big, by default and eager, while its 80 s last
#   bash bench/gpu/check.sh quality    # fp32 / bf16 / captured bf16 loss curves on the same batches; the Multi30k
#                                      # GPU preset end to end
#   bash bench/gpu/check.sh multi30k   # the Multi30k GPU tries of bench/gpu/multi30k-tries.yaml, each end to end
#
# Figures land in $OUT (or ./gpu-check) as JSON and markdown, and in bench/results/ for docs/performance.md.
# The GPU machine lacks sacremoses (the clean stage's): carry its wheels in .whl (the device README says
# how: sacremoses, click, joblib); this script installs whatever .whl holds first.
set -euo pipefail
what=${1:?speed, quality or multi30k}
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
  speed)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k captured_steps 2>&1 \
      | tee "$out/captured-test.log" || true
    python3 -m bench.gpu --models base --parts throughput,profile --systems ours,eager,marian,compiled,captured \
      --part-timeout 150 --budget 280 --out "$out/speed-base.json" || true
    python3 -m bench.gpu --models big --parts throughput --systems ours,eager --budget 80 \
      --out "$out/speed-big.json" || true ;;
  quality) python3 -m bench.gpu --parts curves,multi30k --tries preset --budget 450 --out "$out/quality.json" || true ;;
  multi30k) python3 -m bench.gpu --parts multi30k --budget 450 --out "$out/multi30k.json" || true ;;
  *) echo "check.sh: $what is not speed, quality or multi30k" >&2; exit 2 ;;
esac
cp bench/results/gpu--*.json "$out/" 2>/dev/null || true
