"""Parallel save, observed: the bytes the ranks really wrote (``os.pwrite``) cover each shard's
tensor data exactly once, and sharded strategies split the writing between the ranks."""

from __future__ import annotations

import pytest

from tests.distributed.write_observer import check_written_once, save_and_observe
from tests.harness import run_ranks
from tests.tiny_models import tiny_model

CASES = [
    dict(id=f"{arch}-{strategy}", arch=arch, head=head, config={"strategy": strategy}, shard=6000)
    for arch, head in (("llama", "causal"), ("t5", "seq2seq"))
    for strategy in ("fsdp", "zero1", "ddp")
]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    ranks = run_ranks(save_and_observe, 2, CASES, str(tmp_path_factory.mktemp("saves")), timeout=600)
    return {case["id"]: [r[i] for r in ranks] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_every_byte_written_once(observed, case):
    ranks = observed[case["id"]]
    written = check_written_once(ranks[0]["folder"], [r["writes"] for r in ranks])
    model = tiny_model(case["arch"], case["head"])
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights are stored once
    assert sum(written) == sum(p.numel() * p.element_size() for p in unique)
    assert all(w > 0 for w in written), written  # both ranks wrote a part
    if case["config"]["strategy"] == "fsdp":  # each rank its own half of every tensor
        assert written[0] == pytest.approx(written[1], rel=0.05)
