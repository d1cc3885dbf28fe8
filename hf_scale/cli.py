"""``hf-scale``: the command line.

    hf-scale finetune configs/quickstart.yaml [--section.field value ...] [--resume latest]
    hf-scale plan configs/llama3-8b-fsdp.yaml        # or a Hub id, a folder, a config.json; --tp N, --ep N, --pp N
    hf-scale generate zoo:smollm2 --tp 3 --prompt "What is 12 + 30?" [--max-new-tokens 32 --dtype bf16]
    hf-scale export ckpt/latest out/
    hf-scale push out/ org/my-finetune [--private]

``finetune`` starts its own workers with torchrun (``launch.nproc_per_node``, ``launch.nnodes``
and the rendezvous options in the recipe, or ``--nproc-per-node`` / ``--nnodes`` /
``--rdzv-endpoint`` flags), and runs in-process when it already is a torchrun worker;
``generate`` starts ``--tp`` workers, each loading its slice of the model (``hf_scale.generate``).
Errors in configs and inputs print one line and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping

from .errors import HfScaleConfigError, HfScaleError
from .strict_args import ArgumentParser, unknown_argument

COMMANDS = ("finetune", "plan", "generate", "export", "push")
LAUNCH_FLAGS = {  # flag -> the config field it sets
    "--nproc-per-node": "launch.nproc_per_node", "--nproc_per_node": "launch.nproc_per_node",
    "--nnodes": "launch.nnodes", "--node-rank": "launch.node_rank",
    "--rdzv-endpoint": "launch.rdzv_endpoint", "--max-restarts": "launch.max_restarts",
    "--resume": "checkpoint.resume",
}


def main(argv: list[str] | None = None, *, task: str | None = None) -> int:
    """Entry point of the ``hf-scale`` console script; returns the exit status.

    ``task`` (from the task scripts) makes ``finetune`` refuse a recipe for another task.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    command, rest = argv[0], argv[1:]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if command == "finetune":
            return finetune(rest, task=task)
        return {"plan": plan, "generate": generate, "export": export, "push": push}[command](rest)
    except HfScaleError as e:
        say_error(command, e)
        return 2
    except Exception:
        from .torchrun import peer_filed_error

        if peer_filed_error():  # a worker failing because another rank stopped on bad input: said there
            return 2
        raise


def say_error(command: str, error: HfScaleError) -> None:
    """The one line of a clear error: printed, or in a torchrun worker given to the launcher,
    which prints it once for all ranks (:mod:`hf_scale.torchrun`)."""
    from .torchrun import error_line, file_error

    if not file_error(error_line(command, error)):
        print(error_line(command, error), file=sys.stderr)


def usage() -> str:
    """The module docstring's command lines and their explanation."""
    _, commands, explanation, *_ = __doc__.split("\n\n")
    return "usage:\n" + commands.rstrip() + "\n\n" + explanation.replace("``", "`")


def is_override(arg: str) -> bool:
    """True for a ``--section.field`` (or ``--section.field=value``) recipe override."""
    flag = arg.partition("=")[0]
    return flag.startswith("--") and "." in flag


