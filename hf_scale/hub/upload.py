"""push_to_hub: upload a checkpoint folder to the Hub in a few resumable commits, from rank 0.

What goes up is the folder ``hf_scale.save_pretrained`` wrote, checked complete first (config,
every shard the index lists, every file ``checksums.sha256`` lists), or a PEFT adapter folder
``PeftModel.save_pretrained`` wrote (``adapter_config.json`` and ``adapter_model.safetensors``,
no base weights), which gets an adapter model card (``hub/card.py``) unless it already has a
card of its own: one hf_scale wrote, or one a person wrote (peft's unfilled placeholder is
replaced). It all goes through
huggingface_hub's ``HfApi`` (``create_repo``, ``create_branch``, ``preupload_lfs_files``,
``create_commit``), so ``HF_ENDPOINT``, ``HF_TOKEN`` / ``hf auth login`` and its LFS / xet transfer
apply as everywhere else.

* **Commits**: at most ``max_files_per_commit`` files and ``max_bytes_per_commit`` bytes each,
  shards first and ``config.json`` / the shard index / ``adapter_config.json`` last, so until the
  last commit lands the repo never looks like a loadable model with shards missing.
* **Resumable**: the remote tree is listed first; files already there with the same content (LFS
  sha256, from ``checksums.sha256`` when listed, or git blob id) are skipped, and LFS blobs an
  interrupted push uploaded but did not commit are not sent again (the LFS batch API reports them
  present). Pushing again after any failure sends only what is missing.
* **No stale weights**: weight files on the branch that the folder does not have (another
  sharding, an older run) are deleted in the last commit, so no loader picks them up.
* **Checked**: each shard's sha256, computed for the upload anyway, must match
  ``checksums.sha256`` before the commit that adds it.
* **Retries**: huggingface_hub retries preupload, LFS and listing calls on 5xx / 429 / dropped
  connections; repo creation and the commit POST it does not, so each step here is retried
  ``retries`` times with exponential backoff, and a retried commit first re-lists the remote so a
  commit whose answer was lost is not made twice.
* **Distributed**: under ``torch.distributed`` only rank 0 talks to the Hub; the other ranks wait
  in a broadcast (mind the process group timeout for very large uploads) and return the same URL
  or raise the same error.
* **Token**: never logged and never part of an error message.

Usage::

    url = push_to_hub("out/", "my-org/my-finetune", private=True, card={"base_model": "gpt2"})
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, RepoFile, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import filter_repo_objects, validate_repo_id

from ..checkpoint.files import CHECKSUMS_FILE, read_checksums, sha256_file
from ..checkpoint.load import weight_map_of
from ..checkpoint.shard_layout import INDEX_FILE
from ..errors import HfScaleCheckpointError, HfScaleConfigError, HfScaleError, HfScaleHubError
from ..log import log_rank0
from ..ranks import rank_world
from .adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_adapter,
    is_peft_placeholder,
    read_adapter_config,
)
from .card import CardInfo, as_card_info, validate_card, write_model_card
from .failures import hub_errors, is_transient, mask, resolve_token

T = TypeVar("T")
MAX_FILES_PER_COMMIT = 100
MAX_BYTES_PER_COMMIT = 50 * 2**30
RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
LAST_FILES = ("config.json", INDEX_FILE, ADAPTER_CONFIG)  # committed last: they make the repo loadable
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
LOSS_CURVE = "loss_curve.png"  # the image a fine-tuning run saves beside its weights (train.metrics.LOSS_CURVE)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    allow_patterns: str | Sequence[str] | None = None,
    card: CardInfo | Mapping[str, Any] | None = None,
    commit_message: str | None = None,
    max_files_per_commit: int = MAX_FILES_PER_COMMIT,
    max_bytes_per_commit: int = MAX_BYTES_PER_COMMIT,
    retries: int = 3,
) -> str:
    """Upload checkpoint ``folder`` to Hub repo ``repo_id``; return the URL of the last commit.

    Call it on every rank (or in one process): rank 0 creates the repo (``private`` applies
    to a new repo; an existing public repo is refused when ``private=True``), the branch
    ``revision`` when it is new, writes ``README.md`` from ``card`` when given (for a PEFT
    adapter folder also without ``card``, unless the folder has a card of its own: see
    :func:`adapter_card_needed`), and commits what the Hub does not have yet
    (``allow_patterns``: only matching files). ``token`` defaults to
    ``HF_TOKEN`` / the ``hf auth login`` cache; the Hub is ``HF_ENDPOINT``'s.

    Raises HfScaleCheckpointError (incomplete folder), HfScaleConfigError (bad repo id, no token,
    offline mode) or HfScaleHubError (the Hub refused or failed), on every rank.

    Usage::

        hf_scale.save_pretrained(model, "out/", tokenizer=tok)
        hf_scale.push_to_hub("out/", "my-org/my-finetune", private=True, card=card_info)
    """
    push = _Push(
        folder=Path(folder), repo_id=repo_id, branch=revision or "main", private=private,
        token=token, allow_patterns=allow_patterns, card=card, commit_message=commit_message,
        max_files=max_files_per_commit, max_bytes=max_bytes_per_commit, retries=retries,
    )
    return run_on_rank0(push.run, secret=token or get_token())


def run_on_rank0(fn: Callable[[], T], secret: str | None = None) -> T:
    """``fn()`` on rank 0 only; every rank returns its result or raises its error.

    Without a process group it is just ``fn()``. Errors other than HfScaleError reach the other
    ranks as HfScaleHubError naming the original type (``secret`` masked in the message).
    """
    import torch.distributed as dist

    rank, world = rank_world()
    if world == 1:
        return fn()
    outcome: list[Any] = [None]
    error = None
    if rank == 0:
        try:
            outcome[0] = ("ok", fn())
        except HfScaleError as e:
            error, outcome[0] = e, ("error", type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait forever
            message = mask(f"rank 0 failed: {type(e).__name__}: {e}", secret)
            error, outcome[0] = e, ("error", "HfScaleHubError", message)
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    kind, *rest = outcome[0]
    if kind == "ok":
        return rest[0]
    errors = {c.__name__: c for c in (HfScaleConfigError, HfScaleCheckpointError, HfScaleHubError)}
    raise errors.get(rest[0], HfScaleHubError)(rest[1])


@dataclasses.dataclass
class _Push:
    """One push: the arguments of :func:`push_to_hub`, then the API client and remote state."""

    folder: Path
    repo_id: str
    branch: str
    private: bool
    token: str | None
    allow_patterns: str | Sequence[str] | None
    card: Any
    commit_message: str | None
    max_files: int
    max_bytes: int
    retries: int
    api: Any = dataclasses.field(init=False, default=None)
    checksums: dict[str, str] = dataclasses.field(init=False, default_factory=dict)

    def run(self) -> str:
        self.check_arguments()
        check_checkpoint(self.folder)
        if self.card is not None:
            info = as_card_info(self.card)
            write_model_card(self.folder, dataclasses.replace(info, repo_id=info.repo_id or self.repo_id))
        elif adapter_card_needed(self.folder):
            loss_curve = LOSS_CURVE if (self.folder / LOSS_CURVE).is_file() else None
            write_model_card(self.folder, CardInfo(repo_id=self.repo_id, loss_curve=loss_curve))
            log_rank0(f"wrote the adapter's model card {self.folder / 'README.md'}")
        files = local_files(self.folder, self.allow_patterns)
        self.token = resolve_token(self.token)
        self.api = HfApi(token=self.token)
        self.checksums = read_checksums(self.folder)
        with hub_errors(self.api.endpoint, self.repo_id, self.token):
            if "README.md" in files:  # the Hub's validator, before any byte is uploaded
                validate_card(files["README.md"], self.api.endpoint)
            self.retrying(self.prepare_repo, "creating the repo")
            remote = self.remote_files()
            stale = stale_weights(remote, local_files(self.folder, None), self.allow_patterns)
            groups = commit_groups(self.missing(files, remote), self.max_files, self.max_bytes)
            groups = groups or ([{}] if stale else [])
            url = None
            for i, group in enumerate(groups):
                message = self.commit_message or f"Upload {self.folder.resolve().name} with hf_scale"
                message += f" (part {i + 1}/{len(groups)})" if len(groups) > 1 else ""
                deletes = stale if i == len(groups) - 1 else []
                url = self.retrying(functools.partial(self.commit, group, deletes, message), "commit")
            url = url or self.head_url()
        sent = sum(len(g) for g in groups)
        log_rank0(f"pushed {sent} of {len(files)} files ({len(files) - sent} already on the Hub), "
                  f"removed {len(stale)} stale weight files, in {len(groups)} commits: {url}")
        return url

    def check_arguments(self) -> None:
        try:
            validate_repo_id(self.repo_id)
        except HFValidationError as e:
            raise HfScaleConfigError(
                f"repo_id={self.repo_id!r} is not a valid Hub repo id: {e} "
                "Use 'namespace/name', e.g. 'my-org/my-finetune'."
            ) from None
        if re.fullmatch(r"[0-9a-f]{40}", self.branch):
            raise HfScaleConfigError(f"revision={self.branch!r} is a commit: pass a branch name.")
        for name in ("max_files", "max_bytes"):
            if getattr(self, name) < 1:
                raise HfScaleConfigError(f"{name}_per_commit={getattr(self, name)}: must be >= 1.")

    def prepare_repo(self, attempt: int = 0) -> None:
        self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        if self.private and not self.api.repo_info(self.repo_id).private:
            raise HfScaleHubError(
                f"{self.repo_id} already exists and is public, and private=True was asked: nothing "
                "was uploaded. Make it private on the Hub first, or push with private=False."
            )
        if self.branch != "main":
            self.api.create_branch(self.repo_id, branch=self.branch, exist_ok=True)

    def remote_files(self) -> dict[str, RepoFile]:
        tree = self.api.list_repo_tree(self.repo_id, recursive=True, revision=self.branch)
        return {f.path: f for f in tree if isinstance(f, RepoFile)}

    def missing(self, files: dict[str, Path], remote: dict[str, RepoFile]) -> dict[str, Path]:
        """The files of ``files`` whose content is not at their path in ``remote``."""
        return {p: path for p, path in files.items() if not self.on_hub(path, remote.get(p), p)}

    def on_hub(self, path: Path, remote: RepoFile | None, name: str) -> bool:
        if remote is None or remote.size != path.stat().st_size:
            return False
        if remote.lfs is not None:
            return remote.lfs.sha256 == (self.checksums.get(name) or sha256_file(path))
        return remote.blob_id == git_blob_id(path.read_bytes())

    def commit(self, group: dict[str, Path], deletes: list[str], message: str, attempt: int = 0) -> str:
        """Upload ``group``'s LFS blobs, check them against checksums.sha256, commit them and
        the deletion of ``deletes``."""
        if attempt > 0:  # a lost answer may hide a commit that landed
            remote = self.remote_files()
            group, deletes = self.missing(group, remote), [p for p in deletes if p in remote]
            if not group and not deletes:
                return self.head_url()
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(path)) for p, path in group.items()]
        self.api.preupload_lfs_files(self.repo_id, additions=ops, revision=self.branch, free_memory=False)
        for op in ops:
            expected = self.checksums.get(op.path_in_repo)
            if expected and op.upload_info.sha256.hex() != expected:
                raise HfScaleCheckpointError(
                    f"{op.path_in_repo} does not match its sha256 in {self.folder / CHECKSUMS_FILE}: "
                    "it changed or is corrupt since it was saved. Save the checkpoint again."
                )
        ops += [CommitOperationDelete(path_in_repo=p) for p in deletes]
        return self.api.create_commit(self.repo_id, ops, commit_message=message, revision=self.branch).commit_url

    def head_url(self) -> str:
        sha = self.api.repo_info(self.repo_id, revision=self.branch).sha
        return f"{self.api.endpoint}/{self.repo_id}/commit/{sha}"

    def retrying(self, step: Callable[[int], T], what: str) -> T:
        """``step(attempt)``, retried on 5xx / 429 / dropped connections with backoff."""
        for attempt in range(self.retries + 1):
            try:
                return step(attempt)
            except Exception as e:
                if attempt >= self.retries or not is_transient(e):
                    raise
                wait = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2**attempt)
                reason = mask(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", self.token)
                log_rank0(f"{what} for {self.repo_id} failed ({reason}); retry {attempt + 1}/"
                          f"{self.retries} in {wait:.0f} s", level=logging.WARNING)
                time.sleep(wait)
        raise AssertionError("unreachable")


def check_checkpoint(folder: Path) -> None:
    """Raise HfScaleCheckpointError unless ``folder`` holds a complete Hub-format checkpoint or
    a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    if not folder.is_dir():
        raise HfScaleCheckpointError(f"{folder} is not a folder: pass the folder hf_scale.save_pretrained wrote.")
    if (folder / ADAPTER_CONFIG).is_file():
        check_adapter(folder)
    elif not (folder / "config.json").is_file():
        raise HfScaleCheckpointError(
            f"{folder} has no config.json, so it is not a complete checkpoint, and no {ADAPTER_CONFIG}, "
            f"so it is not a PEFT adapter: push the folder hf_scale.save_pretrained(model, folder) wrote "
            f"(config.json and safetensors shards) or the one PeftModel.save_pretrained(folder) wrote "
            f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})."
        )
    else:
        weight_map_of(folder)  # the index and every shard it lists
    for name in read_checksums(folder):
        if not (folder / name).is_file():
            raise HfScaleCheckpointError(f"{name}, listed in {CHECKSUMS_FILE}, is missing from {folder}.")


