"""The proxy's routes, one router per concern (in the shape of Triton's OpenAI frontend)."""

from .. import limits
from . import chat, completions, models, observability

ROUTERS = (chat.router, completions.router, models.router, observability.router, limits.router)

__all__ = ["ROUTERS"]
