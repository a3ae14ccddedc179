"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..converters import chat_jobs, new_id
from ..dependencies import State, not_draining, require_api_key
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
async def chat_completions(request: Request, body: ChatCompletionRequest, state: State) -> Any:
    response_id = new_id("chatcmpl")
    jobs = chat_jobs(body, response_id, state.config)
    return await serve(request, state, "chat", body, jobs, response_id)
