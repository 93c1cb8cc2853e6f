"""Typed engine stats (pagellm.metrics): one definition for the engine, data-parallel merging,
the log line and Prometheus."""

from __future__ import annotations

from pagellm.metrics import STAT_FIELDS, EngineStats, IterationStats, SchedulerStats


def _stats(running: int, usage: float, queries: int, hits: int, steps: int) -> EngineStats:
    it = IterationStats()
    for _ in range(steps):
        it.record_step(prompt_tokens=10, generation_tokens=1)
    return EngineStats(SchedulerStats(num_running=running, kv_cache_usage=usage, prefix_cache_queries=queries,
                                      prefix_cache_hits=hits), it)


def test_merge_sums_counts_averages_usage_and_weights_the_hit_rate_by_tokens():
    a, b = _stats(2, 0.5, 100, 90, 3), _stats(1, 0.1, 300, 0, 1)
    m = EngineStats.merge([a, b])
    assert m.scheduler.num_running == 3 and m.iteration.steps == 4 and m.iteration.prompt_tokens == 40
    assert abs(m.scheduler.kv_cache_usage - 0.3) < 1e-12
    # Token-weighted (90 of 400 looked-up tokens hit), not the mean of 0.9 and 0.0.
    assert abs(m["prefix_cache_hit_rate"] - 90 / 400) < 1e-12


def test_mapping_view_has_every_field_once():
    s = _stats(2, 0.5, 100, 90, 3)
    names = [f.name for f in STAT_FIELDS]
    assert len(set(names)) == len(names)
    derived = {"prefix_cache_hit_rate", "spec_acceptance_rate", "spec_mean_acceptance_length"}
    assert set(s) == set(names) | derived and len(s) == len(set(s))
    assert s["num_running"] == 2 and s["steps"] == 3 and dict(s)["prefix_cache_hits"] == 90
    for f in STAT_FIELDS:
        assert f.kind in ("gauge", "counter") and f.merge in ("sum", "mean") and f.doc


def test_speculative_decoding_counters_merge_and_export_per_position():
    """Per-position acceptance is summed position by position across replicas and exported as
    one Prometheus series per position; the derived rates follow from the counts."""
    from types import SimpleNamespace

    from pagellm.entrypoints.server_metrics import EngineCollector

    a, b = IterationStats(), IterationStats()
    a.record_spec(3, 2)  # 3 drafts, the first 2 accepted
    b.record_spec(5, 5)
    b.record_spec(2, 0)
    merged = EngineStats.merge([EngineStats(iteration=a), EngineStats(iteration=b)])
    it = merged.iteration
    assert it.spec_accepted_per_pos == [2, 2, 1, 1, 1]
    assert merged["spec_acceptance_rate"] == 7 / 10 and merged["spec_mean_acceptance_length"] == 1 + 7 / 3
    engine = SimpleNamespace(get_stats_now=lambda: merged)
    families = {m.name: m for m in EngineCollector(engine, "m").collect()}
    per_pos = families["pagellm:spec_decode_num_accepted_tokens_per_pos"]
    assert [(s.labels["position"], s.value) for s in per_pos.samples if s.name.endswith("_total")] == [
        ("0", 2), ("1", 2), ("2", 1), ("3", 1), ("4", 1)]
    assert families["pagellm:spec_decode_num_drafts"].samples[0].value == 3
