"""The planner's error, importable by every planner file without an import circle."""
from __future__ import annotations

from ..memory import format_bytes

__all__ = ["BudgetTooSmallError"]


class BudgetTooSmallError(ValueError):
    """No checkpoint schedule fits the budget; ``smallest`` is the lowest feasible budget."""

    def __init__(self, budget: int | float, smallest: int, plain: int) -> None:
        self.budget, self.smallest, self.plain = budget, smallest, plain
        super().__init__(
            f"memory budget {format_bytes(budget)} ({budget} bytes) is below the smallest peak "
            f"any checkpoint schedule of this model reaches on this input: "
            f"{format_bytes(smallest)} ({smallest} bytes; plain training needs "
            f"{format_bytes(plain)}). Give a budget of at least {smallest} bytes, or use a "
            f"smaller batch.")
