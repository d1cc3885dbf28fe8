"""A model's pipeline stages, chained in one process, compute the model's own loss.

Each stage runs the model's own forward on a view that holds only its modules (stage 0 from
the token ids, stage 1 from the hidden states it would receive). An architecture whose base
forward transforms the received hidden states again (Granite's embedding multiplier) would
differ: such models are refused by ``pp_layout``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from hf_scale.errors import HfScaleConfigError
from hf_scale.model_plans import resolve_plan
from hf_scale.model_plans.pp import pp_layout
from hf_scale.parallel.pp import prune_to_stages, stage_module
from tests.distributed.pp_checks import label_tokens, padded_batch, pp_model

ARCHS = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "gpt_neox", "opt")


def chained_loss(model: torch.nn.Module, batch: dict, stages: int = 2) -> float:
    layout = pp_layout(model, resolve_plan(model), stages)
    modules = []
    for stage in range(stages):
        held = copy.deepcopy(model)
        prune_to_stages(held, layout, [stage])
        module = stage_module(held, layout, stage)
        module.label_tokens = label_tokens(batch)
        modules.append(module.eval())
    with torch.no_grad():
        x = batch["input_ids"]
        for module in modules:
            x = module(x, batch["attention_mask"], batch["labels"])
    return float(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_stages_chained_in_one_process_give_the_models_loss(arch):
    model = pp_model(arch).eval()
    batch = padded_batch(5)
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch) == pytest.approx(expected, rel=1e-6, abs=0)


def test_a_model_that_scales_its_embeddings_in_the_base_forward_is_refused():
    config = transformers.GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, vocab_size=128, embedding_multiplier=12.0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(HfScaleConfigError, match="embedding_multiplier=12.0.*Use fsdp / tp"):
        pp_layout(model, resolve_plan(model), 2)


@pytest.mark.parametrize(("model_type", "stream"), [("hy_v4", "top-k selection"), ("inkling2_text", "block_states")])
def test_a_second_stream_between_blocks_is_refused_with_what_it_is(model_type, stream):
    """The architecture scan saw pp=2 hang on these: their base forward passes more than the hidden
    states from block to block."""
    from types import SimpleNamespace

    from hf_scale.model_plans.pp import _check_stagewise

    with pytest.raises(HfScaleConfigError, match=f"second stream.*{stream}.*model_type '{model_type}'.*pp=1"):
        _check_stagewise(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
