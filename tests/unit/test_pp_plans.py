"""Pipeline layouts (one process, no process group): where ``pp_layout`` cuts a model, which
modules run on the first and last stage, which pp rank runs each stage (loop and V), and the
errors for layouts that cannot work -- all raised before any mesh or collective exists.

The balance of the default split is measured by a count of our own (matmul parameters per
token: a block's weights, the head's vocabulary matmul, nothing for an embedding lookup), not
by the layout's ``costs``, so a cost model that forgot the head would fail here.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from hf_scale.config import ParallelConfig
from hf_scale.errors import HfScaleConfigError, HfScalePlanError
from hf_scale.mesh import ParallelDims
from hf_scale.model_plans import resolve_plan
from hf_scale.model_plans.pp import pp_layout
from tests.distributed.pp_checks import pp_config, pp_model
from tests.tiny_models import AUTO, tiny_model

# SmolLM2-135M's shapes (the Hub is out of reach; the zoo ships GGUF weights, not a config).
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def smollm2():
    with torch.device("meta"):
        return tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2))


def _layout(model, pp=2, stages_per_rank=1, v_shape=False, split_points=None, plan=None):
    return pp_layout(model, resolve_plan(model, plan), pp, stages_per_rank, v_shape, split_points)


def _matmul_cost(model, blocks) -> int:
    """Our count: weights of the blocks' Linear layers (what each token multiplies by)."""
    layers = model.model.layers
    return sum(m.weight.numel() for i in blocks for m in layers[i].modules() if isinstance(m, torch.nn.Linear))


def test_smollm2_default_split_balances_compute(smollm2):
    layout = _layout(smollm2)
    assert layout.num_stages == 2 and layout.stage_ranks == (0, 1)
    flat = [b for stage in layout.stage_blocks for b in stage]
    assert flat == list(range(30)), "stages must cover every block once, in order"
    head = smollm2.lm_head.weight.numel()  # 49152 x 576: worth ~8 blocks
    costs = [_matmul_cost(smollm2, layout.stage_blocks[0]), _matmul_cost(smollm2, layout.stage_blocks[1]) + head]
    assert max(costs) / min(costs) <= 1.2, f"stage costs {costs} for blocks {layout.stage_blocks}"
    assert len(layout.stage_blocks[1]) < len(layout.stage_blocks[0]), "the head's stage must get fewer blocks"
    assert layout.balance <= 1.2
    equal = _layout(smollm2, split_points=[15])  # what a split by block count alone would give
    equal_costs = [_matmul_cost(smollm2, range(15)), _matmul_cost(smollm2, range(15, 30)) + head]
    assert max(equal_costs) / min(equal_costs) > 1.2  # so the check above can fail
    assert equal.balance > 1.2


def test_smollm2_four_stages_balance(smollm2):
    for v_shape in (False, True):
        layout = _layout(smollm2, pp=2, stages_per_rank=2, v_shape=v_shape)
        costs = [_matmul_cost(smollm2, blocks) for blocks in layout.stage_blocks]
        costs[-1] += smollm2.lm_head.weight.numel()
        assert max(costs) / min(costs) <= 1.2, f"stage costs {costs} for blocks {layout.stage_blocks}"


def test_smollm2_params_per_stage(smollm2):
    """Each stage's parameters; the tied head counts on both ends (each end holds a copy)."""
    layout = _layout(smollm2)
    embed = smollm2.model.embed_tokens.weight.numel()
    whole = sum(p.numel() for p in smollm2.parameters())  # the tied weight once
    assert sum(layout.params) == whole + embed
    assert layout.params[0] == embed + sum(p.numel() for i in layout.stage_blocks[0] for p in smollm2.model.layers[i].parameters())


def test_split_points_give_the_stages(smollm2):
    layout = _layout(smollm2, split_points=[10])
    assert layout.stage_blocks == (tuple(range(10)), tuple(range(10, 30)))
    four = _layout(smollm2, pp=4, split_points=[5, 12, 20])
    assert [(s[0], s[-1]) for s in four.stage_blocks] == [(0, 4), (5, 11), (12, 19), (20, 29)]


@pytest.mark.parametrize("pp, per_rank, v_shape, ranks", [
    (2, 1, False, (0, 1)),
    (4, 1, False, (0, 1, 2, 3)),
    (2, 2, False, (0, 1, 0, 1)),  # interleaved: stage s on rank s % pp
    (2, 3, False, (0, 1, 0, 1, 0, 1)),
    (2, 2, True, (0, 1, 1, 0)),  # V (zbv): rank r runs stages r and 2p-1-r
    (4, 2, True, (0, 1, 2, 3, 3, 2, 1, 0)),
])
def test_stage_to_rank_mapping(smollm2, pp, per_rank, v_shape, ranks):
    layout = _layout(smollm2, pp=pp, stages_per_rank=per_rank, v_shape=v_shape)
    assert layout.stage_ranks == ranks
    for rank in range(pp):
        assert layout.stages_of(rank) == [s for s, r in enumerate(ranks) if r == rank]
    if v_shape:
        assert layout.stages_of(0) == [0, 2 * pp - 1]  # the first and last stage on one rank


