"""Write a dense checkpoint in the published 4-bit layouts (GPTQ as GPTQModel writes it, AWQ's
GEMM layout), for tests and labs: the loader must read what publishers write.

Quantization here is round-to-nearest per group (GPTQ's error-compensating solver changes which
integers are chosen, not how they are stored). Written independently of `dlm_engine`'s
unpacking, bit by bit from the formats' definitions:
- GPTQ `qweight` int32 [K/8, N]: bits 4j..4j+3 of word [i, n] hold input 8i + j of output n;
  `qzeros` int32 [G, N/8]: bits 4j..4j+3 of word [g, i] hold the zero point of output 8i + j,
  minus one in the `gptq` (v1) format; `scales` float16 [G, N]; `g_idx` int32 [K];
- AWQ `qweight` int32 [K, N/8] and `qzeros` [G, N/8]: nibble j of word [r, i] holds output
  8i + (0, 2, 4, 6, 1, 3, 5, 7)[j]; `scales` float16 [G, N].
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .testing import write_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_KEEP_DENSE = ("wte", "embed", "lm_head", "norm", "gate.weight", "model.transformer.ff_out.weight")
_INDEX = "model.safetensors.index.json"


def _word(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """Eight int64 tensors of values 0..15 -> the int32 whose nibble j is nibbles[j]."""
    word = torch.zeros_like(nibbles[0])
    for j, v in enumerate(nibbles):
        word |= (v & 0xF) << (4 * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantize_rtn(
    w: torch.Tensor, group: int, sym: bool, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of `w` [N, K], groups taken along `order` (act-order: the inputs
    most important first). Returns q [N, K] and each input's group g_idx [K] in the original
    input order, scales float16 [G, N] and integer zeros [G, N]."""
    n, k = w.shape
    wp = w.float()[:, order].reshape(n, k // group, group)
    if sym:
        amax = wp.abs().amax(-1)
        scale = (2 * amax / 15).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = (-lo / scale).round().clamp(0, 15)
    qp = (wp / scale[..., None]).round() + zero[..., None]
    qp = qp.clamp(0, 15).to(torch.int64).reshape(n, k)
    q = torch.empty_like(qp)
    q[:, order] = qp
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return q, g_idx, scale.t().half(), zero.t().to(torch.int64)


def dequantize_reference(
    q: torch.Tensor, g_idx: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """float32 [N, K]: w[n, k] = (q[n, k] - zero[g_idx[k], n]) * scale[g_idx[k], n]."""
    g = g_idx.long()
    return (q.float() - zeros[g].t().float()) * scales[g].t().float()


def gptq_tensors(
    w: torch.Tensor, group: int, sym: bool, desc_act: bool, v1: bool, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A layer's GPTQ tensors (qweight, qzeros, scales, g_idx) and its dequantized weight."""
    n, k = w.shape
    if desc_act:  # GPTQ orders inputs by Hessian diagonal; any order exercises the layout
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(k)
    q, g_idx, scales, zeros = quantize_rtn(w, group, sym, order)
    if v1 and bool((zeros == 0).any()):
        raise ValueError("GPTQ's v1 format stores zero - 1: a zero point of 0 needs gptq_v2")
    qt = q.t()  # [K, N]
    qweight = _word([qt[j::8] for j in range(8)])
    stored = zeros - 1 if v1 else zeros  # [G, N]
    qzeros = _word([stored[:, j::8] for j in range(8)])
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return tensors, dequantize_reference(q, g_idx, scales, zeros)


def awq_tensors(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A layer's AWQ GEMM tensors (qweight, qzeros, scales) and its dequantized weight."""
    n, k = w.shape
    q, g_idx, scales, zeros = quantize_rtn(w, group, False, torch.arange(k))
    qt = q.t()  # [K, N]
    qweight = _word([qt[:, o::8] for o in AWQ_ORDER])
    qzeros = _word([zeros[:, o::8] for o in AWQ_ORDER])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, dequantize_reference(
        q, g_idx, scales, zeros
    )


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    method: str = "gptq",
    group: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    dequantized_dir: Path | None = None,
) -> dict[str, torch.Tensor]:
    """`src` (a dense checkpoint) rewritten as a published GPTQ or AWQ checkpoint in `dst`;
    returns the dequantized weight of each quantized layer by its `.weight` name. With
    `dequantized_dir`, also writes the dense checkpoint of those dequantized weights (the
    reference a 4-bit forward must match)."""
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    dense = dict(state)
    reference: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        w = state[name]
        if not name.endswith(".weight") or w.dim() != 2 or any(s in name for s in _KEEP_DENSE):
            continue
        if method == "gptq":
            v1 = checkpoint_format == "gptq"
            # layers of one block reading the same width share an input order, as GPTQ's
            # act-order gives the layers of one input (q/k/v, gate/up): they stay fusable
            seed = zlib.crc32(name.rsplit(".", 2)[0].encode()) + w.shape[1]
            tensors, deq = gptq_tensors(w, group, sym, desc_act, v1, seed=seed)
        else:
            tensors, deq = awq_tensors(w, group)
        del state[name]
        path = name.removesuffix(".weight")
        state.update({f"{path}.{part}": t for part, t in tensors.items()})
        reference[name] = deq
        dense[name] = deq.to(w.dtype)
    if method == "gptq":
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": checkpoint_format,
            "true_sequential": True,
        }
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
        qc["version"] = "gemm"
    if dequantized_dir is not None:
        write_checkpoint(dequantized_dir, config, dense)
        _copy_tokenizer(src, dequantized_dir)
    write_checkpoint(dst, dict(config, quantization_config=qc), state)
    _copy_tokenizer(src, dst)
    return reference


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """Tokenizer files and generation config as they are."""
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", _INDEX):
            (dst / f.name).write_bytes(f.read_bytes())
