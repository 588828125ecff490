"""How the page tables a session's turns hold are laid out: a lone session's pages form one ascending
run of the pool turn after turn (the long-prefix path reads such a prefix where it lies,
``cudnn_prefill.prefix_run``), and the page manager counts the breaks of released tables."""
from __future__ import annotations

import torch

from scheduler.messages.to_scheduler import SamplingParams
from scheduler.page_manager import PageManager
from scheduler.request import Request
from worker.kv.gpu_pool import KVPool

P = 4


def manager(pages: int = 64) -> PageManager:
    return PageManager(KVPool(1, pages + 1, P, 1, 2, torch.float32, torch.device("cpu")), True)


def breaks(pages: list[int]) -> int:
    return sum(b != a + 1 for a, b in zip(pages, pages[1:]))


def turn(pm: PageManager, prompt: list[int], reply: list[int]) -> list[int]:
    """Admit ``prompt``, decode ``reply`` (pages grown token by token), release; the table held."""
    r = Request(str(len(prompt)), prompt, SamplingParams(), len(reply), frozenset(), ignore_eos=True)
    assert pm.admit(r)
    for i in range(len(reply)):
        assert pm.grow(r, len(prompt) + i)
    table = list(r.pages)
    pm.release(r, prompt + reply[:-1])  # the last sampled token is never fed back
    pm.check([])
    return table


def test_a_lone_sessions_turns_hold_one_run_of_pages():
    pm = manager()
    prompt = list(range(1, 11))
    for t in range(6):
        reply = [100 + t] * (3 + t)
        table = turn(pm, prompt, reply)
        assert breaks(table) == 0, f"turn {t}: {table}"
        prompt = prompt + reply + list(range(200 + 10 * t, 207 + 10 * t))
    assert pm.stats()["kv_table_breaks"] == 0 and pm.stats()["kv_table_pages"] > 6


def test_interleaved_sessions_break_the_run_and_the_breaks_are_counted():
    pm = manager()
    a, b = list(range(1, 11)), list(range(500, 507))
    tables = [turn(pm, a, [7, 7, 7])]
    tables.append(turn(pm, b, [8] * 9))  # b's pages follow a's partial page, which it reuses
    tables.append(turn(pm, a + [7, 7, 7] + list(range(30, 45)), [9, 9]))
    assert breaks(tables[-1]) > 0, tables
    counted = pm.stats()
    assert counted["kv_table_breaks"] == sum(map(breaks, tables))
    assert counted["kv_table_pages"] == sum(map(len, tables))
