"""How long loading ``zoo:smollm2`` takes: transformers reading the GGUF file itself, against
hf_scale's de-quantized safetensors copy (``hf_scale.zoo.load_smollm2``), ratio first.

Each load runs in a fresh interpreter (imports done before the clock starts), the legs
interleaved ``--repeat`` times; the median is reported. The copy is made before the first
round if the cache lacks it (that conversion is not timed).

Usage::

    python scripts/bench_zoo_load.py [--repeat 3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from bench_common import add_write_arg, check_doc, markdown_table, write_doc

PROBE = """import json, time, torch, transformers
from hf_scale.zoo import SMOLLM2_GGUF, load_smollm2, smollm2_dir
t = time.perf_counter()
{code}
print(json.dumps(time.perf_counter() - t))"""
LEGS = {
    "GGUF file (transformers, gguf_file=)": (
        "transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32, "
        "gguf_file=SMOLLM2_GGUF)\ntransformers.AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)"),
    "hf_scale zoo copy (load_smollm2)": "load_smollm2()",
}


def once(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    add_write_arg(parser, "zoo-load")
    args = parser.parse_args()
    check_doc(args)
    once("load_smollm2()")  # makes the copy if the cache lacks it (not timed)
    times: dict[str, list[float]] = {name: [] for name in LEGS}
    for _ in range(args.repeat):
        for name, code in LEGS.items():
            times[name].append(once(code))
    gguf = statistics.median(times["GGUF file (transformers, gguf_file=)"])
    rows = [[name, f"{statistics.median(t) / gguf:.3f}x", f"{statistics.median(t):.2f}", f"{min(t):.2f}"]
            for name, t in times.items()]
    table = markdown_table(["model + tokenizer load", "vs GGUF", "median s", "min s"], rows)
    print(table)
    write_doc(args, f"{table}\n\n{args.repeat} loads each, interleaved, each in a fresh interpreter; median.")


if __name__ == "__main__":
    main()
