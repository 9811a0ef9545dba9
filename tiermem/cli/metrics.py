"""Prometheus metrics of a stats snapshot (a run's or a service's), through ``prometheus_client``: the
text `tiermem stats --prometheus` prints, and the HTTP endpoint `tiermem serve --metrics-port N` serves.

Names are in base units (`_bytes`, `_seconds`, `_bytes_per_second`, counters end in `_total`), each
with HELP and TYPE lines; prometheus_client escapes the label values. A scrape reads a fresh snapshot,
so the endpoint costs the service nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiermem.cli.top import predict
from tiermem.errors import UserError

TRAIN = (("step", "train_step", "optimizer steps done"),
         ("total_steps", "train_total_steps", "optimizer steps planned"),
         ("loss", "train_loss", "training loss of the last step"),
         ("tokens_per_s", "train_tokens_per_second", "tokens trained per second in the last step"),
         ("step_s", "train_step_seconds", "seconds of the last step"),
         ("eta_s", "train_eta_seconds", "seconds left (at the rate since the run started or resumed)"))


def families(snap: dict) -> Iterator[Metric]:
    """The snapshot's metric families."""
    store, run = snap.get("store", {}) or {}, snap.get("run", {}) or {}
    tiers, links = store.get("tiers", {}), store.get("links", {})
    g = GaugeMetricFamily("tiermem_tier_capacity_bytes", "bytes the tier holds", labels=["tier"])
    for name, t in tiers.items():
        g.add_metric([name], t.get("capacity", 0))
    yield g
    g = GaugeMetricFamily("tiermem_tier_used_bytes", "bytes allocated on the tier, by kind of state",
                          labels=["tier", "kind"])
    for name, t in tiers.items():
        for kind, n in t.get("by_kind", {}).items():
            g.add_metric([name, kind], n)
    yield g
    c = CounterMetricFamily("tiermem_link_bytes", "bytes the link moved", labels=["link"])
    for name, lk in links.items():
        c.add_metric([name], lk.get("bytes", 0))
    yield c
    c = CounterMetricFamily("tiermem_link_busy_seconds", "seconds the link was busy", labels=["link"])
    for name, lk in links.items():
        c.add_metric([name], lk.get("busy_s", 0.0))
    yield c
    g = GaugeMetricFamily("tiermem_link_bytes_per_second", "bytes per second the link moved over the last second",
                          labels=["link"])
    for name, lk in links.items():
        g.add_metric([name], lk.get("gbps_now", 0.0) * 1e9)
    yield g
    c = CounterMetricFamily("tiermem_wait_seconds", "seconds spent waiting, by cause", labels=["what"])
    for what, v in store.get("waits_s", {}).items():
        c.add_metric([what], v)
    yield c
    best = predict(snap)
    if best is not None:
        g = GaugeMetricFamily("tiermem_train_predicted_step_seconds", "step seconds at full overlap (the bound: "
                              "compute, a link at its average rate, or the optimizer)", labels=["bound"])
        g.add_metric([best["bound"]], best["seconds"])
        yield g
    for key, name, help_ in TRAIN:
        if run.get(key) is not None:
            yield GaugeMetricFamily(f"tiermem_{name}", help_, value=run[key])
    if run.get("total_steps"):
        yield GaugeMetricFamily("tiermem_train_finished", "1 when the run has finished", value=int(bool(
            run.get("finished"))))


def prometheus(snap: dict) -> str:
    """The snapshot in the Prometheus text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: snap))
    return generate_latest(registry).decode()


class _Collector:
    """A prometheus_client collector of ``read()``'s snapshot; ``tiermem_up`` says whether it could be read."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self.read()
        except (UserError, OSError):
            yield GaugeMetricFamily("tiermem_up", "1 when the snapshot could be read", value=0)
            return
        yield GaugeMetricFamily("tiermem_up", "1 when the snapshot could be read", value=1)
        yield from families(snap)


def serve_metrics(port: int, read: Callable[[], dict], addr: str = "127.0.0.1") -> None:
    """Serve ``read()``'s metrics over HTTP on ``addr:port`` (``/metrics``) from a daemon thread."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(read))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except (OSError, OverflowError, ValueError) as e:  # (a port out of range, an address that is not one)
        raise UserError(f"--metrics-port {port}: cannot listen on {addr}:{port} ({getattr(e, 'strerror', None) or e})"
                        ) from None
