"""Benchmark: hf_scale's parallel Hub-format save and slice-wise load.

Run (one machine; every measurement is its own fresh ``torchrun`` launched by the script, gloo
on CPU, OMP_NUM_THREADS=1)::

    python scripts/bench_checkpoint.py --root /tmp/bench_ck        # loads, then saves
    python scripts/bench_checkpoint.py --part load                 # loads only (2 and 4 ranks)
    python scripts/bench_checkpoint.py --part save --quick         # smoke run: (a), (b) only

Loads (printed first): ``hf_scale.from_pretrained`` against transformers'
``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W))`` at 2 and 4 ranks, on
SmolLM2-135M and on a 1.76 GB random Llama; see ``scripts/bench_checkpoint_load.py``.

Saves, on ``hf_scale.parallelize(hf_scale.zoo.load_smollm2()[0], {"strategy": "fsdp"})`` over 2
ranks: (a) disk: 1 GiB of random bytes in 64 MiB writes + fsync, in the launcher process.
(b) ``hf_scale.save_pretrained(model, dir)`` from both ranks (b2: ``checksums=False``).
(c) what users do today: ``get_model_state_dict(model, options=StateDictOptions(
    full_state_dict=True, cpu_offload=True))`` to rank 0, then ``model.save_pretrained(dir,
    state_dict=...)`` there.
(d) ``torch.distributed.checkpoint.save(get_model_state_dict(model))`` (sharded state dict).

Seconds: slowest rank, between barriers; saves are timed ``--repeats`` times (median), each into a
fresh folder. Extra RSS in save: max over ranks and repeats of (max RSS sampled every 2 ms during
the call - RSS just before). Peak RSS: ``ru_maxrss``, max over ranks. Base RSS: after imports and
process-group start. MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RssSampler, add_write_arg, check_doc, failure_reason, rss_bytes, write_doc

WORLD, MB = 2, 1e6
LOAD_LIMIT, LOAD_POLL_S = 1.5, 60
VERDICT = {True: "PASS", False: "FAIL"}
SAVE_DIRS = {"save_hf": "hf_scale", "save_hf_nosum": "hf_scale_nosum", "save_gather": "gathered", "save_dcp": "dcp"}
SAVE_PATTERNS = {"save_hf": "*.safetensors", "save_hf_nosum": "*.safetensors", "save_gather": "*.safetensors",
                 "save_dcp": "*"}


# ------------------------------------------------------------------ measuring inside a rank


def ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(fn, repeats: int = 1, setup=lambda: None):
    """Run ``setup`` then ``fn`` (timed between barriers, RSS sampled) ``repeats`` times:
    (stats, the last value of ``fn``)."""
    import torch.distributed as dist

    times, extra = [], 0
    for _ in range(repeats):
        setup()
        dist.barrier()
        before, sampler = rss_bytes(), RssSampler(0.002)
        sampler.start()
        start = time.perf_counter()
        value = fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
        extra = max(extra, sampler.stop() - before)
    return {"times": times, "extra_rss": extra, "peak_rss": ru_maxrss()}, value


def model_facts(model) -> dict:
    """What the model really is: FSDP units, DTensor parameters, bytes, largest parameter."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())  # tied weights once
    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    sizes = [p.numel() * p.element_size() for p in params]
    kind = f"FSDP2, {units} fully_shard units" if units else "no FSDP"
    ran_as = f"{type(model).__name__}: {kind}, {n_dtensor}/{len(params)} params DTensor"
    return {"ran_as": ran_as, "model_bytes": sum(sizes), "largest_param": max(sizes)}


# ------------------------------------------------------------------ the measurements (every rank)


def save_hf_scale(model, folder: Path) -> str:
    import hf_scale

    hf_scale.save_pretrained(model, folder)
    return "hf_scale.save_pretrained(model, dir): each rank pwrites its own shards, fsync, sha256"


def save_hf_scale_no_checksums(model, folder: Path) -> str:
    import hf_scale

    hf_scale.save_pretrained(model, folder, checksums=False)
    return "hf_scale.save_pretrained(model, dir, checksums=False): each rank pwrites its own shards, fsync"


def save_gathered(model, folder: Path) -> str:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    start = time.perf_counter()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    seconds, nbytes = time.perf_counter() - start, sum(t.nbytes for t in state.values())
    note = (f"get_model_state_dict(full_state_dict, cpu_offload) {seconds:.2f} s, rank "
            f"{dist.get_rank()} got {len(state)} tensors ({nbytes / MB:.0f} MB); rank 0 ")
    if dist.get_rank() == 0:
        model.save_pretrained(folder, state_dict=state)
    return note + f"{type(model).__name__}.save_pretrained(dir, state_dict=...)"


