"""Architecture coverage: every causal-LM model type of the installed transformers, trained
under fsdp, tp=2 and pp=2 at world 2 against one process of plain transformers.

Run (CPU, gloo; minutes: every model type in one world-2 process group)::

    python scripts/scan_architectures.py                      # every type, a table on stdout
    python scripts/scan_architectures.py --types llama gpt2   # some types
    python scripts/scan_architectures.py --write docs/benchmarks.md --list docs/architectures.md

Each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from its own default config
shrunk by :func:`tiny_config` (hidden 64, 2-4 layers keeping one of each per-layer kind, 4
query and 2 key/value heads, vocabulary 512, dropout off) with a fixed seed. One process runs
the reference: plain transformers, plain AdamW, ``STEPS`` steps with clipping. Two ranks run
``hf_scale.parallelize`` with each layout and the same loop (``train_step``,
``build_optimizer``, ``clip_grad_norm_``): a layout *works* when every step's loss and gradient
norm equal the reference's within ``RTOL`` (the fp32 rule of tests/distributed/test_parity.py);
a case that misses that in fp32 is run again, reference and layout both, in fp64, and works when
fp64 agrees within ``RTOL_FP64`` = 1e-6 (its verdict says "in fp64" with both differences: a
sharding bug keeps its size in fp64, rounding falls to ~1e-7 -- the loss stays fp32 -- and the
verdict lines count those cases);
it is *refused* when ``parallelize`` or the step raises an ``HfScaleError`` (the reason is its
message); anything else *fails* (an exception that is not ours, a parity mismatch, a timeout).
MoE types run as a user runs them: under tp each expert's intermediate size is split over the tp
ranks (``hf_scale.parallel.ep``); experts not called with transformers' routing stay whole.

A case that hangs is killed after ``--case-timeout`` seconds; the ranks restart with the next.
The one-process references run first: a type that fails there is *n/a* and its layouts are not
run (a pipeline whose model raises on one stage leaves the other waiting: a hang per layout).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_scale.model_plans.shrink import shrink as _shrink  # noqa: E402  (the tiny config: also the tp check's)

STEPS = 3
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 1.0
RTOL = 1e-5
RTOL_FP64 = 1e-6  # see judge: fp64 rounding falls to ~1e-7 (the loss stays fp32), a sharding bug keeps its size
PARTNER_TIMEOUT = 20.0  # seconds a rank may lag behind the other's report of the same case
BATCH, SEQ, VOCAB, RESERVED = 4, 16, 512, 32  # token ids >= VOCAB - RESERVED: special tokens only
LAYOUTS = {"fsdp": {"strategy": "fsdp"}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}

def tiny_config(model_type: str):
    """``model_type``'s default config, shrunk."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    return type(default).from_dict(_shrink(default.to_dict()))


def build(model_type: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if dtype == "float32":
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    else:  # the fp64 re-run of a parity miss (see judge); torch's grouped_mm has no fp64 kernel
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), experts_implementation="eager")
        model.to(getattr(torch, dtype))
    model.train()
    return model


def batches(model) -> list[dict]:
    import torch

    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", VOCAB))
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, max(4, vocab - RESERVED), (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def reference(model_type: str, dtype: str = "float32") -> dict:
    """One process, plain transformers and AdamW."""
    import torch

    from hf_scale.parallel.optim import parameter_groups

    start = time.perf_counter()
    model = build(model_type, dtype)
    optimizer = torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR)
    losses, norms = [], []
    for batch in batches(model):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "seconds": time.perf_counter() - start, "attention": has_attention(model)}


def has_attention(model) -> bool:
    """Whether the model has attention layers (by module names): tp's target is those types."""
    return any("attn" in name.lower() or "attention" in name.lower() for name, _ in model.named_modules())


