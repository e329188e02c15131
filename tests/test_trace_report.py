"""`distserve trace-report`: a recorded span file with known timings, read back exactly."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from distserve import trace_report
from distserve.trace_report import (
    BubbleRule,
    TraceReportError,
    breakdown,
    load_spans,
    main,
    percentiles,
    register,
    requests,
)

T0 = 1_700_000_000_000_000_000  # ns
GATEWAY, PREFILL, DECODE = "distserve-gateway", "distserve-prefill", "distserve-decode"


def span(trace, sid, parent, name, service, start_ms, end_ms, status="UNSET", msg="", **attrs):
    return {
        "trace_id": f"{trace:032x}",
        "span_id": f"{sid:016x}",
        "parent_span_id": None if parent is None else f"{parent:016x}",
        "name": name,
        "service": service,
        "start_unix_nano": T0 + round(start_ms * 1_000_000),
        "end_unix_nano": T0 + round(end_ms * 1_000_000),
        "attributes": attrs,
        "status": status,
        "status_message": msg,
        "events": [],
    }


def request_attrs(rid, mode, inp, out, ttft=None, itl=None, tpot=None):
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.usage.input_tokens": inp,
        "gen_ai.usage.output_tokens": out,
        "gen_ai.response.finish_reasons": ["length"],
        "distserve.request_id": rid,
        "distserve.mode": mode,
    }
    for key, v in (("ttft_ms", ttft), ("first_itl_ms", itl), ("tpot_ms", tpot)):
        if v is not None:
            attrs[f"distserve.{key}"] = v
    return attrs


def handoff(trace, sid, parent, start, end, bw, retried, nbytes, status="UNSET"):
    return span(
        trace, sid, parent, "kv.handoff", DECODE, start, end, status,
        **{
            "kv.bytes": nbytes,
            "kv.chunks": 4,
            "kv.chunks_retried": retried,
            "kv.transport": "ucx",
            "kv.bandwidth_bytes_per_s": bw,
            "kv.overlap_fraction": 0.25,
        },
    )  # fmt: skip


def recorded_spans() -> list[dict]:
    """Five requests (times in ms after T0) and the noise around them.

    req-1 disaggregated, behind Envoy and a client span that also says gen_ai.operation.name;
    req-2 disaggregated with a large bubble; req-3 disaggregated, its first handoff failed and it
    was prefilled again; req-4 colocated; req-5 failed while queued for prefill.
    """
    d, c = "disaggregated", "colocated"
    return [
        # req-1: queue 8 + 2, prefill 15, handoff 12, first ITL 12 <= 3 x 5.
        span(1, 0xC1, None, "text_completion tiny", "bench-client", -3, 103,
             **{"gen_ai.operation.name": "text_completion"}),
        span(1, 0xE1, 0xC1, "ingress", "envoy", -1, 101),
        span(1, 0x10, 0xE1, "text_completion tiny", GATEWAY, 0, 100, "OK",
             **request_attrs("req-1", d, 10, 12, ttft=30.0, itl=12.0, tpot=5.0)),
        span(1, 0x11, 0x10, "prefill.queue", PREFILL, 2, 10),
        span(1, 0x12, 0x10, "prefill.compute", PREFILL, 10, 25,
             **{"prefill.batch_size": 2, "prefill.batch_tokens": 20}),
        span(1, 0x13, 0x10, "kv.lease", PREFILL, 25, 33),
        handoff(1, 0x14, 0x10, 20, 32, bw=2e9, retried=0, nbytes=4_000_000),
        # the source frees the pulled KV under the pull's context, as decoding starts
        span(1, 0x15, 0x14, "kv.release", PREFILL, 33, 34, **{"kv.blocks": 1}),
        span(1, 0x16, 0x10, "decode.queue", DECODE, 32, 34),
        span(1, 0x17, 0x10, "decode", DECODE, 34, 99,
             **{"gen_ai.usage.output_tokens": 11, "decode.tpot_ms": 5.0}),
        # req-2: queue 8 + 10, prefill 25, handoff 65, first ITL 80 > 3 x 4.
        span(2, 0x20, None, "text_completion tiny", GATEWAY, 10, 250, "OK",
             **request_attrs("req-2", d, 100, 20, ttft=40.0, itl=80.0, tpot=4.0)),
        span(2, 0x21, 0x20, "prefill.queue", PREFILL, 12, 20),
        span(2, 0x22, 0x20, "prefill.compute", PREFILL, 20, 45),
        handoff(2, 0x23, 0x20, 45, 110, bw=1e9, retried=1, nbytes=40_000_000),
        span(2, 0x24, 0x20, "decode.queue", DECODE, 110, 120),
        span(2, 0x25, 0x20, "decode", DECODE, 120, 249),
        # req-3: two attempts; queue 3 + 4 + 1, prefill 15 + 16, handoff 22 + 17, ITL 76 > 21.
        span(3, 0x30, None, "text_completion tiny", GATEWAY, 20, 300, "OK",
             **request_attrs("req-3", d, 30, 40, ttft=21.0, itl=76.0, tpot=7.0)),
        span(3, 0x31, 0x30, "prefill.queue", PREFILL, 22, 25),
        span(3, 0x32, 0x30, "prefill.compute", PREFILL, 25, 40),
        handoff(3, 0x33, 0x30, 38, 60, bw=0.5e9, retried=2, nbytes=9, status="ERROR"),
        span(3, 0x34, 0x30, "prefill.queue", PREFILL, 60, 64),
        span(3, 0x35, 0x30, "prefill.compute", PREFILL, 64, 80),
        handoff(3, 0x36, 0x30, 78, 95, bw=1.5e9, retried=1, nbytes=12_000_000),
        span(3, 0x37, 0x99, "kv.release", PREFILL, 95, 96),  # its parent was not recorded
        span(3, 0x38, 0x30, "decode.queue", DECODE, 95, 96),
        span(3, 0x39, 0x30, "decode", DECODE, 96, 299),
        # req-4 colocated: queue 2, prefill 8, no handoff, first ITL 9 > 3 x 2.
        span(4, 0x40, None, "text_completion tiny", GATEWAY, 30, 130, "OK",
             **request_attrs("req-4", c, 5, 40, ttft=12.0, itl=9.0, tpot=2.0)),
        span(4, 0x41, 0x40, "prefill.queue", PREFILL, 31, 33),
        span(4, 0x42, 0x40, "prefill.compute", PREFILL, 33, 41),
        span(4, 0x43, 0x40, "decode", DECODE, 41, 129),
        # req-5 failed: queue 4, nothing else.
        span(5, 0x50, None, "text_completion tiny", GATEWAY, 40, 60, "ERROR",
             "no prefill instance available", **request_attrs("req-5", d, 7, 0)),
        span(5, 0x51, 0x50, "prefill.queue", PREFILL, 41, 45),
        # Not a request.
        span(6, 0x60, None, "grpc.health.v1.Health/Check", GATEWAY, 5, 6),
    ]  # fmt: skip


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    spans = recorded_spans()
    lines = [json.dumps(s) for s in spans]
    lines.append(json.dumps(spans[3]))  # an exporter retry wrote req-1's prefill.queue twice
    random.Random(7).shuffle(lines)  # several processes append in any order
    killed = json.dumps(spans[-1])[:40]  # a process killed mid-line
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(lines) + "\n\n" + killed)
    return path


def report(trace_file: Path, capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(trace_file), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_spans_group_into_requests_by_gateway_span_in_start_order(trace_file):
    loaded = load_spans(trace_file)
    assert (loaded.lines, loaded.skipped, len(loaded.spans)) == (35, 1, 33)
    traces = requests(loaded.spans)
    assert [t.root.attributes["distserve.request_id"] for t in traces] == [
        "req-1", "req-2", "req-3", "req-4", "req-5",
    ]  # fmt: skip
    first = traces[0]
    assert [(s.service, s.name) for s in first.ancestors] == [
        ("bench-client", "text_completion tiny"),
        ("envoy", "ingress"),
    ]
    assert [s.name for s in first.spans] == [
        "prefill.queue", "prefill.compute", "kv.handoff", "kv.lease",
        "decode.queue", "kv.release", "decode",
    ]  # fmt: skip
    assert "kv.release" in [s.name for s in traces[2].spans]  # orphan kept with its request


def test_breakdown_sums_attempts_and_flags_bubbles_over_three_tpot(trace_file):
    traces = requests(load_spans(trace_file).spans)
    rows = {r.request_id: r for r in (breakdown(t, BubbleRule()) for t in traces)}
    got = {
        rid: (r.queue_ms, r.prefill_ms, r.handoff_ms, r.first_itl_ms, r.tpot_ms, r.total_ms)
        for rid, r in rows.items()
    }
    assert got == {
        "req-1": (10.0, 15.0, 12.0, 12.0, 5.0, 100.0),
        "req-2": (18.0, 25.0, 65.0, 80.0, 4.0, 240.0),
        "req-3": (8.0, 31.0, 39.0, 76.0, 7.0, 280.0),
        "req-4": (2.0, 8.0, None, 9.0, 2.0, 100.0),
        "req-5": (4.0, None, None, None, None, 20.0),
    }
    assert {rid for rid, r in rows.items() if r.flagged} == {"req-2", "req-3", "req-4"}
    r3 = rows["req-3"]
    assert (r3.prefill_attempts, r3.handoff_attempts, r3.retries) == (2, 2, 1)
    assert (r3.kv_chunks_retried, r3.kv_bytes, r3.kv_bandwidth_bytes_per_s) == (3, 12e6, 1.5e9)
    assert (r3.ttft_queue_ms, r3.ttft_compute_ms, r3.ttft_other_ms) == (3.0, 15.0, 3.0)
    assert rows["req-5"].status == "ERROR"
    assert rows["req-4"].bubble_threshold_ms == 6.0

    absolute = [breakdown(t, BubbleRule(ms=10.0)) for t in traces]
    assert {r.request_id for r in absolute if r.flagged} == {"req-1", "req-2", "req-3"}


def test_percentiles_interpolate_over_requests_that_have_the_value(trace_file):
    rows = [breakdown(t, BubbleRule()) for t in requests(load_spans(trace_file).spans)]
    p = percentiles(rows)
    expected = {
        "queue_ms": (8.0, 14.8, 17.68, 18.0, 5),  # of 2, 4, 8, 10, 18
        "prefill_ms": (20.0, 29.2, 30.82, 31.0, 4),  # of 8, 15, 25, 31
        "handoff_ms": (39.0, 59.8, 64.48, 65.0, 3),  # of 12, 39, 65
        "first_itl_ms": (44.0, 78.8, 79.88, 80.0, 4),  # of 9, 12, 76, 80
        "total_ms": (100.0, 264.0, 278.4, 280.0, 5),  # of 20, 100, 100, 240, 280
    }
    for column, (p50, p90, p99, top, count) in expected.items():
        q = p[column]
        assert (q["p50"], q["p90"], q["p99"]) == pytest.approx((p50, p90, p99)), column
        assert (q["max"], q["count"]) == (top, count), column


def test_json_report_has_rows_percentiles_and_summary(trace_file, capsys):
    code, out, _ = report(trace_file, capsys, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["skipped_lines"] == 1 and doc["spans"] == 33
    assert [r["request_id"] for r in doc["requests"]] == [f"req-{i}" for i in range(1, 6)]
    r2 = doc["requests"][1]
    assert (r2["mode"], r2["input_tokens"], r2["output_tokens"], r2["ttft_ms"]) == (
        "disaggregated", 100, 20, 40.0,
    )  # fmt: skip
    assert (r2["prefill_queue_ms"], r2["decode_queue_ms"], r2["flagged"]) == (8.0, 10.0, True)
    assert doc["requests"][4]["handoff_ms"] is None
    assert doc["percentiles"]["queue_ms"]["p90"] == pytest.approx(14.8)
    s = doc["summary"]
    assert (s["requests"], s["errors"], s["flagged"]) == (5, 1, 3)
    assert s["error_messages"] == {"no prefill instance available": 1}
    # TTFT 30 + 40 + 21 + 12 = 103: queueing 8 + 8 + 3 + 2, prefill 15 + 25 + 15 + 8, other 19.
    assert s["ttft_ms"] == pytest.approx(103.0)
    assert s["ttft_queue_share"] == pytest.approx(21 / 103)
    assert s["ttft_compute_share"] == pytest.approx(63 / 103)
    assert s["ttft_other_share"] == pytest.approx(19 / 103)
    # The failed handoff of req-3 is not averaged in; its retried chunks are counted.
    assert s["kv_handoffs"] == 3
    assert s["kv_mean_bandwidth_bytes_per_s"] == pytest.approx(1.5e9)
    assert (s["kv_chunks_retried"], s["requests_retried"]) == (4, 1)

    _, out, _ = report(trace_file, capsys, "--json", "--bubble-ms", "10")
    flagged = [r["request_id"] for r in json.loads(out)["requests"] if r["flagged"]]
    assert flagged == ["req-1", "req-2", "req-3"]


def test_text_report_rows_dashes_flags_percentiles_and_summary(trace_file, capsys):
    code, out, _ = report(trace_file, capsys)
    assert code == 0
    lines = out.splitlines()
    assert "5 requests from 33 spans, unparsable lines skipped: 1" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("req-")}
    assert rows["req-4"] == [
        "req-4", "colocated", "OK", "5", "40", "12.0", "2.0", "8.0", "-", "9.0", "2.0",
        "100.0", "BUBBLE",
    ]  # fmt: skip
    assert rows["req-3"][-2:] == ["1", "BUBBLE"]  # one retry
    assert rows["req-1"][-1] == "100.0"  # not flagged
    assert rows["req-5"][:3] == ["req-5", "disaggregated", "ERROR"]
    assert rows["req-5"][5:] == ["-", "4.0", "-", "-", "-", "-", "20.0"]
    queue = next(line.split() for line in lines if line.startswith("queue "))
    assert queue == ["queue", "8.0", "14.8", "17.7", "18.0", "5"]
    assert "requests: 5, errors: 1 (1 x no prefill instance available), flagged: 3" in out
    assert "TTFT: 20.4% queueing, 61.2% prefill compute, 18.4% other" in out
    assert "mean bandwidth 1.50 GB/s over 3 handoffs, chunks retried: 4" in out


def test_errors_that_differ_only_in_their_figures_are_one_kind(tmp_path, capsys):
    """Hundreds of refusals each saying its own queue read as one line, the commonest first."""
    queued = "the mesh is overloaded: {} prompt tokens are queued ahead, predicted TTFT {} ms"
    messages = [queued.format(q, q * 2.5) for q in range(100, 107)]
    messages += ["deadline exceeded"] * 2 + [f"kind {k}" for k in "abcde"]
    spans = [
        span(i, 0x100 + i, None, "text_completion tiny", GATEWAY, i, i + 1, "ERROR", m,
             **request_attrs(f"req-{i}", "disaggregated", 7, 0))
        for i, m in enumerate(messages, start=1)
    ]  # fmt: skip
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in spans) + "\n")
    _, out, _ = report(path, capsys)
    assert (
        "errors: 14 (7 x the mesh is overloaded: N prompt tokens are queued ahead, predicted "
        "TTFT N ms; 2 x deadline exceeded; 1 x kind a; 1 x kind b; 1 x kind c; 2 more kinds)"
    ) in out


def test_limit_shows_first_rows_and_counts_the_rest(trace_file, capsys):
    _, out, _ = report(trace_file, capsys, "--limit", "2")
    shown = [line.split()[0] for line in out.splitlines() if line.startswith("req-")]
    assert shown == ["req-1", "req-2"]
    assert "(3 more requests not shown; --limit 0 shows all)" in out
    assert "count" in out and "5" in out.split("count")[1]  # percentiles still cover all


def test_png_waterfall_of_the_slowest_requests_is_written(trace_file, tmp_path, capsys):
    png = tmp_path / "waterfall.png"
    code, _, err = report(trace_file, capsys, "--png", str(png), "--slowest", "2")
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    from matplotlib.image import imread

    height, width, _ = imread(png).shape
    assert width > 0 and height > 0
    assert "2 slowest requests" in err
    pairs = [(t, breakdown(t, BubbleRule())) for t in requests(load_spans(trace_file).spans)]
    assert [r.request_id for _, r in trace_report.slowest(pairs, 2)] == ["req-3", "req-2"]


def test_png_without_matplotlib_is_refused_before_any_work_naming_the_extra(
    trace_file, tmp_path, capsys, monkeypatch
):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )
    code, out, err = report(trace_file, capsys, "--png", str(tmp_path / "w.png"))
    assert code == 2 and out == ""
    assert "matplotlib" in err and "distserve-mesh[plots]" in err
    assert not (tmp_path / "w.png").exists()


def test_no_png_unless_asked(trace_file, tmp_path, capsys):
    assert report(trace_file, capsys)[0] == 0
    assert not list(tmp_path.glob("*.png"))


def test_register_adds_the_subcommand_with_func(trace_file, capsys):
    parser = argparse.ArgumentParser(prog="distserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace-report", str(trace_file), "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["requests"] == 5
    missing = parser.parse_args(["trace-report", str(trace_file.with_name("nope.jsonl"))])
    with pytest.raises(TraceReportError, match="no such file"):
        missing.func(missing)


def test_python_dash_m_runs_the_report(trace_file):
    """`python -m distserve.trace_report` is `distserve trace-report`."""
    run = subprocess.run(
        [sys.executable, "-m", "distserve.trace_report", str(trace_file), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["summary"]["requests"] == 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ("\n  \n", "the file is empty"),
        ('{"trace_id": "ab", "span_\n', "no spans: all 1 lines unparsable"),
        (json.dumps(span(6, 0x60, None, "health", GATEWAY, 5, 6)) + "\n", "no request spans"),
    ],
)
def test_unusable_files_exit_2_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "spans.jsonl"
    if content is not None:
        path.write_text(content)
    code, out, err = report(path, capsys)
    assert code == 2
    assert message in err and str(path) in err
    assert "Traceback" not in err and out == ""


def test_directory_and_unwritable_png_exit_2(trace_file, tmp_path, capsys):
    assert report(tmp_path, capsys)[0] == 2
    code, _, err = report(trace_file, capsys, "--png", str(tmp_path / "no" / "such" / "x.png"))
    assert code == 2 and "cannot write" in err
