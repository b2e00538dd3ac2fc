"""A tier's tasks: kinds and statuses are enums that still compare equal to, and print as, their string values
(SGLang's backend and the logs read them as strings); each kind's record finalizes as its kind does."""

from __future__ import annotations

import logging

from kvtier.tier import ImmediateExecutor, TaskKind, TaskStatus
from kvtier.tier.executor import FailingExecutor
from tests.tier_helpers import make_tier, page_slots, prompt


def test_kinds_and_statuses_compare_and_print_as_their_values():
    tier = make_tier()
    store = tier.wait(tier.store(prompt(0, 3), None, page_slots(0, 3, 2)))
    load = tier.wait(tier.load_layerwise(prompt(0, 3), None, page_slots(4, 3, 2)))
    assert (store.kind, store.status) == (TaskKind.STORE, TaskStatus.DONE)
    assert store.kind == "store" and store.status == "done" and f"{store.kind}/{store.status}" == "store/done"
    assert load.kind is TaskKind.LOAD_LAYERWISE and str(load.kind) == "load_layerwise" and load.done
    assert not TaskKind.LOAD.reads_lower_tier and TaskKind.READ.reads_lower_tier and TaskKind.READ.inserts
    tier.destroy()


def test_a_failed_task_logs_its_kind_by_value(caplog):
    tier = make_tier(executor=FailingExecutor(ImmediateExecutor(), rate=1.0))  # every issue raises
    with caplog.at_level(logging.WARNING, logger="kvtier.tier.manager"):
        task = tier.store(prompt(0, 2), None, page_slots(0, 2, 2))
    assert task.status == TaskStatus.FAILED and task.num_pages == 0
    assert "kvtier: store of" in caplog.text and "TaskKind" not in caplog.text
    assert tier.stats()["failed_stores"] == 1 and tier.pool.num_free == tier.pool.num_blocks  # unwound
    tier.destroy()
