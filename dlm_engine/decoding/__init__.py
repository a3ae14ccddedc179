"""Decoding policies: proposals and confidences, transfer schedules, batched selection."""

from .proposals import RowDecode, RowIndex, propose
from .schedules import DreamSchedule, llada_block_schedule
from .selection import select_transfers

__all__ = [
    "DreamSchedule",
    "RowDecode",
    "RowIndex",
    "llada_block_schedule",
    "propose",
    "select_transfers",
]
