"""hf_scale.from_pretrained in one process, and every bad checkpoint it must refuse."""

import json
import mmap

import pytest
import torch

import hf_scale
from hf_scale import HfScaleCheckpointError
from hf_scale.checkpoint import convert_pickle_checkpoint
from tests.tiny_models import AUTO, all_cases, tiny_batch, tiny_model


@pytest.mark.parametrize("arch, head", all_cases(), ids=[f"{a}-{h}" for a, h in all_cases()])
def test_round_trip_in_one_process(arch, head, tmp_path):
    model = tiny_model(arch, head, seed=3)
    folder = hf_scale.save_pretrained(model, tmp_path / "m", max_shard_size=20000)
    loaded = hf_scale.from_pretrained(folder, auto_class=AUTO[head])
    for (name, p), q in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name
    batch = tiny_batch(head, 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)


def _mapping(address: int) -> tuple[str | None, int]:
    """(file, size in bytes) of the mapping at ``address`` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return (fields[5] if len(fields) > 5 else None), end - start
    return None, 0


@pytest.fixture
def saved(tmp_path):
    return hf_scale.save_pretrained(tiny_model("llama", "causal"), tmp_path / "m", max_shard_size=20000)


def test_checksum_mismatch_when_asked(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(HfScaleCheckpointError, match=rf"{shard.name}.*do not match checksums.sha256"):
        hf_scale.from_pretrained(saved, verify_checksums=True)
    # off by default (as in transformers): no full read of every shard before the load
    loaded = hf_scale.from_pretrained(saved)
    assert sum(p.numel() for p in loaded.parameters()) > 0


def test_cpu_load_maps_the_files_copy_on_write(saved):
    """Parameters are views of the mapped shards (nothing read or copied at load time), and a
    write to them (training) never reaches the files."""
    before = {p: p.read_bytes() for p in saved.glob("*.safetensors")}
    loaded = hf_scale.from_pretrained(saved)
    params = dict(loaded.named_parameters())
    assert [n for n, p in params.items() if _mapping(p.data_ptr())[0] not in map(str, before)] == []
    # each maps its own bytes, not the whole file (a rank never maps its neighbours' slices)
    slack = 2 * mmap.ALLOCATIONGRANULARITY
    assert [n for n, p in params.items() if _mapping(p.data_ptr())[1] > p.nbytes + slack] == []
    reference = tiny_model("llama", "causal").state_dict()
    with torch.no_grad():
        for name, p in params.items():
            assert torch.equal(p, reference[name]), name
            p.add_(1.0)
    assert {p: p.read_bytes() for p in before} == before


def test_truncated_shard_without_checksums(saved):
    (saved / "checksums.sha256").unlink()
    shard = sorted(saved.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(HfScaleCheckpointError, match=f"cannot read shard {shard.name}"):
        hf_scale.from_pretrained(saved)


def test_missing_shard(saved):
    shard = sorted(saved.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HfScaleCheckpointError, match=f"shard '{shard.name}'.*is missing"):
        hf_scale.from_pretrained(saved)


def test_index_pointing_outside_the_folder(saved):
    index_path = saved / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(HfScaleCheckpointError, match="outside the checkpoint folder"):
        hf_scale.from_pretrained(saved)


def test_shape_mismatch_names_the_tensor(saved):
    config = json.loads((saved / "config.json").read_text())
    config["intermediate_size"] = 48
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(HfScaleCheckpointError, match=r"mlp.*has shape \[64, 32\], the model expects \[48, 32\]"):
        hf_scale.from_pretrained(saved)


def test_pickle_checkpoint_is_refused_then_converted_with_weights_only(tmp_path):
    model = tiny_model("gpt2", "causal", seed=5)
    folder = tmp_path / "pickled"
    folder.mkdir()
    model.config.architectures = ["GPT2LMHeadModel"]
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(HfScaleCheckpointError, match="pickle weights.*weights_only=True"):
        hf_scale.from_pretrained(folder)
    convert_pickle_checkpoint(folder)
    loaded = hf_scale.from_pretrained(folder)
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name


def test_pickle_with_code_is_refused(tmp_path):
    import pickle

    folder = tmp_path / "evil"
    folder.mkdir()

    class Payload:
        def __reduce__(self):
            return (print, ("this code must not run",))

    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": Payload()}, f)
    with pytest.raises(HfScaleCheckpointError, match="weights_only=True.*refused"):
        convert_pickle_checkpoint(folder)


def test_not_a_folder(tmp_path):
    with pytest.raises(HfScaleCheckpointError, match="is not a checkpoint folder"):
        hf_scale.from_pretrained(tmp_path / "nope")


def test_load_converts_dtype(saved):
    reference = {k: v for k, v in tiny_model("llama", "causal").state_dict().items()}
    loaded = hf_scale.from_pretrained(saved, dtype=torch.bfloat16)
    for name, p in loaded.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, reference[name].to(torch.bfloat16)), name


def test_float_where_the_model_has_integers_is_refused(tmp_path):
    import struct

    folder = hf_scale.save_pretrained(tiny_model("bert", "seqcls"), tmp_path / "m")
    shard = folder / "model.safetensors"
    raw = shard.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"  # same size, wrong kind
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (length - len(new))
    shard.write_bytes(raw[:8] + new + raw[8 + length :])
    (folder / "checksums.sha256").unlink()
    with pytest.raises(HfScaleCheckpointError, match=f"'{name}'.*is I32, the model's is torch.float32"):
        hf_scale.from_pretrained(folder)


def test_hub_id_through_the_huggingface_hub_cache(tmp_path, monkeypatch):
    """A repo id resolves through huggingface_hub's cache (offline here: no Hub is reachable)."""
    model = tiny_model("llama", "causal", seed=4)
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    hf_scale.save_pretrained(model, snapshot)
    (cache / "models--org--tiny" / "refs").mkdir(parents=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    loaded = hf_scale.from_pretrained("org/tiny")
    for (name, p), q in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name


def test_one_process_on_an_accelerator_puts_buffers_there_too(tmp_path, monkeypatch):
    """World 1 on a GPU under the default fsdp: parameters and buffers (BERT's position ids) all
    end on the device (the buffers stayed on the CPU). The meta device stands in for CUDA."""
    import hf_scale.checkpoint.load as load
    from hf_scale import orchestrate
    from hf_scale.distributed import DistEnv

    hf_scale.save_pretrained(hf_scale.parallelize(tiny_model("bert", "seqcls")), tmp_path / "bert")
    monkeypatch.setattr(orchestrate, "init_distributed", lambda timeout: DistEnv(0, 1, 0, 1, torch.device("meta")))
    real = load.assign_from_files  # reads onto the CPU (a meta "GPU" cannot hold the values read)
    monkeypatch.setattr(load, "assign_from_files", lambda m, f, w, device: real(m, f, w, torch.device("cpu")))
    model = hf_scale.from_pretrained(tmp_path / "bert", {"strategy": "fsdp"})
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_maps_stay_under_the_open_file_limit(saved, monkeypatch):
    """Each mapped block holds a file descriptor: past half the (raised) open-file limit the rest
    are read, so a model with thousands of tensors per rank cannot run out of descriptors."""
    import resource

    import hf_scale.checkpoint.load as load

    monkeypatch.setattr(resource, "getrlimit", lambda what: (8, 8))  # soft = hard = 8: 4 maps at most
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: None)
    assert load.map_budget(100) == 4
    maps = []
    real = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: maps.append(1) or real(*a, **k))
    model = hf_scale.from_pretrained(saved)
    assert len(maps) == 4
    want = AUTO["causal"].from_pretrained(saved)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
