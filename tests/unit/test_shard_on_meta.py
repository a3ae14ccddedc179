"""Sharding a model built on the meta device keeps every tensor there.

A rank builds its model on the meta device and reads only its slices of the checkpoint; a
sharded layer made on the host instead would be drawn at random in float32 and thrown away
at load, so each rank of a 100B model held tens of GB it never used (four ranks of
LLaDA2.0-flash ran a 512 GiB host out of memory)."""

from __future__ import annotations

import pytest
import torch

from dlm_engine.models import build_model, detect_family
from dlm_engine.parallel.sharding import rules_for, shard_model
from dlm_engine.presets import PRESETS

SHRINK = {"n_layers": 2, "num_hidden_layers": 2}  # the published widths, two layers
WORLD = 4
# split by heads, DiffusionGemma's full layers' 2 key/value heads take at most 2 ranks
WORLD_OF = {("diffusiongemma-26b-a4b", False): 2}


def _cases() -> list[tuple[str, bool]]:
    cases = []
    for name, preset in PRESETS.items():
        family = detect_family(preset).name
        for ep in (False, True):
            try:
                rules = rules_for(family, ep)
            except ValueError:
                continue
            if ep and rules.expert_list is None and rules.expert_stack is None:
                continue  # a dense family has no experts to spread
            cases.append((name, ep))
    return cases


@pytest.mark.parametrize(("preset", "expert_parallel"), _cases())
def test_sharding_a_meta_model_allocates_nothing(preset: str, expert_parallel: bool) -> None:
    config = dict(PRESETS[preset])
    config.update({k: v for k, v in SHRINK.items() if k in config})
    family = detect_family(config)
    with torch.device("meta"):
        model = build_model(family, config)
    world = WORLD_OF.get((preset, expert_parallel), WORLD)
    shard_model(model, family.name, world, rank=1, expert_parallel=expert_parallel)
    on_host = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != "meta"
    ]
    assert not on_host, f"{len(on_host)} tensors made on the host, e.g. {on_host[:3]}"
