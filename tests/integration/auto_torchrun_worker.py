"""A torchrun worker for ``test_auto_torchrun``: ``parallelize(model, "auto")`` with no planner
calibration cached, twice. First the calibration's helper process dies: every rank must raise
the same clear error (rank 0 measures; the others wait for its answer). Then the calibration runs
its real gloo measurement between helper processes started from inside this torchrun worker (the
part that hung on torchrun's agent-store variable), its slow single-process FLOP/s figures
replaced by fixed ones: every rank must get the same layout. Each rank writes what it saw to
``<out>/rank<N>.json``.

    python -m torch.distributed.run --nproc_per_node 2 auto_torchrun_worker.py OUT

Deliberately without an ``if __name__ == "__main__"`` guard, as many training scripts are: the
calibration's helpers must not run it again (multiprocessing's spawn would re-import it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _dying_calibration() -> dict:
    from hf_scale.layout_search.helpers import run_helpers

    return run_helpers("hf_scale.layout_search.calibrate", "no-such-measurement", 1, 60, "a helper that dies")[0]


def _quick_calibration() -> dict:
    from hf_scale.layout_search import calibrate

    fixed = {"flops_fp32": 3e10, "flops_bf16": 1e9, "mem_bandwidth": 5e9, "threads": 1, "cpus": 2}
    return {**fixed, **calibrate.collectives(2)}


def main(out: Path) -> None:
    import transformers

    import hf_scale
    from hf_scale.distributed import shutdown_distributed
    from hf_scale.layout_search import calibrate
    from hf_scale.layout_search.machine import calibration_path

    seen: dict = {"cache_before": calibration_path().exists()}
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=128)
    calibrate.calibrate = _dying_calibration
    try:
        hf_scale.parallelize(transformers.LlamaForCausalLM(config), "auto")
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        seen["failure"] = f"{type(e).__name__}: {e}"
    calibrate.calibrate = _quick_calibration
    model = hf_scale.parallelize(transformers.LlamaForCausalLM(config), "auto")
    state = hf_scale.parallel_state.get_state(model)
    seen["chosen"] = {"strategy": state.config.strategy, "tp": state.config.tp, "pp": state.config.pp}
    seen["cache_after"] = calibration_path().exists()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
    shutdown_distributed()


main(Path(sys.argv[1]))  # no __main__ guard, on purpose (see above)
