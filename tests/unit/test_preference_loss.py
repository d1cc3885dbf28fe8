"""Preference losses against values computed by hand (``math``, TRL 1.16's formulas written out),
and the per-position log-probs of the loss path (plain, chunked, labelled-only) against
log-softmax + gather on the full logits, with gradients, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from hf_scale.errors import HfScaleConfigError
from hf_scale.parallel.loss import apply_chunked_loss
from hf_scale.parallel.preference import PairTotals, pair_totals, preference_step, sequence_logps
from hf_scale.parallel.preference_loss import PreferenceLoss, pair_losses
from tests.tiny_models import pair_batch, tiny_model


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# one pair: policy chosen -2 (2 tokens), rejected -5 (4 tokens); reference -3, -4; beta 0.5:
# log-ratios +1 and -1, delta 2, beta * delta 1
C, R, CN, RN, RC, RR, BETA = -2.0, -5.0, 2, 4, -3.0, -4.0, 0.5
DPO_CASES = {
    ("sigmoid", 0.0): -_logsig(1.0),
    ("sigmoid", 0.1): -0.9 * _logsig(1.0) - 0.1 * _logsig(-1.0),  # conservative DPO
    ("robust", 0.1): (-0.9 * _logsig(1.0) + 0.1 * _logsig(-1.0)) / 0.8,
    ("hinge", 0.0): 0.0,
    ("ipo", 0.0): ((1.0 / 2 - (-1.0) / 4) - 1 / (2 * BETA)) ** 2,  # token-mean log-ratios
}


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("loss,smoothing", list(DPO_CASES))
def test_dpo_family_by_hand(loss, smoothing):
    knobs = PreferenceLoss(loss, beta=BETA, label_smoothing=smoothing)
    terms = pair_losses(knobs, _t(C), _t(R), _t(CN), _t(RN), _t(RC), _t(RR))
    assert float(terms.losses[0]) == pytest.approx(DPO_CASES[(loss, smoothing)], abs=1e-12)
    assert float(terms.chosen_rewards[0]) == pytest.approx(BETA * 1.0)
    assert float(terms.rejected_rewards[0]) == pytest.approx(BETA * -1.0)
    sums = terms.metric_sums()
    assert float(sums["rewards/margins"]) == pytest.approx(1.0) and float(sums["rewards/accuracies"]) == 1.0
    assert float(sums["logps/chosen"]) == C and float(sums["logps/rejected"]) == R


def test_simpo_and_orpo_by_hand():
    c, r = C / CN, R / RN  # token means: -1, -1.25
    simpo = PreferenceLoss("simpo", beta=BETA, simpo_gamma=0.5, label_smoothing=0.1)
    logits = c - r - 0.5 / BETA
    want = -0.9 * _logsig(BETA * logits) - 0.1 * _logsig(-BETA * logits)
    terms = pair_losses(simpo, _t(C), _t(R), _t(CN), _t(RN))
    assert float(terms.losses[0]) == pytest.approx(want, abs=1e-12)
    assert float(terms.chosen_rewards[0]) == pytest.approx(BETA * c)
    orpo = PreferenceLoss("orpo", beta=BETA)
    log_odds = (c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r)))
    terms = pair_losses(orpo, _t(C), _t(R), _t(CN), _t(RN))
    assert float(terms.losses[0]) == pytest.approx(-BETA * _logsig(log_odds), abs=1e-6)
    assert float(terms.metric_sums()["logps/chosen"]) == pytest.approx(c)
    assert not simpo.needs_reference and not orpo.needs_reference and orpo.nll_weight == 1.0


@pytest.mark.parametrize("bad", [{"loss": "cpo"}, {"beta": 0}, {"loss": "robust", "label_smoothing": 0.5},
                                 {"loss": "ipo", "label_smoothing": 0.1}, {"loss": "orpo", "rpo_alpha": 1.0}])
def test_bad_knobs_refused(bad):
    with pytest.raises(HfScaleConfigError):
        PreferenceLoss(**bad)


def test_reference_required():
    with pytest.raises(HfScaleConfigError, match="reference"):
        pair_losses(PreferenceLoss("sigmoid"), _t(C), _t(R), _t(CN), _t(RN))


# ------------------------------------------------------------------ through a model
def _manual_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    shift = batch["labels"][:, 1:]
    picked = logits[:, :-1].log_softmax(-1).gather(-1, shift.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (shift != -100)).sum(-1)


@pytest.mark.parametrize("chunk,labeled_only", [(None, False), (5, False), (None, True), (7, True)])
def test_sequence_logps_in_loss_path(chunk, labeled_only):
    model = tiny_model("llama", "causal")
    if chunk or labeled_only:
        apply_chunked_loss(model, model.get_output_embeddings(), chunk, labeled_only=labeled_only)
    batch = pair_batch()
    with torch.no_grad():
        want = _manual_logps(model, batch)
    got = sequence_logps(model, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # with gradients: the same loss and gradients as the full-logits computation
    batch["ref_logps"] = want.detach() + torch.linspace(-0.3, 0.3, want.numel())
    knobs = PreferenceLoss("sigmoid", beta=0.2, rpo_alpha=0.5)
    out = preference_step(model, batch, knobs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = tiny_model("llama", "causal")
    logps = _manual_logps(plain, batch)
    terms = pair_losses(knobs, logps[0::2], logps[1::2], *(batch["labels"][:, 1:] != -100).sum(-1).view(-1, 2).T,
                        batch["ref_logps"][0::2], batch["ref_logps"][1::2])
    chosen_tokens = (batch["labels"][0::2, 1:] != -100).sum()
    loss = terms.losses.mean() + 0.5 * -logps[0::2].sum() / chosen_tokens
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_head_runs_on_the_scored_positions_only():
    """On a plain layout the output head (and the log-softmax after it) sees only the positions a
    label is scored at (logits_to_keep), in the reference's forward and in a training step, and
    the log-probs equal the full-logits ones (their gradients: test_sequence_logps_in_loss_path)."""
    model = tiny_model("llama", "causal")
    batch = pair_batch(pairs=4)
    with torch.no_grad():
        want = _manual_logps(model, batch)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    scored = int((batch["labels"][:, 1:] != -100).sum())
    assert scored < batch["labels"].numel()  # prompts and padding are not scored
    torch.testing.assert_close(sequence_logps(model, batch), want, rtol=1e-6, atol=1e-5)
    batch["ref_logps"] = want
    preference_step(model, batch, PreferenceLoss("sigmoid", beta=0.2))
    vocab = model.config.vocab_size
    assert seen == [(scored, vocab), (scored, vocab)]


def test_totals_weight_shares():
    """Two halves with the whole batch's totals add up to the whole batch's loss."""
    model = tiny_model("llama", "causal")
    batch = pair_batch(pairs=4)
    knobs = PreferenceLoss("simpo", beta=0.5, rpo_alpha=1.0)
    whole = preference_step(model, batch, knobs).loss
    totals = pair_totals(batch, knobs)
    assert isinstance(totals, PairTotals) and totals.pairs == 4
    halves = [preference_step(model, {k: v[s] for k, v in batch.items()}, knobs, totals=totals).loss
              for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-6, atol=1e-6)


def test_bad_batches_refused():
    model = tiny_model("llama", "causal")
    batch = pair_batch()
    with pytest.raises(HfScaleConfigError, match="odd"):
        preference_step(model, {k: v[:5] for k, v in batch.items()}, PreferenceLoss("simpo"))
    with pytest.raises(HfScaleConfigError, match="reference"):
        preference_step(model, batch, PreferenceLoss("sigmoid"))


def test_orpo_nll_covers_the_whole_chosen_sequence():
    """ORPO's NLL (TRL: labels = the attended input ids) is transformers' causal-LM loss of the
    chosen rows with every real token labelled, prompt included; RPO's covers the completion only."""
    model = tiny_model("llama", "causal")
    batch = pair_batch(pairs=3)
    chosen = {k: v[0::2] for k, v in batch.items()}
    with torch.no_grad():
        whole = model(input_ids=chosen["input_ids"], attention_mask=chosen["attention_mask"],
                      labels=chosen["input_ids"].masked_fill(chosen["attention_mask"] == 0, -100)).loss
        completion = model(**chosen).loss
    for knobs, want in ((PreferenceLoss("orpo"), whole), (PreferenceLoss("simpo", rpo_alpha=1.0), completion)):
        totals = pair_totals(batch, knobs)
        out = preference_step(model, batch, knobs)
        model.zero_grad()
        torch.testing.assert_close(out.sums["nll"].float() / totals.nll_tokens, want, rtol=1e-5, atol=1e-6)


