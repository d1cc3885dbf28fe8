"""Running a batch through the pipeline: torch's schedules over this rank's stage modules.

:class:`Pipeline` is what ``model.train_step`` / ``model.eval_step`` call under pipeline
parallel. Per batch it splits the batch into microbatches (every rank of a pipeline holds the
same batch: the input ids go to the first stage; the input ids again, the attention mask,
position ids and the labels, as keyword arguments, to every stage: later stages run their base
forward from the ids up to their first block, the last one uses the labels), runs the
schedule, sums the gradients of a weight tied across stages (the input
embedding of the first stage and the head of the last: Megatron's embedding group), and hands
every rank the batch's loss.

The loss of a batch is the mean over all its label tokens, as in one process: the last stage
returns, per microbatch, the sum of its token losses divided by the batch's label-token count
(transformers' ``num_items_in_batch``), so the microbatch losses add up to the batch mean and
no gradient rescaling is needed (``scale_grads=False``).

torch's stages fix their activation shapes at their first batch; batches padded to other
lengths get their own stages and schedule (kept for the last few shapes; each new one costs a
shape-inference exchange and its receive buffers, logged once: pad to a few fixed lengths to
avoid it).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from ..errors import HfScaleConfigError
from ..log import log_rank0
from ..model_plans.pp import PipelineLayout

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
_KEEP_SHAPES = 8


class Pipeline:
    """This rank's stages of one pipeline, and the schedule that runs them."""

    def __init__(
        self,
        model: nn.Module,
        layout: PipelineLayout,
        stages: list[int],
        stage_modules: list[nn.Module],
        pp_group,
        device: torch.device,
        schedule: str,
        microbatches: int | None,
        tie_group,
        ties: list[tuple[str, str]],
    ) -> None:
        self.model, self.layout, self.stages = model, layout, stages
        self.stage_modules = stage_modules
        self.pp_group, self.device = pp_group, device
        self.schedule_name = schedule
        self.microbatches = microbatches or layout.num_stages
        self.tie_group, self.ties = tie_group, ties
        self._cache: OrderedDict = OrderedDict()
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        self._row_loss = None  # run_rows: the loss of a microbatch from the last stage's output
        self.holds_last = layout.num_stages - 1 in stages
        # when an FSDP stage reduces its gradients: "last" (torch's) or "each" microbatch (pp_grads.py)
        self.grad_sync = "last"

    # ------------------------------------------------------------------ public
    def train_step(self, batch: dict, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over the microbatches; gradients of ``loss_scale`` x the batch
        loss accumulate into ``.grad``. Returns the batch loss (the same on every rank)."""
        return self._run(batch, loss_scale, train=True)

    def eval_step(self, batch: dict) -> torch.Tensor:
        """The batch loss, forward only (the same on every rank)."""
        with torch.no_grad():
            return self._run(batch, 1.0, train=False)

    def run_rows(self, batch: dict, target: torch.Tensor, row_loss, loss_scale: float = 1.0,
                 train: bool = True) -> torch.Tensor:
        """A step whose loss the caller computes from the last stage's output, per microbatch:
        ``row_loss(output, target_rows)`` gets the microbatch's output (what the last stage's
        forward returns: the model's ``loss`` field, e.g. per-position log-probabilities under
        :func:`hf_scale.parallel.token_logps.token_logps_mode`) and its rows of ``target``
        (split on dim 0 as the batch is) and returns a scalar. Returns the sum of those scalars
        over the microbatches (the same on every rank); ``train``: backward of ``loss_scale`` x it."""
        self._row_loss = row_loss
        try:
            if train:
                return self._run(batch, loss_scale, train=True, target=target)
            with torch.no_grad():
                return self._run(batch, 1.0, train=False, target=target)
        finally:
            self._row_loss = None

    # ------------------------------------------------------------------ internals
    def _run(self, batch: dict, loss_scale: float, train: bool, target: torch.Tensor | None = None) -> torch.Tensor:
        ids, mask, labels = self._check(batch)
        target = labels if target is None else target.to(self.device)
        extra = {} if batch.get("position_ids") is None else {"position_ids": batch["position_ids"].to(self.device)}
        for module in self.stage_modules:  # the views copy a few modules: follow model.train()/eval()
            if module.training != self.model.training:
                module.train(self.model.training)
        count, positions = self._label_tokens(labels)
        for module in self.stage_modules:
            module.label_tokens, module.label_positions = max(count, 1), max(positions, 1)
        self._losses, self._scale = [], loss_scale
        # every stage gets the token ids too: a later stage's base forward runs from them (pp.py)
        kwargs = {"labels": labels, "input_ids": ids, **extra}
        if mask is not None:
            kwargs["attention_mask"] = mask
        schedule = self._schedule(tuple(ids.shape), train)
        if train:
            before = self._tied_grads_before()
            schedule.step(ids, target=target, return_outputs=False, **kwargs)
            self._sum_tied_grads(before)
        else:
            schedule.eval(ids, target=target, return_outputs=False, **kwargs)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.holds_last:  # the first batch of a shape also runs torch's shape inference: skip it
            loss += torch.stack([x.float() for x in self._losses[-self.microbatches:]]).sum()
        dist.all_reduce(loss, group=self.pp_group)  # one rank holds the last stage
        self._losses = []
        return loss

    @staticmethod
    def _label_tokens(labels: torch.Tensor) -> tuple[int, int]:
        """The batch's label tokens after the shift (the loss's denominator) and its labelled
        positions (the shift not applied: heads that take their own mean, pp.py)."""
        return int((labels[:, 1:] != -100).sum()), int((labels != -100).sum())

    def _check(self, batch: dict):
        """The batch's tensors on this device, after every rank of the pipeline has compared its
        batch with the others' (one all-gather): a bad batch on any rank raises on every rank."""
        problem = self._problem(batch)
        ids = labels = mask = positions = None
        if problem is None:
            ids = batch["input_ids"].to(self.device)
            labels = batch["labels"].to(self.device)
            mask = None if batch.get("attention_mask") is None else batch["attention_mask"].to(self.device)
            positions = batch.get("position_ids")
        self._check_same_batch(ids, mask, labels, positions, problem)
        return ids, mask, labels

    def _problem(self, batch) -> str | None:
        if not isinstance(batch, dict) or batch.get("input_ids") is None:
            return "train_step/eval_step need a batch dict with 'input_ids' (and 'labels')."
        if batch.get("labels") is None:
            return ("train_step/eval_step under pipeline parallel need 'labels' in the batch: the last "
                    "stage computes the loss. For causal LM training, labels = input_ids (pads -100).")
        unknown = sorted(set(batch) - {"input_ids", "attention_mask", "position_ids", "labels"})
        if unknown:
            return (f"batch keys {unknown} are not supported under pipeline parallel (the stages "
                    "receive input_ids, attention_mask, position_ids and labels): drop them.")
        size = batch["input_ids"].shape[0]
        if size % self.microbatches:
            return (f"a batch of {size} sequences does not split into pp_microbatches="
                    f"{self.microbatches} equal microbatches: make the per-rank batch size a multiple "
                    f"of {self.microbatches}, or set pp_microbatches to a divisor of {size}.")
        return None

    def _check_same_batch(self, ids, mask, labels, positions, problem) -> None:
        """Every rank of a pipeline must pass the same batch (the first stage reads its input ids,
        the last its labels): a script that splits data by global rank, as for DDP, would train
        on mismatched labels, or hang in shape inference. One small all-gather per step compares
        shapes and sums (and carries any rank's bad-batch flag), so every rank raises the same
        error instead of some waiting for the others."""
        if problem is not None:
            mine = torch.zeros(8, dtype=torch.float64, device=self.device)
            mine[0] = 1
        else:
            mine = torch.tensor([0, ids.shape[0], ids.shape[-1], ids.dim(), int(ids.sum()), int(labels.sum()),
                                 -1 if mask is None else int(mask.sum()),
                                 -1 if positions is None else int(positions.sum())],
                                dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.pp_group))]
        dist.all_gather(every, mine, group=self.pp_group)
        if any(e[0] for e in every):  # some rank's batch is bad: every rank says what
            said = [None] * len(every)
            dist.all_gather_object(said, problem, group=self.pp_group)
            first = next((p, r) for r, p in enumerate(said) if p is not None)
            raise HfScaleConfigError(problem if problem is not None else f"pipeline rank {first[1]}: {first[0]}")
        if any(not torch.equal(e, every[0]) for e in every):
            shapes = ", ".join(f"{int(e[1])}x{int(e[2])}" for e in every)
            raise HfScaleConfigError(
                "the ranks of one pipeline passed different batches to train_step/eval_step (shapes "
                f"{shapes}, or different token ids / labels / masks / positions): every pp rank of a "
                "data-parallel replica must pass the same batch. Split data by the data-parallel rank "
                "(hf_scale.get_state(model).dp_rank / dp_degree), not by the global rank."
            )

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._row_loss is not None:
            output = self._row_loss(output, target)
        self._losses.append(output.detach())
        return output * self._scale

    def _schedule(self, shape: tuple, train: bool):
        key = (shape, train)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        built = [
            PipelineStage(module, stage, self.layout.num_stages, self.device, group=self.pp_group)
            for stage, module in zip(self.stages, self.stage_modules)
        ]
        cls = getattr(pipelining.schedules, SCHEDULES[self.schedule_name])
        single = len(built) == 1 and self.schedule_name in ("gpipe", "1f1b")
        schedule = cls(built[0] if single else built, n_microbatches=self.microbatches,
                       loss_fn=self._loss_fn, scale_grads=False)
        if not train and self.schedule_name == "zbv":
            # torch 2.13's V schedule runs its backward actions in eval() too (and fails): give
            # it a forward-only order, each rank's stages in turn; torch adds the sends/receives.
            try:
                schedule.pipeline_order_with_comms = _forward_only(self.layout, self.microbatches)
            except (ImportError, TypeError) as e:  # torch's private lowering helpers moved
                raise HfScaleConfigError(
                    f"eval_step under pp_schedule='zbv' uses torch {torch.__version__}'s schedule "
                    f"internals, which changed ({e}): evaluate with another pp_schedule."
                ) from None
        self._cache[key] = schedule
        if len(self._cache) > 1:
            log_rank0("pipeline: a batch of a new shape builds new stages (torch fixes activation "
                      "shapes at the first batch): pad batches to a few fixed lengths to avoid it",
                      once=True)
        if len(self._cache) > _KEEP_SHAPES:
            self._cache.popitem(last=False)
        return schedule

    def _tied_ends(self) -> list[list[torch.Tensor]]:
        """Per tie across stages, the end(s) this rank holds (one, or both on a V rank)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        ends = []
        for target, source in self.ties:
            held = [p for p in (params.get(target), params.get(source)) if p is not None]
            if any(not p.requires_grad for p in held):  # a frozen tie (a LoRA run's embedding): no gradient
                continue
            if held and not (len(held) == 2 and held[0] is held[1]):
                ends.append(held)
        return ends

    def _tied_grads_before(self) -> list[list[torch.Tensor | None]]:
        """The tied ends' gradients before this step (accumulated by earlier train_steps)."""
        return [[None if p.grad is None else _grad_like_param(p).clone() for p in held]
                for held in self._tied_ends()]

    def _sum_tied_grads(self, before: list[list[torch.Tensor | None]]) -> None:
        """A weight tied across stages (input embedding, head) gets the sum of both ends'
        gradients of this step on both ends, so both copies take the same optimizer step. Only
        this step's increment is summed: gradients accumulated by earlier train_steps were
        summed then (gradient accumulation calls train_step several times per optimizer step)."""
        for held, prev in zip(self._tied_ends(), before):
            grads = [_grad_like_param(p) for p in held]
            deltas = [g if b is None else g - b for g, b in zip(grads, prev)]
            total = deltas[0] + deltas[1] if len(deltas) == 2 else deltas[0]
            if len(deltas) == 1:
                dist.all_reduce(total, group=self.tie_group)
            for grad, b in zip(grads, prev):
                grad.copy_(total if b is None else b + total)


