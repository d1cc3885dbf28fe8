"""``generate`` on a tensor-parallel model (issue 12, item 7): a tiny Llama (4 query heads,
2 key/value heads) at tp=2, two CPU ranks in one spawn."""

import pytest

from tests.distributed import tp_generate_checks
from tests.harness import run_ranks

VOCAB = 128


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(tp_generate_checks.worker, 2, timeout=600)


def test_the_model_is_split(tp2):
    for facts in tp2:
        assert "(Shard(dim=0),)" in facts["sharded"] and "(Shard(dim=1),)" in facts["sharded"], facts["sharded"]


def test_greedy_tokens_are_one_process_tokens(tp2):
    for facts in tp2:
        assert facts["logits_diff"] < 1e-5  # the full logits, gathered, relative to their largest
        assert facts["greedy"] == facts["ref_greedy"]
        assert facts["texts"] == facts["ref_texts"]
    assert tp2[0]["ref_greedy"] == tp2[1]["ref_greedy"]  # both ranks built the same model


def test_kv_cache_holds_the_local_heads(tp2):
    for facts in tp2:
        assert (facts["ref_kv_heads"], facts["kv_heads"]) == (2, 1)


def test_sampling_with_a_seed_draws_the_same_tokens_on_every_rank(tp2):
    first, second = tp2
    for key in ("sampled", "app_sampled"):
        assert first[key] == second[key], key
    assert first["sampled"] == first["sampled_again"]
    # the seed matters: sampling is not greedy in disguise, so equal draws are not a given
    assert first["sampled"] != first["sampled_other_seed"] and first["sampled"] != first["greedy"]


def test_bf16_generation_runs(tp2):
    first, second = tp2
    assert first["bf16_dtypes"] == ["torch.bfloat16"]
    assert first["bf16"] == second["bf16"]
    assert all(len(row) == 12 and all(0 <= t < VOCAB for t in row) for row in first["bf16"])
    # bf16 rounds differently split in two (partial sums all-reduced), so near-ties may flip;
    # most tokens still agree with one process in bf16 (measured: all 24)
    agree = sum(a == b for r, s in zip(first["bf16"], first["bf16_ref"]) for a, b in zip(r, s))
    assert agree >= 18, (first["bf16"], first["bf16_ref"])