def test_lora_reference_is_the_base_model():
    """Under peft, the reference is the base with the adapter disabled: the rewards are beta x
    (adapted policy - a separately built base model), and the adapter is on again afterwards."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(tiny_model("llama", "causal"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                     init_lora_weights=False))
    base = tiny_model("llama", "causal")
    batch = pair_batch(pairs=3)
    policy, ref = sequence_logps(model, batch), sequence_logps(base, batch)
    assert float((policy - ref).abs().max()) > 1e-3  # the adapter changes the model
    knobs = PreferenceLoss("sigmoid", beta=0.5)
    out = preference_step(model, batch, knobs)
    torch.testing.assert_close(out.sums["rewards/chosen"].float(), 0.5 * (policy - ref)[0::2].sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.sums["rewards/rejected"].float(), 0.5 * (policy - ref)[1::2].sum(), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(sequence_logps(model, batch), policy)


def test_adapter_disabled_leaves_requires_grad_alone():
    """The reference's switch (hf_scale.parallel.adapter_off): inside, the model computes as its base
    and every parameter keeps its requires_grad (peft's disable_adapter sets False on the adapter
    weights registered at that moment: under FSDP2 the gathered copies only, which the next gather
    overwrites from the sharded ones, tests/distributed/test_preference.py *_no_grad_first); after,
    the adapter computes again, even when the block raised."""
    from peft import LoraConfig, get_peft_model

    from hf_scale.parallel.adapter_off import adapter_disabled

    torch.manual_seed(1)
    model = get_peft_model(tiny_model("llama", "causal"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                     init_lora_weights=False))
    base = tiny_model("llama", "causal")
    batch = pair_batch(pairs=2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    policy = sequence_logps(model, batch)
    with adapter_disabled(model):
        assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
        torch.testing.assert_close(sequence_logps(model, batch), sequence_logps(base, batch))
    with pytest.raises(RuntimeError, match="inside"), adapter_disabled(model):
        raise RuntimeError("inside")
    torch.testing.assert_close(sequence_logps(model, batch), policy)
    with pytest.raises(HfScaleConfigError, match="peft model"), adapter_disabled(base):
        pass


def test_scored_logits_decided_by_the_forward_not_its_source():
    """keeps_scored_logits runs the class's forward (one layer, on the meta device) with 2-D
    logits_to_keep: a forward that names slice_logits_to_keep( but keeps every position is a no."""
    from transformers import LlamaForCausalLM

    from hf_scale.parallel.token_logps import keeps_scored_logits

    class KeepsAll(LlamaForCausalLM):
        def forward(self, *args, logits_to_keep=0, **kwargs):  # slice_logits_to_keep( is not called
            return super().forward(*args, **kwargs)

    model = tiny_model("llama", "causal")
    keeps_all = KeepsAll(model.config)
    assert keeps_scored_logits(model) and not keeps_scored_logits(keeps_all)
    assert not keeps_scored_logits(torch.nn.Linear(2, 2))  # no loss_function


def test_scored_logits_kept_for_a_parallelized_config_without_a_cache(monkeypatch):
    """parallelize turns the KV cache off (disable_kv_cache); without a cache transformers searches
    position_ids for packed documents with a data-dependent `.all()`, which the meta-device probe
    cannot run: the probe failed on every parallelized model, so every preference forward (policy
    and reference, full parameters and LoRA) computed [rows, seq, vocabulary] logits and their
    log-softmax (SmolLM2 DPO, LoRA on 2 ranks: +0.12 GiB peak RSS)."""
    from hf_scale.orchestrate import disable_kv_cache
    from hf_scale.parallel import token_logps

    monkeypatch.setattr(token_logps, "_PROBED", {})  # decided once per class: decide again here
    model = tiny_model("llama", "causal")
    disable_kv_cache(model)
    assert model.config.use_cache is False
    assert token_logps.keeps_scored_logits(model)
    assert model.config.use_cache is False  # the probe changed a copy only
