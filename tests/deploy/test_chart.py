"""The Helm chart without a cluster: schema, values used by templates, files that parse."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "hsx"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
TEMPLATES = sorted((CHART / "templates").glob("*"))


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of an override file over values.yaml (maps merge, the rest replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def leaf_paths(values: Any, prefix: str = "") -> set[str]:
    """Every key path of the values, maps included (``a``, ``a.b``, ...)."""
    paths = set()
    if isinstance(values, dict):
        for key, value in values.items():
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            paths |= leaf_paths(value, path) if isinstance(value, dict) else set()
    return paths


def test_values_and_examples_validate() -> None:
    defaults = load(CHART / "values.yaml")
    jsonschema.validate(defaults, schema())
    assert EXAMPLES, "example values files are missing"
    for example in EXAMPLES:
        override = load(example)
        jsonschema.validate(override, schema())
        jsonschema.validate(merged(defaults, override), schema())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"replicaCount": "two"}, "is not of type 'integer'"),
        ({"replicas": 2}, "Additional properties are not allowed"),
        ({"engine": {"tensorParallelSize": 0}}, "less than the minimum"),
        ({"engine": {"dtype": "fp8"}}, "is not one of"),
        ({"storage": {"type": "gcs"}}, "is not one of"),
        ({"storage": {"s3": {"bucketName": "x"}}}, "Additional properties are not allowed"),
    ],
)
def test_schema_refuses_wrong_types_and_unknown_keys(
    override: dict[str, Any], message: str
) -> None:
    values = merged(load(CHART / "values.yaml"), override)
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(values, schema())


def template_value_paths() -> set[str]:
    found = set()
    for template in TEMPLATES:
        found |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()))
    return {p.rstrip(".") for p in found}


def test_every_value_a_template_reads_exists() -> None:
    defined = leaf_paths(load(CHART / "values.yaml"))
    used = template_value_paths()
    assert len(used) > 40
    assert sorted(used - defined) == []


def leaves(values: Any, prefix: str = "") -> set[str]:
    """Key paths whose value is not a non-empty map."""
    found = set()
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        found |= leaves(value, path) if isinstance(value, dict) and value else {path}
    return found


def test_every_value_is_used_or_documented() -> None:
    defined = leaves(load(CHART / "values.yaml"))
    used = template_value_paths()
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, re.MULTILINE))

    # A key counts as used when a template reads it or one of its parents whole.
    def covered(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in used for i in range(1, len(parts) + 1))

    assert sorted(p for p in defined if not covered(p) and p not in documented) == []
    assert sorted(documented - leaf_paths(load(CHART / "values.yaml"))) == []  # none stale


def test_every_yaml_and_json_file_parses() -> None:
    files = [p for p in CHART.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    plain = [p for p in files if "templates" not in p.parts]
    assert len(plain) >= 6
    for path in plain:
        (json.loads if path.suffix == ".json" else yaml.safe_load)(path.read_text())


def test_chart_dashboards_are_the_observability_dashboards() -> None:
    dashboards = sorted((CHART / "dashboards").glob("*.json"))
    assert [p.name for p in dashboards] == ["hsx-overview.json"]
    from tests.api import test_metrics

    assert dashboards == test_metrics.DASHBOARDS  # the metric tests read these same files
    assert '.Files.Glob "dashboards/*.json"' in (CHART / "templates/dashboards.yaml").read_text()


def test_chart_metadata() -> None:
    chart = load(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "hsx"
    assert (CHART / "templates" / "NOTES.txt").is_file()


# `make install` puts one in the venv when npm is available.
HELM = shutil.which("helm") or next(
    (str(p) for p in [ROOT / ".venv" / "bin" / "helm"] if p.is_file()), None
)


@pytest.mark.skipif(HELM is None, reason="no helm binary (PATH or .venv); schema checks ran")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_helm_lint_and_template(example: Path) -> None:
    assert HELM is not None
    subprocess.run([HELM, "lint", str(CHART), "-f", str(example)], check=True)
    # An explicit cluster version: the chart needs >= 1.29 (native preStop sleep).
    command = [HELM, "template", "hsx", str(CHART), "-f", str(example), "--kube-version", "1.30.0"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    documents = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in documents}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    deployment = next(
        d
        for d in documents
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["spec"]["containers"][0]["name"] == "hsx"
    )
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    values = merged(load(CHART / "values.yaml"), load(example))
    assert env["HSX_ENGINE__TENSOR_PARALLEL_SIZE"] == str(values["engine"]["tensorParallelSize"])
    gpus = values["gpu"]["count"]
    resources = container["resources"]
    assert (
        resources["limits"].get("nvidia.com/gpu")
        == resources["requests"].get("nvidia.com/gpu")
        == (gpus or None)
    )
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"  # /dev/shm


@pytest.mark.skipif(HELM is None, reason="no helm binary (PATH or .venv); schema checks ran")
def test_dataset_job_renders_one_pod_per_shard_against_the_service() -> None:
    assert HELM is not None
    example = CHART / "examples" / "values-dataset.yaml"
    command = [HELM, "template", "hsx", str(CHART), "-f", str(example), "--kube-version", "1.30.0"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    documents = [d for d in yaml.safe_load_all(out) if d]
    job = next(d for d in documents if d["kind"] == "Job")
    service = next(d for d in documents if d["kind"] == "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert (spec["completions"], spec["parallelism"], spec["backoffLimitPerIndex"]) == (8, 4, 3)
    assert spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    args = pod["containers"][0]["args"]
    assert args[:3] == ["dataset", "run", "s3://my-bucket/datasets/ultrachat-200k.jsonl"]
    port = service["spec"]["ports"][0]["port"]
    assert args[args.index("--endpoint") + 1] == f"http://{service['metadata']['name']}:{port}"
    assert args[args.index("--shard") + 1] == "$(JOB_COMPLETION_INDEX)/8"
    assert args[args.index("--output") + 1].startswith("s3://")
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert (
        "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    assert env["HSX_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "hsx-dataset-client"
    # The Service must not select the Job's pods.
    selector = service["spec"]["selector"]
    labels = spec["template"]["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in selector.items())
    # Off by default: no Job at all.
    plain = subprocess.run(
        [HELM, "template", "hsx", str(CHART), "-f", str(EXAMPLES[0]), "--kube-version", "1.30.0"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "kind: Job" not in plain


def test_dataset_values_are_checked() -> None:
    values = merged(load(CHART / "values.yaml"), {"dataset": {"shards": 0}})
    with pytest.raises(jsonschema.ValidationError, match="less than the minimum"):
        jsonschema.validate(values, schema())
    values = merged(load(CHART / "values.yaml"), {"dataset": {"loss": "some"}})
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        jsonschema.validate(values, schema())
    values = merged(load(CHART / "values.yaml"), {"dataset": {"output": "/local/dir"}})
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(values, schema())


# -- Mooncake: a master beside hsx, or an existing one ------------------------------

MOONCAKE_EXAMPLE = CHART / "examples" / "values-mooncake.yaml"
NEEDS_HELM = pytest.mark.skipif(HELM is None, reason="no helm binary (PATH or .venv)")


def helm_template(
    tmp_path: Path, values: dict[str, Any], *files: Path, namespace: str = "default"
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart with ``files`` then ``values`` on top."""
    assert HELM is not None
    override = tmp_path / "values.yaml"
    override.write_text(yaml.safe_dump(values))
    command = [HELM, "template", "hsx", str(CHART), "--namespace", namespace]
    command += [arg for f in (*files, override) for arg in ("-f", str(f))]
    command += ["--kube-version", "1.30.0"]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def rendered(tmp_path: Path, values: dict[str, Any], *files: Path, **kw: str) -> list[Any]:
    result = helm_template(tmp_path, values, *files, **kw)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def named(documents: list[Any], kind: str) -> dict[str, Any]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def hsx_env(documents: list[Any]) -> dict[str, dict[str, Any]]:
    container = named(documents, "Deployment")["hsx"]["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "hsx"
    return {e["name"]: e for e in container["env"]}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


EXTERNAL = {
    "model": {"name": "m"},
    "storage": {"type": "mooncake"},
    "mooncake": {"master": {"address": "mooncake-master.training.svc:50051"}},
}


@NEEDS_HELM
def test_mooncake_master_beside_hsx(tmp_path: Path) -> None:
    documents = rendered(tmp_path, {}, MOONCAKE_EXAMPLE, namespace="train")
    deployments = named(documents, "Deployment")
    services = named(documents, "Service")
    assert set(deployments) == {"hsx", "hsx-mooncake-master"}
    assert set(services) == {"hsx", "hsx-mooncake-master"}

    # The master: one replica, never two at once, the flags and ports the values give.
    master = deployments["hsx-mooncake-master"]["spec"]
    assert master["replicas"] == 1
    assert master["strategy"] == {"type": "Recreate"}
    pod = master["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["mooncake_master"]
    assert container["args"] == ["--rpc_port=50051", "--metrics_port=9003", "--rpc_thread_num=8"]
    app_version = load(CHART / "Chart.yaml")["appVersion"]
    assert container["image"] == f"ghcr.io/hsx/hsx:{app_version}"  # hsx's own image
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"rpc": 50051, "metrics": 9003}
    assert container["readinessProbe"]["tcpSocket"]["port"] == "rpc"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["resources"]["limits"]["memory"] == "2Gi"

    # Its Service selects the master and only it; hsx's Service never routes there.
    service = services["hsx-mooncake-master"]["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["ports"]} == {
        "rpc": (50051, "rpc"),
        "metrics": (9003, "metrics"),
    }
    master_labels = master["template"]["metadata"]["labels"]
    hsx_labels = deployments["hsx"]["spec"]["template"]["metadata"]["labels"]
    assert selects(service["selector"], master_labels)
    assert not selects(service["selector"], hsx_labels)
    assert not selects(services["hsx"]["spec"]["selector"], master_labels)
    pdb = next(d for d in documents if d["kind"] == "PodDisruptionBudget")
    assert not selects(pdb["spec"]["selector"]["matchLabels"], master_labels)

    # hsx writes to it, reachable at the pod's IP, with the example's sizes.
    env = hsx_env(documents)
    assert env["HSX_STORAGE__URL"]["value"] == "mooncake://hsx-mooncake-master.train.svc:50051"
    assert (
        env["HSX_STORAGE__MOONCAKE__METRICS_URL"]["value"]
        == "http://hsx-mooncake-master.train.svc:9003/metrics"
    )
    assert env["HSX_STORAGE__MOONCAKE__LOCAL_HOSTNAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert env["HSX_STORAGE__MOONCAKE__SEGMENT_BYTES"]["value"] == "34359738368"
    assert env["HSX_STORAGE__MOONCAKE__BUFFER_BYTES"]["value"] == "536870912"
    assert env["HSX_STORAGE__MOONCAKE__REPLICAS"]["value"] == "1"
    assert env["HSX_STORAGE__MOONCAKE__PROTOCOL"]["value"] == "tcp"
    assert env["HSX_STORAGE__MOONCAKE__METADATA_SERVER"]["value"] == "P2PHANDSHAKE"
    assert "HSX_STORAGE__MOONCAKE__DEVICE_NAME" not in env
    assert not [name for name in env if name.startswith(("HSX_STORAGE__S3__", "AWS_"))]
    assert not [d for d in documents if d["kind"] == "PersistentVolumeClaim"]

    # The master's metrics are scraped beside hsx's.
    monitors = named(documents, "ServiceMonitor")
    assert set(monitors) == {"hsx", "hsx-mooncake-master"}
    monitor = monitors["hsx-mooncake-master"]["spec"]
    assert monitor["endpoints"][0]["port"] == "metrics"
    assert selects(
        monitor["selector"]["matchLabels"], services["hsx-mooncake-master"]["metadata"]["labels"]
    )
    assert not selects(
        monitors["hsx"]["spec"]["selector"]["matchLabels"],
        services["hsx-mooncake-master"]["metadata"]["labels"],
    )

    # Trainers (networkPolicy.from) reach the API port and, for the store, every port.
    peers = load(MOONCAKE_EXAMPLE)["networkPolicy"]["from"]
    ingress = named(documents, "NetworkPolicy")["hsx"]["spec"]["ingress"]
    assert ingress == [
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": peers},
        {"from": peers},
    ]


@NEEDS_HELM
def test_mooncake_existing_master(tmp_path: Path) -> None:
    values = merged(
        EXTERNAL,
        {
            "mooncake": {
                "master": {"metricsUrl": "http://mooncake-master.training.svc:9003/metrics"},
                "segmentBytes": 0,
                "replicas": 2,
                "protocol": "rdma",
                "deviceName": "mlx5_0",
            },
        },
    )
    documents = rendered(tmp_path, values)
    assert set(named(documents, "Deployment")) == {"hsx"}  # no master of its own
    assert set(named(documents, "Service")) == {"hsx"}
    env = hsx_env(documents)
    assert env["HSX_STORAGE__URL"]["value"] == "mooncake://mooncake-master.training.svc:50051"
    assert (
        env["HSX_STORAGE__MOONCAKE__METRICS_URL"]["value"]
        == "http://mooncake-master.training.svc:9003/metrics"
    )
    assert env["HSX_STORAGE__MOONCAKE__SEGMENT_BYTES"]["value"] == "0"
    assert env["HSX_STORAGE__MOONCAKE__REPLICAS"]["value"] == "2"
    assert env["HSX_STORAGE__MOONCAKE__PROTOCOL"]["value"] == "rdma"
    assert env["HSX_STORAGE__MOONCAKE__DEVICE_NAME"]["value"] == "mlx5_0"
    assert "fieldRef" in env["HSX_STORAGE__MOONCAKE__LOCAL_HOSTNAME"]["valueFrom"]

    # No metrics URL given: none exported. Off (the default): no Mooncake at all.
    env = hsx_env(rendered(tmp_path, EXTERNAL))
    assert "HSX_STORAGE__MOONCAKE__METRICS_URL" not in env
    plain = rendered(tmp_path, {}, EXAMPLES[0])
    assert set(named(plain, "Deployment")) == {"hsx"}
    assert not [name for name in hsx_env(plain) if "MOONCAKE" in name]


@NEEDS_HELM
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"mooncake": {"master": {"enabled": True}}},
            "mooncake.master.enabled and mooncake.master.address are both set",
        ),
        (
            {"storage": {"type": "s3", "s3": {"bucket": "b"}}},
            'mooncake.master is set but storage.type is "s3": set storage.type=mooncake',
        ),
        (
            {"storage": {"type": "local"}},
            'mooncake.master is set but storage.type is "local"',
        ),
        (
            {"mooncake": {"master": {"address": ""}}},
            "storage.type=mooncake needs mooncake.master.enabled=true or "
            "mooncake.master.address=HOST:PORT",
        ),
        (
            {"env": [{"name": "HSX_STORAGE__URL", "value": "s3://b/p"}]},
            "env sets HSX_STORAGE__URL while storage.type=mooncake",
        ),
        (
            {
                "mooncake": {"segmentBytes": 34359738368},
                "resources": {"limits": {"memory": "32Gi"}},
            },
            r"resources.limits.memory \(32Gi\) is less than mooncake.segmentBytes \+ 2 x "
            r"mooncake.bufferBytes \(34896609280 bytes",
        ),
        (
            {
                "mooncake": {
                    "master": {
                        "enabled": True,
                        "address": "",
                        "metricsUrl": "http://x:9003/metrics",
                    }
                }
            },
            "mooncake.master.metricsUrl is for an existing master",
        ),
    ],
)
def test_mooncake_contradictions_are_refused(
    tmp_path: Path, override: dict[str, Any], message: str
) -> None:
    result = helm_template(tmp_path, merged(EXTERNAL, override))
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr


