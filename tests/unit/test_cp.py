"""Context parallel without a process group: the config and mesh degrees, how a sequence is dealt
out, the mask against transformers' own, and which architectures are refused (checked on a tiny
copy, not listed). The split itself runs at world 2 and 4: tests/distributed/test_cp.py."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from torch import nn

import hf_scale
from hf_scale import HfScaleConfigError, ParallelConfig
from hf_scale.config import from_dict
from hf_scale.mesh import ParallelDims
from hf_scale.parallel.cp import Forward, chunk_indices, document_ids, granule
from hf_scale.parallel.cp_alltoall import check_heads
from hf_scale.parallel.cp_check import cp_refusal

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


@pytest.mark.parametrize("fields, message", [
    ({"cp": 0}, "cp=0: must be a positive integer"),
    ({"cp": 2, "cp_layout": "zigzag"}, "cp_layout='zigzag' is not one of 'head_tail', 'contiguous'"),
    ({"cp": 2, "tp": 2}, "cp=2 with tp=2: not yet"),
    ({"cp": 2, "pp": 2}, "cp=2 with pp=2: not yet"),
    ({"cp": 2, "ep": 2}, "cp=2 with ep=2: not yet"),
    ({"cp": 2, "strategy": "zero1"}, "not yet: ZeRO-1"),
    ({"cp": 2, "strategy": "hsdp"}, "not yet: hsdp with cp"),
    ({"cp": 2, "cp_exchange": "ring"}, "cp_exchange='ring' is not one of 'allgather', 'alltoall'"),
])
def test_config_refuses_what_cp_does_not_compose_with_yet(fields, message):
    with pytest.raises(HfScaleConfigError, match=message):
        ParallelConfig(**fields)


def test_other_stacks_names_of_the_degree_point_to_cp():
    with pytest.raises(HfScaleConfigError, match="Did you mean 'cp'"):
        from_dict(ParallelConfig, {"context_parallel_size": 2})


@pytest.mark.parametrize("fields, world, degrees, dp, dp_cp", [
    ({"cp": 2}, 2, (1, 1, 2), 1, 2),
    ({"cp": 2}, 4, (1, 2, 2), 2, 4),
    ({"cp": 2, "strategy": "ddp"}, 4, (2, 1, 2), 2, 4),
    ({"cp": 4, "strategy": "zero2"}, 8, (1, 2, 4), 2, 8),
])
def test_cp_ranks_share_a_batch_and_reduce_gradients(fields, world, degrees, dp, dp_cp):
    dims = ParallelDims.resolve(ParallelConfig(**fields), world)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == degrees
    assert (dims.dp_degree, dims.dp_cp_degree) == (dp, dp_cp)
    assert f"cp={fields['cp']}" in dims.describe()


def test_cp_degrees_that_do_not_fit_the_world_print_every_degree():
    with pytest.raises(HfScaleConfigError, match="cp=2 does not divide WORLD_SIZE=3"):
        ParallelDims.resolve(ParallelConfig(cp=2), 3)
    with pytest.raises(HfScaleConfigError, match=r"dp_shard=3 x cp=2 x tp=1 = 6 ranks, but WORLD_SIZE=4"):
        ParallelDims.resolve(ParallelConfig(cp=2, dp_shard=3), 4)
    assert "cp" not in ParallelDims.resolve(ParallelConfig(), 2).describe()  # shown where used


def test_cp_in_one_process_asks_for_torchrun():
    with pytest.raises(HfScaleConfigError, match="cp=2 needs 2 processes"):
        hf_scale.parallelize(tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)), {"cp": 2})


def test_head_tail_gives_each_rank_a_head_and_a_tail_chunk():
    assert [chunk_indices(8, 2, r, "head_tail").tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [chunk_indices(8, 2, r, "contiguous").tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for layout in ("head_tail", "contiguous"):
        cp, length = 4, 4 * granule(4, layout)
        dealt = torch.cat([chunk_indices(length, cp, r, layout) for r in range(cp)])
        assert sorted(dealt.tolist()) == list(range(length))
    # causal work (keys below each query) is balanced by head_tail, not by contiguous
    work = {layout: [int(chunk_indices(64, 4, r, layout).add(1).sum()) for r in range(4)]
            for layout in ("head_tail", "contiguous")}
    assert len(set(work["head_tail"])) == 1 and len(set(work["contiguous"])) == 4


def test_documents_from_positions_as_transformers_finds_them():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(document_ids(positions), find_packed_sequence_indices(positions))
    assert document_ids(torch.arange(8)[None]) is None


@pytest.mark.parametrize("window", [None, 3])
def test_mask_on_global_indices_is_transformers_mask(window):
    """One rank holding everything (cp=1): the mask equals transformers' sdpa mask for packed
    rows, with and without a sliding window; a rank's rows are that mask's rows at its indices."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = tf.MistralConfig(**SMALL, sliding_window=window)
    config._attn_implementation = "sdpa"
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]])
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    theirs = make(config=config, inputs_embeds=torch.zeros(2, 8, 32), attention_mask=None, cache=None,
                  position_ids=positions)
    whole = torch.arange(8)
    ours = Forward(None, whole, whole, document_ids(positions)).mask(window)
    assert torch.equal(ours, theirs)
    kv = torch.cat([chunk_indices(8, 2, r, "head_tail") for r in range(2)])
    for rank in range(2):
        q = chunk_indices(8, 2, rank, "head_tail")
        local = Forward(None, q, kv, document_ids(positions)).mask(window)
        assert torch.equal(local, theirs[:, :, q][..., kv])
        # the all-to-all's mask: every position in global order, whatever the rank's split
        assert torch.equal(Forward(None, q, kv, document_ids(positions)).mask(window, whole=True), theirs)


