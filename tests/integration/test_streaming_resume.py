"""``hf-scale finetune`` with ``data.streaming`` and packing on 2 ranks: interrupted after step 3
and resumed, it logs the losses and gradient norms of the uninterrupted run at every step after
(each rank's stream position is saved with the checkpoint). The data is one JSONL file (one shard,
fewer than the ranks: each rank reads every other example) of 30 examples, so the 6 steps wrap
around the stream more than once, and packing groups of 4 put batches across group boundaries."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.harness import run_cli
from tests.integration.cli_reference import logged_steps
from tests.tiny_models import tiny_recipe


@pytest.mark.slow
def test_a_resumed_stream_continues_where_it_stopped(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i * 3}?", "response": str(i * 4)}) + "\n"
                            for i in range(30)))
    recipe = tiny_recipe(tmp_path, steps=6, data={"path": str(data), "streaming": True, "packing": "bfd",
                                                  "pack_group": 4, "eval_split": None, "max_seq_len": 48},
                         train={"scheduler": "constant", "sample_generations": 0, "batch_size": 2},
                         checkpoint={"every_steps": 3})
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_cli("finetune", str(recipe), "--train.output_dir", str(whole))
    # the run as if stopped after its step-3 checkpoint: that checkpoint and the records before it
    shutil.copytree(whole / "checkpoints" / "step_00000003", parts / "checkpoints" / "step_00000003")
    (parts / "checkpoints" / "latest").write_text("step_00000003\n")
    kept = [line for line in (whole / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("step", 0) <= 3]
    (parts / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    log = run_cli("finetune", str(recipe), "--train.output_dir", str(parts), "--resume", "latest").stdout
    assert "resumed from" in log and "at step 3" in log, log[-2000:]
    want, got = logged_steps(whole), logged_steps(parts)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-6, err_msg=key)
    assert len({r["loss"] for r in want}) == 6
