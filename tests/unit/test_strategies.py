"""Decoding strategies live in one registry (`dlm_engine/decoding/strategies/`): the request
contract names exactly the registered algorithms, every strategy is documented in the
generated table, and a row's place in a step (KV slot, shared block phase, pages) is its
strategy's answer, the same for the scheduler and the model runner."""

from __future__ import annotations

import re

import pytest
import torch

from dlm_engine.decoding.commit_rules import (
    BOUNDED,
    DYNAMIC,
    ENTROPY,
    FACTOR,
    JOINT,
    LEAP,
    MULTI_BD,
    RANK,
    SEQUENTIAL,
    THRESHOLD,
    row_rule,
)
from dlm_engine.decoding.strategies import (
    MULTI_BLOCK,
    STRATEGIES,
    BlockStrategy,
    algorithms,
    algorithms_table,
    row_strategy,
    strategy_of,
)
from dlm_engine.errors import InvalidRequestError
from dlm_engine.models import FAMILIES, family_of
from dlm_engine.sampling_params import SamplingParams, resolve
from dlm_engine.sequence import Sequence
from dlm_protocol import docgen
from dlm_protocol.params import ALGORITHM_SUMMARIES, ALGORITHMS, BLOCK_ALGORITHM_KEYS

CPU = torch.device("cpu")


def _resolve(family: str, **keys):
    fam = family_of(family)
    return resolve(
        SamplingParams(**keys),
        family=fam,
        default_algorithm=fam.default_algorithm,
        uses_blocks=fam.uses_blocks_by_default,
        max_canvas=256,
        default_max_tokens=32,
        model_block=fam.default_block_length,
    )


def _row(family: str, **keys) -> Sequence:
    return Sequence("r", [5, 6, 7], _resolve(family, **keys), family=family, mask_id=99, device=CPU)


def test_the_contract_names_exactly_the_registered_algorithms() -> None:
    assert [s.name for s in algorithms()] == list(ALGORITHMS)
    assert set(ALGORITHM_SUMMARIES) == set(ALGORITHMS)
    block_keys = {s.name: s.keys for s in algorithms() if isinstance(s, BlockStrategy) and s.keys}
    assert block_keys == BLOCK_ALGORITHM_KEYS


def test_every_registered_strategy_is_documented() -> None:
    text = docgen.API_DOC.read_text()
    section = re.search(
        r"<!-- BEGIN GENERATED: algorithms -->\n(.*?)<!-- END GENERATED -->", text, re.S
    )
    assert section is not None, "docs/api.md lost its generated algorithms table"
    assert section.group(1) == algorithms_table(), "run python -m dlm_protocol.docgen"
    documented = re.findall(r"^\| `([a-z_0-9]+)`", section.group(1), re.M)
    assert documented == list(STRATEGIES)
    for s in STRATEGIES.values():
        assert s.source, s.name  # where it is published
        assert ALGORITHM_SUMMARIES.get(s.name, s.summary), s.name


def test_family_specific_strategies_name_their_families() -> None:
    own = {a for f in FAMILIES for a in f.own_algorithms}
    assert own == {s.name for s in STRATEGIES.values() if s.family_specific}
    assert "| `origin` | Dream |" in algorithms_table()
    with pytest.raises(InvalidRequestError, match="origin is Dream's") as e:
        _resolve("llada", algorithm="origin")
    assert e.value.field == "algorithm"
    with pytest.raises(InvalidRequestError, match="LLaDA") as e:
        _resolve("dream", algorithm="factor")
    assert e.value.field == "algorithm"


@pytest.mark.parametrize(
    ("family", "keys", "code"),
    [
        ("llada", {}, RANK),
        ("llada", {"threshold": 0.8}, THRESHOLD),
        ("llada", {"algorithm": "factor"}, FACTOR),
        ("llada", {"algorithm": "local_leap"}, LEAP),
        ("dream", {"algorithm": "entropy_threshold"}, ENTROPY),
        ("dream", {"multi_block": True}, ENTROPY),
        ("sdar", {}, DYNAMIC),
        ("sdar", {"algorithm": "low_confidence_static"}, RANK),
        ("sdar", {"algorithm": "sequential"}, SEQUENTIAL),
        ("sdar", {"algorithm": "entropy_bounded", "steps": 3}, BOUNDED),
        ("llada2", {"algorithm": "joint_threshold"}, JOINT),
        ("llada2", {"algorithm": "multi_bd"}, MULTI_BD),
    ],
)
def test_a_row_commits_by_its_strategys_rule(family: str, keys: dict, code: int) -> None:
    seq = _row(family, **keys)
    assert seq.rule is strategy_of(seq.params.algorithm)
    assert row_rule(seq).code == code


