"""A model family lives in one file: no code outside `dlm_engine/models/` compares a family's
name. Read from the syntax tree of every serving package, so `family == "llada"`,
`name != "dream"` and `family in ("sdar", "llada2")` are all caught wherever they appear."""

from __future__ import annotations

import ast
from pathlib import Path

from dlm_engine.models import FAMILIES, Family, detect_family, family_of

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("dlm_engine", "dlm_triton", "dlm_protocol", "openai_proxy", "client")
HOME = ROOT / "dlm_engine" / "models"
NAMES = {f.name for f in FAMILIES}


def _family_literals(node: ast.AST) -> set[str]:
    """Family names among a comparison operand: a string, or a tuple / list / set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {
        i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)
    } & NAMES


def family_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of every comparison of a family-name literal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in sorted(_family_literals(operand))]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, name) for name in sorted(_family_literals(node.value))]
    return found


def test_the_scan_finds_each_form_of_comparison() -> None:
    src = (
        'a = family == "llada"\nb = "dream" != name\nc = f in ("sdar", "x")\n'
        'match f:\n    case "llada2":\n        pass\nd = f == "other"\n'
    )
    assert family_comparisons(src) == [(1, "llada"), (2, "dream"), (3, "sdar"), (5, "llada2")]


def test_no_family_name_is_compared_outside_the_family_files() -> None:
    offenders = []
    for package in SERVING:
        for path in sorted((ROOT / package).rglob("*.py")):
            if HOME in path.parents:
                continue
            for line, name in family_comparisons(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{line} compares {name!r}")
    assert not offenders, "ask the family object (models/family.py) instead:\n" + "\n".join(
        offenders
    )


def test_each_family_is_registered_once_and_detects_its_own_config() -> None:
    assert len(NAMES) == len(FAMILIES)
    configs = {
        "llada": {"model_type": "llada"},
        "dream": {"architectures": ["DreamModel"]},
        "sdar": {"architectures": ["SDARForCausalLM"]},
        "sdar_moe": {"architectures": ["SDARMoeForCausalLM"]},  # not SDAR's dense layout
        "llada2": {"architectures": ["LLaDA2MoeModelLM"]},  # not LLaDA's, though it starts so
        "diffusion_gemma": {"model_type": "diffusion_gemma"},
        "fast_dllm_v2": {"architectures": ["Fast_dLLM_QwenForCausalLM"]},  # Qwen2, not Dream
    }
    assert set(configs) == NAMES
    for name, config in configs.items():
        assert detect_family(config) is family_of(name)
        assert family_of(family_of(name)) is family_of(name)


def test_family_capabilities_are_attributes() -> None:
    llada, dream, sdar, llada2 = (family_of(n) for n in ("llada", "dream", "sdar", "llada2"))
    assert isinstance(llada, Family)
    assert llada.supports_cfg and not dream.supports_cfg
    assert "origin" in dream.own_algorithms and "origin" not in llada.own_algorithms
    assert sdar.default_thresholds["low_confidence_dynamic"] == 0.85
    assert llada2.default_thresholds["multi_bd"] == 0.9
    assert llada2.steps_capped_by_length and not sdar.steps_capped_by_length
    assert sdar.block_diffusion and sdar.default_block_length == 4
