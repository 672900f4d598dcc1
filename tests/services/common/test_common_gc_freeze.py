"""A replica's start-up objects leave the garbage collector's generations (services/common/gc_freeze.py)."""

from __future__ import annotations

import gc

from genserve.services.common.gc_freeze import freeze_loaded_objects


def test_objects_alive_at_start_up_are_frozen_and_later_ones_are_collected():
    loaded = [{"token": i} for i in range(10_000)]  # a vocabulary's worth of long-lived objects
    try:
        freeze_loaded_objects()
        assert gc.get_freeze_count() >= len(loaded)
        frozen = gc.get_freeze_count()
        cycle = []
        cycle.append(cycle)  # garbage made after start-up is still found
        del cycle
        assert gc.collect() >= 1 and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
