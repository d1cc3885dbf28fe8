"""KTO's loss (hf_scale.parallel.kto) by hand, and against TRL 1.16's own loss code,
``KTOTrainer._compute_loss`` (called on a stand-in trainer, not through its Trainer), on the same
tiny model, examples and reference: at step 0 and over 3 AdamW steps (fp32, lr 1e-5), with a
held reference of other weights and with LoRA (the base with the adapter disabled).

TRL's side builds its batch with its own collator from the examples' prompt and completion ids
and its own KL rotation (``KL_completion_ids``: the last completion first, then the others), so
our collator's KL rows and masks are checked too. The inputs make every term count: both labels,
a KL reference point above 0 in every step (asserted), unequal desirable / undesirable weights.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hf_scale.data.unpaired import UnpairedCollator
from hf_scale.errors import HfScaleConfigError
from hf_scale.parallel.kto import kl_point, kto_prepare, kto_step
from hf_scale.parallel.preference_loss import PreferenceLoss, kto_losses, kto_means, pair_losses
from hf_scale.parallel.preference_reference import frozen_reference_logps
from tests.tiny_models import tiny_model, unpaired_rows

BETA, DW, UW = 0.5, 1.5, 0.75
LR, STEPS, EXAMPLES = 1e-5, 3, 6
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "init_lora_weights": False}


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_losses_by_hand():
    """Two desirable and one undesirable example; kl 0.4: Eqn (7) of the KTO paper term by term."""
    knobs = PreferenceLoss("kto", beta=BETA, desirable_weight=DW, undesirable_weight=UW)
    logps, ref = _t(-3.0, -5.0, -4.0), _t(-4.0, -4.5, -3.0)
    terms = kto_losses(knobs, logps, ref, torch.tensor([True, True, False]), 0.4)
    want = [DW * (1 - _sig(BETA * (1.0 - 0.4))), DW * (1 - _sig(BETA * (-0.5 - 0.4))),
            UW * (1 - _sig(BETA * (0.4 - (-1.0))))]
    assert terms.losses.tolist() == pytest.approx(want, abs=1e-12)
    assert terms.rewards.tolist() == pytest.approx([BETA * 1.0, BETA * -0.5, BETA * -1.0])
    sums = {**terms.metric_sums(), "kl": torch.tensor(0.4 * 3)}
    means = kto_means(sums, 3)
    assert means["rewards/chosen"] == pytest.approx(BETA * 0.25) and means["rewards/rejected"] == pytest.approx(-BETA)
    assert means["rewards/margins"] == pytest.approx(BETA * 1.25) and means["kl"] == pytest.approx(0.4)
    assert means["logps/chosen"] == pytest.approx(-4.0) and means["logps/rejected"] == pytest.approx(-4.0)
    assert "rewards/margins" not in kto_means(terms.metric_sums(torch.tensor([1.0, 1.0, 0.0])), 2)


def test_no_gradient_reaches_the_kl_point():
    """TRL detaches the KL estimate: the loss's gradient reaches the log-probs, never the KL."""
    knobs = PreferenceLoss("kto", beta=BETA)
    logps, kl = _t(-3.0, -4.0).requires_grad_(), torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    kto_losses(knobs, logps, _t(-4.0, -3.0), torch.tensor([True, False]), kl).losses.sum().backward()
    assert kl.grad is None and logps.grad is not None and bool((logps.grad != 0).all())


@pytest.mark.parametrize("bad", [{"loss": "sigmoid", "desirable_weight": 2.0}, {"loss": "kto", "undesirable_weight": 0},
                                 {"loss": "kto", "rpo_alpha": 1.0}, {"loss": "kto", "label_smoothing": 0.1}])
def test_bad_kto_knobs_refused(bad):
    with pytest.raises(HfScaleConfigError):
        PreferenceLoss(**bad)


def test_kto_is_not_a_pair_loss():
    with pytest.raises(HfScaleConfigError, match="unpaired"):
        pair_losses(PreferenceLoss("kto"), _t(-1), _t(-2), _t(1), _t(1), _t(-1), _t(-2))