def take_overrides(args: list[str], flags: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(the other arguments, the recipe overrides with their values), in one pass.

    Overrides are ``--section.field value`` (or ``--section.field=value``), kept as written, and
    each flag of ``flags`` (flag -> the field it sets) turned into one: ``--resume latest``
    becomes ``--checkpoint.resume latest``. A value is the next argument, even one that starts
    with '-' (``-1``); a flag of ``flags`` without one is an error (an override without one is
    reported by the recipe loader, naming the field).
    """
    flags = flags or {}
    rest, overrides, args = [], [], list(args)
    while args:
        arg = args.pop(0)
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if not eq:
                if not args:
                    raise HfScaleConfigError(f"flag {flag} has no value.")
                value = args.pop(0)
            overrides += [f"--{flags[flag]}", value]
        elif is_override(arg):
            overrides.append(arg)
            if not eq and args:
                overrides.append(args.pop(0))
        else:
            rest.append(arg)
    return rest, overrides


def split_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """(the recipe path, ``--section.field value`` overrides), launch flags translated.

    The recipe is the first argument (or ``--config PATH``); ``--nproc-per-node 4`` becomes
    ``--launch.nproc_per_node 4`` and ``--resume latest`` ``--checkpoint.resume latest``.
    Any other argument is an error naming the closest flag.
    """
    rest, overrides = take_overrides(args, LAUNCH_FLAGS)
    parser = ArgumentParser(prog="hf-scale finetune", add_help=False)
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--config")
    ns, extras = parser.parse_known_args(rest)
    if extras or (ns.recipe and ns.config):
        known = ["--config", *(f for f in LAUNCH_FLAGS if "_" not in f)]
        extra = extras[0] if extras else ns.recipe
        raise unknown_argument(extra, known, "hf-scale finetune", ", and --section.field value overrides")
    return ns.config or ns.recipe, overrides


def finetune(args: list[str], task: str | None = None) -> int:
    """Load the recipe, then train here (torchrun worker, one process) or launch torchrun."""
    from .config import AUTO
    from .launch import check_launch, resolve_launch, torchrun_argv, under_torchrun
    from .mesh import ParallelDims
    from .train.config import load_job

    if any(a in ("-h", "--help") for a in args):
        print(usage())
        return 0
    config, overrides = split_overrides(args)
    if config is None:
        raise HfScaleConfigError("finetune needs a recipe: hf-scale finetune configs/quickstart.yaml")
    job = load_job(config, overrides)
    job.launch = resolve_launch(job.launch)  # nodes, node rank, rendezvous from SLURM under srun
    if task is not None and job.model.task != task:
        raise HfScaleConfigError(
            f"{config} trains model.task={job.model.task!r}, but this script is for {task!r}: "
            "use the script of that task, or hf-scale finetune."
        )
    if under_torchrun() or job.launch.nproc_per_node * job.launch.nnodes == 1:
        if not under_torchrun():
            check_launch(job.launch)
        _train(job)
        return 0
    if job.parallel.strategy != AUTO:  # the degrees against the processes, before any starts
        ParallelDims.resolve(job.parallel, job.launch.nproc_per_node * job.launch.nnodes, job.launch.nnodes)
        _check_tp_before_launch(job)
    argv = torchrun_argv(job.launch, ["-m", "hf_scale.cli", "finetune", *args])
    print(f"[hf_scale] launching: torchrun {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(argv)
    except KeyboardInterrupt:  # Ctrl-C reached torchrun and its workers too: they stop
        return 130


def _check_tp_before_launch(job) -> None:
    """A tensor-parallel degree the model's heads do not split, refused before torchrun starts
    (SmolLM2's 9 heads at tp=2, what users try first), from the config alone: only for a local
    folder or a zoo model (a Hub id would cost a download here; its workers say the same)."""
    from pathlib import Path

    from .model_plans.tp import check_tp_sizes
    from .train.model import read_model_config
    from .zoo import is_zoo

    tp, name = job.parallel.tp, job.model.name_or_path
    if not isinstance(tp, int) or tp <= 1 or not (is_zoo(name) or Path(name).exists()):
        return
    config = read_model_config(job.model)
    check_tp_sizes(config, tp, (getattr(config, "architectures", None) or [type(config).__name__])[0])


def _train(job) -> None:
    from .distributed import shutdown_distributed
    from .torchrun import filing_errors
    from .train.loop import run

    try:
        with filing_errors("finetune"):
            run(job)
    finally:
        shutdown_distributed()


def plan(args: list[str]) -> int:
    """Print the resolved plan and mesh for a recipe, a Hub id, a folder or a config.json."""
    from .config import PP_SCHEDULES, ParallelConfig, from_dict
    from .layout_preview import plan_report
    from .train.config import ModelConfig, load_job
    from .train.model import read_model_config

    parser = ArgumentParser(prog="hf-scale plan", description=plan.__doc__)
    parser.add_argument("source", help="a recipe .yaml, a Hub model id, a model folder or a config.json")
    parser.add_argument("--world-size", type=int, help="ranks to plan for (default: the recipe's launch)")
    parser.add_argument("--nnodes", type=int, help="nodes (default: the recipe's launch.nnodes, else 1)")
    parser.add_argument("--task", default=None, choices=("causal_lm", "sequence_classification", "reward"))
    parser.add_argument("--strategy", default=None, help="parallel strategy (default: the recipe's, else fsdp)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel degree: show the tp layout (default: the recipe's parallel.tp, else 1)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (MoE models): experts per rank, their training state and the "
                             "all-to-all volume (default: the recipe's parallel.ep, else 1)")
    parser.add_argument("--cp", type=int, default=None,
                        help="context-parallel degree: each sequence split over cp ranks (default: the recipe's "
                             "parallel.cp, else 1; the auto-planner tries it when a sequence fits no layout without)")
    parser.add_argument("--cp-exchange", default=None, choices=("allgather", "alltoall"),
                        help="context parallel's exchange: K / V all-gathered, or heads for sequence (all-to-all)")
    parser.add_argument("--pp", type=int, default=None,
                        help="pipeline-parallel degree: show the stage split and the schedule's bubble "
                             "(default: the recipe's parallel.pp, else 1)")
    parser.add_argument("--pp-schedule", default=None,
                        help=f"pipeline schedule, one of {', '.join(PP_SCHEDULES)} (default: the recipe's "
                             "parallel.pp_schedule, else 1f1b)")
    parser.add_argument("--pp-microbatches", type=int, default=None,
                        help="microbatches per batch under pp (default: the recipe's, else the number of stages)")
    parser.add_argument("--pp-grad-sync", default=None, choices=("auto", "last", "each"),
                        help="under pp with fsdp: reduce-scatter gradients after the last microbatch (torch's) or "
                             "after each (sharded through the schedule); auto (default): by fit")
    parser.add_argument("--gpus", type=int, default=None,
                        help="auto-planner: rank every layout for this many GPUs (H100 numbers) and recommend one")
    parser.add_argument("--gpu-memory", default=None,
                        help="auto-planner: memory per rank, e.g. 80GB, 80GiB or 8e10 (default 80GB; on CPU the RAM "
                             "per process)")
    parser.add_argument("--seq", type=int, default=None,
                        help="auto-planner: tokens per sequence (default: the recipe's data.max_seq_len, else 1024)")
    parser.add_argument("--batch", type=int, default=None,
                        help="auto-planner: sequences per data-parallel rank per step (default: the recipe's "
                             "train.batch_size x grad_accum, else 1)")
    parser.add_argument("--intra-gbps", type=float, default=None,
                        help="auto-planner: bus bandwidth per rank within a node, GB/s (default: NVLink 200 for "
                             "--gpus, this machine's measured gloo on CPU)")
    parser.add_argument("--inter-gbps", type=float, default=None,
                        help="auto-planner: bus bandwidth per rank between nodes, GB/s (default: InfiniBand 40)")
    parser.add_argument("--latency-us", type=float, default=None,
                        help="auto-planner: latency of one collective, microseconds (default: 10 NVLink, 20 IB)")
    parser.add_argument("--simulate", action="store_true",
                        help="run the real parallelize and a training step as the first and last rank of the world "
                             "on fake CUDA devices (no GPU needed): the peak memory by category beside the planner's "
                             "estimate, and the device of every tensor; with --gpus, of the recommended layout")
    parser.add_argument("--simulate-ranks", default=None,
                        help="with --simulate: the ranks to simulate, comma-separated (default: first and last)")
    parser.add_argument("--candidates", action="store_true",
                        help="auto-planner for this machine: the recipe's CPU processes, the RAM divided among them")
    args, overrides = take_overrides(args)
    ns = parser.parse_strict(args)
    flags = {k: v for k, v in (("strategy", ns.strategy), ("tp", ns.tp), ("ep", ns.ep), ("pp", ns.pp), ("cp", ns.cp),
                                ("cp_exchange", ns.cp_exchange),
                                ("pp_schedule", ns.pp_schedule),
                                ("pp_microbatches", ns.pp_microbatches),
                                ("pp_grad_sync", ns.pp_grad_sync)) if v is not None}
    if ns.source.endswith((".yaml", ".yml")):
        job = load_job(ns.source, overrides)
        model_cfg, parallel, launch = job.model, job.parallel, job.launch
        if flags:
            parallel = from_dict(ParallelConfig, {**vars(parallel), **flags})
            job = dataclasses.replace(job, parallel=parallel)  # the planner reads the job's
        nnodes = ns.nnodes or launch.nnodes
        given_nodes = ns.nnodes or (launch.nnodes if launch.nnodes > 1 else None)
        world = ns.world_size or launch.nproc_per_node * launch.nnodes
    else:
        if overrides:
            raise HfScaleConfigError(
                f"{overrides[0]} overrides a recipe field, but {ns.source!r} is not a recipe (.yaml): use "
                "--world-size, --nnodes, --task, --strategy, --tp, --ep, --cp, --cp-exchange, --pp, --pp-schedule, --pp-microbatches, "
                "--pp-grad-sync, or plan a "
                "recipe."
            )
        model_cfg = ModelConfig(name_or_path=ns.source, task=ns.task or "causal_lm")
        parallel = from_dict(ParallelConfig, {"strategy": "fsdp", **flags})
        nnodes, world = ns.nnodes or 1, ns.world_size or parallel.tp * parallel.pp * parallel.ep * parallel.cp
        given_nodes = ns.nnodes
    links = {k: v for k, v in (("intra_gbps", ns.intra_gbps), ("inter_gbps", ns.inter_gbps),
                               ("latency_us", ns.latency_us)) if v is not None}
    ranks = [int(r) for r in ns.simulate_ranks.split(",")] if ns.simulate_ranks else None
    if ns.simulate and ns.gpus and not parallel.auto:
        recipe = job if ns.source.endswith((".yaml", ".yml")) else None
        print(_plan_and_simulate(read_model_config(model_cfg), ns, given_nodes, links, ranks, flags, recipe))
        return 0
    if ns.simulate and not parallel.auto:  # the layout of the flags (or the recipe), as planned below
        from .layout_search import Workload, model_facts, parse_memory
        from .layout_search.choose import fitting_grad_sync
        from .layout_search.simulate import as_layout, format_simulations, simulate_ranks

        config, task = read_model_config(model_cfg), ns.task or model_cfg.task
        recipe = job if ns.source.endswith((".yaml", ".yml")) else None
        print(_report_text(plan_report(config, parallel, world, nnodes, task), recipe, world, nnodes))
        # a LoRA recipe: the LoRA run (under model.quantize: nf4, its NF4 base), not a full fine-tune
        config, quantize = _simulated_source(config, recipe)
        batch = ns.batch or 1  # one forward of the batch per step (a pipeline splits it into its microbatches)
        held = False
        if ns.source.endswith((".yaml", ".yml")) and job.preference.enabled:  # --batch pairs: 2 rows each
            batch, held = 2 * batch, job.planner_rows()[1] > 0
        layout = as_layout(parallel, world, nnodes, micro_batch=batch)
        budget = parse_memory(ns.gpu_memory or "80GB")
        if parallel.pp_grad_sync == "auto":  # by fit, as the chooser decides it
            work = Workload(seq=ns.seq or 1024, batch=batch, device="cuda")
            layout = fitting_grad_sync(model_facts(config, task), layout, work, budget)
        print(format_simulations(simulate_ranks(config, layout, ns.seq or 1024, batch, ranks, task,
                                                local_world_size=world // nnodes if given_nodes else None,
                                                reference=held, quantize=quantize), budget))
        return 0
    if ns.gpus or ns.candidates or ns.gpu_memory or ns.seq or ns.batch or links or parallel.auto:
        from .layout_search.ranking import plan_text

        job = job if ns.source.endswith((".yaml", ".yml")) else None
        print(plan_text(read_model_config(model_cfg), job, gpus=ns.gpus, gpu_memory=ns.gpu_memory, seq=ns.seq,
                        batch=ns.batch, nodes=given_nodes, world_size=ns.world_size, task=ns.task or model_cfg.task,
                        links=links, fixed=flags))
        return 0
    report = plan_report(read_model_config(model_cfg), parallel, world, nnodes, ns.task or model_cfg.task)
    print(_report_text(report, job if ns.source.endswith((".yaml", ".yml")) else None, world, nnodes))
    return 0


def _report_text(report: dict, job, world: int, nnodes: int) -> str:
    """``hf-scale plan``'s layout report; of a LoRA / QLoRA recipe ``job``, with the run's own
    training state (and NF4 base) in place of a full fine-tune's line."""
    from .layout_preview import format_report

    if job is None or not job.peft.enabled:
        return format_report(report)
    from .layout_search.adapter_report import adapter_lines

    report["train_state_gb_per_rank"] = None
    return format_report(report) + "\n" + "\n".join(adapter_lines(job, world, nnodes))


def _simulated_source(config, job=None):
    """``(source, quantize)`` a recipe's run is planned and simulated on: a LoRA recipe's model on
    the meta device with its adapters and its ``model.quantize``; else ``config`` and None."""
    from .layout_search.ranking import recipe_source

    source, quantize = recipe_source(config, job)
    if source is not config:
        from .layout_search.frozen import meta_copy

        source = meta_copy(source)  # the adapters too on the meta device (attach_adapter makes them real)
    return source, quantize


def _plan_and_simulate(config, ns, nodes, links, ranks, fixed=None, job=None) -> str:
    """``plan --gpus N --simulate``: the candidates, then the recommended layout simulated (of a
    LoRA recipe ``job``: its LoRA run, on an NF4 base under ``model.quantize: nf4``)."""
    from .layout_search.ranking import (
        H100,
        default_nodes,
        format_candidates,
        pinned_space,
        plan_candidates,
        with_links,
    )
    from .layout_search.simulate import format_simulations, simulate_ranks

    seq, batch, task = ns.seq or 1024, ns.batch or 1, ns.task or "causal_lm"
    nodes = default_nodes(ns.gpus, nodes)
    source, quantize = _simulated_source(config, job)
    facts, best, ranked, budget, work = plan_candidates(
        source, ns.gpus, ns.gpu_memory or "80GB", seq, batch, nodes, with_links(H100, **links), task=task,
        quantize=quantize, **pinned_space(fixed, ns.gpus, nodes))
    text = format_candidates(facts, best, ranked, budget, work)
    if best is None:
        return text
    return text + "\n\n" + format_simulations(simulate_ranks(source, best.layout, seq, batch, ranks, task,
                                                             quantize=quantize), budget)


def generate(args: list[str]) -> int:
    """Generate text with a model split over ``--tp`` processes (see ``hf_scale.generate``)."""
    from .generate import main as generate_main

    return generate_main(args)


def export(args: list[str]) -> int:
    """Copy a training checkpoint's model out as a clean Hub-format folder (1..N processes), or
    with --merge write its LoRA adapter merged into the base model."""
    from .checkpoint.export import export_checkpoint
    from .distributed import init_distributed, shutdown_distributed

    parser = ArgumentParser(prog="hf-scale export", description=export.__doc__)
    parser.add_argument("checkpoint", help="a step_* folder, or <root>/latest")
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=None, help="tokenizer (name or folder) to save beside the model")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA adapter (checkpoint or adapter folder): write the base with it merged, "
                             "a plain Hub-format model (one process)")
    parser.add_argument("--base", default=None, help="with --merge: the base model (default: the adapter "
                                                     "config's base_model_name_or_path)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="with --merge: the merged model's dtype (default: the base checkpoint's)")
    parser.add_argument("--dequantize", action="store_true",
                        help="with --merge of a QLoRA adapter: merge into the base as it was trained (its NF4 "
                             "weights quantized and dequantized again) instead of the full-precision base")
    ns = parser.parse_strict(args)
    if (ns.base or ns.dtype or ns.dequantize) and not ns.merge:
        parser.error("--base, --dtype and --dequantize apply with --merge only")
    init_distributed()
    try:
        tokenizer = None
        if ns.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer)
        if ns.merge:
            import torch

            from .checkpoint.merge import adapter_folder, merge_adapter, read_base
            from .zoo import local_copy

            dtype = getattr(torch, ns.dtype) if ns.dtype else None
            base = local_copy(ns.base or read_base(adapter_folder(ns.checkpoint)))  # zoo models: their folder
            out = merge_adapter(ns.checkpoint, ns.out, base=base, dtype=dtype, tokenizer=tokenizer,
                               dequantize=ns.dequantize)
            print(f"merged into {out}")
        else:
            print(f"exported to {export_checkpoint(ns.checkpoint, ns.out, tokenizer)}")
    finally:
        shutdown_distributed()
    return 0


def push(args: list[str]) -> int:
    """Upload a saved model folder to a Hub repository (see ``hf_scale.hub``)."""
    from .hub import main as push_main

    return push_main(args)


def __getattr__(name: str):
    """``hf_scale.cli.read_model_config``, for scripts that imported it from here: it lives in
    :mod:`hf_scale.train.model` (loaded on first use, so ``hf-scale --help`` imports no torch)."""
    if name == "read_model_config":
        from .train.model import read_model_config

        return read_model_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
