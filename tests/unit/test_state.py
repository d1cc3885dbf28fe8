"""get_state / ParallelState in one process (the multi-rank cases are in distributed/test_layout)."""

import hf_scale
from hf_scale import ParallelConfig
from tests.distributed.layout_checks import state_facts
from tests.tiny_models import tiny_model


def test_get_state_in_one_process_holds_the_config_and_plan_and_no_mesh():
    config = ParallelConfig(strategy="fsdp", mixed_precision="bf16", activation_checkpointing="full")
    model = hf_scale.parallelize(tiny_model("t5", "seq2seq"), config)
    state = hf_scale.get_state(model)
    assert state.config == config
    facts = state_facts(model)
    assert facts["plan"][:2] == ("t5", ("T5Block",))
    assert facts["env"] == (0, 1) and facts["dims"] is None and facts["mesh"] is None
    assert facts["dp_mesh_size"] is None
    assert state.plan.keep_fp32_modules == ("wo",)  # T5's fp32 feed-forward output


def test_get_state_of_a_plain_model_is_none():
    assert hf_scale.get_state(tiny_model("llama", "causal")) is None
