"""GET /v1/models and /v1/models/{id}: the models READY in Triton."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends

from ..dependencies import State, require_api_key
from ..schemas import ModelCard, ModelList
from ._responses import error_responses

router = APIRouter(dependencies=[Depends(require_api_key)])


def _card(model_id: str) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "dlm-triton",
    }


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
async def list_models(state: State) -> Any:
    backend = state.backend
    if not backend.any_ready():
        await backend.refresh()
        if not backend.any_ready():
            raise backend.unavailable()
    return {"object": "list", "data": [_card(m) for m in backend.ready_models()]}


@router.get(
    "/v1/models/{model_id}", response_model=ModelCard, responses=error_responses(401, 404, 503)
)
async def get_model(model_id: str, state: State) -> Any:
    await state.backend.check_model(model_id)
    return _card(model_id)
