"""FP8 under tensor (and expert) parallelism on CPU: 2 real ranks over gloo, each reading its
slices of a published FP8 checkpoint's weights and scales (per channel and per block), or
quantizing its own bf16 shard at load (`quantization=fp8`). The ranks' dequantized slices are
exactly the stored weights. Logits agree with one device's within FP8 rounding, not bit for
bit: a row-parallel layer quantizes each token's activations over its rank's slice of the
inputs (and, quantized at load, its weight rows over that slice), where one device uses the
whole row; one device made to round its row layers that way gives the ranks' logits and the
same greedy tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fp8 import _as_published_fp8
from test_tensor_parallel import _any_worker_for, _prompts, _tokens
from torch import nn

from dlm_engine import Engine, EngineConfig
from dlm_engine.fp8 import E4M3, Fp8Experts, Fp8Linear, quantize_rows
from dlm_engine.models.common import full_logits
from dlm_engine.models.shard_rules import COLUMN, EXPERT, PARTIAL, QKV, ROW
from dlm_engine.parallel.layers import RowParallelFp8Linear
from dlm_engine.parallel.sharding import kind_of, read_shard, rules_for
from dlm_lab.testing import make_tiny_checkpoint, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")


ROWS = [{"max_tokens": 16, "steps": 16}, {"max_tokens": 12, "steps": 12}, {"max_tokens": 8}]


def _as_block_fp8(src: Path, dst: Path, block: tuple[int, int]) -> None:
    """`src` rewritten as transformers' fine-grained FP8 (`quant_method: fp8`): e4m3 weights
    with one `weight_scale_inv` per `block` (rows, columns), the head and norms kept."""
    config = json.loads((src / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    bn, bk = block
    for name in list(state):
        w = state[name]
        if not name.endswith("proj.weight") or w.dim() != 2:
            continue
        n, k = w.shape
        tiles = w.float().reshape(n // bn, bn, k // bk, bk)
        scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        q = (tiles / scale[:, None, :, None]).clamp(-448, 448).reshape(n, k).to(E4M3)
        state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    write_checkpoint(dst, config, state)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            (dst / f.name).write_bytes(f.read_bytes())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _dequantized(state: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """Every FP8 weight of `state` in float32 (per tensor, channel or block scales)."""
    out = {}
    for name, w in state.items():
        if w.dtype != E4M3:
            continue
        layer = name.removesuffix(".weight")
        s = state.get(f"{layer}.weight_scale", state.get(f"{layer}.weight_scale_inv")).float()
        if block is not None and s.numel() > 1 and s.dim() == 2:
            s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        else:
            s = s.reshape(-1, 1)
        out[name] = w.float() * s
    return out


def _reassembled(ranks: list[dict[str, torch.Tensor]], rules, config, ep: bool):
    """The ranks' dequantized slices put back together as `kind_of` says they were split."""
    qkv = rules.qkv_rows(config) if rules.qkv_rows is not None else None
    per = int(config.get(rules.expert_count_key, 0)) // len(ranks)
    whole: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        kind = kind_of(name, rules, ep)
        if kind == EXPERT:
            for r, part in enumerate(ranks):
                for local in [n for n in part if n == name]:
                    m = re.search(rules.expert_tensor, local)
                    glob = f"{local[: m.start(1)]}{int(m.group(1)) + r * per}{local[m.end(1) :]}"
                    whole[glob] = part[local]
        elif kind == COLUMN:
            whole[name] = torch.cat([part[name] for part in ranks])
        elif kind in (ROW, PARTIAL):
            whole[name] = torch.cat([part[name] for part in ranks], dim=1)
        elif kind == QKV:
            q, kv = (n // len(ranks) for n in qkv)
            pieces = [part[name].split([q, kv, kv]) for part in ranks]
            whole[name] = torch.cat([p[i] for i in range(3) for p in pieces])
        else:
            whole[name] = ranks[0][name]
    return whole


@pytest.mark.parametrize(
    ("family", "layout", "ep"),
    [
        ("dream", "channel", False),
        ("dream", (16, 16), False),
        ("llada2", "channel", False),
        ("llada2", "channel", True),
        ("llada2", (16, 16), False),
    ],
)
def test_each_ranks_fp8_slices_reassemble_the_stored_weights(tmp_path, family, layout, ep) -> None:
    """Each rank reads its slices of the e4m3 weights and the matching slices of their scales:
    dequantized and put back together, the ranks' slices are exactly the stored weights."""
    src = make_tiny_checkpoint(tmp_path / "src", family, seed=10)
    dst = tmp_path / "fp8"
    if layout == "channel":
        _as_published_fp8(src, dst, "channel")
        block = None
    else:
        _as_block_fp8(src, dst, layout)
        block = layout
    config = json.loads((dst / "config.json").read_text())
    published = {n: t for f in dst.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    stored = _dequantized(published, block)
    assert stored
    ranks = [
        _dequantized(
            read_shard(dst, family, config, r, 2, torch.device("cpu"), torch.float32, ep), block
        )
        for r in range(2)
    ]
    whole = _reassembled(ranks, rules_for(family, ep), config, ep)
    assert set(whole) == set(stored)
    for name, w in stored.items():
        assert torch.equal(whole[name], w), name


class _AsRanks(nn.Module):
    """A row layer on one device computing as 2 ranks do: each half of the inputs through its
    own `Fp8Linear` (its activations quantized over that half), the halves' products summed."""

    def __init__(self, halves: list[Fp8Linear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.halves, self.bias = nn.ModuleList(halves), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(len(self.halves), dim=-1)
        y = sum(h.product(p) for h, p in zip(self.halves, parts, strict=True))
        return y if self.bias is None else y + self.bias


def _round_as_ranks(lm: nn.Module, unquantized: nn.Module | None, rows: list[str]) -> None:
    """Make one device's FP8 `lm` round its row layers `rows` as 2 ranks do: the published
    weights and scales split by input columns (block scales by input blocks), or, quantized
    at load, each half of `unquantized`'s weight quantized on its own."""
    for name in rows:
        layer = lm.get_submodule(name)
        halves = []
        for i in range(2):
            if unquantized is not None:
                w = unquantized.get_submodule(name).weight.chunk(2, dim=1)[i]
                q, scale = quantize_rows(w)
                half = Fp8Linear(w.shape[1], w.shape[0], None, q, scale)
            else:
                w = layer.weight.chunk(2, dim=1)[i].contiguous()
                s = layer.weight_scale
                if layer.block is not None:
                    s = s.chunk(2, dim=1)[i].contiguous()
                half = Fp8Linear(w.shape[1], w.shape[0], None, w, s, layer.block)
            halves.append(half)
        bias = None if layer.bias is None else layer.bias.data
        parent, _, attr = name.rpartition(".")
        setattr(lm.get_submodule(parent), attr, _AsRanks(halves, bias))


def _check(
    path: str,
    quantization: str | None = None,
    reference: str | None = None,
    as_ranks: bool = False,
    **config,
):
    """TP=2 (or EP=2) on FP8 weights: rank 0 computes in FP8 (its row layers still summed over
    ranks); one forward's logits differ from one device's by less than FP8 differs from the
    unquantized `reference` (each rank quantizes a token's activations over its own inputs),
    and served requests finish. With `as_ranks`: one device made to round its row layers as
    the ranks do gives the ranks' logits and the same greedy tokens."""
    one = Engine(EngineConfig(model=path, quantization=quantization))
    full = Engine(EngineConfig(model=reference or path))
    two_config = EngineConfig(
        model=path, quantization=quantization, tensor_parallel_size=2, **config
    )
    engine = Engine(two_config)
    model = engine.runner.model
    try:
        local = list(model.local.modules())
        assert any(isinstance(m, Fp8Linear | Fp8Experts) for m in local)
        assert any(isinstance(m, RowParallelFp8Linear) for m in local)
        prompts = _prompts(one)
        x = torch.tensor([prompts[0] + [one.mask_id] * 12])
        with torch.no_grad():
            a, b = full_logits(one.runner.model)(x), full_logits(model)(x)
            exact = full_logits(full.runner.model)(x)
        assert 0 < _rel(b, a) < _rel(a, exact), (_rel(b, a), _rel(a, exact))
        outs = engine.generate(prompts, ROWS)
        assert all(o.finished for o in outs) and any(o.token_ids for o in outs)
        if as_ranks:  # one device rounding as the ranks do: their logits and greedy tokens
            rows = [
                n for n, m in model.local.named_modules() if isinstance(m, RowParallelFp8Linear)
            ]
            _round_as_ranks(one.runner.model, full.runner.model if quantization else None, rows)
            with torch.no_grad():
                c = full_logits(one.runner.model)(x)
            torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-4)
            assert [o.token_ids for o in outs] == _tokens(one, prompts, ROWS)
    finally:
        model.close()
        assert all(p.poll() is not None for p in model.workers.procs)


def test_published_per_channel_fp8_runs_at_tp2(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "dream", seed=11)
    _as_published_fp8(src, tmp_path / "fp8", "channel")
    _check(str(tmp_path / "fp8"), reference=str(src), as_ranks=True)


def test_published_block_fp8_runs_at_tp2(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "dream", seed=12)
    _as_block_fp8(src, tmp_path / "fp8", (16, 16))
    _check(str(tmp_path / "fp8"), reference=str(src), as_ranks=True)


def test_quantized_at_load_fp8_runs_at_tp2(tmp_path: Path) -> None:
    """Each rank quantizes its own shard: column layers get one device's scales, row layers
    scales over their slice of the inputs."""
    src = make_tiny_checkpoint(tmp_path / "src", "llada", seed=13)
    _check(str(src), quantization="fp8", as_ranks=True)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_llada2_published_fp8_runs_at_tp2_and_ep2(tmp_path: Path, expert_parallel) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "llada2", seed=14)
    _as_published_fp8(src, tmp_path / "fp8", "channel")
    _check(str(tmp_path / "fp8"), reference=str(src), expert_parallel=expert_parallel)


def test_a_split_that_cuts_a_scale_block_is_refused_by_layer(tmp_path: Path) -> None:
    """Dream's k/v have 32 rows: 16 a rank cuts blocks of 32 rows. Refused before any rank
    starts; 4-bit and bitsandbytes quantization stay refused by name."""
    src = make_tiny_checkpoint(tmp_path / "src", "dream", seed=15)
    _as_block_fp8(src, tmp_path / "fp8", (32, 32))
    path = str(tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"k_proj: tensor_parallel_size 2 .* FP8 scale blocks"):
        Engine(EngineConfig(model=path, tensor_parallel_size=2))
    assert not _any_worker_for(path)
    for scheme in ("int4", "int8", "nf4"):
        with pytest.raises(ValueError, match=f"quantization={scheme} is not supported"):
            Engine(EngineConfig(model=str(src), tensor_parallel_size=2, quantization=scheme))