def parallel(model_type: str, layout: str, dtype: str = "float32") -> dict:
    """This rank's run of one case: global losses and gradient norms per step."""
    import torch.distributed as dist

    import hf_scale

    model = build(model_type, dtype)
    data = batches(model)
    config = {**LAYOUTS[layout], "timeout_seconds": 120}
    model = hf_scale.parallelize(model, config)  # MoE experts: split by tp as issue 27 built it
    state = hf_scale.get_state(model)
    optimizer = hf_scale.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for batch in data:
        n = BATCH // state.dp_degree
        local = {k: v[state.dp_rank * n:(state.dp_rank + 1) * n] for k, v in batch.items()}
        loss = model.train_step(local).detach().clone()
        norms.append(float(hf_scale.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
    return {"losses": losses, "norms": norms}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"


def run_case(model_type: str, layout: str, dtype: str = "float32") -> dict:
    """This rank's outcome of one case: ``ran`` (losses, norms), ``refused`` or ``fails`` (reason)."""
    import hf_scale

    start = time.perf_counter()
    try:
        out = {"status": "ran", **parallel(model_type, layout, dtype)}
    except hf_scale.HfScaleError as e:
        out = {"status": "refused", "reason": _first_line(e)}
    except Exception as e:  # noqa: BLE001 - recorded as a failure with its traceback
        out = {"status": "fails", "reason": _first_line(e), "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = time.perf_counter() - start
    _free_groups()
    return out


def _free_groups() -> None:
    """Destroy the sub-groups the case's device mesh made (the default group stays for the next
    case): each gloo group keeps two threads and sockets, and a scan of hundreds of cases in one
    process group piled up thousands of threads (load average in the hundreds)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from hf_scale.distributed import _clear_dtensor_caches

    if not dist.is_initialized():
        return
    _clear_dtensor_caches()
    for group in [g for g in list(_world.pg_map) if g is not _world.default_pg]:
        dist.destroy_process_group(group)


def run_cases(cases: list[tuple[str, str]]) -> list[dict]:
    """Every ``(model_type, layout)`` case on this rank, in order, in one process group (the test's
    entry: :func:`tests.harness.run_ranks` runs it on two ranks)."""
    import warnings

    warnings.filterwarnings("ignore")
    return [run_case(model_type, layout) for model_type, layout in cases]


def rank_main(rank: int, world: int, port: int, cases: list, results, generation: int = 0,
              dtype: str = "float32") -> None:
    """One rank: run ``cases`` in order, reporting each."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for index, (model_type, layout) in cases:
        results.put(("case", index, (generation, rank), run_case(model_type, layout, dtype)))
    results.put(("end", None, (generation, rank), None))


def reference_main(types: list, results, dtype: str = "float32") -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for model_type in types:
        try:
            out = {"status": "ok", **reference(model_type, dtype)}
        except Exception as e:  # noqa: BLE001
            out = {"status": "fails", "reason": _first_line(e)}
        results.put(("ref", model_type, 0, out))


def run_scan(types: list[str], case_timeout: float, layouts=tuple(LAYOUTS), dtype: str = "float32",
             only: list[tuple[str, str]] | None = None) -> tuple[dict, dict]:
    """(references by type, results by (type, layout)), the ranks restarted after a hang; ``only``:
    these ``(type, layout)`` cases instead of every type under every layout."""
    from bench_common import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ref_proc = ctx.Process(target=reference_main, args=(types, results, dtype), daemon=True)
    ref_proc.start()
    cases = list(enumerate(only if only is not None else [(t, layout) for t in types for layout in layouts]))
    refs, per_rank, done = {}, {}, {}
    while len(refs) < len(set(types)) and (ref_proc.is_alive() or not results.empty()):
        try:  # the references first (a second each): a type that fails in one process is n/a
            kind, key, _, out = results.get(timeout=2)
        except queue.Empty:
            continue
        refs[key] = out
    for index, (model_type, _) in cases:  # n/a whatever a layout would do: not run (a hang there costs minutes)
        if refs.get(model_type, {}).get("status") != "ok":
            done[index] = {0: {"status": "n/a", "reason": "not run: the one-process reference fails", "seconds": 0.0}}
    pending = [c for c in cases if c[0] not in done]
    generation, retries = 0, 0
    while pending:
        port, generation = free_port(), generation + 1
        procs = [ctx.Process(target=rank_main, args=(r, 2, port, pending, results, generation, dtype), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        last = time.monotonic()
        retry = False
        ended, alone = 0, None  # alone: when one rank reported a case the other has not
        while ended < 2:
            try:
                kind, key, rank, out = results.get(timeout=2)
            except queue.Empty:
                now = time.monotonic()
                if now - last > case_timeout or (alone and now - alone > PARTNER_TIMEOUT) \
                        or not any(p.is_alive() for p in procs):
                    break
                continue
            if kind == "ref":
                refs[key] = out
                continue
            if rank[0] != generation or key in done:  # a killed group's last words
                continue
            rank = rank[1]
            if kind == "end":
                ended += 1
                continue
            last = time.monotonic()
            if "EADDRINUSE" in out.get("reason", "") and retries < 5:  # the port was taken: start again
                retries, retry = retries + 1, True
                break
            per_rank.setdefault(key, {})[rank] = out
            alone = last if len(per_rank[key]) == 1 else None
            if len(per_rank[key]) == 2:
                done[key] = per_rank[key]
                print(f"  {cases[key][1][0]:<28} {cases[key][1][1]:<5} {out['status']:<8} "
                      f"{out.get('reason', '')[:100]}", flush=True)
        for p in procs:
            p.kill() if p.is_alive() else None
            p.join()
        remaining = [c for c in pending if c[0] not in done]
        for c in remaining:
            per_rank.pop(c[0], None)
        if remaining and ended < 2 and not retry:  # the first case not done by both ranks hung (or killed them)
            index = remaining[0][0]
            got = per_rank.get(index, {})
            reason = next((o.get("reason") for o in got.values() if o.get("reason")), None)
            done[index] = {0: {"status": "fails", "reason": (f"one rank raised, the other hung: {reason}" if reason else
                               f"timeout after {case_timeout:.0f}s (a hung collective)"), "seconds": case_timeout}}
            print(f"  {cases[index][1][0]:<28} {cases[index][1][1]:<5} fails    {done[index][0]['reason']}", flush=True)
            remaining = remaining[1:]
        pending = remaining
    while len(refs) < len(types):
        kind, key, _, out = results.get(timeout=600)
        if kind == "ref":
            refs[key] = out
    ref_proc.join()
    return refs, {cases[i][1]: v for i, v in done.items()}


def judge(ref: dict, ranks: dict, ref64: dict | None = None, ranks64: dict | None = None) -> tuple[str, str]:
    """(``works`` / ``refused`` / ``fails`` / ``n/a``, reason) for one case. A parity miss in fp32
    re-run in fp64 (``ref64``, ``ranks64``) works when fp64 agrees within ``RTOL_FP64``: the fp32
    difference was rounding (the reason says so, with both differences). transformers computes
    the loss in fp32 even for an fp64 model (``logits.float()``), so fp64 runs keep ~1e-7 of fp32
    rounding there; a sharding bug keeps its fp32 size in fp64 (measured: Apertus' partial
    xIELU gradients, 2.7e-5 in both; RemBERT's rounding, 1.2e-5 -> 1.4e-7)."""
    status, reason = _judge(ref, ranks, RTOL)
    if status == "fails" and reason.startswith("parity: max") and ref64 is not None and ranks64:
        status64, reason64 = _judge(ref64, ranks64, RTOL_FP64)
        fp32 = reason.split("difference ")[1].split(" ")[0]
        if status64 == "works":
            return "works", f"in fp64 (fp32 differs by {fp32}, fp64 by {reason64}: rounding)"
        return "fails", f"{reason}; in fp64: {reason64 or status64}"
    return status, reason


def _judge(ref: dict, ranks: dict, rtol: float) -> tuple[str, str]:
    if ref.get("status") != "ok":
        return "n/a", f"one process: {ref.get('reason', '')}"
    outs = list(ranks.values())
    statuses = {o["status"] for o in outs}
    if statuses == {"refused"}:
        return "refused", outs[0]["reason"]
    bad = [o for o in outs if o["status"] != "ran"]
    if bad:
        return "fails", bad[0]["reason"]
    want = ref["losses"] + ref["norms"]
    diff = 0.0
    for out in outs:  # every rank: a rank that diverges alone is a failure too
        got = out["losses"] + out["norms"]
        if len(got) != len(want) or not all(math.isfinite(v) for v in got):
            return "fails", f"parity: {len(out['losses'])} steps with losses {out['losses']} (want {len(ref['losses'])}, finite)"
        for a, b in zip(got, want):
            diff = max(diff, abs(a - b) / max(abs(b), 1e-12))
    if diff > rtol:
        return "fails", f"parity: max relative difference {diff:.1e} of losses / grad norms (> {rtol:g})"
    return "works", "" if rtol == RTOL else f"{diff:.0e}"


SSM_WORDS = ("mamba", "rwkv", "xlstm", "recurrent", "ssm")


def totals(rows: list[dict], layouts, refs: dict) -> dict:
    out = {}
    for layout in layouts:
        built = [r for r in rows if r[layout][0] != "n/a"]
        count = {s: sum(r[layout][0] == s for r in built) for s in ("works", "refused", "fails")}
        tracebacks = sum(r[layout][0] == "fails" and not r[layout][1].startswith(("parity", "HfScale")) for r in built)
        attention = [r for r in built if refs[r["type"]].get("attention")]
        count["fp64"] = sum(r[layout][0] == "works" and r[layout][1].startswith("in fp64") for r in built)
        out[layout] = {"built": len(built), **count, "tracebacks": tracebacks, "attention": len(attention),
                       "attention_works": sum(r[layout][0] == "works" for r in attention)}
    return out


def main() -> None:
    from bench_common import add_write_arg, check_doc, write_doc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--case-timeout", type=float, default=90.0)
    parser.add_argument("--json", help="also write every case's result to this JSON file")
    parser.add_argument("--from-json", nargs="*", help="report runs saved with --json instead of running "
                        "(several: merged by model type, a later file's types replacing an earlier's)")
    parser.add_argument("--list", metavar="DOC", help="write the per-type page (docs/architectures.md)")
    add_write_arg(parser, "architectures")
    args = parser.parse_args()
    check_doc(args)
    if args.from_json:
        saved = merged([json.loads(Path(f).read_text()) for f in args.from_json])
        types, refs, minutes = [r["type"] for r in saved["rows"]], saved["refs"], saved.get("minutes")
        done, done64 = ({tuple(k.split("/")): {int(r): o for r, o in v.items()} for k, v in saved.get(key, {}).items()}
                        for key in ("raw", "raw64"))
        refs64 = saved.get("refs64", {})
        layouts = [lay for lay in LAYOUTS if all(lay in r for r in saved["rows"])]
        for t in types:  # a run saved before the attention flag was recorded
            if refs[t].get("status") == "ok" and "attention" not in refs[t]:
                refs[t]["attention"] = has_attention(build(t))
    else:
        types, layouts = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), args.layouts
        start = time.perf_counter()
        refs, done = run_scan(types, args.case_timeout, tuple(layouts))
        misses = [case for case, ranks in done.items()
                  if judge(refs.get(case[0], {}), ranks)[1].startswith("parity: max")]
        refs64, done64 = {}, {}
        if misses:  # each fp32 parity miss again in fp64: rounding, or a real difference?
            print(f"re-running {len(misses)} fp32 parity misses in fp64", flush=True)
            refs64, done64 = run_scan(sorted({t for t, _ in misses}), args.case_timeout, dtype="float64", only=misses)
        minutes = (time.perf_counter() - start) / 60
    if args.from_json and not done:  # saved before the raw results were: its judgements
        rows = saved["rows"]
    else:
        rows = [{"type": t, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t, "?"),
                 **{layout: judge(refs.get(t, {}), done.get((t, layout), {}), refs64.get(t), done64.get((t, layout)))
                    for layout in layouts}} for t in types]
    summary = totals(rows, layouts, refs)
    body = report(types, refs, summary, minutes)
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "refs": refs, "totals": summary, "minutes": minutes,
                                               "raw": {f"{t}/{layout}": v for (t, layout), v in done.items()},
                                               "refs64": refs64,
                                               "raw64": {f"{t}/{layout}": v for (t, layout), v in done64.items()}},
                                              indent=1, default=str))
    write_doc(args, body + "\n\nPer model type: [architectures.md](architectures.md).")
    if args.list:
        write_list(args.list, rows, layouts, body)