def test_one_definition_of_cached_phased_and_paged_rows() -> None:
    fast = _row("llada", cache="prefix")  # Fast-dLLM: refreshes at each block start
    assert (fast.slot_cached, fast.phased, fast.paged) == (True, True, False)
    dual = _row("dream", cache="dual")
    assert (dual.slot_cached, dual.phased, dual.paged) == (True, True, False)
    delayed = _row("llada", multi_block=True, cache="prefix")  # d3LLM's delayed cache
    assert delayed.strategy is MULTI_BLOCK and delayed.multi is not None
    assert delayed.multi.cache is not None
    assert (delayed.slot_cached, delayed.phased, delayed.paged) == (True, False, False)
    plain_multi = _row("dream", multi_block=True)
    assert plain_multi.multi is not None and plain_multi.multi.cache is None
    assert (plain_multi.slot_cached, plain_multi.phased) == (False, False)
    exact = _row("llada")
    assert (exact.slot_cached, exact.phased, exact.paged) == (False, False, False)
    block = _row("sdar")
    assert (block.slot_cached, block.phased, block.paged) == (False, False, True)
    assert row_strategy(block.params) is block.strategy is block.rule


def test_each_strategy_sets_up_its_own_row_state() -> None:
    editing = _row("llada2", algorithm="joint_threshold", edit_threshold=0.3)
    assert editing.editing and editing.params.edit_threshold == 0.3
    running = _row("sdar", algorithm="multi_bd", buffer_size=2)
    assert running.mbd is not None and running.mbd.buffer == 2 and not running.editing
    plain = _row("sdar")
    assert plain.mbd is None and plain.multi is None and not plain.editing
    assert _row("llada", algorithm="random").generator is not None  # draws at temperature 0
    assert _row("llada").generator is None


def test_a_strategys_own_keys_are_refused_for_another() -> None:
    with pytest.raises(InvalidRequestError) as e:
        _resolve("llada", algorithm="threshold", leap_radius=2)
    assert e.value.field == "leap_radius"
    with pytest.raises(InvalidRequestError) as e:
        _resolve("sdar", algorithm="multi_bd", edit_threshold=0.2)
    assert e.value.field == "edit_threshold"
    with pytest.raises(InvalidRequestError) as e:
        _resolve("llada", buffer_size=2)
    assert e.value.field == "buffer_size"
    with pytest.raises(InvalidRequestError) as e:
        _resolve("dream", algorithm="sequential")
    assert e.value.field == "algorithm"


def test_keys_that_imply_a_strategy_select_it() -> None:
    assert _resolve("llada", factor=2.0).algorithm == "factor"
    assert _resolve("llada", leap_radius=3).algorithm == "local_leap"
    assert _resolve("llada", use_local_leap=True).algorithm == "local_leap"
    assert _resolve("dream", block_add_threshold=0.2).algorithm == "entropy_threshold"
    assert _resolve("llada", threshold=0.7).algorithm == "threshold"


def test_thresholds_default_per_strategy_and_family() -> None:
    assert _resolve("sdar").threshold == 0.85
    assert _resolve("llada2").threshold == 0.95
    assert _resolve("sdar", algorithm="multi_bd").threshold == 0.95
    assert _resolve("llada2", algorithm="multi_bd").threshold == 0.9
    assert _resolve("llada", algorithm="threshold").threshold == 0.9
    assert _resolve("dream", algorithm="entropy_threshold").threshold == 0.5
    assert _resolve("sdar", algorithm="entropy_bounded", steps=3).threshold == 0.35
    assert _resolve("sdar", algorithm="sequential").threshold is None
