"""The Grafana dashboard against a real Prometheus scraping a real hsx.

Debian's ``prometheus`` (``make install`` installs it where apt works) scrapes an
``hsx serve`` process every second. After a known workload, every PromQL expression of
``deploy/helm/hsx/dashboards/hsx-overview.json`` must evaluate without error through
Prometheus' HTTP API and return data, with Grafana's variables filled in the way
Grafana fills them; the prompt, byte, token and KV-cache panels must show exactly the
work that was done.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import free_port, hsx_serve, link_demo_model, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/helm/hsx/dashboards/hsx-overview.json"
JOB = "hsx"
# Grafana's $__rate_interval is at least four scrape intervals; one minute spans the
# whole workload here, so rate() sees the counters before and after it.
RATE_INTERVAL = "1m"
PROMPTS = [{"token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
REQUESTS = 3


def wait_for(check: Any, what: str, limit_s: float = 300) -> Any:
    """``check()`` until it returns something truthy (polled, no fixed sleeps)."""
    return wait_until(
        check, limit_s, f"timed out waiting for {what}", interval_s=0.5,
        ignore=(httpx.TransportError,),
    )  # fmt: skip


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """Debian's ``prometheus``, or a skip: asked for before hsx starts, so a machine
    without it does not start a server for nothing."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary (Debian package `prometheus`; `make install` adds it)")
    return binary


@pytest.fixture(scope="module")
def hsx(
    prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[str]:
    """``hsx serve`` with the demo model, in a clean environment; SIGTERM at the end."""
    cwd = tmp_path_factory.mktemp("hsx")
    link_demo_model(cwd, demo_model)
    with hsx_serve(cwd) as served:
        yield served.url
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(120)


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: str, hsx: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Debian's Prometheus on 127.0.0.1, scraping ``hsx`` every second."""
    binary = prometheus_binary
    root = tmp_path_factory.mktemp("prometheus")
    target = hsx.removeprefix("http://")
    (root / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    with (root / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).is_success, "Prometheus")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query; fails on any PromQL error."""
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert reply["status"] == "success", f"{expr}: {reply}"
    return list(reply["data"]["result"])


def value(prometheus: str, expr: str) -> float:
    result = query(prometheus, expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def workload(hsx: str, prometheus: str) -> dict[str, Any]:
    """REQUESTS requests of three prompts each, once Prometheus has scraped the idle
    service twice; returns what was done, after Prometheus has seen all of it."""
    wait_for(
        lambda: query(prometheus, f'count_over_time(up{{job="{JOB}"}}[1m]) >= 2'),
        "two scrapes before the workload",
    )
    answers = []
    for _ in range(REQUESTS):
        reply = httpx.post(f"{hsx}/extract", json={"prompts": PROMPTS}, timeout=120)
        assert reply.status_code == 200, reply.text
        answers.append(reply.json())
    objects = [obj for answer in answers for obj in answer["objects"]]
    done = {
        "prompts": len(objects),
        "bytes": sum(obj["bytes"] for obj in objects),
        "tokens": sum(answer["usage"]["prompt_tokens"] for answer in answers),
        "model": answers[0]["model"],
        "layer_ids": answers[0]["layer_ids"],
    }
    wait_for(
        lambda: query(prometheus, f'hsx_extract_prompts_total{{outcome="ok"}} == {len(objects)}'),
        "Prometheus to scrape the finished workload",
    )
    return done


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target of every panel."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in panels(board["panels"])
        for target in panel.get("targets", [])
    ]


def variables(prometheus: str) -> dict[str, str]:
    """Grafana's template variables, resolved as Grafana does: ``label_values(metric,
    label)`` through Prometheus' label API, every value selected (a regex of them)."""
    board = json.loads(DASHBOARD.read_text())
    resolved = {"__rate_interval": RATE_INTERVAL}
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
        assert found, var["definition"]
        selector = substitute(found.group(1), resolved)
        reply = httpx.get(
            f"{prometheus}/api/v1/label/{found.group(2)}/values", params={"match[]": selector}
        ).json()
        assert reply["status"] == "success", f"${var['name']}: {reply}"
        assert reply["data"], f"${var['name']} has no values: {selector}"
        # Regex-escaped, then escaped again for PromQL's string literal, as Grafana does.
        regex = "|".join(re.escape(v) for v in reply["data"])
        resolved[var["name"]] = regex.replace("\\", "\\\\")
    return resolved


