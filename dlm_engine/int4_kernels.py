"""Triton kernels for int4 weights (`int4.Int4Linear`), dispatched by the token rows M.

Two products, chosen per M by `DISPATCH`:
- fused: each tile of int4 weights is expanded to the activations' dtype in registers and fed
  to the tensor cores, so the weights are read from memory at a quarter of bf16's bytes (the
  win while M is small and a product is a read of the weights);
- dequantize, then cuBLAS: the whole weight expanded once into a scratch matrix and multiplied
  by cuBLAS, for large M where the product is bound by the tensor cores and cuBLAS's tiles beat
  the fused kernel's.
The table is what `benchmarks/gpu_check_int4.py` measured fastest on an H100 over the
LLaDA-8B-sized layers with 16-bit activations (the W4A8 tiles, e4m3 activations, are measured
too but not dispatched: they round the activations, which GPTQ/AWQ checkpoints are not
calibrated for); that script's sweep prints the table for another GPU. None of these products
beats bf16's cuBLAS time at a step's token counts on the H100 (docs/benchmarks.md, "4-bit
weights"): the int4 path saves memory, not time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tile:
    """One launch configuration of the fused kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # programs sharing one output tile along K (small M: more programs)
    warps: int = 4
    stages: int = 3
    a8: bool = False  # activations in e4m3 per token, FP8 tensor cores (Ada/Hopper)
    swap: bool = False  # y^T = W^T x^T (`_w4a16_swapped`): few tokens still fill the MMA
    strided: bool = False  # one product per nibble position (no reshape); K step 128+, 16-bit


# (largest M, tile; None: dequantize then cuBLAS), the first entry whose bound holds wins
DISPATCH: list[tuple[int, Tile | None]] = [
    (16, Tile(16, 64, 128, split_k=8, warps=4, stages=3, swap=True, strided=True)),
    (32, Tile(32, 64, 128, split_k=4, warps=4, stages=3, swap=True)),
    (128, Tile(64, 128, 64, warps=4, stages=4)),
    (1 << 62, None),
]


