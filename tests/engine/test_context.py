"""Context bookkeeping helpers (`server.engine.context`)."""

from __future__ import annotations

import pytest

from server.engine.context import slot_indices


@pytest.mark.parametrize(("start", "end"), [(0, 0), (5, 5), (0, 1), (3, 40), (16, 48), (15, 17), (37, 300)])
def test_slot_indices_are_each_positions_block_and_offset(start: int, end: int) -> None:
    table = [7, 2, 9, 0, 4, 11, 3, 8, 1, 6, 5, 10, 12, 13, 15, 14, 16, 17, 18, 19]
    expected = [table[p // 16] * 16 + p % 16 for p in range(start, end)]
    assert slot_indices(table, start, end, 16) == expected