def merged(runs: list[dict]) -> dict:
    """Saved runs merged by model type and layout (a later run's cases replace an earlier's); their
    minutes add."""
    if len(runs) == 1:
        return runs[0]
    rows, refs, raw, refs64, raw64 = {}, {}, {}, {}, {}
    for run in runs:  # by (type, layout): a run of some layouts replaces those only
        for r in run["rows"]:
            rows[r["type"]] = {**rows.get(r["type"], {}), **r}
        refs.update(run["refs"])
        raw.update(run.get("raw", {}))
        for key in run.get("raw", {}):  # a later fp32 run of a case makes an earlier fp64 re-run stale
            raw64.pop(key, None)
        refs64.update(run.get("refs64", {}))
        raw64.update(run.get("raw64", {}))
    minutes = [run.get("minutes") for run in runs]
    return {"rows": [rows[t] for t in sorted(rows)], "refs": refs, "raw": raw, "refs64": refs64, "raw64": raw64,
            "minutes": sum(minutes) if None not in minutes else None}


def report(types: list[str], refs: dict, summary: dict, minutes: float | None) -> str:
    from bench_common import markdown_table

    built = sum(refs.get(t, {}).get("status") == "ok" for t in types)
    took = f"; {minutes:.1f} min on this machine" if minutes is not None else ""
    lines = [f"{len(types)} model types, {built} build and train in one process at the scan's size{took}."]
    header = ["layout", "types built", "works (parity)", "refused (reason)", "fails", "of which exceptions",
              "attention-based types: works"]
    table = markdown_table(header, [
        [layout, str(s["built"]), f"{s['works']} ({100 * s['works'] / max(1, s['built']):.0f}%)", str(s["refused"]),
         str(s["fails"]), str(s["tracebacks"]),
         f"{s['attention_works']} of {s['attention']} ({100 * s['attention_works'] / max(1, s['attention']):.0f}%)"]
        for layout, s in summary.items()])
    return "\n".join(lines) + "\n\n" + table + "\n\n```\n" + "\n".join(verdicts(summary)) + "\n```"


