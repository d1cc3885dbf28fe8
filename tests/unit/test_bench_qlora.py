"""The QLoRA benchmark's pure logic: the verdicts against issue 41's targets and the NF4 bound
from a model's shapes (scripts/bench_qlora.py; the benchmark itself is run by hand)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_qlora as bq  # noqa: E402


def _leg(frozen, peak, tok_s=100.0, loss=(3.0, 2.5), load_peak=1.0, after=0.99, slice_=0.05):
    return {"status": "ok", "frozen": frozen, "peak": peak, "tok_s": tok_s, "loss": list(loss),
            "load_peak": load_peak, "after_load": after, "slice": slice_}


def test_verdicts_pass_and_fail_on_the_targets():
    legs = {"lora bf16": _leg(1000, 2.0), "qlora fp32": _leg(300, 1.4, load_peak=1.2, after=1.1)}
    lines = bq.verdicts(legs)
    assert lines[0].startswith("PASS: frozen-weight bytes") and "= 0.300" in lines[0]
    assert lines[1].startswith("PASS: peak RSS") and "= 0.70" in lines[1]
    assert lines[2].startswith("n/a: qlora fp32 vs TRL qlora")
    assert lines[3].startswith("FAIL: qlora fp32 RSS peak during load")  # 0.1 GiB over > 0.05
    legs = {"lora bf16": _leg(1000, 2.0), "qlora fp32": _leg(301, 1.5, tok_s=110, loss=(3.0, 2.52)),
            "TRL qlora": _leg(900, 2.5, tok_s=100, loss=(3.0, 2.5))}
    lines = bq.verdicts(legs)
    assert lines[0].startswith("FAIL: frozen") and lines[1].startswith("FAIL: peak RSS")
    assert lines[2].startswith("FAIL: tokens/s") and "1.10" in lines[2]
    assert lines[3].startswith("FAIL: loss per step") and "2.0e-02" in lines[3]
    assert lines[4].startswith("PASS: qlora fp32 RSS peak during load")


def test_verdicts_say_which_leg_is_missing():
    assert bq.verdicts({"qlora fp32": {"status": "failed: OOM"}}) == [
        "n/a: qlora fp32 (failed: OOM) vs lora bf16 (not run)"]


def test_nf4_bound_counts_only_lora_weights_with_whole_blocks():
    from hf_scale.quantize.nf4 import BITS_PER_PARAMETER, nf4_bits

    shapes = [[[1536, 576], 1536 * 576, True],   # MLP: 6,912 blocks a slice -> NF4, scaler block 256
              [[576, 576], 576 * 576, True],     # attention: 2,592 blocks a slice (10.125 groups of 256) -> 216
              [[40, 40], 40 * 40, True],         # 800 elements a slice: not whole 64-element blocks -> stays
              [[49152, 576], 49152 * 576, False]]  # the embedding: never NF4
    ratio, nf4, total = bq.nf4_bound(shapes, 2, 2)
    assert nf4 == 1536 * 576 + 576 * 576 and total == sum(s[1] for s in shapes)
    held = 1536 * 576 * nf4_bits(256, 2) / 8 + 576 * 576 * nf4_bits(216, 2) / 8 + (40 * 40 + 49152 * 576) * 2
    assert abs(ratio - held / (2 * total)) < 1e-12
    assert bq.nf4_bound(shapes[:1], 2, 4)[0] == BITS_PER_PARAMETER / 16  # all NF4 at 256: 4.127 bits over 16
