"""KVPool: rows lent and packed, slots grown without losing what was written."""

from __future__ import annotations

import torch

from eyas.scheduler.kv_pool import KVPool


def fill(pool: KVPool, row: int, value: float, length: int) -> None:
    pool.cache.keys[:, row, :, :length] = value
    pool.cache.values[:, row, :, :length] = -value


def test_rows_are_packed_when_requests_leave(tiny_target):
    pool = KVPool(tiny_target, rows=4, max_slots=64, initial_slots=8)
    owners = [object() for _ in range(4)]
    rows = [pool.allocate(o) for o in owners]
    assert rows == [0, 1, 2, 3] and pool.num_free == 0
    for row in rows:
        fill(pool, row, float(row + 1), 5)
    pool.free(0)
    pool.free(2)
    moves = pool.compact()
    assert moves == [(owners[3], 3, 0)]  # the highest row fills the lowest hole
    for owner, source, target in moves:
        pool.move_row(source, target, 5)
    assert pool.owners == [owners[3], owners[1], None, None]
    assert torch.all(pool.cache.keys[:, 0, :, :5] == 4.0)
    assert torch.all(pool.cache.values[:, 0, :, :5] == -4.0)
    assert pool.allocate(object()) == 2


def test_slots_grow_by_doubling_and_keep_contents(tiny_target):
    pool = KVPool(tiny_target, rows=2, max_slots=40, initial_slots=8)
    fill(pool, 1, 3.0, 8)
    pool.ensure_slots(9)
    assert pool.slots == 16
    assert torch.all(pool.cache.keys[:, 1, :, :8] == 3.0)
    pool.ensure_slots(33)
    assert pool.slots == 40  # capped at max_slots
    view = pool.view(1, 2)
    view.keys[:, 0, :, 20] = 7.0  # a view writes through to the pool
    assert torch.all(pool.cache.keys[:, 1, :, 20] == 7.0)


def test_a_row_s_view_is_kept_until_the_slots_grow(tiny_target):
    pool = KVPool(tiny_target, rows=2, max_slots=64, initial_slots=8)
    view = pool.view(1, 2)
    assert pool.view(1, 2) is view and pool.view(0, 2) is not view  # the same rows: the same view
    pool.ensure_slots(8)  # no growth
    assert pool.view(1, 2) is view
    pool.ensure_slots(9)
    grown = pool.view(1, 2)
    assert grown is not view and grown.keys.shape[3] == 16 and grown.max_slots == 16
    grown.keys[:, 0, :, 12] = 5.0  # the new view writes through to the grown storage
    assert torch.all(pool.cache.keys[:, 1, :, 12] == 5.0)


def test_swap_exchanges_the_first_slots_of_two_rows_and_their_taps(tiny_target):
    pool = KVPool(tiny_target, rows=3, max_slots=16, initial_slots=8)
    for row in range(3):
        fill(pool, row, float(row + 1), 8)
    pool.write_taps(0, 0, torch.full((8, 2), 1.0))
    pool.write_taps(2, 0, torch.full((8, 2), 3.0))
    pool.swap_now(0, 2, 5)
    assert torch.all(pool.cache.keys[:, 0, :, :5] == 3.0) and torch.all(pool.cache.keys[:, 0, :, 5:8] == 1.0)
    assert torch.all(pool.cache.values[:, 2, :, :5] == -1.0) and torch.all(pool.cache.values[:, 2, :, 5:8] == -3.0)
    assert torch.all(pool.cache.keys[:, 1, :, :8] == 2.0)  # the third row is untouched
    assert torch.all(pool.taps[0, :5] == 3.0) and torch.all(pool.taps[0, 5:8] == 1.0)
    assert torch.all(pool.taps[2, :5] == 1.0) and torch.all(pool.taps[2, 5:8] == 3.0)


def test_grown_slots_doubles_from_the_start_until_the_need_fits() -> None:
    from eyas.scheduler.kv_pool import grown_slots

    assert [grown_slots(need, 256) for need in (1, 256, 257, 512, 513, 1025)] == [256, 256, 512, 512, 1024, 2048]
    assert grown_slots(300, 64) == 512
    assert grown_slots(3, 0) == 4  # an empty start still doubles
