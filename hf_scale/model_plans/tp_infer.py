"""A tensor-parallel plan inferred from a model's module structure, for models that neither
transformers nor the registry gives one: names and shapes only, never a model name.

In each block (an instance of ``plan.wrap_modules``), the Linear layers (and transformers'
``Conv1D``) of the attention and of the MLP get Megatron's pairing (DeepSpeed's AutoTP and
ColossalAI's policies do the same by hand):

* attention (a child whose name holds ``attn`` / ``attention``): query / key / value
  projections -- separate (``q_proj``, ``query``, ``wq``...) or fused (``query_key_value``,
  ``qkv_proj``, ``c_attn``, ``Wqkv``...) -- ``colwise``, the output projection (``o_proj``,
  ``out_proj``, ``dense``, ``c_proj``...) ``rowwise``; its head counts and hidden sizes are
  divided by tp (``tp_local_attrs``). A fused projection of ``3 x hidden`` features may be laid
  out ``[q; k; v]`` (``packed_colwise:3``) or head by head (``colwise``): both are candidates;
  one of ``hidden + 2 t`` features (``t`` dividing hidden: multi-query attention's single k and
  v head) keeps k and v whole on every rank (``colwise_replicated_kv:2t``, its kv head counts
  left whole), else head by head;
* MLP (``mlp``, ``ffn``, ``feed_forward``..., or BERT's ``intermediate`` / ``output``): up and
  gate projections ``colwise`` (a fused ``gate_up_proj`` ``packed_colwise:2``), the down
  projection ``rowwise``.

The last candidate shards the MLPs only, every attention whole on every rank (computed on each:
correct, its parameters not divided); ``hf-scale plan`` and the model card say so.

A group is sharded only when every Linear in it has a known role and the shapes agree (the
column-parallel layers read the hidden size, the row-parallel one writes it); otherwise it
stays whole on every tp rank (still correct, computed on each). Groups holding experts (MoE:
issue 27), per-head parameters or norms over the whole projected width are left whole too.
Embeddings and the output head are added by :func:`hf_scale.model_plans.tp.tp_layout`.

The plan is a guess: ``parallelize`` checks it on the tp group (one forward of the sharded
model on a probe batch against the unsharded one, :mod:`hf_scale.parallel.tp_check`) and
refuses the model, naming the first block that differed, when no candidate matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

QKV = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "wq", "wk", "wv",
       "q_lin", "k_lin", "v_lin", "query_proj", "key_proj", "value_proj", "to_q", "to_k", "to_v", "Wq", "Wk", "Wv"}
FUSED_QKV = {"query_key_value", "qkv_proj", "c_attn", "Wqkv", "qkv", "wqkv", "in_proj", "qkv_linear"}
ATTN_OUT = {"o_proj", "out_proj", "dense", "c_proj", "wo", "o", "out_lin", "proj", "out", "output_proj", "to_out",
            "Wo"}
UP = {"up_proj", "gate_proj", "fc1", "c_fc", "dense_h_to_4h", "w1", "w3", "fc_in", "wi", "wi_0", "wi_1",
      "lin1", "fc", "c_fc2", "c_fc1", "up", "linear_1", "ffn_up"}
FUSED_UP = {"gate_up_proj", "w12", "fc1_gate_up", "Wi"}
DOWN = {"down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2", "fc_out", "wo", "lin2", "proj", "down", "linear_2",
        "ffn_down", "Wo"}
ATTN_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "ffn", "feed_forward", "feedforward", "ff", "fc")
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
              "n_kv_heads", "hidden_size", "embed_dim", "all_head_size", "split_size", "inner_dim",
              "hidden_size_per_partition", "head_count")


KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


@dataclass(frozen=True)
class InferredTP:
    """Candidate plans (module name -> style; most likely first), their local attributes, the
    groups left whole and why, or why nothing could be inferred (``reason``)."""

    candidates: tuple[dict[str, str], ...]
    local_attrs: dict[str, tuple[str, ...]]
    whole: tuple[str, ...] = ()
    reason: str = ""
    attention: tuple[str, ...] = ()  # the attention groups sharded by the first candidates

    def attrs_for(self, candidate: int) -> dict[str, tuple[str, ...]]:
        """The local attributes of candidate ``candidate``: where a fused projection keeps its
        key/value heads whole (``colwise_replicated_kv``), its attention's kv head counts stay
        whole too; an attention the candidate leaves whole keeps all its counts."""
        styles = self.candidates[candidate]
        whole_kv = [n.rpartition(".")[0] for n, s in styles.items() if s.startswith("colwise_replicated_kv:")]
        unsharded = [g for g in self.attention if not any(n.startswith(g + ".") for n in styles)]
        out = {}
        for name, attrs in self.local_attrs.items():
            if any(name == g or name.startswith(g + ".") for g in whole_kv):
                attrs = tuple(a for a in attrs if a not in KV_ATTRS)
            if any(name == g or name.startswith(g + ".") for g in unsharded):
                continue
            if attrs:
                out[name] = attrs
        return out

    def attention_whole(self, candidate: int) -> bool:
        """Candidate ``candidate`` is the last resort that leaves every attention whole."""
        styles = self.candidates[candidate]
        return bool(self.attention) and not any(n.startswith(g + ".") for g in self.attention for n in styles)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: [in, out]


HIDDEN_ATTRS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")


def _hidden(model: nn.Module) -> int | None:
    """The width of the residual stream: the config's hidden size, else the embedding's (ELECTRA
    embeds in 128 and projects to its hidden size)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for attr in HIDDEN_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return int(weight.shape[1]) if weight is not None and weight.dim() == 2 else None


