"""parallelize() without torchrun: checkpointing, precision and chunked loss in one process,
plus the optimizer helpers and the errors that need no process group."""

import pytest
import torch
from transformers import Trainer
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_scale
from hf_scale import HfScaleConfigError
from hf_scale.distributed import DistEnv
from hf_scale.orchestrate import precision_dtype
from hf_scale.parallel.optim import parameter_groups
from tests.tiny_models import all_cases, tiny_batch, tiny_model


def _count_calls(modules):
    """Counts forward starts (a pre-hook: recomputation stops early, before post-hooks)."""
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("mode, every, expected", [(None, 1, [1, 1]), ("full", 1, [2, 2]), ("full", 2, [2, 1]), ("selective", 1, [2, 2])])
def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients(mode, every, expected):
    ref = tiny_model("llama", "causal")
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"activation_checkpointing": mode, "ac_every": every})
    counts = _count_calls([layer.mlp for layer in model.model.layers])
    batch = tiny_batch("causal", 2)
    model(**batch).loss.backward()
    ref(**batch).loss.backward()
    assert counts == expected  # a recomputed block runs its forward again in backward
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-6, atol=1e-7)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    if mode:
        assert model.config.use_cache is False


def test_one_process_says_so_once(monkeypatch):
    import logging

    from hf_scale import log

    monkeypatch.setattr(log, "_said", set())
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.logger.addHandler(handler)
    try:
        hf_scale.parallelize(tiny_model("llama", "causal"))
        hf_scale.parallelize(tiny_model("llama", "causal"))
    finally:
        log.logger.removeHandler(handler)
    assert sum("running in one process" in r.getMessage() for r in records) == 1


def test_bf16_in_one_process_computes_in_bf16_keeps_fp32_params_and_grads():
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"mixed_precision": "bf16"})
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loss = model(**tiny_batch("causal", 2)).loss
    loss.backward()
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp32_modules_stay_fp32_under_autocast():
    model = hf_scale.parallelize(tiny_model("t5", "seq2seq"), {"mixed_precision": "bf16"})
    seen = {}
    wo = model.encoder.block[0].layer[-1].DenseReluDense.wo
    wi = model.encoder.block[0].layer[-1].DenseReluDense.wi
    wo.register_forward_hook(lambda m, i, o: seen.update(wo=(i[0].dtype, o.dtype)))
    wi.register_forward_hook(lambda m, i, o: seen.update(wi=o.dtype))
    model(**tiny_batch("seq2seq", 2)).loss.backward()
    assert seen == {"wo": (torch.float32, torch.float32), "wi": torch.bfloat16}


def test_parallelize_twice_is_refused():
    model = hf_scale.parallelize(tiny_model("gpt2", "causal"))
    with pytest.raises(HfScaleConfigError, match="already applied"):
        hf_scale.parallelize(model)


def test_bf16_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "OldGPU")
    env = DistEnv(0, 1, 0, 1, torch.device("cuda", 0))
    with pytest.raises(HfScaleConfigError, match="OldGPU has no bf16 support: use mixed_precision='fp16'"):
        precision_dtype(hf_scale.ParallelConfig(mixed_precision="bf16"), env)


def test_chunked_loss_matches_and_keeps_eval_logits():
    ref = tiny_model("gpt2", "causal")
    model = hf_scale.parallelize(tiny_model("gpt2", "causal"), {"loss_chunk_tokens": 7})
    batch = tiny_batch("causal", 2)
    out = model(**batch)
    assert out.logits is None  # the point: no full logits in a training forward
    torch.testing.assert_close(out.loss, ref(**batch).loss)
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 16, 128)


