"""What benchmarks share from distserve.loadgen, without a mesh: Poisson arrivals, metrics by
name and label, and /proc readings of this process."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np

from distserve.loadgen import procfs, scrape
from distserve.loadgen.requests import poisson_arrivals


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = poisson_arrivals(np.random.default_rng(3), 20.0, 20_000)
    assert np.array_equal(a, poisson_arrivals(np.random.default_rng(3), 20.0, 20_000))
    assert (np.diff(a) > 0).all() and a[0] > 0
    assert abs(len(a) / a[-1] - 20.0) < 0.5


def sample(name: str, value: float, **labels: str):
    return SimpleNamespace(name=name, value=value, labels=labels)


def test_total_sums_the_samples_of_a_name_whose_labels_include_the_asked_ones():
    samples = [
        sample("tokens_total", 3, role="prefill", kind="best"),
        sample("tokens_total", 4, role="prefill", kind="cached"),
        sample("tokens_total", 5, role="decode", kind="best"),
        sample("other_total", 100, role="prefill", kind="best"),
    ]
    assert scrape.total(samples, "tokens_total") == 12
    assert scrape.total(samples, "tokens_total", role="prefill") == 7
    assert scrape.total(samples, "tokens_total", role="prefill", kind="best") == 3
    assert scrape.total(samples, "missing_total") == 0


def test_by_label_splits_a_name_by_one_label_and_names_a_missing_one_empty():
    samples = [
        sample("routes_total", 2, route="local"),
        sample("routes_total", 5, route="disaggregated"),
        sample("routes_total", 1),
        sample("other_total", 9, route="local"),
    ]
    assert scrape.by_label(samples, "routes_total", "route") == {
        "local": 2,
        "disaggregated": 5,
        "": 1,
    }


def test_role_total_sums_over_the_workers_of_one_role():
    def worker(name: str, value: float):
        return SimpleNamespace(name=name, metrics=lambda: [sample("bytes_total", value)])

    mesh = SimpleNamespace(
        workers=[worker("prefill-0", 1), worker("prefill-1", 2), worker("decode-0", 4)]
    )
    assert scrape.role_total(mesh, "prefill", "bytes_total") == 3
    assert scrape.role_total(mesh, "decode", "bytes_total") == 4


def test_procfs_reads_this_process_and_its_children_and_nothing_for_a_gone_one():
    assert procfs.cpu_seconds(os.getpid()) > 0
    assert procfs.rss_bytes(os.getpid()) > 2**20
    assert procfs.host_cpu_seconds() > 0
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert child.pid in procfs.descendants(os.getpid())
        assert procfs.command_name(child.pid).startswith("python")
    finally:
        child.communicate(b"")
    assert procfs.rss_bytes(child.pid) is None
    assert procfs.command_name(child.pid) == "?"