def adapter_card_needed(folder: Path) -> bool:
    """Whether pushing ``folder`` without ``card=`` should write its card: yes for a PEFT adapter
    folder without ``README.md`` or with the placeholder card peft writes; a card hf_scale or a
    person wrote is kept (and said so)."""
    if read_adapter_config(folder) is None:
        return False
    readme = folder / "README.md"
    if readme.is_file() and not is_peft_placeholder(readme):
        log_rank0(f"pushing the adapter with its own {readme} (for hf_scale's adapter card instead, "
                  "delete it or pass card= to push_to_hub)")
        return False
    return True


def local_files(folder: Path, allow_patterns: str | Sequence[str] | None) -> dict[str, Path]:
    """``{path in repo: local path}`` of the files to push (hidden files and folders left out)."""
    found = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    found = {k: p for k, p in found.items() if not any(part.startswith(".") for part in k.split("/"))}
    kept = set(filter_repo_objects(found, allow_patterns=allow_patterns))
    if not kept:
        raise HfScaleConfigError(f"allow_patterns={allow_patterns!r} match no file in {folder} "
                                 f"(it holds {', '.join(found)}).")
    return {k: p for k, p in found.items() if k in kept}


def stale_weights(
    remote: Mapping[str, Any], local: Mapping[str, Path], allow_patterns: str | Sequence[str] | None
) -> list[str]:
    """Weight files on the Hub that the folder no longer has (another sharding, an older run):
    left there, a loader could read them instead of the new weights."""
    weights = [p for p in remote if p not in local and p.endswith(WEIGHT_SUFFIXES)]
    return list(filter_repo_objects(weights, allow_patterns=allow_patterns))


def commit_groups(files: dict[str, Path], max_files: int, max_bytes: int) -> list[dict[str, Path]]:
    """Split ``files`` into commits of at most ``max_files`` files and ``max_bytes`` bytes (a
    larger file goes alone), shards first and :data:`LAST_FILES` last."""
    def order(name: str) -> tuple:
        return (0 if name.endswith(".safetensors") else 2 if name in LAST_FILES else 1, name)

    groups: list[dict[str, Path]] = []
    current: dict[str, Path] = {}
    size = 0
    for name in sorted(files, key=order):
        nbytes = files[name].stat().st_size
        if current and (len(current) >= max_files or size + nbytes > max_bytes):
            groups.append(current)
            current, size = {}, 0
        current[name] = files[name]
        size += nbytes
    return groups + [current] if current else groups


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's content (what the Hub reports for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
