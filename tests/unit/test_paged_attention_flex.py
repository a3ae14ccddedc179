"""`paged_attention=flex` (dlm_engine/paged_flex.py) reads block rows' keys in place through
their page tables; it must see exactly the keys the gather path sees.

Attention level: on random pools (float32, CPU) whose rows share prefix pages, end in a
partial page and carry trash-page entries (their tables and padding rows), the packed
forward's block attention equals both the gather path and a direct per-row softmax over the
row's logical keys; the trash page holds huge keys, so a glimpse of it would show. Engine
level: the tiny SDAR and LLaDA2 checkpoints give the same tokens with `flex` as with
`gather`, each request alone and batched with unlike rows, and with shared prompt pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from block_checks import check_alone_and_batched

from dlm_engine import paged_flex
from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_engine.paged_kv import PagePool
from dlm_engine.parallel import ParallelLM
from dlm_engine.ragged import PackedAttention, RowQuery, packed_bucket, plan_packed
from dlm_lab import testing

HEADS, KV, DIM, PT = 4, 2, 16, 16


def _pool(pages: int = 12) -> PagePool:
    g = torch.Generator().manual_seed(1)
    pool = PagePool(1, pages, PT, KV, DIM, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    pool.k[0][pool.trash] = 50.0  # a trash key seen anywhere would dominate its softmax
    pool.v[0][pool.trash] = 1e3
    return pool


# (first fed position, length, block, page table): rows 0 and 1 share pages 0-1 (a prompt
# prefix at the same positions), row 2 is short, row 3 a prefill; lengths end mid-page
ROWS = [
    (36, 40, 4, [0, 1, 2]),
    (40, 44, 4, [0, 1, 3]),
    (8, 12, 4, [4]),
    (0, 50, 8, [5, 6, 7, 8]),
]


def _queries(rows=ROWS) -> list[RowQuery]:
    return [
        RowQuery(torch.zeros(end - start, dtype=torch.long), start, end, start, None, blk, pgs)
        for start, end, blk, pgs in rows
    ]


def _plan(pool: PagePool, mode: str, bucket: bool, rows=ROWS):
    return plan_packed(
        _queries(rows), width=4, shift=0, pad_id=0, device=torch.device("cpu"), pool=None,
        bucket=bucket, query_multiple=1, pages=pool, paged_attention=mode,
    )  # fmt: skip


def _attend(pool: PagePool, plan, q, k, v) -> torch.Tensor:
    ctx = PackedAttention(plan.inputs, None, plan.layout, pool)
    return ctx.attend(0, q, k, v)[0].transpose(0, 1)[: plan.tokens]  # real tokens [N, H, D]


def _forward(pool: PagePool, mode: str, bucket: bool, q, k, v, rows=ROWS) -> torch.Tensor:
    plan = _plan(pool, mode, bucket, rows)
    assert (paged_flex.PAGES in plan.inputs) == (mode == "flex")
    return _attend(pool, plan, q, k, v)


def _direct(pool: PagePool, q: torch.Tensor, rows=ROWS) -> torch.Tensor:
    """Per row and query: softmax over the row's logical keys below the query's block end."""
    outs, base = [], 0
    for start, end, blk, pgs in rows:
        keys = pool.k[0][pgs].reshape(-1, KV, DIM)
        values = pool.v[0][pgs].reshape(-1, KV, DIM)
        for j in range(end - start):
            limit = min(((start + j) // blk + 1) * blk, end)
            qj = q[0, :, base + j].view(KV, HEADS // KV, DIM)  # query heads by their KV head
            s = torch.einsum("grd,kgd->grk", qj, keys[:limit]) / DIM**0.5
            outs.append(
                torch.einsum("grk,kgd->grd", s.softmax(-1), values[:limit]).reshape(-1, DIM)
            )
        base += end - start
    return torch.stack(outs)


def _packed(n: int, seed: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, n, DIM, generator=g)
    k = torch.randn(1, KV, n, DIM, generator=g)
    v = torch.randn(1, KV, n, DIM, generator=g)
    return q, k, v


@pytest.mark.parametrize("bucket", [False, True])
def test_flex_equals_gather_and_the_direct_softmax(bucket: bool) -> None:
    n = sum(end - start for start, end, _, _ in ROWS)
    q, k, v = _packed(packed_bucket(n) if bucket else n)  # the padded tail: the plan's
    gather_pool, flex_pool = _pool(), _pool()
    got = _forward(flex_pool, "flex", bucket, q, k, v)
    want = _forward(gather_pool, "gather", bucket, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the fresh keys went to the same places (the trash page took the padded positions)
    assert torch.equal(flex_pool.k[0][:-1], gather_pool.k[0][:-1])
    torch.testing.assert_close(got, _direct(flex_pool, q), rtol=1e-5, atol=1e-5)
    assert got.abs().max() < 50, "no trash value leaked into a real row"


def test_a_failed_flex_call_gathers_from_then_on_and_says_so(monkeypatch) -> None:
    """A kernel that cannot run here (a compiler failure on a GPU) costs speed, not answers:
    the forward gathers the same pages, later forwards do not try again, and the fallback
    is reported where the fused kernels' are (ready line, metric)."""
    from dlm_engine.models.common import FusedKernels

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(paged_flex, "flex_attention", broken)
    monkeypatch.setattr(paged_flex._Compiled, "failed", False)
    monkeypatch.setattr(FusedKernels, "fallbacks", [])
    n = sum(end - start for start, end, _, _ in ROWS)
    q, k, v = _packed(packed_bucket(n))
    want = _forward(_pool(), "gather", True, q, k, v)
    for _ in range(2):
        torch.testing.assert_close(_forward(_pool(), "flex", True, q, k, v), want)
    assert len(calls) == 1
    assert FusedKernels.fallbacks == ["paged_attention_flex"]