@NEEDS_HELM
@pytest.mark.parametrize(
    ("limit", "fits"),
    [
        ("32Gi", False),
        ("33280Mi", True),  # exactly 32 GiB + 2 x 256 MiB
        ("33279Mi", False),
        ("34G", False),
        ("35G", True),
        (34896609280, True),
        (34896609279, False),
        ("1Ti", True),
    ],
)
def test_mooncake_memory_limit_must_hold_segment_and_buffers(
    tmp_path: Path, limit: str | int, fits: bool
) -> None:
    values = merged(
        EXTERNAL,
        {"mooncake": {"segmentBytes": 34359738368}, "resources": {"limits": {"memory": limit}}},
    )
    result = helm_template(tmp_path, values)
    assert (result.returncode == 0) is fits, result.stderr
    if not fits:
        assert "is less than mooncake.segmentBytes + 2 x mooncake.bufferBytes" in result.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"mooncake": {"segmentBytes": 1000}}, "is not valid under any of the given schemas"),
        ({"mooncake": {"segmentBytes": 16777215}}, "is not valid under any of the given schemas"),
        ({"mooncake": {"segmentBytes": -1}}, "is not valid under any of the given schemas"),
        ({"mooncake": {"segmentBytes": "1Gi"}}, "is not of type 'integer'"),
        ({"mooncake": {"bufferBytes": 1024}}, "less than the minimum"),
        ({"mooncake": {"replicas": 0}}, "less than the minimum"),
        ({"mooncake": {"replicas": 9}}, "greater than the maximum"),
        ({"mooncake": {"protocol": "ib"}}, "is not one of"),
        ({"mooncake": {"master": {"address": "mooncake://m:50051"}}}, "does not match"),
        ({"mooncake": {"master": {"address": "m"}}}, "does not match"),
        ({"mooncake": {"master": {"rpcPort": 0}}}, "less than the minimum"),
        ({"mooncake": {"master": {"enabled": "yes"}}}, "is not of type 'boolean'"),
        ({"mooncake": {"master": {"port": 50051}}}, "Additional properties are not allowed"),
        ({"mooncake": {"segment_bytes": 0}}, "Additional properties are not allowed"),
        ({"storage": {"type": "mooncake://m:50051"}}, "is not one of"),
    ],
)
def test_mooncake_schema_refuses_bad_values(override: dict[str, Any], message: str) -> None:
    values = merged(load(CHART / "values.yaml"), override)
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(values, schema())


def test_mooncake_schema_accepts_the_smallest_segments() -> None:
    for segment in (0, 16777216, 1 << 40):
        values = merged(load(CHART / "values.yaml"), {"mooncake": {"segmentBytes": segment}})
        jsonschema.validate(values, schema())
    values = merged(load(CHART / "values.yaml"), EXTERNAL)
    jsonschema.validate(values, schema())


@NEEDS_HELM
def test_helm_refuses_a_segment_below_mooncakes_smallest(tmp_path: Path) -> None:
    result = helm_template(tmp_path, merged(EXTERNAL, {"mooncake": {"segmentBytes": 1000}}))
    assert result.returncode != 0
    assert "mooncake.segmentBytes" in result.stderr
    assert "values don't meet the specifications of the schema" in result.stderr