def _grad_like_param(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient as a local tensor laid out as the parameter (a tensor-parallel
    embedding's gradient may come back replicated, the head's sharded: one layout to sum)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    placements = getattr(param, "placements", None)
    if placements is not None and grad.placements != placements:
        grad = param.grad = grad.redistribute(param.device_mesh, placements)
    return _local(grad)


def _forward_only(layout: PipelineLayout, microbatches: int) -> dict:
    """Each rank's forwards, its stages in turn, lowered as torch lowers its own schedules
    (FSDP unshard / reshard, then sends and receives); torch's validation wants backwards."""
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
    )

    order = {
        rank: _add_unshard_reshard([
            _Action(stage, _ComputationType.FORWARD, mb)
            for stage in layout.stages_of(rank) for mb in range(microbatches)
        ])
        for rank in sorted(set(layout.stage_ranks))
    }
    return _add_send_recv(order, stage_to_rank=lambda s: layout.stage_ranks[s],
                          num_stages=layout.num_stages)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def tied_across_stages(layout: PipelineLayout, ties) -> list[tuple[str, str]]:
    """The ties whose two ends run on different stages (the embedding and the head)."""
    first = tuple(f"{n}." for n in layout.first)
    last = tuple(f"{n}." for n in layout.last)
    return [(t, s) for t, s in ties if (t.startswith(last) and s.startswith(first))
            or (t.startswith(first) and s.startswith(last))]


def tie_group(mesh, layout: PipelineLayout, pp: int):
    """Process group joining, in each pipeline, the rank of the first stage and that of the last
    (None when they are one rank: a V schedule). Every rank must call this."""
    first_rank, last_rank = layout.stage_ranks[0], layout.stage_ranks[-1]
    if first_rank == last_rank:
        return None
    if pp == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh.tolist()  # (pp, dp_replicate, dp_shard, tp) global ranks (lists: no tensor ops, which a
    pairs = [[a, b] for a, b in zip(_flat(ranks[first_rank]), _flat(ranks[last_rank]))]  # simulation fakes)
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _flat(nested) -> list[int]:
    return [x for item in nested for x in _flat(item)] if isinstance(nested, list) else [nested]