def choose(m: int) -> Tile | None:
    for bound, tile in DISPATCH:
        if m <= bound:
            return tile
    return None


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every token count
def _w4a16(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    xs_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    A8: tl.constexpr,
    STRIDED: tl.constexpr,
):
    grid_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % grid_m  # neighbouring programs share a weight tile: read once, then cached
    pid_n = pid // grid_m
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    # [BLOCK_K / 8, BLOCK_N] words, eight nibbles each, unpacked in registers
    q_ptrs = qw_ptr + tl.arange(0, BLOCK_K // 8)[:, None] * stride_qk + offs_n[None, :]
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    rows = tl.arange(0, BLOCK_K // 8) * 8
    for k0 in range(k_start, k_start + k_len, BLOCK_K):
        packed = tl.load(q_ptrs + (k0 // 8) * stride_qk, mask=mask_n[None, :], other=0)
        g = k0 // GROUP  # a K block never straddles two groups
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.float32)
        if STRIDED:  # nibble j of word row i is input 8i + j: eight products, no reshape
            for j in tl.static_range(8):
                a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + j + rows)[None, :]
                a_j = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                w_j = (((packed >> (4 * j)) & 0xF).to(tl.float32) - z[None, :]) * s[None, :]
                acc = tl.dot(a_j, w_j.to(a_j.dtype), acc)
        else:
            a = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            q = tl.reshape((packed[:, None, :] >> shifts) & 0xF, (BLOCK_K, BLOCK_N))
            q = q.to(tl.float32)
            if A8:  # q - zero is an integer in -16..15: exact in e4m3; the group scale after
                acc += tl.dot(a, (q - z[None, :]).to(tl.float8e4nv)) * s[None, :]
            else:
                acc = tl.dot(a, ((q - z[None, :]) * s[None, :]).to(a.dtype), acc)
    if A8:
        acc *= tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _w4a16_swapped(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    xs_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    A8: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """`_w4a16` as y^T = W^T x^T: the weight tile, expanded in registers, is the MMA's first
    operand (its 64-row side), the tokens the second, so a few tokens waste no MMA rows and
    the expanded weights need no trip through shared memory."""
    grid_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % grid_m
    pid_n = pid // grid_m
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    xt_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    qt_ptrs = qw_ptr + tl.arange(0, BLOCK_K // 8)[None, :] * stride_qk + offs_n[:, None]
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    rows = tl.arange(0, BLOCK_K // 8) * 8
    for k0 in range(k_start, k_start + k_len, BLOCK_K):
        packed = tl.load(qt_ptrs + (k0 // 8) * stride_qk, mask=mask_n[:, None], other=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.float32)
        if STRIDED:
            for j in tl.static_range(8):
                xt_ptrs_j = x_ptr + offs_m[None, :] * stride_xm + (k0 + j + rows)[:, None]
                xt_j = tl.load(xt_ptrs_j, mask=mask_m[None, :], other=0.0)
                w_j = (((packed >> (4 * j)) & 0xF).to(tl.float32) - z[:, None]) * s[:, None]
                acc = tl.dot(w_j.to(xt_j.dtype), xt_j, acc)
        else:
            xt = tl.load(xt_ptrs + k0, mask=mask_m[None, :], other=0.0)
            q = tl.reshape((packed[:, :, None] >> shifts) & 0xF, (BLOCK_N, BLOCK_K))
            q = q.to(tl.float32)
            if A8:
                acc += tl.dot((q - z[:, None]).to(tl.float8e4nv), xt) * s[:, None]
            else:
                acc = tl.dot(((q - z[:, None]) * s[:, None]).to(xt.dtype), xt, acc)
    if A8:
        acc *= tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit
def _dequantize(
    qw_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    K,
    stride_qk,
    stride_sg,
    stride_wk,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    packed = tl.load(qw_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :], mask=mask)
    q = ((packed >> ((offs_k[:, None] % 8) * 4)) & 0xF).to(tl.float32)
    sg = (offs_k[:, None] // GROUP) * stride_sg + offs_n[None, :]
    s = tl.load(s_ptr + sg, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sg, mask=mask, other=0).to(tl.float32)
    w = (q - z) * s
    tl.store(
        w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask
    )


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [K, N] in `dtype` (the layer's stored input order)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 128))
    _dequantize[grid](
        qweight, scales, zeros, w, n, k, qweight.stride(0), scales.stride(0), w.stride(0),
        GROUP=group, BLOCK_K=64, BLOCK_N=128,
    )  # fmt: skip
    return w


def _block_k(tile: Tile, k: int, group: int) -> int | None:
    """The tile's K step, shrunk until it divides both the group and K; None where none
    does (or, for a strided tile, none of 128 or more: eight products of 16 inputs)."""
    bk = min(tile.block_k, group)
    while bk > 16 and (group % bk or k % bk):
        bk //= 2
    if group % bk or k % bk or (tile.strided and bk < 128):
        return None
    return bk


def fused(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    tile: Tile,
) -> torch.Tensor:
    """x [M, K] times the int4 weight through the fused kernel with `tile`."""
    m, k = x.shape
    n = qweight.shape[1]
    out_dtype = x.dtype
    x = x.contiguous()
    xs = x  # per-token scales of the e4m3 activations (unused in 16 bits)
    if tile.a8:
        from .fp8 import quantize_tokens

        x, xs = quantize_tokens(x)
    bk = _block_k(tile, k, group)
    if bk is None or (tile.a8 and tile.strided):
        raise ValueError(f"tile {tile} does not fit K={k} in groups of {group}")
    split = tile.split_k
    while split > 1 and k % (bk * split):
        split //= 2
    if split == 1:
        y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), split)
    kernel = _w4a16_swapped if tile.swap else _w4a16
    kernel[grid](
        x, qweight, scales, zeros, y, xs, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=bk, SPLIT_K=split,
        A8=tile.a8, STRIDED=tile.strided, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return y if split == 1 else y.to(out_dtype)


def matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """x [M, K] (16-bit, the stored input order) times the int4 weight: [M, N]."""
    tile = choose(x.shape[0])
    if tile is None or _block_k(tile, x.shape[1], group) is None:
        # large M, or inputs no K step of 16+ divides: expand the weight, then cuBLAS
        return x @ dequantize(qweight, scales, zeros, group, x.dtype)
    return fused(x, qweight, scales, zeros, group, tile)
