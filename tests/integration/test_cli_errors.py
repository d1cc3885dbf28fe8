"""Bad input to the ``hf-scale`` process: one line, exit status 2, before any model is loaded.

One case runs as the process itself; the others, found as early, run in this process
(``hf_scale.cli.main``, whose status is the command's), since a process start is most of their cost.
"""

from __future__ import annotations

from tests.harness import run_cli


def test_bad_lr_and_unknown_flag_exit_2_in_one_line(tmp_path, capfd):
    from hf_scale.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], '
                                          '"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4, "vocab_size": 128}')
    for args, message in [
        (("finetune", "configs/quickstart.yaml", "--train.lr", "-1"),
         "hf-scale finetune: error: train.lr=-1.0: the learning rate must be > 0, e.g. 2e-5."),
        (("plan", str(tmp_path), "--xyzzy", "3", "--world-size", "8"),
         "hf-scale plan: error: unknown flag --xyzzy: hf-scale plan takes --world-size, --nnodes, --task, --strategy, "
         "--tp, --ep, --cp, --cp-exchange, --pp, --pp-schedule, --pp-microbatches, --pp-grad-sync, --gpus, --gpu-memory, --seq, --batch, --intra-gbps, "
         "--inter-gbps, --latency-us, --simulate, --simulate-ranks, --candidates."),
        (("plan", str(tmp_path), "--gpu", "8"), "hf-scale plan: error: unknown flag --gpu: did you mean --gpus?"),
    ]:
        capfd.readouterr()
        status = main(list(args))
        said = "".join(capfd.readouterr())
        assert status == 2, said
        assert said.count("\n") == 1 and said.startswith(message), said
    result = run_cli("plan", "not-a-model-id-xyz", check=False, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("\n") == 1, result.stdout
    assert result.stdout.startswith("hf-scale plan: error: cannot find model 'not-a-model-id-xyz'"), result.stdout
