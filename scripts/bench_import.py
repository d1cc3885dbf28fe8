"""What ``import hf_scale`` costs beside ``import transformers`` (issue 10, item 2).

Each import runs in a fresh interpreter, several times interleaved, and the median wall time
is reported with the modules it loaded. ``import hf_scale`` loads the configuration and the
errors only; the engine (torch) loads when a name such as ``hf_scale.parallelize`` is first used.
Target: ``import hf_scale`` <= 1.1x ``import transformers``.

Usage::

    python scripts/bench_import.py [--repeat 7] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from bench_common import add_write_arg, check_doc, markdown_table, write_doc

LEGS = {
    "import transformers": "import transformers",
    "import hf_scale": "import hf_scale",
    "import torch": "import torch",
    "hf_scale.parallelize (first use)": "import hf_scale; hf_scale.parallelize",
    "import torch, transformers + AutoModelForCausalLM": "import torch, transformers; transformers.AutoModelForCausalLM",
}
WATCHED = ("torch", "transformers", "datasets", "huggingface_hub", "hf_scale.train", "hf_scale.hub")
PROBE = """import json, sys, time
t = time.perf_counter()
{code}
took = time.perf_counter() - t
print(json.dumps([took, [m for m in {watched!r} if m in sys.modules]]))"""


def once(code: str) -> tuple[float, list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(code=code, watched=WATCHED)],
                         capture_output=True, text=True, check=True)
    took, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    return took, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    add_write_arg(parser, "import")
    args = parser.parse_args()
    check_doc(args)
    times: dict[str, list[float]] = {name: [] for name in LEGS}
    loaded: dict[str, list[str]] = {}
    once("import torch, transformers")  # warm the file cache once for every leg alike
    for _ in range(args.repeat):  # interleaved, so machine load hits every leg alike
        for name, code in LEGS.items():
            took, loaded[name] = once(code)
            times[name].append(took)
    base = statistics.median(times["import transformers"])
    rows = [[name, f"{statistics.median(t) / base:.2f}x", f"{statistics.median(t):.3f}",
             f"{min(t):.3f}", ", ".join(loaded[name]) or "-"] for name, t in times.items()]
    table = markdown_table(["import", "vs transformers", "median s", "min s", "modules loaded"], rows)
    ratio = statistics.median(times["import hf_scale"]) / base
    verdict = f"import hf_scale = {ratio:.2f}x import transformers (target <= 1.10x): " + (
        "met" if ratio <= 1.10 else "NOT met")
    print(table)
    print(verdict)
    write_doc(args, f"{table}\n\n{verdict} ({args.repeat} runs each, interleaved, median).")


if __name__ == "__main__":
    main()