def test_a_prompt_wider_than_the_flex_limit_gathers_its_step() -> None:
    """Each query width compiles the flex call once, so a step feeding a long prompt gathers
    (the compiled shapes stay the denoising widths); the same answer either way."""
    wide = paged_flex.MAX_QUERY + 40
    rows = [(0, wide, 4, list(range(-(-wide // PT)))), (36, 40, 4, [11, 12, 13])]
    n = wide + 4
    q, k, v = _packed(packed_bucket(n), seed=4)
    pool = _pool(pages=16)
    plan = _plan(pool, "flex", True, rows)
    assert paged_flex.PAGES not in plan.inputs and "block_pages" in plan.inputs
    assert paged_flex.PAGES in _plan(pool, "flex", True, rows[1:]).inputs
    got = _attend(pool, plan, q, k, v)
    torch.testing.assert_close(got, _direct(pool, q, rows), rtol=1e-5, atol=1e-5)


def test_one_row_alone_sees_its_pages_only() -> None:
    """A row whose pages sit among other rows' pages of the pool (not in this forward)."""
    rows = [(44, 46, 4, [7, 2, 9])]
    q, k, v = _packed(packed_bucket(2), seed=3)
    pool = _pool()
    got = _forward(pool, "flex", True, q, k, v, rows)
    torch.testing.assert_close(got, _direct(pool, q, rows), rtol=1e-5, atol=1e-5)


def test_host_inputs_map_pages_to_their_logical_index() -> None:
    trash = 9
    table = np.array([[3, 1, 4, trash], [3, 1, 5, 6], [trash] * 4])  # row 2: padding
    limit = np.array([[40, 48], [52, 52], [1, 1]])
    got = paged_flex.host_inputs(table, limit, 16, trash)
    assert got[paged_flex.BLOCKS].ravel().tolist() == [3, 4, 1]
    logical = got[paged_flex.LOGICAL]
    assert [logical[p] for p in (3, 1, 4, 5, 6, trash)] == [0, 1, 2, 2, 3, 0]
    with pytest.raises(RuntimeError, match="two logical indices"):
        paged_flex.host_inputs(np.array([[1, 2], [2, 1]]), limit[:2], 16, trash)


def test_host_inputs_pad_the_table_to_a_power_of_two_width() -> None:
    """Compiled shapes stay static and few: a table of 5 pages a row becomes 8 wide, the
    added columns trash, the pages each row reads and the page map as before."""
    trash = 20
    table = np.array([[3, 1, 4, 7, 8], [2, 5, trash, trash, trash]])
    limit = np.array([[70, 80], [20, 30]])
    got = paged_flex.host_inputs(table, limit, 16, trash)
    pages = got[paged_flex.PAGES].reshape(2, -1)
    assert pages.shape == (2, 8)
    assert (pages[:, :5] == table).all() and (pages[:, 5:] == trash).all()
    assert got[paged_flex.BLOCKS].ravel().tolist() == [5, 2]
    four = paged_flex.host_inputs(table[:, :4], limit, 16, trash)  # already a power of two
    assert four[paged_flex.PAGES].shape[-1] == 4


def test_kernel_tile_divides_the_page() -> None:
    assert [paged_flex.kernel_block(p) for p in (16, 20, 32, 48, 128)] == [16, 0, 32, 16, 64]
    assert paged_flex.supported(20, torch.device("cpu"))
    assert not paged_flex.supported(20, torch.device("cuda"))


PROMPTS = ["Hello there", "abc", "What is 2+2? Tell me more.", "x"]
SYSTEM = "You are a careful assistant. Answer in one short line. "
CASES = {
    "sdar": [
        {"max_tokens": 13, "block_length": 4, "steps": 4},
        {"max_tokens": 12, "block_length": 8, "steps": 4, "algorithm": "sequential"},
    ],
    "llada2": [
        {"max_tokens": 16, "block_length": 8, "steps": 8},
        {"max_tokens": 12, "block_length": 4, "steps": 2, "threshold": 0.2},
    ],
}


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_flex_engine_gives_the_gather_tokens(family: str, tmp_path) -> None:
    path = testing.make_tiny_checkpoint(tmp_path / family, family)
    config = {"model": str(path), "device": "cpu", "kv_cache_tokens": 2048}
    gather = Engine(EngineConfig(**config))
    flex = Engine(EngineConfig(**config, paged_attention="flex"), gather.loaded)
    assert flex.runner.paged_attention == "flex"

    def reference(_engine: Engine, prompt: list[int], case: dict) -> list[int]:
        return gather.generate([prompt], case)[0].token_ids

    # unlike rows (lengths, blocks), and prompts sharing a prefix's pages
    texts = PROMPTS + [SYSTEM + "2+2?", SYSTEM + "Name a color."]
    prompts = [flex.encode_prompt(text=t) for t in texts]
    pairs = [(p, c) for c in CASES[family] for p in prompts]
    expected = check_alone_and_batched(flex, pairs, reference, past=4)
    assert flex.runner.prefix_cache.hit_tokens > 0, "shared prompt pages were read in place"
    # the CUDA-graph path's bucketed shapes (padded rows, queries and pages) on the CPU
    bucketed = Engine(EngineConfig(**config, paged_attention="flex"), gather.loaded)
    graphs = testing.EagerGraphs()
    bucketed.runner.graphs, bucketed.runner.length_multiple = graphs, 32
    got = bucketed.generate([p for p, _ in pairs], [c for _, c in pairs])
    assert [o.token_ids for o in got] == expected
    assert any(paged_flex.LOGICAL in shapes for shapes in graphs.shapes)


def test_tensor_parallel_ranks_read_the_pages_in_place(tmp_path, one_thread_per_rank) -> None:
    """The flex index tensors travel with the plan's inputs: a worker rank, which never sees
    the setting, runs the same path (the gather path's page table is not even sent)."""
    path = str(testing.make_tiny_checkpoint(tmp_path / "sdar", "sdar", seed=1))
    one = Engine(EngineConfig(model=path, kv_cache_tokens=2048))
    two = Engine(
        EngineConfig(
            model=path, kv_cache_tokens=2048, paged_attention="flex", tensor_parallel_size=2
        )
    )
    model = two.runner.model
    try:
        assert isinstance(model, ParallelLM) and len(model.workers.pids) == 1
        prompts = [one.encode_prompt(text=t) for t in PROMPTS[:3]]
        case = {"max_tokens": 12, "block_length": 4, "steps": 4}
        got = [o.token_ids for o in two.generate(prompts, case)]
        assert got == [o.token_ids for o in one.generate(prompts, case)]
    finally:
        model.close()
