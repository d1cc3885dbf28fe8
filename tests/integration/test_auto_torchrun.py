"""``parallelize(model, "auto")`` under the real torchrun, with an empty calibration cache.

The calibration's helper processes inherited torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` and
hung connecting to a store no one served; a failed helper surfaced minutes later as a bare
``queue.Empty`` on one rank; and multiprocessing's spawn re-ran a training script without a
``__main__`` guard inside every helper. See :mod:`tests.integration.auto_torchrun_worker`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.harness import finish_command, start_command

WORKER = Path(__file__).with_name("auto_torchrun_worker.py")


def test_auto_calibrates_under_torchrun_and_fails_alike_on_every_rank(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER), str(out)]
    log = finish_command(start_command(argv, {"XDG_CACHE_HOME": str(cache)}), timeout=240).stdout
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert not ranks[0]["cache_before"], "the test needs an empty calibration cache"
    failures = [r["failure"] for r in ranks]
    assert failures[0] == failures[1], failures  # the same error on every rank
    assert failures[0].startswith("HfScaleError: the planner's calibration of this machine failed: "
                                  "a helper that dies: helper process 0 exited with code 1"), failures[0]
    assert ranks[0]["chosen"] == ranks[1]["chosen"], ranks
    assert ranks[0]["chosen"]["strategy"] in ("ddp", "zero1", "zero2", "fsdp", "hsdp"), ranks[0]
    assert ranks[0]["cache_after"], "the calibration measured under torchrun was not cached"
    assert "strategy 'auto' chose" in log, log[-2000:]