@pytest.mark.parametrize("heads, kv, cp, refused", [
    (4, 2, 2, False), (8, 8, 4, False), (8, 2, 4, False), (12, 3, 6, False),  # key-value heads repeated to cp
    (9, 3, 2, True), (4, 2, 8, True), (6, 3, 2, True), (12, 3, 4, True),  # 3 key-value heads: neither divisible by 4 nor dividing it
])
def test_alltoall_needs_heads_divisible_by_cp(heads, kv, cp, refused):
    config = tf.LlamaConfig(**{**SMALL, "num_attention_heads": heads, "num_key_value_heads": kv,
                               "hidden_size": 8 * heads})
    if not refused:
        check_heads(config, cp)
        return
    with pytest.raises(HfScaleConfigError, match=f"cp={cp}: the model has {heads} attention heads and {kv} key-value"):
        check_heads(config, cp)


class _CumsumMLP(nn.Module):
    """A token mixer outside attention (a running sum over the sequence)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x).cumsum(1)


class MixingLlamaForCausalLM(tf.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = _CumsumMLP(layer.mlp)


class _OwnAttention(nn.Module):
    """Attention that does not go through transformers' registry (here: none at all)."""

    def forward(self, hidden_states, **kwargs):
        return hidden_states * 0, None


class OwnAttentionLlamaForCausalLM(tf.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = _OwnAttention()


def _small(cls, **extra):
    return cls(**{**SMALL, **extra})


@pytest.mark.parametrize("build, reason", [
    (lambda: tf.AutoModelForCausalLM.from_config(_small(tf.LlamaConfig)), None),
    (lambda: tf.AutoModelForCausalLM.from_config(_small(tf.Gemma2Config, head_dim=8)), None),
    (lambda: tf.AutoModelForSequenceClassification.from_config(_small(tf.LlamaConfig)), "not a causal LM"),
    (lambda: tf.BertForMaskedLM(tf.BertConfig(**SMALL)), "not a causal LM"),
    (lambda: tf.MambaForCausalLM(tf.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128)),
     r"\['linear_attention'\] layers"),
    (lambda: OwnAttentionLlamaForCausalLM(_small(tf.LlamaConfig)), "never calls an attention function"),
    (lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=128)),
     "does not go through transformers' attention registry"),
    (lambda: tf.AutoModelForCausalLM.from_config(_small(tf.GptOssConfig)), r"passes \['s_aux'\]"),
    (lambda: tf.AutoModelForCausalLM.from_config(_small(tf.Qwen3NextConfig, layer_types=["linear_attention", "full_attention"])),
     r"\['linear_attention'\] layers"),
    (lambda: MixingLlamaForCausalLM(_small(tf.LlamaConfig)), "mixes tokens outside its attention function"),
])
def test_architectures_cp_cannot_split_are_refused(build, reason):
    verdict = cp_refusal(build())
    if reason is None:
        assert verdict is None, verdict
    else:
        assert verdict is not None and re.search(reason, verdict), verdict


def test_finetune_refuses_cp_on_padded_rows_and_the_planner_takes_cp():
    """hf-scale finetune runs cp on packed data only (padded rows carry a mask cp cannot split:
    tests/unit/test_train_cp.py); the planner prices cp (tests/unit/test_planner_cp.py): a cp
    config is a planner layout, and strategy "auto" may keep a cp given beside it."""
    from hf_scale.layout_search.simulate import as_layout
    from hf_scale.train.config import DataConfig, JobConfig

    with pytest.raises(HfScaleConfigError, match="parallel.cp=2 on padded rows"):
        JobConfig(parallel=ParallelConfig(cp=2))
    JobConfig(parallel=ParallelConfig(cp=2), data=DataConfig(packing="bfd"))
    layout = as_layout(ParallelConfig(cp=2, cp_exchange="alltoall"), world_size=4)
    assert (layout.cp, layout.dp_shard, layout.cp_exchange, layout.world_size) == (2, 2, "alltoall", 4)
    assert ParallelConfig(cp=2, strategy="auto").cp == 2