@pytest.mark.parametrize("chunk", [None, 5])
def test_loss_labeled_only_gives_the_loss_and_gradients_of_the_full_logits(chunk):
    """Prompt positions masked with -100 (and one row with no label at all): the head runs on
    the labeled positions only, and the loss and every gradient are plain transformers'."""
    ref = tiny_model("llama", "causal")
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"loss_labeled_only": True, "loss_chunk_tokens": chunk})
    batch = tiny_batch("causal", 3)
    batch["labels"][:, :11] = -100  # a prompt
    batch["labels"][1] = -100  # a row whose every position is masked
    out = model(**batch)
    assert out.logits is None
    want = ref(**batch)
    torch.testing.assert_close(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():
        assert model(**batch).logits.shape == (3, 16, 128)


@pytest.mark.parametrize("chunk", [None, 5])
def test_loss_labeled_only_backward_runs_on_a_batch_with_no_label(chunk):
    """A batch whose every label is masked (a data-parallel rank's rows, a microbatch): the loss
    is plain transformers' (0 / 0) and its backward runs, every gradient zero, so the rank
    joins its gradient collectives (with chunks it raised: no chunk, a loss with no graph)."""
    ref = tiny_model("llama", "causal")
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"loss_labeled_only": True, "loss_chunk_tokens": chunk})
    batch = tiny_batch("causal", 2)
    batch["labels"][:] = -100
    out, want = model(**batch), ref(**batch)
    torch.testing.assert_close(out.loss, want.loss, equal_nan=True)
    (out.loss * 0.0).backward()  # the fine-tuning loop's weight for a slice without labels
    for name, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_loss_labeled_only_runs_the_head_on_the_labeled_positions_only(monkeypatch):
    from hf_scale.parallel import loss

    rows = []
    chunk_loss = loss._chunk_loss
    monkeypatch.setattr(loss, "_chunk_loss", lambda hidden, *a: rows.append(hidden.shape[0]) or chunk_loss(hidden, *a))
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"loss_labeled_only": True})
    batch = tiny_batch("causal", 2)
    batch["labels"][:, :12] = -100  # positions 11..14 predict labels 12..15: 4 per row
    model(**batch)
    assert rows == [8]


def test_loss_labeled_only_must_be_a_bool():
    with pytest.raises(HfScaleConfigError, match="loss_labeled_only='yes' must be true or false"):
        hf_scale.ParallelConfig(loss_labeled_only="yes")


def test_chunked_loss_refused_for_a_model_with_its_own_loss():
    model = tiny_model("t5", "seq2seq")
    with pytest.raises(HfScaleConfigError, match="does not compute its loss through model.loss_function"):
        hf_scale.parallelize(model, {"loss_chunk_tokens": 8})
    assert model(**tiny_batch("seq2seq", 2)).logits is not None  # left as it was


@pytest.mark.parametrize("arch, head", all_cases(), ids=[f"{a}-{h}" for a, h in all_cases()])
def test_weight_decay_groups_match_hf_trainer(arch, head, tmp_path):
    model = tiny_model(arch, head)
    trainer = Trainer.__new__(Trainer)  # only its parameter rule is used
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {id(params[n]) for n in trainer.get_decay_parameter_names(model)}
    groups = parameter_groups(model, 0.1)
    decay = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    no_decay = {id(p) for g in groups if not g["weight_decay"] for p in g["params"]}
    assert decay == expected
    assert no_decay and not decay & no_decay
    assert len(decay | no_decay) == len(list(model.parameters()))


def test_clip_grad_norm_matches_torch_in_one_process():
    a, b = tiny_model("llama", "causal"), tiny_model("llama", "causal")
    batch = tiny_batch("causal", 2)
    for m in (a, b):
        m(**batch).loss.backward()
    ours = hf_scale.clip_grad_norm_(a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_no_sync_is_a_no_op_in_one_process():
    model = hf_scale.parallelize(tiny_model("llama", "causal"))
    with hf_scale.no_sync(model):
        model(**tiny_batch("causal", 2)).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_chunked_loss_runs_no_forward_when_applied():
    """parallelize must not run the (possibly huge, unsharded) model to check the chunked loss."""
    model = tiny_model("llama", "causal")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    hf_scale.parallelize(model, {"loss_chunk_tokens": 8})
    assert calls == []


def test_chunked_loss_refuses_a_forward_that_changes_the_logits_at_its_first_step():
    from transformers import LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden) * 2.0  # a logit transform the config does not declare
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    model = Doubled(tiny_model("llama", "causal").config)
    hf_scale.parallelize(model, {"loss_chunk_tokens": 8})
    batch = tiny_batch("causal", 2)
    with pytest.raises(HfScaleConfigError, match="changes the head's output before the loss"):
        model(**batch)
    with torch.no_grad():  # evaluation forwards are unchanged
        assert model(**batch).logits is not None


def test_one_process_on_an_accelerator_moves_the_whole_model_there(monkeypatch):
    """World 1 on a GPU: nothing shards the model, so parallelize puts it on the device whatever
    the strategy (it stayed on the CPU under the default fsdp, found writing scripts/gpu_check.py).
    The meta device stands in for CUDA here."""
    from hf_scale import orchestrate

    monkeypatch.setattr(orchestrate, "init_distributed", lambda timeout: DistEnv(0, 1, 0, 1, torch.device("meta")))
    model = hf_scale.parallelize(tiny_model("llama", "causal"), {"strategy": "fsdp"})
    assert {p.device.type for p in model.parameters()} == {"meta"}
