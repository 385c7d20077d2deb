"""The scheduler's periodic stats line (scheduler/stats_log.py, vLLM's LoggingStatLogger): a real
scheduler stepped by the tests' driver, the time given: throughput since the last line, the queues,
the KV usage and the prefix cache's hit rate; INFO while busy, DEBUG once idle; --disable-log-stats."""

from __future__ import annotations

import logging

from pagedserve.scheduler.core.scheduler import SchedulerConfig
from pagedserve.scheduler.stats_log import StatsLog
from pagedserve.scheduler.stats_recorder import Totals
from scheduler_driver import Driver, make_request


def test_the_line_reads_the_interval_and_the_scheduler(caplog):
    driver = Driver(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=64))
    prompt = list(range(1, 17))
    driver.add(make_request("a", prompt, max_tokens=4))
    driver.step()
    driver.add(make_request("b", prompt, max_tokens=4), make_request("c", list(range(50, 58)), max_tokens=4))
    driver.step()
    totals = Totals(prompt_tokens=300, generation_tokens=40)
    stats = StatsLog(interval_s=10.0, now=100.0)
    assert stats.line(totals, driver.sched, now=109.9) is None  # not yet
    with caplog.at_level(logging.DEBUG, logger="pagedserve.scheduler"):
        stats.maybe_log(totals, driver.sched, waiting_extra=1, now=110.0)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    bm = driver.sched.block_manager
    used = 1 - bm.num_free_blocks / bm.num_total_blocks
    hit = bm.prefix_hits / bm.prefix_queries  # b's prompt found a's blocks
    assert 0 < used < 1 and 0 < hit <= 1
    assert record.getMessage() == (
        f"engine: avg prompt throughput: 30.0 tokens/s, avg generation throughput: 4.0 tokens/s, running: 2 reqs, "
        f"waiting: 2 reqs, KV cache usage: {100 * used:.1f}%, prefix cache hit rate: {100 * hit:.1f}%")

    # the next interval: only what happened in it; once idle, one more INFO line, then DEBUG
    caplog.clear()
    driver.run()
    totals.generation_tokens += 10
    with caplog.at_level(logging.DEBUG, logger="pagedserve.scheduler"):
        stats.maybe_log(totals, driver.sched, now=115.0)  # within the interval: nothing
        stats.maybe_log(totals, driver.sched, now=130.0)
        stats.maybe_log(totals, driver.sched, now=140.0)
        stats.maybe_log(totals, driver.sched, now=150.0)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]
    first = caplog.records[0].getMessage()
    assert "avg prompt throughput: 0.0 tokens/s, avg generation throughput: 0.5 tokens/s, running: 0 reqs" in first
    assert "KV cache usage: 0.0%" in caplog.records[2].getMessage()


def test_disable_log_stats_turns_it_off():
    from pagedserve.cli import build_parser
    from pagedserve.scheduler.server import config_from_args
    parser = build_parser()
    assert config_from_args(parser.parse_args(["scheduler"])).log_stats
    assert not config_from_args(parser.parse_args(["scheduler", "--disable-log-stats"])).log_stats
    assert parser.parse_args(["serve", "--disable-log-stats"]).disable_log_stats
