"""pipeline.trace: the recorder, the Chrome trace-event document and the timeline checks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.trace import (CATEGORIES, Span, TraceError, Tracer, busy_and_bubble, chrome_trace, check_trace,
                            spans_from_chrome, write_trace)


def test_untraced_steps_record_nothing_and_share_one_noop_context() -> None:
    t = Tracer(rank=0, steps=[3])
    assert not t.on(2) and t.on(3)
    first, second = t.span(2, "0F0", "forward"), t.span(4, "1B0", "backward", microbatch=0)
    assert first is second  # one shared object: nothing allocated per call when off
    with first:
        pass
    t.add(2, "moved", "migrate-ahead", 1.0, 0.5)
    assert t.spans == []


def test_traced_step_records_nested_spans_with_sorted_args() -> None:
    t = Tracer(rank=1, steps=(5,))
    with t.span(5, "step", "compute"):
        with t.span(5, "1F0", "forward", microbatch=0, stage=1):
            time.sleep(0.001)
    t.add(5, "ahead", "migrate-ahead", 10.0, 0.25, op="a/b")
    inner, outer, added = t.spans
    assert (inner.rank, inner.step, inner.name, inner.cat) == (1, 5, "1F0", "forward")
    assert inner.args == (("microbatch", 0), ("stage", 1)) and hash(inner)  # frozen, hashable
    assert outer.start_s <= inner.start_s and inner.end_s <= outer.end_s and inner.dur_s >= 0.001
    assert added == Span(1, 5, "ahead", "migrate-ahead", 10.0, 0.25, (("op", "a/b"),))
    check_trace(t.spans)
    t.clear()
    assert t.spans == []
    assert {"forward", "backward", "recv-wait", "send", "migrate", "migrate-ahead", "plan", "optimizer",
            "swap"} == set(CATEGORIES)


def test_chrome_trace_format_one_track_per_rank_on_one_axis(tmp_path: Path) -> None:
    spans = [Span(0, 7, "0F0", "forward", 100.0, 0.002, (("microbatch", 0),)),
             Span(1, 7, "1F0", "forward", 100.003, 0.001),
             Span(1, 7, "recv", "recv-wait", 100.0025, 0.0005)]
    doc = chrome_trace(spans)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] in ("process_name", "thread_name")}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in x] == [
        (0, "0F0", 0.0, 2000.0), (1, "recv", 2500.0, 500.0), (1, "1F0", 3000.0, 1000.0)]
    assert x[0]["args"] == {"step": 7, "microbatch": 0} and x[0]["cat"] == "forward"

    path = tmp_path / "run" / "trace.json"
    write_trace(path, spans)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temporary file left
    back = spans_from_chrome(json.loads(path.read_text()))
    assert [(s.rank, s.step, s.name, s.cat, s.args) for s in back] == [
        (0, 7, "0F0", "forward", (("microbatch", 0),)), (1, 7, "recv", "recv-wait", ()), (1, 7, "1F0", "forward", ())]
    assert back[2].start_s == pytest.approx(0.003) and back[2].dur_s == pytest.approx(0.001)


def test_check_trace_accepts_nesting_and_disjoint_and_rejects_partial_overlap() -> None:
    ok = [Span(0, 1, "step", "compute", 0.0, 10.0), Span(0, 1, "a", "forward", 1.0, 2.0),
          Span(0, 1, "a.1", "recv-wait", 1.0, 1.0), Span(0, 1, "b", "backward", 3.0, 2.0),
          Span(1, 1, "c", "forward", 2.5, 5.0)]  # another rank's track may overlap freely
    check_trace(ok)
    with pytest.raises(TraceError, match=r"rank 0: span 'c' .* partially overlaps 'b'"):
        check_trace([*ok, Span(0, 1, "c", "send", 4.0, 2.0)])
    with pytest.raises(TraceError, match="partially overlaps 'step'"):
        check_trace([*ok, Span(0, 1, "late", "optimizer", 9.0, 2.0)])
    with pytest.raises(TraceError, match="negative duration"):
        check_trace([Span(0, 1, "x", "forward", 0.0, -1.0)])


def test_busy_and_bubble_counts_compute_outside_waits() -> None:
    spans = [Span(0, 2, "0F0", "forward", 0.0, 4.0), Span(0, 2, "wait", "recv-wait", 1.0, 1.0),
             Span(0, 2, "opt", "optimizer", 6.0, 1.0), Span(1, 2, "1F0", "forward", 2.0, 8.0)]
    table = busy_and_bubble(spans)
    assert table[2][0] == pytest.approx((4.0, 6.0, 10.0))  # 3 s of forward outside the wait, 1 s optimizer
    assert table[2][1] == pytest.approx((8.0, 2.0, 10.0))


def test_app_writes_the_timeline_of_the_traced_steps(tmp_path: Path) -> None:
    from search.app import run
    from tests.test_app import make_cfg

    run(make_cfg("pipeline.trace_steps=[2,3]"), output_dir=tmp_path)
    spans = spans_from_chrome(json.loads((tmp_path / "trace.json").read_text()))
    assert {s.step for s in spans} == {2, 3} and {s.rank for s in spans} == {0}
    assert {"forward", "backward", "optimizer"} <= {s.cat for s in spans}
    check_trace(spans)
