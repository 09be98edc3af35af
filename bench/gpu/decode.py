"""bench.gpu's decode part: base trained here for a short while, then decoded by every system (ours,
transformers, CTranslate2) at every precision, each in a process of its own (bench/peers.py)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.common import model_config, train_params
from bench.gpu import Sizes


def decode_weights(sizes: Sizes, work: Path) -> tuple[Path, str, dict[str, Any]]:
    """Base (tiny with --smoke) trained by the train stage in bf16 for a short while on the prepared
    sample, so that it ends its sentences rather than running to the length limit as random weights
    do: its last checkpoint, its name and the train stage's metrics. Also what the CPU bench decodes
    (`bench.decode --model` it, after `--parts decode --work W`, or after this alone)."""
    from stages import train
    from stages.model_files import current_dir, list_checkpoints

    name = sizes.small_model
    steps = sizes.decode_train_steps
    # The paper's rate with the warm-up as long as the run, scaled so that it peaks where the paper's does.
    params = train_params(batch_tokens=sizes.batch_tokens, max_steps=steps, warmup_steps=steps,
                          lr_scale=(steps / 4000) ** 0.5, log_every=max(steps // 10, 1))
    trained = train.run(model_config(name), params, encoded_dir=work / "encoded", vocab_dir=work / "vocab",
                        checkpoint_dir=work / "checkpoints-decode", plots_dir=work / "plots-decode")
    return list_checkpoints(current_dir(work / "checkpoints-decode"))[-1][1], name, trained


def decode(sizes: Sizes, work: Path) -> dict[str, Any]:
    """decode_weights' model decoded by every system at every precision (the share of identical outputs
    shows whether it ends its sentences)."""
    import sacrebleu

    from bench.peers import decode_all, report, table

    model_path, name, trained = decode_weights(sizes, work)
    steps = sizes.decode_train_steps
    lines = (work / "text/test.en").read_text(encoding="utf-8").splitlines()
    refs = (work / "text/test.de").read_text(encoding="utf-8").splitlines()
    results, unavailable = [], {}
    for precision in sizes.decode_precisions:  # each printed as it ends: a run cut short keeps the first in its log
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            done, why = decode_all(model_path, work / "vocab", lines, 4, (8000,), (precision,), Path(tmp))
        print("\n".join(report(done)), flush=True)
        results, unavailable = results + done, unavailable | why
    ours = {r.precision: r for r in results if r.system.startswith("ours")}
    mfu = f", {trained['mean_mfu']:.1%} MFU" if trained.get("mean_mfu") is not None else ""
    return {"sentences": len(lines), "weights": f"{name}, {steps} steps of bf16 training (loss {trained['loss']:.2f}; "
                                                f"{trained['mean_tgt_tokens_per_sec']:,.0f} target tokens/s{mfu})",
            "model": str(model_path),
            "table": report(results),
            "rows": (found := table(results, refs))[0],
            "summary": found[1] + "".join(f"; {system}: not measured ({why})" for system, why in unavailable.items()),
            "unavailable": unavailable,
            "systems": [{"system": r.system, "precision": r.precision, "tgt_tokens_per_sec": r.rate,
                         "seconds": r.seconds, "tokens": r.tokens,
                         "same_as_ours": sum(a == b for a, b in zip(ours[r.precision].lines, r.lines, strict=True))
                         / len(lines), "bleu": sacrebleu.corpus_bleu(r.lines, [refs]).score} for r in results]}
