"""push_to_hub against the local Hub server (tests/hub_server.py), through the real huggingface_hub.

Round trip from a 2-rank fsdp save, resume after interrupted pushes, retries, errors and options.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_scale
from hf_scale.checkpoint.files import read_checksums
from hf_scale.errors import HfScaleCheckpointError, HfScaleConfigError, HfScaleHubError
from hf_scale.hub import main
from tests.harness import ROOT, run_ranks
from tests.hub import push_ranks
from tests.hub.conftest import TOKEN, point_hub_at
from tests.tiny_models import tiny_model

REPO = "org/tiny-finetune"


def contents(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def assert_on_hub(hub, folder) -> None:
    """The repo's main branch holds exactly the folder's files (and the Hub's .gitattributes)."""
    assert hub.files(REPO) == contents(folder) | {".gitattributes": hub.files(REPO)[".gitattributes"]}


def tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def puts(hub, since: int = 0) -> set[str]:
    """The LFS objects (sha256) uploaded since request number ``since``."""
    return {path.rsplit("/", 1)[1] for method, path in hub.requests[since:] if method == "PUT"}


def commits(hub, since: int = 0) -> int:
    """Commit requests sent since request number ``since`` (landed or not)."""
    return sum(1 for method, path in hub.requests[since:] if method == "POST" and "/commit/" in path)


def landed(hub) -> list[tuple[str, ...]]:
    """The paths of each commit the server applied to REPO, in order (as it received them)."""
    return [c.paths for c in hub.commits if c.repo == REPO]


def assert_each_file_committed_once(hub, folder, max_files: int) -> None:
    """Observed on the server: commits of at most ``max_files`` files, every file of the folder
    committed exactly once, shards first, config and index last (loadable only once complete)."""
    groups = landed(hub)
    assert all(0 < len(g) <= max_files for g in groups), groups
    order = [name for g in groups for name in g]
    assert sorted(order) == sorted(contents(folder)), order  # none twice, none missing
    shards = [i for i, name in enumerate(order) if name.endswith(".safetensors")]
    assert shards == list(range(len(shards))), order
    assert set(order[-2:]) == {"config.json", "model.safetensors.index.json"}, order


def test_round_trip_from_two_fsdp_ranks(hub, tmp_path):
    """Saved on 2 fsdp ranks, pushed from all (rank 0 talks to the Hub), loaded back identical."""
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    # fresh ranks: huggingface_hub reads the endpoint (this test's server) when first imported
    ranks = run_ranks(push_ranks.save_and_push, 2, str(tmp_path), REPO, "hf_wrong_" + TOKEN, timeout=300,
                      fresh=True)
    folder = tmp_path / "out"
    assert ranks[0]["url"] == ranks[1]["url"] and ranks[0]["url"].startswith(f"{hub.url}/{REPO}/commit/")
    assert ranks[0]["errors"] == ranks[1]["errors"]  # the same error, raised on every rank
    assert ranks[1]["errors"]["bad_id"][0] == "HfScaleConfigError"
    kind, message = ranks[1]["errors"]["refused"]
    assert kind == "HfScaleHubError" and "401" in message and TOKEN not in message
    assert hub.repos[REPO].private and f'from_pretrained("{REPO}")' in hub.files(REPO)["README.md"].decode()
    assert sum(1 for m, p in hub.requests if m == "POST" and p == "/api/repos/create") == 2  # rank 0 only

    snapshot = Path(snapshot_download(REPO))
    assert contents(snapshot) == contents(folder) | {".gitattributes": hub.files(REPO)[".gitattributes"]}
    saved = tensors(folder)
    for model in (AutoModelForCausalLM.from_pretrained(REPO), hf_scale.from_pretrained(REPO)):
        state = model.state_dict()
        for name, value in saved.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_resume_after_a_failed_lfs_upload(hub, checkpoint):
    """The 2nd shard's upload is refused (as an expired presigned URL is: no retry); the next push
    sends only the blobs that are not in LFS storage yet (uploaded, but never committed)."""
    digests = read_checksums(checkpoint)
    shards = sorted(digests)
    hub.fail("PUT", digests[shards[1]], action=403)
    with pytest.raises(HfScaleHubError, match="push again") as failed:
        hf_scale.push_to_hub(checkpoint, REPO)
    assert "403" in str(failed.value) and not any(name.endswith(".safetensors") for name in hub.files(REPO))
    stored = {oid for oid in digests.values() if (hub.blobs / oid).exists()}
    assert stored and digests[shards[1]] not in stored  # the upload threads that ran before the failure
    start = len(hub.requests)
    hf_scale.push_to_hub(checkpoint, REPO)
    assert puts(hub, start) == set(digests.values()) - stored
    assert_on_hub(hub, checkpoint)


def test_resume_after_a_dropped_commit(hub, checkpoint):
    """Two files per commit, no retries: the 2nd commit's connection drops. The next push makes
    only the missing commits and uploads no blob again (committed or not)."""
    hub.fail("POST", r"/commit/", action="drop", after=1)
    with pytest.raises(HfScaleHubError, match="lost the connection"):
        hf_scale.push_to_hub(checkpoint, REPO, max_files_per_commit=2, retries=0)
    first = landed(hub)
    assert len(first) == 1 and len(first[0]) == 2 and set(hub.files(REPO)) == {".gitattributes", *first[0]}
    uploaded = puts(hub)  # the first two commits' blobs: one committed, one not
    start = len(hub.requests)
    hf_scale.push_to_hub(checkpoint, REPO, max_files_per_commit=2, retries=0)
    assert commits(hub, start) == len(landed(hub)) - 1  # no commit request failed or repeated
    assert_each_file_committed_once(hub, checkpoint, max_files=2)  # loadable only once complete
    digests = read_checksums(checkpoint)
    assert puts(hub, start) == set(digests.values()) - uploaded  # no blob sent twice
    assert_on_hub(hub, checkpoint)


def test_server_errors_and_dropped_connections_are_retried(hub, checkpoint):
    """A 500 on the commit and a lost answer (the commit landed) are retried by push_to_hub, a 500
    on an LFS upload by huggingface_hub; the retried commit is not made twice."""
    hub.fail("POST", r"/commit/", action=500)
    hub.fail("POST", r"/commit/", action="lose", after=1)  # 2nd commit lands, its answer is lost
    hub.fail("PUT", r"/_lfs/", action=500)
    url = hf_scale.push_to_hub(checkpoint, REPO, max_files_per_commit=8)
    assert len(landed(hub)) == 2 and commits(hub) == 3  # first one twice (500), second once (lost)
    assert_each_file_committed_once(hub, checkpoint, max_files=8)  # the lost one is not redone
    assert url.endswith(hub.repos[REPO].branches["main"])
    assert_on_hub(hub, checkpoint)


def test_wrong_token_gives_a_clear_401_without_the_token(hub, checkpoint, caplog, capsys):
    wrong = "hf_wrong_" + TOKEN
    with caplog.at_level(logging.DEBUG), pytest.raises(HfScaleHubError) as failed:
        hf_scale.push_to_hub(checkpoint, REPO, token=wrong)
    message = str(failed.value)
    assert "401" in message and "HF_TOKEN" in message and "hf auth login" in message and hub.url in message
    text = "".join(traceback.format_exception(failed.value)) + caplog.text + "".join(capsys.readouterr())
    assert TOKEN not in text and wrong not in text


def test_push_to_an_existing_repo_makes_a_new_commit(hub, checkpoint, tmp_path):
    """A second run (one file instead of shards) replaces the weights: new blobs, stale shards
    and index deleted; pushing it again changes nothing."""
    url1 = hf_scale.push_to_hub(checkpoint, REPO)
    second = hf_scale.save_pretrained(tiny_model("llama", "causal", seed=1), tmp_path / "b")
    start = len(hub.requests)
    url2 = hf_scale.push_to_hub(second, REPO, commit_message="second run")
    assert url1 != url2 and commits(hub, start) == 1
    assert puts(hub, start) == set(read_checksums(second).values())  # the new weights only
    assert_on_hub(hub, second)
    start = len(hub.requests)
    assert hf_scale.push_to_hub(second, REPO) == url2  # nothing changed: no commit, same head
    assert commits(hub, start) == 0 and not puts(hub, start)
    state = hf_scale.from_pretrained(REPO).state_dict()
    for name, value in tensors(second).items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_private_flag_branch_and_allow_patterns(hub, checkpoint):
    from huggingface_hub import hf_hub_download

    hf_scale.push_to_hub(checkpoint, REPO, private=True, revision="v1", allow_patterns=["*.json"])
    assert hub.repos[REPO].private
    assert set(hub.files(REPO, "v1")) == {".gitattributes", *(p.name for p in checkpoint.glob("*.json"))}
    assert set(hub.files(REPO, "main")) == {".gitattributes"}
    downloaded = Path(hf_hub_download(REPO, "config.json", revision="v1"))
    assert downloaded.read_text() == (checkpoint / "config.json").read_text()
    with pytest.raises(HfScaleConfigError, match=r"\*\.txt.*match no file"):
        hf_scale.push_to_hub(checkpoint, REPO, allow_patterns="*.txt")
    hf_scale.push_to_hub(checkpoint, "org/public")
    with pytest.raises(HfScaleHubError, match="exists and is public"):
        hf_scale.push_to_hub(checkpoint, "org/public", private=True)


@pytest.mark.parametrize("break_it, missing", [
    (lambda folder: (folder / "config.json").unlink(), "config.json"),
    (lambda folder: sorted(folder.glob("*.safetensors"))[1].unlink(), "model-00002-of-"),
])
def test_incomplete_checkpoint_is_refused(hub, checkpoint, break_it, missing):
    break_it(checkpoint)
    with pytest.raises(HfScaleCheckpointError, match=missing):
        hf_scale.push_to_hub(checkpoint, REPO)
    assert hub.requests == []


def test_corrupt_shard_is_refused_before_its_commit(hub, checkpoint):
    shard = min(checkpoint.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(HfScaleCheckpointError, match=f"{shard.name} does not match its sha256"):
        hf_scale.push_to_hub(checkpoint, REPO)
    assert commits(hub) == 0


def test_bad_repo_id_no_token_unreachable_hub(hub, checkpoint, monkeypatch, tmp_path, closed_port_url):
    with pytest.raises(HfScaleConfigError, match="not a valid Hub repo id"):
        hf_scale.push_to_hub(checkpoint, "org/bad name!")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HfScaleConfigError, match=r"set HF_TOKEN .* or run `hf auth login`"):
        hf_scale.push_to_hub(checkpoint, REPO)
    assert hub.requests == []
    point_hub_at(closed_port_url, tmp_path / "elsewhere", monkeypatch)
    with pytest.raises(HfScaleHubError, match=f"cannot reach the Hub at {closed_port_url} \\(set by HF_ENDPOINT\\)"):
        hf_scale.push_to_hub(checkpoint, REPO, token=TOKEN)


def test_hf_scale_push_command(hub, checkpoint):
    """``python -m hf_scale.cli push`` (the installed ``hf-scale push``) in its own process,
    pointed at the local Hub by the environment the fixture set."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "hf_scale.cli", "push", str(checkpoint), REPO, "--commit-message", "from the CLI"]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{hub.url}/{REPO}/commit/{hub.repos[REPO].branches['main']}"
    assert_each_file_committed_once(hub, checkpoint, max_files=len(contents(checkpoint)))
    assert {c.summary for c in hub.commits} == {"from the CLI"}
    assert_on_hub(hub, checkpoint)
    bad = subprocess.run([*argv[:4], str(checkpoint / "nowhere"), REPO], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("hf-scale push: error:") and "Traceback" not in bad.stderr
    assert TOKEN not in done.stdout + done.stderr + bad.stderr


def test_cli_main(hub, checkpoint, capsys):
    assert main([str(checkpoint), REPO, "--private", "--allow-pattern", "*.json"]) == 0
    assert capsys.readouterr().out.startswith(f"{hub.url}/{REPO}/commit/")
    assert main([str(checkpoint / "nowhere"), REPO]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-scale push: error:") and err.count("\n") == 1 and "Traceback" not in err
