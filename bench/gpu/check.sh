#!/usr/bin/env bash
# The GPU checks, each one command planned to end within 8 minutes (bench.gpu's --budget stops the parts
# when their share is spent and reports those not begun; the machine's start is not counted). Part times
# on one H100: the CUDA test 73 s, data 7 s, eager base 16 s, MarianMT 23 s; the default (compiled) base
# step did not finish within 120 s (compiling), so speed times it after the steps that compile little or
# nothing, with what is left of its 360 s up to 240.
#
#   bash bench/gpu/check.sh speed      # the CUDA tests of the captured step's gradients against eager's and of
#                                      # the out-of-memory line's GPU figures; base: the step eager, MarianMT of
#                                      # the same shape, the step with its layers compiled, by default (compiled
#                                      # whole), and a profile of the default
#   bash bench/gpu/check.sh capture    # base compiled on bucket shapes and captured (CUDA graphs, a graph per
#                                      # shape); then big, by default and eager, while its share lasts
#   bash bench/gpu/check.sh quality    # fp32 / bf16 / captured bf16 loss curves on the same batches; the Multi30k
#                                      # GPU preset end to end
#   bash bench/gpu/check.sh multi30k   # the Multi30k GPU tries of bench/gpu/multi30k-tries.yaml (the CPU
#                                      # presets' model on the preset's schedule, then the preset, each in
#                                      # en-de with its rescore variants; then each in en-fr; then Transformer-Tiny),
#                                      # each end to end (about 2.3 minutes each, a variant seconds on dev);
#                                      # `check.sh multi30k 330` gives them 330 s in place of 450: the first two
#
# Figures land in $OUT (or ./gpu-check) as JSON and markdown, and in bench/results/ for docs/performance.md.
# The GPU machine has no MLflow, Prefect, DVC or CTranslate2, which these parts do without (CI's smoke of bench.gpu,
# .ci/benches, runs with the four unimportable), and no sacremoses (the clean stage's): carry its wheel in
# .whl (its needs are there); this script installs whatever .whl holds first. The shared data travels as .test-data
# (../shared/data's wmt14/{train-sample,newstest2013,newstest2014-full} and multi30k). `make gpu-carry` makes both.
set -euo pipefail
what=${1:?speed, capture, quality or multi30k}
out=${OUT:-gpu-check}
mkdir -p "$out"
started=$(mktemp)  # the bench results this run writes are those newer than this
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a crash prints every thread's Python stack
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
case $what in
  speed)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "captured_steps or out_of_gpu_memory" 2>&1 \
      | tee "$out/captured-test.log" || true
    python3 -m bench.gpu --models base --parts throughput,profile --systems eager,marian,layers,ours \
      --part-timeout 240 --budget 360 --out "$out/speed-base.json" || true ;;
  capture)
    python3 -m bench.gpu --models base --parts throughput --systems compiled,captured --part-timeout 240 \
      --budget 300 --out "$out/capture-base.json" || true
    python3 -m bench.gpu --models big --parts throughput --systems eager,ours --budget 150 \
      --out "$out/speed-big.json" || true ;;
  quality) python3 -m bench.gpu --parts curves,multi30k --tries preset --budget 450 --out "$out/quality.json" || true ;;
  multi30k) python3 -m bench.gpu --parts multi30k --budget "${2:-450}" --out "$out/multi30k.json" || true ;;
  *) echo "check.sh: $what is not speed, capture, quality or multi30k" >&2; exit 2 ;;
esac
find bench/results -name 'gpu--*.json' -newer "$started" -exec cp {} "$out/" \;
