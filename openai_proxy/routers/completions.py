"""POST /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from .. import tenancy
from ..converters import completion_jobs, new_id
from ..dependencies import State, TenantKey, not_draining, require_api_key
from ..generation import serve
from ..schemas import CompletionRequest, CompletionResponse
from ._responses import ERROR_RESPONSES

router = APIRouter(dependencies=[Depends(require_api_key), Depends(not_draining)])


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=ERROR_RESPONSES,
    summary="Text completion of raw prompts or token ids (stream=true: SSE chunks)",
)
async def completions(
    request: Request, body: CompletionRequest, state: State, tenant: TenantKey
) -> Any:
    response_id = new_id("cmpl")
    jobs = completion_jobs(body, response_id, state.config)
    tenancy.salt_jobs(jobs, tenant)  # with API keys: cached prompts stay the key's own
    return await serve(request, state, "completion", body, jobs, response_id)