# issue 25's targets: the share of built types with parity (tp: of the attention-based types), and
# no failure that is not a parity mismatch or an hf_scale error
TARGETS = {"fsdp": ("built", "works", 0.98), "tp2": ("attention", "attention_works", 0.90),
           "pp2": ("built", "works", 0.90)}


def verdicts(summary: dict) -> list[str]:
    """One PASS / FAIL line per target (docs/benchmarks.md's summaries read them)."""
    lines = []
    for layout, (total, good, need) in TARGETS.items():
        if layout in summary:
            s = summary[layout]
            share = s[good] / max(1, s[total])
            what = "attention-based types" if total == "attention" else "types built"
            fp64 = f"; {s['fp64']} of them by an fp64 re-run of an fp32 miss" if s.get("fp64") else ""
            lines.append(f"{'PASS' if share >= need else 'FAIL'}: {layout} parity on {s[good]} of {s[total]} "
                         f"{what} = {share:.0%} (need >= {need:.0%}{fp64})")
    exceptions = {layout: s["tracebacks"] for layout, s in summary.items()}
    lines.append(f"{'PASS' if not any(exceptions.values()) else 'FAIL'}: failures that are not parity mismatches "
                 f"or HfScale errors: {', '.join(f'{k} {v}' for k, v in exceptions.items())} (need 0)")
    return lines


def write_list(path: str, rows: list[dict], layouts, body: str) -> None:
    from bench_common import command_line, machine, markdown_table

    def cell(v):
        status, reason = v
        reason = " ".join(reason.split())[:160].replace("|", "/")
        return status if not reason else f"{status}: {reason}"

    table = markdown_table(["model type", "class", *layouts], [[r["type"], r["class"], *(cell(r[l]) for l in layouts)]
                                                              for r in rows])
    Path(path).write_text(
        "# Architecture coverage\n\n"
        "Every causal-LM model type of the installed transformers, built tiny from its own default config, "
        "trained 3 AdamW steps at world 2 under each layout and compared with one process of plain "
        "transformers (losses and gradient norms within 1e-5; a case that misses that in fp32 is run again in fp64, "
        "both sides, and works when fp64 agrees within 1e-6: its verdict says *in fp64*, with both differences). "
        "*works*: parity; *refused*: hf_scale "
        "raised an error saying why; *fails*: anything else; *n/a*: the model does not train in one process "
        "at this size.\n\n"
        f"Written by `{command_line()}` on {machine()}.\n\n{body}\n\n{table}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
