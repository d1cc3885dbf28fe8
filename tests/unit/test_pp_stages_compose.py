"""A model's pipeline stages, chained in one process, compute the model's own loss.

Each stage runs the model's own forward on a view that holds only its modules (stage 0 from
the token ids; a later stage from the token ids too, its first block taking the hidden states it
would receive). What a base forward does to the embeddings before the blocks (Granite's
multiplier, BART-family decoders' scale, positions and embedding norm registered after the
blocks) therefore runs on stage 0 only, as in one process; a module whose output reaches every
block beside the hidden states is refused by ``pp_layout``.
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
from tests.tiny_models import VOCAB

ARCHS = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "gpt_neox", "opt")


def chained_loss(model: torch.nn.Module, batch: dict, stages: int = 2, microbatches: int = 1) -> float:
    """The batch's loss as the pipeline computes it: each microbatch through the stages in
    turn, the last stage's microbatch losses summed."""
    layout = pp_layout(model, resolve_plan(model), stages)
    modules = []
    for stage in range(stages):
        held = copy.deepcopy(model)
        prune_to_stages(held, layout, [stage])
        module = stage_module(held, layout, stage)
        module.label_tokens = label_tokens(batch)
        module.label_positions = int((batch["labels"] != -100).sum())
        modules.append(module.eval())
    total = 0.0
    with torch.no_grad():
        for part in zip(*(batch[k].chunk(microbatches) for k in ("input_ids", "attention_mask", "labels"))):
            ids, mask, labels = part
            x = ids
            for module in modules:
                x = module(x, mask, labels, input_ids=ids)
            total += float(x)
    return total


@pytest.mark.parametrize("arch", ARCHS)
def test_stages_chained_in_one_process_give_the_models_loss(arch):
    model = pp_model(arch).eval()
    batch = padded_batch(5)
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch) == pytest.approx(expected, rel=1e-6, abs=0)


def tiny(model_type: str, **overrides) -> torch.nn.Module:
    """``model_type``'s default config at a tiny size (4 blocks), random weights, eval mode."""
    sizes = dict(hidden_size=32, d_model=32, intermediate_size=64, ffn_dim=64, decoder_ffn_dim=64,
                 num_hidden_layers=4, decoder_layers=4, num_attention_heads=4, decoder_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0)
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("granite", {"embedding_multiplier": 12.0}),  # scales the embeddings in the base forward
    ("bart", {"scale_embedding": True}),  # embeddings, positions and norm inside a decoder wrapper,
    ("mbart", {"scale_embedding": True}),  # its layernorm_embedding registered after the blocks
    ("xglm", {}),  # sinusoidal positions added in the base forward
    ("lfm2", {}),  # embedding_norm: registered after the blocks, and run after them
])
def test_what_the_base_forward_does_before_the_blocks_runs_on_stage_0_only(model_type, overrides):
    model = tiny(model_type, **overrides)
    batch = padded_batch(5)
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch) == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize("model_type", ["llama", "bart"])
def test_microbatch_losses_add_up_to_the_batch_mean_whether_the_model_reduces_its_own_loss_or_not(model_type):
    """Llama's loss sums over ``num_items_in_batch``; BART's head takes a ``CrossEntropyLoss()``
    mean of its microbatch (no shift), which the last stage weights by its share of the labels.
    The padded rows make the microbatches' label counts differ."""
    model = tiny(model_type)
    batch = padded_batch(6)
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch, microbatches=2) == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize("model_type", ["llama", "bart"])
def test_a_microbatch_without_labels_adds_nothing_and_no_nan(model_type):
    """A microbatch of prompt-only rows (every label -100): BART's own mean over no labels is NaN,
    which the last stage must not add (a review's finding: the step's loss was NaN)."""
    model = tiny(model_type)
    batch = padded_batch(6)
    batch["labels"][:2] = -100  # the first microbatch of two holds no labels
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch, microbatches=2) == pytest.approx(expected, rel=1e-6, abs=0)


def test_a_model_that_declares_accepts_loss_kwargs_false_but_calls_loss_function_is_not_weighted_twice(monkeypatch):
    """Qwen2.5-VL declares ``accepts_loss_kwargs = False`` (for Trainer) and still passes
    ``num_items_in_batch`` to ``loss_function``: its microbatch losses are shares already."""
    model = tiny("llama")
    monkeypatch.setattr(type(model), "accepts_loss_kwargs", False, raising=False)
    batch = padded_batch(6)
    with torch.no_grad():
        expected = float(model(**batch).loss)
    assert chained_loss(model, batch, microbatches=2) == pytest.approx(expected, rel=1e-6, abs=0)


def test_finding_where_modules_run_draws_no_random_numbers_and_keeps_the_training_mode():
    model = tiny("gpt2").train()  # GPT-2 drops out its embeddings before the first block
    model.transformer.h[1].eval()  # a module in its own mode keeps it
    state = torch.get_rng_state()
    pp_layout(model, resolve_plan(model), 2)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model.transformer.drop.training and not model.transformer.h[1].training


def test_a_module_registered_after_the_blocks_that_runs_before_them_is_on_the_first_stage():
    layout = pp_layout(tiny("mbart"), resolve_plan(tiny("mbart")), 2)
    assert "model.decoder.layernorm_embedding" in layout.first
    assert "model.decoder.layer_norm" in layout.last  # the final norm stays last
    lfm2 = tiny("lfm2")
    assert "model.embedding_norm" in pp_layout(lfm2, resolve_plan(lfm2), 2).last  # its final norm


def test_the_order_is_found_on_the_meta_device_too():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny("mbart").config)
    assert "model.decoder.layernorm_embedding" in pp_layout(model, resolve_plan(model), 2).first


def test_a_module_whose_output_reaches_every_block_is_refused_naming_it():
    model = tiny("roformer", embedding_size=32, is_decoder=True)
    with pytest.raises(HfScaleConfigError, match="output of roformer.encoder.embed_positions to every block.*pp=1"):
        pp_layout(model, resolve_plan(model), 2)


@pytest.mark.parametrize(("model_type", "stream"), [("hy_v4", "top-k selection"), ("inkling2_text", "block_states")])
def test_a_second_stream_between_blocks_is_refused_with_what_it_is(model_type, stream):
    """The architecture scan saw pp=2 hang on these: their base forward passes more than the hidden
    states from block to block."""
    from types import SimpleNamespace

    from hf_scale.model_plans.pp import _check_stagewise

    with pytest.raises(HfScaleConfigError, match=f"second stream.*{stream}.*model_type '{model_type}'.*pp=1"):
        _check_stagewise(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