def save_dcp(model, folder: Path) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder))
    return "torch.distributed.checkpoint.save(get_model_state_dict(model))"


def save_task(name: str, save):
    """A save row: time ``save(model, folder)`` of the FSDP model into a fresh folder each time,
    then time an fsync of its files (what the save left unsynced)."""

    def run(root: Path, repeats: int) -> dict:
        import torch.distributed as dist

        import hf_scale
        from hf_scale.zoo import load_smollm2

        model = hf_scale.parallelize(load_smollm2()[0], {"strategy": "fsdp"})
        folder = root / SAVE_DIRS[name]

        def fresh_folder():
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)

        stats, note = measure(lambda: save(model, folder), repeats, setup=fresh_folder)
        facts = model_facts(model)
        start = time.perf_counter()
        for path in folder.glob(SAVE_PATTERNS[name]):
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        facts["ran_as"] = (f"{note}; an fsync of its files afterwards took "
                           f"{time.perf_counter() - start:.2f} s; model {facts['ran_as']}")
        return stats | facts

    return run


TASKS = {  # name: (row label, function run on every rank)
    "save_hf": ("(b) hf_scale.save_pretrained", save_task("save_hf", save_hf_scale)),
    "save_hf_nosum": ("(b2) hf_scale.save_pretrained, checksums=False",
                      save_task("save_hf_nosum", save_hf_scale_no_checksums)),
    "save_gather": ("(c) gather to rank 0 + save_pretrained (anchor)",
                    save_task("save_gather", save_gathered)),
    "save_dcp": ("(d) torch DCP save, sharded", save_task("save_dcp", save_dcp)),
}
QUICK_TASKS = ("save_hf",)


