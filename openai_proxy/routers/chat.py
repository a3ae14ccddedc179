"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from .. import tenancy
from ..converters import chat_jobs, new_id
from ..dependencies import State, TenantKey, not_draining, require_api_key
from ..generation import serve
from ..schemas import ChatCompletionRequest, ChatCompletionResponse
from ._responses import ERROR_RESPONSES

router = APIRouter(dependencies=[Depends(require_api_key), Depends(not_draining)])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=ERROR_RESPONSES,
    summary="Chat completion (stream=true: SSE chunks)",
)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, state: State, tenant: TenantKey
) -> Any:
    response_id = new_id("chatcmpl")
    jobs = chat_jobs(body, response_id, state.config)
    tenancy.salt_jobs(jobs, tenant)  # with API keys: cached prompts stay the key's own
    return await serve(request, state, "chat", body, jobs, response_id)