def infer_tp_plan(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> InferredTP:
    """The inferred plan for ``model`` whose blocks are ``blocks`` (``(name, module)``)."""
    hidden = _hidden(model)
    if hidden is None or not blocks:
        return InferredTP((), {}, reason="no input embedding or no repeated blocks to shard")
    styles: dict[str, str] = {}
    fused: list[str] = []
    attrs: dict[str, tuple[str, ...]] = {}
    whole: list[str] = []
    kinds = set()
    attention: list[str] = []
    for block_name, block in blocks:
        for group_name, group, role in _groups(block):
            full = _join(block_name, group_name)
            got, why = _group_styles(group, role, hidden)
            if got is None:
                if why != "no Linear layers":
                    whole.append(f"{full} ({type(group).__name__}: {why})")
                continue
            kinds.add(role)
            if role == "attention":
                attention.append(full)
            for name, style in got.items():
                styles[_join(full, name)] = style
                if style == "fused_qkv":
                    fused.append(_join(full, name))
            if role == "attention":
                attrs.update(_head_attrs(full, group))
    if not styles:
        kinds_seen = sorted({type(b).__name__ for _, b in blocks})
        why = "; ".join(whole[:3]) or ("no attention or MLP layers to pair (a state-space or recurrent block: "
                                       "tp does not split it; fsdp and pp do)")
        return InferredTP((), {}, tuple(whole), reason=f"blocks {kinds_seen}: {why}")
    options = {n: _fused_options(*_in_out(model.get_submodule(n))) for n in fused}
    count = max((len(o) for o in options.values()), default=1)
    candidates = [{n: (options[n][min(i, len(options[n]) - 1)] if s == "fused_qkv" else s) for n, s in styles.items()}
                  for i in range(count)]
    if "mlp" in kinds and attention:
        # the last resort: the MLPs sharded, every attention whole on every rank (one whose forward
        # reshapes to a width read from its input, as TrOCR's does, cannot run on local heads)
        candidates.append({n: s for n, s in candidates[0].items()
                           if not any(n.startswith(g + ".") for g in attention)})
    return InferredTP(tuple(candidates), attrs, tuple(whole), attention=tuple(attention))


def _fused_options(in_f: int, out_f: int) -> list[str]:
    """Styles a fused q/k/v projection may take, most likely first: ``[q; k; v]`` of equal parts
    (``packed_colwise:3``); fewer key/value heads than query heads, ``hidden + 2 t`` features
    with ``t`` a whole number of heads' width (``colwise_replicated_kv:2t``: one k and one v
    head of multi-query attention, kept whole on every rank); and head-by-head interleaving
    (``colwise``) last."""
    tail = out_f - in_f
    if 0 < tail < 2 * in_f and tail % 2 == 0 and in_f % (tail // 2) == 0:
        return [f"colwise_replicated_kv:{tail}", "colwise"]
    return ["packed_colwise:3", "colwise"] if out_f % 3 == 0 else ["colwise"]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _groups(block: nn.Module):
    """``(name, module, "attention" | "mlp")`` of the block: attention children and MLP
    children (BERT's ``intermediate`` + ``output`` pair counts as the block itself)."""
    children = dict(block.named_children())
    found = []
    for name, child in children.items():
        low = name.lower()
        if any(w in low for w in ATTN_WORDS) and "norm" not in low and not low.startswith("ln"):
            found.append((name, child, "attention"))
        elif any(low == w or low.startswith(w + "_") or low.endswith("_" + w) for w in MLP_WORDS):
            found.append((name, child, "mlp"))
    if not found and any(w in type(block).__name__.lower() for w in ATTN_WORDS):
        found.append(("", block, "attention"))  # the repeated unit is an attention itself (XLM's attentions list)
    if "intermediate" in children and "output" in children:  # BERT-style: the block holds the MLP pair
        found.append(("", _View({"intermediate": children["intermediate"], "output": children["output"]}), "mlp"))
    direct = {n: c for n, c in children.items() if is_linear(c)}
    if direct and all(n in UP | DOWN | FUSED_UP for n in direct):  # fc1 / fc2 held by the block itself
        found.append(("", _View(direct), "mlp"))
    return found


class _View(nn.Module):
    """Some children of a block seen as one group (never registered in the model)."""

    def __init__(self, children: dict[str, nn.Module]):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _group_styles(group: nn.Module, role: str, hidden: int) -> tuple[dict[str, str] | None, str]:
    """Styles for the Linear layers of ``group`` (names relative to it), or None and why."""
    linears = [(n, m) for n, m in group.named_modules() if n and is_linear(m)]
    if not linears:
        return None, "no Linear layers"
    for name, module in group.named_modules():
        if "expert" in name.lower() or any("expert" in p for p, _ in module.named_parameters(recurse=False)):
            return None, "experts (sharded by expert parallel, issue 27)"
    styles: dict[str, str] = {}
    if role == "mlp" and isinstance(group, nn.Sequential) and len(linears) == 2 \
            and not any(n.rpartition(".")[2] in UP | DOWN | FUSED_UP for n, _ in linears):
        # an MLP written as Sequential(Linear, activation, Linear) (CTRL's ffn): up, then down
        order = {linears[0][0]: "colwise", linears[1][0]: "rowwise"}
    else:
        order = {}
    for name, module in linears:
        leaf = name.rpartition(".")[2]
        in_f, out_f = _in_out(module)
        if role == "attention":
            if leaf in ATTN_OUT or name.endswith("output.dense"):
                style = "rowwise"
            elif leaf in FUSED_QKV:
                style = "fused_qkv"
            elif leaf in QKV:
                style = "colwise"
            else:
                return None, f"a Linear {name!r} ({in_f}->{out_f}) of no known role"
        elif name in order:
            style = order[name]
        else:
            if leaf in DOWN or name.startswith("output"):
                style = "rowwise"
            elif leaf in FUSED_UP:
                style = "packed_colwise:2"
            elif leaf in UP or name.startswith("intermediate"):
                style = "colwise"
            else:
                return None, f"a Linear {name!r} ({in_f}->{out_f}) of no known role"
        if style == "rowwise" and out_f != hidden:
            return None, f"{name!r} writes {out_f} features, not the hidden size {hidden}"
        if style != "rowwise" and in_f != hidden:
            return None, f"{name!r} reads {in_f} features, not the hidden size {hidden}"
        styles[name] = style
    rows = [n for n, s in styles.items() if s == "rowwise"]
    cols = [n for n, s in styles.items() if s != "rowwise"]
    if len(rows) != 1 or not cols:
        return None, f"{len(cols)} input and {len(rows)} output projections (one output expected)"
    width_in = _in_out(group.get_submodule(rows[0]))[0]
    if role == "mlp" and len(cols) == 1 and styles[cols[0]] == "colwise" \
            and _in_out(group.get_submodule(cols[0]))[1] == 2 * width_in:
        styles[cols[0]] = "packed_colwise:2"  # one up projection twice the down's input: [gate; up] (Moshi's fc1)
    widths = {_in_out(group.get_submodule(n))[1] for n in cols if styles[n] == "colwise"}
    for name, module in group.named_modules():  # a norm over the whole projected width
        weight = getattr(module, "weight", None)
        if name and not is_linear(module) and weight is not None and weight.dim() == 1 \
                and weight.shape[0] in widths | {width_in} and weight.shape[0] != hidden:
            return None, f"{name!r} ({type(module).__name__}) normalises all {weight.shape[0]} projected features"
    for pname, param in group.named_parameters(recurse=False):  # per-head parameters (sinks, gates)
        return None, f"a parameter {pname!r} {tuple(param.shape)} of its own"
    return styles, ""


def _head_attrs(name: str, group: nn.Module) -> dict[str, tuple[str, ...]]:
    """Integer head counts and widths of the attention module and its children (BERT's ``self``)."""
    out = {}
    for sub_name, module in group.named_modules():
        if is_linear(module):
            continue
        found = tuple(a for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)
                      and not isinstance(getattr(module, a), bool) and a in vars(module))
        if found:
            out[_join(name, sub_name)] = found
    return out


def collapse(styles: dict[str, str], modules: dict[str, nn.Module]) -> dict[str, str]:
    """Exact names -> ``*`` patterns where every module the pattern matches has the same style."""
    by_pattern: dict[str, set[str]] = {}
    for name in modules:
        by_pattern.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name), set()).add(name)
    out: dict[str, str] = {}
    for name, style in styles.items():
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        members = by_pattern.get(pattern, {name})
        if all(styles.get(m) == style for m in members):
            out[pattern] = style
        else:
            out[name] = style
    return out