def worker(task: str, root: Path, repeats: int) -> None:
    # every row pays the same imports before its base RSS is read
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint
    import transformers.distributed  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    import hf_scale

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    base = rss_bytes()
    result = TASKS[task][1](root, repeats) | {"base_rss": base}
    (root / "results" / f"{task}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    hf_scale.shutdown_distributed()


# ------------------------------------------------------------------ the launcher


def wait_for_quiet_machine(max_wait_s: int) -> str:
    """Wait up to ``max_wait_s`` for the 1-minute load average (as ``uptime`` shows) <= LOAD_LIMIT."""
    waited = 0
    while (load := os.getloadavg()[0]) > LOAD_LIMIT and waited < max_wait_s:
        print(f"  1-min load {load:.2f} > {LOAD_LIMIT}: waited {waited // 60} min", flush=True)
        time.sleep(LOAD_POLL_S)
        waited += LOAD_POLL_S
    state = "ok" if load <= LOAD_LIMIT else "still above the limit: measured anyway"
    return f"load average (1, 5, 15 min) {os.getloadavg()} after {waited // 60} min wait ({state})"


def disk_write_mb_s(folder: Path, total: int, chunk: int = 64 << 20) -> float:
    block, path = memoryview(os.urandom(chunk)), folder / "disk_bandwidth.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(total // chunk):
            if os.write(fd, block) != chunk:
                raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return total / MB / seconds


def folder_bytes(folder: Path, pattern: str) -> tuple[int, int]:
    """(total, largest file) bytes of the files matching ``pattern`` in ``folder``."""
    sizes = [p.stat().st_size for p in folder.glob(pattern) if p.is_file()] or [0]
    return sum(sizes), max(sizes)


def launch(task: str, root: Path, repeats: int, timeout: int) -> dict:
    """One fresh ``torchrun --nproc_per_node 2`` for ``task``; the ranks' results merged."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(WORLD), os.path.abspath(__file__),
           "--worker", task, "--root", str(root), "--repeats", str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log_path = root / "results" / f"{task}.log"
    with open(log_path, "w") as log:
        try:
            returncode = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {timeout} s"
    ranks = [json.loads(p.read_text()) for p in sorted((root / "results").glob(f"{task}.rank*"))]
    if returncode != 0 or len(ranks) != WORLD:
        return {"status": failure_reason(log_path.read_text(errors="replace"), returncode)}
    slowest = [max(per_rank) for per_rank in zip(*(r["times"] for r in ranks))]
    merged = {k: max(r[k] for r in ranks) for k in ("extra_rss", "peak_rss", "base_rss")}
    merged["seconds"] = statistics.median(slowest)
    if task in SAVE_DIRS:
        written = folder_bytes(root / SAVE_DIRS[task], SAVE_PATTERNS[task])
        merged["written"], merged["largest_file"] = written
    return {"status": "ok", "ranks": ranks, **ranks[0], **merged}


def same_tensors(a: Path, b: Path) -> str:
    """Compare two Hub-format folders tensor by tensor (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    def tensors(folder):  # name -> file
        return {k: f for f in folder.glob("*.safetensors") for k in safe_open(f, "pt").keys()}  # noqa: SIM118

    def read(files, key):
        return safe_open(files[key], "pt").get_tensor(key)

    left, right = tensors(a), tensors(b)
    common = sorted(set(left) & set(right))
    same = sum(torch.equal(read(left, k), read(right, k)) for k in common)
    pairs = (("(b)", set(left) - set(right)), ("(c)", set(right) - set(left)))
    extra = "".join(f"; only in {tag}: {sorted(names)}" for tag, names in pairs if names)
    return f"{same}/{len(common)} common tensors bit-identical{extra}"


# ------------------------------------------------------------------ report


def fmt(value, scale: float = 1.0, digits: int = 0) -> str:
    return "" if value is None else f"{value / scale:.{digits}f}"


def ratio(value, ref) -> str:
    return f"{value / ref:.2f}" if value is not None and ref else ""


def table(rows: dict, disk: float, disk_bytes: int) -> str:
    def anchor(name, key):
        return rows[name][key] if rows.get(name, {}).get("status") == "ok" else None

    header = ["measurement", "time / anchor", "MB/s / disk (a)", "RSS / anchor", "seconds",
              "MB written", "MB/s", "extra RSS in save, max/rank (MB)", "peak RSS, max/rank (MB)",
              "base RSS (MB)"]
    disk_row = [f"(a) disk: {disk_bytes >> 20} MiB write + fsync, 1 process", "", "1.00", "",
                fmt(disk_bytes / disk, MB, 2), fmt(disk_bytes, MB), fmt(disk), "", "", ""]
    lines = [header, ["---"] * len(header), disk_row]
    for name, row in rows.items():
        if row["status"] != "ok":
            lines.append([TASKS[name][0], row["status"]] + [""] * (len(header) - 2))
            continue
        mb_s = row["written"] / MB / row["seconds"]
        lines.append([TASKS[name][0], ratio(row["seconds"], anchor("save_gather", "seconds")),
                      ratio(mb_s, disk), ratio(row["extra_rss"], anchor("save_gather", "extra_rss")),
                      fmt(row["seconds"], digits=2), fmt(row.get("written"), MB), fmt(mb_s),
                      fmt(row["extra_rss"], MB), fmt(row["peak_rss"], MB),
                      fmt(row["base_rss"], MB)])
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def save_bound(written: int, seconds: float, disk: float, anchor_s: float) -> str:
    """What the disk allows a save that wrote ``written`` bytes in ``seconds``: at (a)'s median
    bandwidth (MB/s, one process) writing them takes at least ``written / disk`` seconds, so its
    time against the anchor's ``anchor_s`` cannot fall below that over ``anchor_s``; and the
    bandwidth a disk needs for the 0.5x target, the anchor's time staying as measured. A save that
    wrote faster than (a) measured is not bound by it (the page cache, a disk faster than (a) saw):
    then the line says so instead."""
    floor = written / MB / disk
    if seconds < floor * 0.95:
        return (f"wrote {written / MB:.0f} MB at {written / MB / seconds:.0f} MB/s, faster than the disk's "
                f"{disk:.0f} MB/s in (a): the disk does not bound it here")
    need = written / MB / (0.5 * anchor_s)
    return (f"writing its {written / MB:.0f} MB at the disk's {disk:.0f} MB/s takes >= {floor:.2f} s, "
            f"so time / (c) >= {floor / anchor_s:.2f}x on this disk; 0.5x needs >= {need:.0f} MB/s "
            f"({need / disk:.1f}x this disk) with (c) unchanged")


def save_targets(rows: dict, disk: float) -> list[str]:
    if rows["save_hf"]["status"] != "ok":
        return ["n/a  (b) did not run: no save target can be checked"]
    b, out = rows["save_hf"], []
    for name, label in (("save_hf", "(b)"), ("save_hf_nosum", "(b2)")):
        row = rows.get(name, {})
        if row.get("status") != "ok":
            continue
        if rows.get("save_gather", {}).get("status") == "ok":
            c = rows["save_gather"]["seconds"]
            out.append(f"{VERDICT[row['seconds'] <= 0.5 * c]} {label} time <= 0.5x (c): "
                       f"{row['seconds']:.2f} s vs {c:.2f} s = {row['seconds'] / c:.2f}x")
            if row["seconds"] > 0.5 * c:  # a miss: what the disk allows
                out.append(f"  bound: {label} {save_bound(row['written'], row['seconds'], disk, c)}")
        mb_s = row["written"] / MB / row["seconds"]
        out.append(f"{VERDICT[mb_s >= 0.5 * disk]} {label} throughput >= 50% of disk (a): "
                   f"{mb_s:.0f} vs {disk:.0f} MB/s = {mb_s / disk:.0%}")
    limit = b["largest_file"] + b["largest_param"]
    out.append(f"{VERDICT[b['extra_rss'] <= limit]} (b) extra RSS during save <= largest file "
               f"written ({b['largest_file'] / MB:.1f} MB) + largest parameter "
               f"({b['largest_param'] / MB:.1f} MB) = {limit / MB:.1f} MB: "
               f"{', '.join(fmt(r['extra_rss'], MB, 1) for r in b['ranks'])} MB on the ranks")
    return out


def report(rows: dict, disks: list[float], disk_bytes: int, root: Path) -> str:
    disk = statistics.median(disks)
    lines = [table(rows, disk, disk_bytes), "", "```", "anchor: (c) (RSS = extra RSS in save)", ""]
    lines += save_targets(rows, disk)
    lines += ["", "what each row really ran:",
              f"  (a) {disk_bytes >> 20} MiB of random bytes, 64 MiB os.write calls + fsync, in {root}, before "
              f"each save row and after the last ({len(disks)} times, interleaved with the saves; the median is "
              f"the row): {', '.join(f'{d:.0f}' for d in disks)} MB/s"]
    for name, row in rows.items():
        note = row["ran_as"] if row["status"] == "ok" else row["status"]
        lines.append(f"  {TASKS[name][0].split()[0]} {note}")
    if all(rows.get(n, {}).get("status") == "ok" for n in ("save_hf", "save_gather")):
        folders = [root / SAVE_DIRS[n] for n in ("save_hf", "save_gather")]
        lines.append(f"  (b) vs (c) files: {same_tensors(*folders)}")
    for name in ("save_hf", "save_hf_nosum"):
        if rows.get(name, {}).get("status") == "ok":
            files = sorted(p.name for p in (root / SAVE_DIRS[name]).glob("*.safetensors"))
            lines.append(f"  {TASKS[name][0].split()[0]} wrote {len(files)} shard file(s): {', '.join(files)}")
    return "\n".join(lines + ["```"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/bench_checkpoint",
                        help="output folder root, on the disk to test")
    parser.add_argument("--part", choices=("all", "load", "save"), default="all")
    parser.add_argument("--quick", action="store_true", help="saves: (a) on 256 MiB and (b) once")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per save (median)")
    parser.add_argument("--worlds", default="2,4", help="loads: rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="loads: interleaved rounds (median)")
    parser.add_argument("--wait", type=int, default=0, help="seconds to wait for 1-min load <= 1.5")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per torchrun")
    parser.add_argument("--worker", choices=TASKS, help=argparse.SUPPRESS)
    add_write_arg(parser, "checkpoint-load")  # the load table; the saves write section "checkpoint"
    args = parser.parse_args()
    root = Path(args.root).resolve()
    if args.worker:
        return worker(args.worker, root, args.repeats)
    check_doc(args)
    if args.part in ("all", "save"):
        check_doc(argparse.Namespace(write=args.write, section="checkpoint"))

    start = time.perf_counter()
    print("machine: " + wait_for_quiet_machine(args.wait), flush=True)
    if args.part in ("all", "load"):
        from bench_checkpoint_load import run

        worlds = [int(w) for w in args.worlds.split(",")]
        table, notes = run(root, worlds, args.rounds, args.timeout)
        print(f"\n{table}\n\n{notes}\n", flush=True)
        write_doc(args, f"{table}\n\n```\n{notes}\n```")
    if args.part in ("all", "save"):
        run_saves(root, args)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


def run_saves(root: Path, args) -> None:
    for sub in ["results", *SAVE_DIRS.values()]:
        shutil.rmtree(root / sub, ignore_errors=True)
    (root / "results").mkdir(parents=True)
    disk_bytes, repeats = ((256 << 20), 1) if args.quick else ((1 << 30), args.repeats)
    rows, disks = {}, []
    for task in QUICK_TASKS if args.quick else TASKS:
        disks.append(disk_write_mb_s(root, disk_bytes))  # the disk is noisy: measured between the saves
        print(f"  (a) disk: {disks[-1]:.0f} MB/s", flush=True)
        t0 = time.perf_counter()
        rows[task] = launch(task, root, repeats, args.timeout)
        wall = time.perf_counter() - t0
        print(f"  {TASKS[task][0]}: {rows[task]['status']} ({wall:.0f} s wall)", flush=True)
    disks.append(disk_write_mb_s(root, disk_bytes))
    title = (f"Saves: SmolLM2-135M fp32, FSDP over {WORLD} gloo ranks on CPU; {repeats} timed call(s) "
             f"per save (median); outputs and logs in {root}")
    body = f"{title}\n\n{report(rows, disks, disk_bytes, root)}"
    print(f"\n{body}")
    write_doc(argparse.Namespace(write=args.write, section="checkpoint"), body)


if __name__ == "__main__":
    main()
