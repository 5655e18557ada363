"""kiln.plugins.openmp_teams.TeamWatch: the step loop notices when another thread's OpenMP team has made libgomp stop
spinning between parallel regions (decode then runs up to ~2x slower), and says so once, naming the cause and what
to do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from kiln.plugins import openmp_teams
from kiln.runtime import LLM, SamplingParams

from runtime_support import get_engine


def _fake_probe(monkeypatch, values):
    """region_us returns ``values`` in turn; the names of the threads that probed are recorded."""
    seen = []
    it = iter(values)

    def probe(nthreads):
        seen.append((threading.current_thread().name, nthreads))
        return next(it)

    monkeypatch.setattr(openmp_teams, "region_us", probe)
    return seen


def test_two_slow_checks_in_a_row_warn_once(monkeypatch, caplog):
    slow = openmp_teams.CONTENDED_REGION_US * 4
    seen = _fake_probe(monkeypatch, [0.8, slow, 0.9, slow, slow, slow])
    watch = openmp_teams.TeamWatch(interval_s=0.0)
    watch.check(1)                       # no team of its own: nothing to measure
    assert seen == [] and watch.region_us is None and not watch.contended
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        for _ in range(3):               # fast, slow (one slow probe: a busy machine), fast
            watch.check(2)
            assert not watch.contended
        watch.check(2)
        watch.check(2)                   # two slow in a row
        assert watch.contended and watch.region_us == slow
        watch.check(2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "another thread of this process has an OpenMP team" in warnings[0]
    assert "on_own_thread" in warnings[0] and "another process" in warnings[0]


def test_checks_wait_for_the_interval(monkeypatch):
    seen = _fake_probe(monkeypatch, [1.0, 1.0])
    watch = openmp_teams.TeamWatch(interval_s=3600.0)
    watch.check(2)
    watch.check(2)
    assert len(seen) == 1


def test_the_step_loop_probes_its_own_team_and_reports_it(checkpoint_dir, monkeypatch, caplog):
    """The check runs on the step loop's thread (whose team runs the steps) and its result shows in stats()."""
    slow = openmp_teams.CONTENDED_REGION_US * 4
    seen = _fake_probe(monkeypatch, [slow] * 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)   # the tests' processes run 1 thread (conftest)
    with LLM(get_engine(checkpoint_dir("llama")), max_kv_cache_tokens=256) as llm:
        llm.executor.team_watch.interval_s = 0.0
        with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        stats = llm.stats()["openmp"]
        loop_thread = llm.executor._thread.name
    assert stats == {"region_us": slow, "contended": True}
    assert seen and set(seen) == {(loop_thread, 2)}
    assert sum("has an OpenMP team" in r.getMessage() for r in caplog.records) == 1


PROBE_AROUND_A_SECOND_TEAM = """
import os, threading, torch
from kiln.plugins import openmp_teams
n = os.cpu_count()
torch.set_num_threads(n)
def on_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]
alone = on_new_thread(lambda: openmp_teams.region_us(n))
torch.ones(1 << 22).add_(1)   # a parallel torch operation on the main thread: its team lives as long as it does
print("PROBE", alone, on_new_thread(lambda: openmp_teams.region_us(n)))
"""


def test_a_second_team_slows_the_probe_past_the_threshold(native):
    """The real probe in a fresh process: a thread's empty parallel region after the main thread ran a parallel
    torch operation (two teams of all the CPUs' threads) takes a sleeping worker's wake-up."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: one thread a team, no parallel region to wait for")
    res = subprocess.run([sys.executable, "-c", PROBE_AROUND_A_SECOND_TEAM], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("PROBE")]
    alone, contended = map(float, line.split()[1:])
    assert alone > 0 and contended > openmp_teams.CONTENDED_REGION_US, (alone, contended)