@pytest.mark.parametrize("arch, blocks, first, last", [
    ("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")),
    ("qwen2", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")),
    ("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"), ("transformer.ln_f", "lm_head")),
    ("gpt_neox", "gpt_neox.layers", ("gpt_neox.embed_in", "gpt_neox.emb_dropout"), ("gpt_neox.final_layer_norm", "lm_head")),
    ("opt", "model.decoder.layers", ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
     ("model.decoder.final_layer_norm", "lm_head")),
])
def test_first_and_last_stage_modules(arch, blocks, first, last):
    """Rotary embeddings (buffers only) are on neither list: they run on every stage."""
    layout = _layout(pp_model(arch))
    assert (layout.blocks, layout.first, layout.last) == (blocks, first, last)
    assert layout.head == last[-1]
    assert not any("rotary" in name for name in layout.first + layout.last)


def test_opt_projections_when_present():
    """OPT-350m projects embeddings in and out (word_embed_proj_dim != hidden_size): the
    projections run on the first and last stage; without them (the tiny config) they are absent."""
    config = pp_config("opt")
    config.word_embed_proj_dim = 16
    torch.manual_seed(0)
    layout = _layout(AUTO["causal"].from_config(config))
    assert "model.decoder.project_in" in layout.first and "model.decoder.project_out" in layout.last


# ---------------------------------------------------------------- errors, before any collective

def test_more_stages_than_blocks():
    with pytest.raises(HfScaleConfigError, match=r"4 stages.*2 blocks"):
        _layout(tiny_model("llama", "causal"), pp=2, stages_per_rank=2)


@pytest.mark.parametrize("points, words", [
    ([4], "between 1 and 3"),  # past the last block
    ([0], "increasing"),  # an empty first stage
    ([2, 2, 3], "increasing"),
    ([3, 1, 2], "increasing"),
    ([1, 2], "give 1 split point"),  # 3 stages for pp=2
])
def test_bad_split_points(points, words):
    stages = len(points) + 1 if len(points) == 3 else 2
    with pytest.raises(HfScaleConfigError, match=rf"pp_split_points={points!s}.*".replace("[", r"\[").replace("]", r"\]")) as err:
        _layout(pp_model("llama"), pp=2, stages_per_rank=stages // 2, split_points=points)
    assert words in str(err.value)


@pytest.mark.parametrize("arch, head, name", [
    ("bert", "seqcls", "BertForSequenceClassification"),
    ("t5", "seq2seq", "T5ForConditionalGeneration"),
    ("llama", "seqcls", "LlamaForSequenceClassification"),
])
def test_not_a_causal_lm_is_refused(arch, head, name):
    with pytest.raises(HfScaleConfigError, match="not supported yet") as err:
        _layout(tiny_model(arch, head))
    assert name in str(err.value)


def test_plan_naming_no_module():
    with pytest.raises(HfScalePlanError, match="embed_tokenz"):
        _layout(pp_model("llama"), plan={"pp_plan": {"embed_tokenz": (["input_ids"], ["x"]), "layers": ((), ())}})


def test_unknown_schedule_lists_them():
    with pytest.raises(HfScaleConfigError) as err:
        ParallelConfig(pp=2, pp_schedule="zb1p")
    for name in ("'zb1p'", "'gpipe'", "'1f1b'", "'interleaved_1f1b'", "'zero_bubble'", "'zbv'"):
        assert name in str(err.value)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_pp_with_replicating_strategy_over_several_dp_ranks(strategy):
    with pytest.raises(HfScaleConfigError, match=rf"strategy='{strategy}' with pp=2 over 2 data-parallel ranks"):
        ParallelDims.resolve(ParallelConfig(pp=2, strategy=strategy), world_size=4)
    assert ParallelDims.resolve(ParallelConfig(pp=2, strategy=strategy), world_size=2).pp == 2  # one dp rank: fine


def test_pp_and_tp_must_divide_the_world():
    with pytest.raises(HfScaleConfigError, match="tp x pp = 2 x 2 = 4 does not divide WORLD_SIZE=6"):
        ParallelDims.resolve(ParallelConfig(pp=2, tp=2), world_size=6)
