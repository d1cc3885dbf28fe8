"""The real pretrained models shipped by PyPI packages: SmolLM2-135M (Llama) and MiniLM (BERT)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import hf_scale
from hf_scale.parallel.optim import parameter_groups
from hf_scale.zoo import load_smollm2, minilm_dir
from tests.harness import run_ranks

pytestmark = pytest.mark.slow

STEPS, LR, SEQ = 2, 1e-5, 32
COMPARED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (2, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, optimizer, rank, world):
    losses = []
    for ids in _batches():
        local = ids[rank::world]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def smollm2_fsdp_worker():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model, _ = load_smollm2()
    model = hf_scale.parallelize(model, {"strategy": "fsdp"})
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=0.1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    losses = _train(model, optimizer, rank, world)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    norms, tensors = {}, {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        norms[name] = float(full.norm())
        if name in COMPARED:
            tensors[name] = full.detach()
    return {"losses": [float(x) for x in losses], "norms": norms, "tensors": tensors if rank == 0 else None}


def test_smollm2_fsdp_world2_matches_one_process():
    result = run_ranks(smollm2_fsdp_worker, 2, timeout=900)[0]
    torch.manual_seed(0)
    model, _ = load_smollm2()
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=LR)
    losses = [float(x) for x in _train(model, optimizer, 0, 1)]
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    params = dict(model.named_parameters())
    assert set(result["norms"]) == set(params)
    for name, norm in result["norms"].items():
        assert norm == pytest.approx(float(params[name].detach().norm()), rel=1e-5), name
    for name in COMPARED:
        want = params[name].detach().numpy()
        got = result["tensors"][name]
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), name


def test_minilm_plan_from_the_packaged_config():
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(minilm_dir())
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    plan = hf_scale.resolve_plan(model)
    assert plan.model_type == "bert" and plan.wrap_modules == ("BertLayer",)
    assert len(hf_scale.model_plans.wrap_units(model, plan)) == config.num_hidden_layers == 6


def test_minilm_recipe_learns_topics(tmp_path):
    """The real all-MiniLM-L6-v2 recipe end to end: accuracy rises, the export loads in transformers."""
    import json

    from transformers import AutoModelForSequenceClassification

    from tests.harness import ROOT, run_cli

    out = tmp_path / "minilm"
    run_cli("finetune", str(ROOT / "configs" / "minilm-classification.yaml"), "--train.output_dir", str(out),
            "--train.progress", "false", timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["eval_accuracy"] < 0.5 < 0.9 <= summary["after"]["eval_accuracy"]
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.id2label == {0: "food", 1: "sports", 2: "weather"}


def test_the_zoo_copy_is_the_gguf_model_and_tokenizer():
    """zoo:smollm2 loads from its de-quantized copy (made once in the cache): every tensor, the
    tokenizer (chat template included) and the generation config equal what transformers reads
    from the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_scale.zoo import SMOLLM2_GGUF, converted_folder, smollm2_dir

    model, tokenizer = load_smollm2()
    direct = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32, gguf_file=SMOLLM2_GGUF)
    want = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    mine, theirs = model.state_dict(), direct.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    assert tokenizer.chat_template == want.chat_template
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    text = "The Eiffel Tower was built in 1889. <|im_end|> 12 + 30 = 42"
    assert tokenizer(text).input_ids == want(text).input_ids
    assert model.generation_config.eos_token_id == direct.generation_config.eos_token_id
    assert not hasattr(model.config, "quantization_config") and (converted_folder("zoo:smollm2") / "model.safetensors").is_file()


def test_smollm2_lora_recipe_end_to_end(tmp_path):
    """configs/quickstart-lora.yaml on the real SmolLM2 (a few steps): the run trains LoRA
    adapters under fsdp, checkpoints and saves them in peft's format, peft loads the result on
    the base model, and hf-scale export --merge turns it into a plain model that gives the same
    logits."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_scale.zoo import zoo_source
    from tests.harness import ROOT, run_cli

    out = tmp_path / "lora"
    run_cli("finetune", str(ROOT / "configs" / "quickstart-lora.yaml"), "--train.output_dir", str(out),
            "--train.max_steps", "3", "--train.batch_size", "4", "--data.max_eval_samples", "16",
            "--train.eval_batch_size", "8", "--train.sample_generations", "0", "--train.progress", "false",
            "--checkpoint.every_steps", "2", timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_loss"] is not None
    folder = out / "model"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in folder.iterdir()}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["r"] == 16
    assert (out / "checkpoints" / "step_00000002" / "model" / "adapter_model.safetensors").is_file()
    base = zoo_source("zoo:smollm2")[0]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder))
    trained = [n for n, p in peft_model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert trained, "every lora_B is still zero: the adapters did not train"
    merged_dir = tmp_path / "merged"
    from hf_scale.cli import main

    # in this process (hf_scale.cli.main, whose status is the command's): one process start saved;
    # the command as a process: tests/unit/test_adapter_checkpoints.py
    assert main(["export", "--merge", str(folder), str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    ids = torch.tensor([[1, 422, 2000, 30, 9]])
    with torch.no_grad():
        want, got = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