def substitute(expr: str, resolved: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: resolved[m.group(1)], expr)


def test_every_dashboard_expression_returns_data(prometheus: str, workload: dict[str, Any]) -> None:
    resolved = variables(prometheus)
    assert resolved["model"] == re.escape(workload["model"]).replace("\\", "\\\\")
    empty = []
    for title, expr in dashboard_queries():
        if not query(prometheus, substitute(expr, resolved)):
            empty.append(f"{title}: {expr}")
    assert not empty, "expressions without data:\n" + "\n".join(empty)


def without_rate(expr: str) -> str:
    """The panel's expression over the counters themselves instead of their rate."""
    return re.sub(r"rate\((.+?)\[\$__rate_interval\]\)", r"\1", expr)


def panel(title: str) -> list[str]:
    return [expr for name, expr in dashboard_queries() if name == title]


def test_throughput_panels_count_the_work(prometheus: str, workload: dict[str, Any]) -> None:
    resolved = variables(prometheus)
    ok, failed = panel("Prompts extracted /s")
    assert value(prometheus, substitute(without_rate(ok), resolved)) == workload["prompts"]
    assert value(prometheus, substitute(without_rate(failed), resolved)) == 0
    assert value(prometheus, substitute(ok, resolved)) > 0
    (tokens,) = panel("Tokens extracted /s")
    assert value(prometheus, substitute(without_rate(tokens), resolved)) == workload["tokens"]
    (written,) = panel("Bytes written /s")
    series = query(prometheus, substitute(without_rate(written), resolved))
    assert [(s["metric"], float(s["value"][1])) for s in series] == [
        ({"backend": "file"}, workload["bytes"])
    ]


def test_kv_cache_panels_show_the_engine_layout(prometheus: str, workload: dict[str, Any]) -> None:
    resolved = variables(prometheus)
    info, memory, page = (substitute(e, resolved) for e in panel("KV-cache groups"))
    (group,) = query(prometheus, info)
    labels = group["metric"]
    # The demo model (SmolLM2, a Llama): one uniform group for its 30 attention layers and
    # the hidden-state layer, vLLM's CPU block size.
    assert (labels["group"], labels["kind"], labels["layers"]) == (
        "0",
        "full_attention+hidden_state",
        "31",
    )
    assert labels["block_size"] == "128"
    allocated, _hidden, blocks = (substitute(e, resolved) for e in panel("KV-cache memory"))
    group_memory = value(prometheus, memory)
    assert group_memory == value(prometheus, allocated)
    assert group_memory == value(prometheus, page) * value(prometheus, blocks)
    # hsx's default CPU cache: 1 GiB, of which whole blocks are allocated.
    assert 1024**3 - value(prometheus, page) < group_memory <= 1024**3


def test_token_norm_panel_shows_every_served_layer(
    prometheus: str, workload: dict[str, Any]
) -> None:
    """The gauge's value is checked against the objects' statistics without an engine
    (tests/engine/test_statistics.py); here, that the panel graphs each layer."""
    resolved = variables(prometheus)
    (expr,) = panel("Hidden-state token norm by layer")
    series = query(prometheus, substitute(expr, resolved))
    layers = {s["metric"]["layer"]: float(s["value"][1]) for s in series}
    assert sorted(layers, key=int) == [str(i) for i in workload["layer_ids"]]
    assert all(0 < norm < float("inf") for norm in layers.values()), layers
    assert {s["metric"]["model"] for s in series} == {workload["model"]}