# ------------------------------------------------------------------ TRL's loss code
def trl_batch(rows: list[dict]) -> dict:
    """TRL's collated batch of the same examples: prompt / completion ids split at the first
    label, TRL's KL rotation, TRL's collator."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    split = [next(k for k, t in enumerate(r["labels"]) if t != -100) for r in rows]
    completions = [r["input_ids"][p:] for r, p in zip(rows, split)]
    kl = [completions[-1]] + completions[:-1]  # TRL's add_kl_completion_ids
    examples = [{"prompt_ids": r["input_ids"][:p], "completion_ids": c, "KL_completion_ids": k, "label": r["label"]}
                for r, p, c, k in zip(rows, split, completions, kl)]
    return DataCollatorForUnpairedPreference(pad_token_id=0)(examples)


def trl_trainer(policy, reference):
    """A stand-in ``self`` with what ``KTOTrainer._compute_loss`` reads, for one process."""
    from trl.trainer.kto_trainer import KTOTrainer

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t,
                                  unwrap_model=lambda m: m)
    fake = SimpleNamespace(model=policy, ref_model=reference, accelerator=accelerator, calculate_KL=True,
                           precompute_ref_logps=False, args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                           beta=BETA, loss_type="kto", desirable_weight=DW, undesirable_weight=UW,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1, aux_loss_enabled=False)
    fake._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, fake)
    return fake, functools.partial(KTOTrainer._compute_loss, fake)


def models(lora: bool):
    """(policy, reference or None): the reference a held model, the policy with its (tied)
    embeddings scaled by 3 (sharper, so the policy's log-probs of the KL rows are the higher
    and the KL point is above 0), or the base with the adapter disabled (LoRA, initialised
    non-zero so the two differ)."""
    policy = tiny_model("llama", "causal")
    if not lora:
        reference = copy.deepcopy(policy).eval()
        with torch.no_grad():
            reference.get_output_embeddings().weight.mul_(3.0)
        for p in reference.parameters():
            p.requires_grad_(False)
        return policy, reference
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(policy, LoraConfig(**LORA)), None


def _fused(model):
    """TRL's copy of a model, with TRL's fused LM head (added before peft wraps it, as TRL does)."""
    from trl.trainer.utils import add_fused_lm_head

    if model is None:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits"))
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["held_reference", "lora"])
def test_matches_trl_over_three_adamw_steps(lora):
    pytest.importorskip("trl")  # the anchor: installed beside the benchmarks, not a test dependency
    knobs = PreferenceLoss("kto", beta=BETA, desirable_weight=DW, undesirable_weight=UW)
    ours, reference = models(lora)
    theirs, their_reference = _fused(copy.deepcopy(ours)), _fused(copy.deepcopy(reference))
    fake, trl_loss = trl_trainer(theirs, their_reference)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]
    opt_ours = torch.optim.AdamW(trainable(ours), lr=LR, weight_decay=0.0)
    opt_theirs = torch.optim.AdamW(trainable(theirs), lr=LR, weight_decay=0.0)
    collate = UnpairedCollator(0)
    for step in range(STEPS):
        rows = unpaired_rows(EXAMPLES, seed=1 + step)  # seeds where LoRA's KL point is above 0 too
        batch = collate(rows)
        if reference is not None:
            batch["ref_logps"] = frozen_reference_logps(reference, batch)
        kl = kl_point(kto_prepare(ours, batch, knobs))
        assert kl > 0.05, f"step {step}: the KL reference point is {kl}: pick inputs where it counts"
        out = kto_step(ours, batch, knobs, kl)
        loss = trl_loss(theirs, trl_batch(rows), False)
        loss.backward()
        torch.testing.assert_close(out.loss, loss.detach().float(), rtol=1e-5, atol=1e-7)
        metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
        mine = kto_means(out.sums, out.pairs)
        for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            # kl and the rewards are differences of log-prob sums of about -40 (fp32): 1e-5 absolute
            assert mine[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-5), f"step {step} {key}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=f"step {step} grad {name}")
        opt_ours.step(), opt_theirs.step()
        opt_ours.zero_grad(), opt_theirs.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=f"after {STEPS} steps: {name}")


def test_reference_is_required():
    model = tiny_model("llama", "causal")
    with pytest.raises(HfScaleConfigError, match="reference"):
        kto_prepare(model, UnpairedCollator(0)(unpaired_rows(3)), PreferenceLoss("kto"))


def test_eval_weights_leave_padding_copies_out():
    """A padding copy (weight 0) changes neither the KL point nor the loss sums."""
    model, reference = models(lora=False)
    knobs = PreferenceLoss("kto", beta=BETA)
    rows = unpaired_rows(4)
    results = []
    for batch_rows, weight in ((rows[:3], None), (rows[:3] + [rows[0]], torch.tensor([1.0, 1.0, 1.0, 0.0]))):
        batch = UnpairedCollator(0)(batch_rows)
        if weight is not None:
            batch["pair_weight"] = weight
        batch["ref_logps"] = frozen_reference_logps(reference, batch)
        with torch.no_grad():
            sums = kto_prepare(model, batch, knobs)
            out = kto_step(model, batch, knobs, kl_point(sums), train=False)
        results.append((float(sums[1]), out.sums))
    (n3, a), (n4, b) = results
    assert n3 == n4 == 3  # KL rows counted
    assert float(a["count/chosen"] + a["count/rejected"]) == float(b["count/chosen"] + b["count/rejected"]) == 3
