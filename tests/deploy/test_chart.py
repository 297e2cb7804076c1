"""The Helm chart without a cluster: schema, values used by templates, files that parse."""

from __future__ import annotations

import copy
import json
import os
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


def api_pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template running ``hsx serve`` in a Deployment or a LeaderWorkerSet."""
    if workload["kind"] == "LeaderWorkerSet":
        return dict(workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    return dict(workload["spec"]["template"])


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
    values = merged(load(CHART / "values.yaml"), load(example))
    # The API's pods: the Deployment's, or across nodes each LeaderWorkerSet group's leader.
    workload = "LeaderWorkerSet" if values["multiNode"]["enabled"] else "Deployment"
    assert {workload, "Service", "PodDisruptionBudget"} <= kinds
    pod = next(
        template["spec"]
        for d in documents
        if d["kind"] == workload
        for template in [api_pod_template(d)]
        if template["spec"]["containers"][0]["name"] == "hsx"
    )
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
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
#: A NetworkPolicy peer: the release's own pods (release hsx).
OWN_PODS = {
    "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "hsx", "app.kubernetes.io/instance": "hsx"}
    }
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
    assert env["HSX_STORAGE__MOONCAKE__MIN_FREE_BYTES"]["value"] == "4194304"
    assert "HSX_STORAGE__MOONCAKE__SHARED_BY_NAMESPACES" not in env  # one tenant
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

    # The API's clients (networkPolicy.from) reach the API port; the store's members,
    # the trainers and the release's own pods, every port (the transfer engine's).
    policy = load(MOONCAKE_EXAMPLE)["networkPolicy"]
    ingress = named(documents, "NetworkPolicy")["hsx"]["spec"]["ingress"]
    assert ingress == [
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": policy["from"]},
        {"from": policy["mooncake"]["trainers"]},
        {"from": [OWN_PODS]},
    ]


def every_port_to(ingress: list[dict[str, Any]]) -> list[Any]:
    """The peers of the rules that open every port (a rule without ``ports``); ``{}``
    for a rule that opens them to every pod."""
    return [rule.get("from", {}) for rule in ingress if "ports" not in rule]


@NEEDS_HELM
def test_mooncake_master_network_policy(tmp_path: Path) -> None:
    """The master lists every key on its metrics port and lets any client of its RPC
    port read and remove every object: only the store's members reach the RPC port,
    only hsx and the monitoring peers the metrics port."""
    documents = rendered(tmp_path, {}, MOONCAKE_EXAMPLE)
    policy = load(MOONCAKE_EXAMPLE)["networkPolicy"]["mooncake"]
    master = named(documents, "NetworkPolicy")["hsx-mooncake-master"]["spec"]
    pod = named(documents, "Deployment")["hsx-mooncake-master"]["spec"]["template"]
    assert selects(master["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    assert master["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in master["ingress"]}
    assert by_port == {
        "rpc": [OWN_PODS, *policy["trainers"]],
        "metrics": [OWN_PODS, *policy["monitoring"]],
    }
    assert [r["ports"][0]["protocol"] for r in master["ingress"]] == ["TCP", "TCP"]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert set(by_port) == ports  # the policy's names are the container's ports

    # No trainer and no API peer given: every port of the hsx pods to their own pods
    # only (once any pod's), the API port to any pod; the master's ports to hsx only.
    bare = {"networkPolicy": {"from": [], "mooncake": {"trainers": [], "monitoring": []}}}
    policies = named(rendered(tmp_path, bare, MOONCAKE_EXAMPLE), "NetworkPolicy")
    ingress = policies["hsx"]["spec"]["ingress"]
    assert ingress[0] == {"ports": [{"port": "http", "protocol": "TCP"}]}
    assert every_port_to(ingress) == [[OWN_PODS]]
    assert [r["from"] for r in policies["hsx-mooncake-master"]["spec"]["ingress"]] == [
        [OWN_PODS],
        [OWN_PODS],
    ]

    # An existing master is not the chart's to guard; without networkPolicy, nothing is.
    external = merged(EXTERNAL, {"networkPolicy": {"enabled": True}})
    assert set(named(rendered(tmp_path, external), "NetworkPolicy")) == {"hsx"}
    off = {"networkPolicy": {"enabled": False}}
    assert not named(rendered(tmp_path, off, MOONCAKE_EXAMPLE), "NetworkPolicy")


@NEEDS_HELM
def test_mooncake_store_shared_by_namespaces_is_said_in_values(tmp_path: Path) -> None:
    values = merged(EXTERNAL, {"mooncake": {"sharedByNamespaces": True, "minFreeBytes": 0}})
    env = hsx_env(rendered(tmp_path, values))
    assert env["HSX_STORAGE__MOONCAKE__SHARED_BY_NAMESPACES"]["value"] == "true"
    assert env["HSX_STORAGE__MOONCAKE__MIN_FREE_BYTES"]["value"] == "0"


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
        ({"mooncake": {"minFreeBytes": -1}}, "less than the minimum"),
        ({"mooncake": {"sharedByNamespaces": "yes"}}, "is not of type 'boolean'"),
        ({"networkPolicy": {"mooncake": {"trainers": {}}}}, "is not of type 'array'"),
        ({"networkPolicy": {"mooncake": {"trainer": []}}}, "Additional properties are not allowed"),
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


# -- Across nodes: a LeaderWorkerSet, the leader serving, headless vLLM workers --------

MULTINODE_EXAMPLE = CHART / "examples" / "values-multinode.yaml"
MULTINODE = {
    "model": {"name": "org/model"},
    "engine": {"tensorParallelSize": 4, "layerIds": [2, 3]},
    "gpu": {"count": 2},
    "multiNode": {"enabled": True, "size": 2},
    "storage": {"type": "local"},
}


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in an argument list (which has it once)."""
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def multinode_parts(
    documents: list[Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The LeaderWorkerSet's spec, and the leader's and the worker's pod templates and
    containers: (spec, leader template, worker template, worker container)."""
    sets = [d for d in documents if d["kind"] == "LeaderWorkerSet"]
    assert len(sets) == 1
    assert sets[0]["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = sets[0]["spec"]
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]
    assert len(worker["spec"]["containers"]) == 1
    return spec, leader, worker, worker["spec"]["containers"][0]


@NEEDS_HELM
def test_multinode_renders_one_leaderworkerset(tmp_path: Path) -> None:
    documents = rendered(tmp_path, {}, MULTINODE_EXAMPLE, namespace="llm")
    example = merged(load(CHART / "values.yaml"), load(MULTINODE_EXAMPLE))
    model, size, gpus = example["model"]["name"], 2, 8
    assert (example["multiNode"]["size"], example["gpu"]["count"]) == (size, gpus)

    # One LeaderWorkerSet in place of the Deployment, nothing that scales pods one by one.
    assert named(documents, "Deployment") == {}
    kinds = [d["kind"] for d in documents]
    assert kinds.count("LeaderWorkerSet") == 1
    assert not {"HorizontalPodAutoscaler", "ScaledObject"} & set(kinds)
    spec, leader, worker, container = multinode_parts(documents)
    assert spec["replicas"] == example["replicaCount"]
    assert spec["leaderWorkerTemplate"]["size"] == size
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"

    # The leader: hsx serve, vLLM's node 0 of `size`, its own address as the master.
    hsx = leader["spec"]["containers"][0]
    assert (hsx["name"], hsx["args"]) == ("hsx", ["serve"])
    assert "command" not in hsx
    env = {e["name"]: e for e in hsx["env"]}
    assert env["HSX_ENGINE__TENSOR_PARALLEL_SIZE"]["value"] == str(size * gpus)
    assert json.loads(env["HSX_ENGINE__EXTRA_ARGS"]["value"]) == {
        "nnodes": size,
        "node_rank": 0,
        "master_addr": "$(LWS_LEADER_ADDRESS)",
        "master_port": 29501,
    }
    assert env["VLLM_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert hsx["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert hsx["resources"]["limits"]["nvidia.com/gpu"] == gpus

    # The workers: vLLM headless, node LWS_WORKER_INDEX (1 and up), same layout.
    args = container["args"]
    assert container["command"] == ["vllm"]
    assert args[:3] == ["serve", model, "--headless"]
    assert flag(args, "--nnodes") == str(size)
    assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert flag(args, "--master-port") == "29501"
    assert flag(args, "--tensor-parallel-size") == str(size * gpus)
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--max-model-len") == "32768"
    assert flag(args, "--gpu-memory-utilization") == "0.9"
    # The engine hsx builds: its extraction, its connector (only on the leader's rank 0
    # does it write), its worker extension.
    speculative = json.loads(flag(args, "--speculative-config"))
    assert speculative["method"] == "extract_hidden_states"
    layer_ids = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layer_ids == json.loads(env["HSX_ENGINE__LAYER_IDS"]["value"]) == [2, 63, 123, 126]
    transfer = json.loads(flag(args, "--kv-transfer-config"))
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (
        "HsxConnector",
        "service.engine.connector",
    )
    assert flag(args, "--worker-extension-cls") == "service.engine.introspect.HsxWorkerExtension"
    assert not {"--node-rank", "--headless"} & set(hsx["args"])
    assert not {"ports", "readinessProbe", "startupProbe"} & set(container)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    worker_env = {e["name"] for e in container["env"]}
    assert {"VLLM_HOST_IP", "HF_TOKEN"} <= worker_env
    assert not [name for name in worker_env if name.startswith(("HSX_", "AWS_"))]
    assert {m["name"] for m in container["volumeMounts"]} == {"shm", "tmp", "models"}
    assert worker["spec"]["nodeSelector"] == leader["spec"]["nodeSelector"]

    # The Service (and the ServiceMonitor through it) reaches the leaders only.
    selector = named(documents, "Service")["hsx"]["spec"]["selector"]
    assert selects(selector, leader["metadata"]["labels"])
    assert not selects(selector, worker["metadata"]["labels"])


@NEEDS_HELM
def test_multinode_extra_args_network_and_cache(tmp_path: Path) -> None:
    extra = {
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_seqs": 64,
        "compilation_config": {"cudagraph_capture_sizes": [1, 2]},
        "kv_cache_dtype": "fp8",
    }
    values = merged(
        MULTINODE,
        {
            "engine": {"extraArgs": extra, "maxModelLen": 1000000, "enablePrefixCaching": "false"},
            "multiNode": {"size": 4, "masterPort": 30000},
            "gpu": {"count": 1},
            "model": {"cache": {"type": "pvc"}},
            "networkPolicy": {"enabled": True},
            "replicaCount": 3,
        },
    )
    documents = rendered(tmp_path, values)
    spec, leader, _, container = multinode_parts(documents)
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (3, 4)
    env = {e["name"]: e.get("value") for e in leader["spec"]["containers"][0]["env"]}
    assert json.loads(env["HSX_ENGINE__EXTRA_ARGS"]) == {
        **extra,
        "nnodes": 4,
        "node_rank": 0,
        "master_addr": "$(LWS_LEADER_ADDRESS)",
        "master_port": 30000,
    }
    # The workers get the same engine arguments, mapped as vLLM's --config maps them.
    args = container["args"]
    assert (flag(args, "--nnodes"), flag(args, "--master-port")) == ("4", "30000")
    assert flag(args, "--max-model-len") == "1000000"
    assert "--enable-prefix-caching" not in args
    assert {"--no-enable-prefix-caching", "--enforce-eager", "--no-enable-chunked-prefill"} <= set(
        args
    )
    assert flag(args, "--max-num-seqs") == "64"
    assert json.loads(flag(args, "--compilation-config")) == extra["compilation_config"]
    assert flag(args, "--kv-cache-dtype") == "fp8"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1

    # The group's pods reach each other on every port; peers reach only the API's.
    ingress = named(documents, "NetworkPolicy")["hsx"]["spec"]["ingress"]
    own = {"app.kubernetes.io/name": "hsx", "app.kubernetes.io/instance": "hsx"}
    assert ingress[0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert ingress[-1] == {"from": [{"podSelector": {"matchLabels": own}}]}
    # One model cache that every node mounts.
    claims = named(documents, "PersistentVolumeClaim")
    assert claims["hsx-models"]["spec"]["accessModes"] == ["ReadWriteMany"]
    # Off (the default): the Deployment's claim, its Service selector, no LWS.
    plain = rendered(tmp_path, merged(values, {"multiNode": {"enabled": False}}))
    assert named(plain, "PersistentVolumeClaim")["hsx-models"]["spec"]["accessModes"] == [
        "ReadWriteOnce"
    ]
    assert "app.kubernetes.io/component" not in named(plain, "Service")["hsx"]["spec"]["selector"]
    assert not [d for d in plain if d["kind"] == "LeaderWorkerSet"]
    assert set(named(plain, "Deployment")) == {"hsx"}


@NEEDS_HELM
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"autoscaling": {"enabled": True}}, "multiNode.enabled with autoscaling"),
        ({"autoscaling": {"keda": {"enabled": True}}}, "multiNode.enabled with autoscaling"),
        (
            {"multiNode": {"size": 1}, "engine": {"tensorParallelSize": 2}},
            "multiNode.size is 1: a replica across nodes needs at least 2 pods",
        ),
        (
            {"engine": {"tensorParallelSize": 2}},
            r"engine.tensorParallelSize \(2\) must be multiNode.size x gpu.count "
            r"\(2 x 2 = 4\)",
        ),
        ({"engine": {"layerIds": []}}, "multiNode needs engine.layerIds"),
        (
            {"engine": {"extraArgs": {"node_rank": 1}}},
            "engine.extraArgs sets node_rank while multiNode.enabled",
        ),
        (
            {"engine": {"extraArgs": {"master_addr": "10.0.0.1"}}},
            "engine.extraArgs sets master_addr while multiNode.enabled",
        ),
    ],
)
def test_multinode_contradictions_are_refused(
    tmp_path: Path, override: dict[str, Any], message: str
) -> None:
    result = helm_template(tmp_path, merged(MULTINODE, override))
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr
    assert helm_template(tmp_path, MULTINODE).returncode == 0  # the base renders


@NEEDS_HELM
@pytest.mark.slow
def test_multinode_workers_configure_vllm_as_hsx_serve_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's command line, parsed by vLLM 0.32's own `vllm serve` parser, gives
    the engine arguments hsx serve builds on the leader from the leader's environment."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from service.config import Settings
    from service.engine.builder import ModelInfo, engine_args
    from service.engine.wire import ConnectorConfig

    values = {"engine": {"extraArgs": {"enforce_eager": True, "max_num_seqs": 64}}}
    documents = rendered(tmp_path, values, MULTINODE_EXAMPLE)
    _, leader, _, container = multinode_parts(documents)
    address = "hsx-0.hsx.default"  # what LWS puts in LWS_LEADER_ADDRESS

    # The leader: hsx's settings from its environment, then the engine arguments.
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)  # set on CPU
    for name in [n for n in os.environ if n.startswith("HSX_")]:
        monkeypatch.delenv(name)
    for item in leader["spec"]["containers"][0]["env"]:
        if item["name"].startswith("HSX_") and "value" in item:
            monkeypatch.setenv(
                item["name"], item["value"].replace("$(LWS_LEADER_ADDRESS)", address)
            )
    settings = Settings()
    info = ModelInfo(name="meta-llama/Llama-3.1-405B-Instruct", num_layers=126,
                     hidden_size=16384, hybrid=False)  # fmt: skip
    ours = engine_args(settings, info, [2, 63, 123, 126], "ipc:///tmp/hsx-test.sock")

    # A worker: its arguments as the kubelet expands them, through vLLM's CLI.
    args = [
        a.replace("$(LWS_WORKER_INDEX)", "1").replace("$(LWS_LEADER_ADDRESS)", address)
        for a in container["args"]
    ]
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    namespace = parser.parse_args(args)
    assert namespace.headless is True
    namespace.model = namespace.model_tag  # as `vllm serve` does with its positional model
    theirs = AsyncEngineArgs.from_cli_args(namespace)

    same = [
        "model", "dtype", "tensor_parallel_size", "max_model_len", "max_num_batched_tokens",
        "gpu_memory_utilization", "enable_prefix_caching", "speculative_config",
        "worker_extension_cls", "nnodes", "master_addr", "master_port", "enforce_eager",
        "max_num_seqs", "pipeline_parallel_size", "data_parallel_size",
    ]  # fmt: skip
    assert {k: getattr(theirs, k) for k in same} == {k: getattr(ours, k) for k in same}
    assert (ours.node_rank, theirs.node_rank) == (0, 1)
    assert ours.master_addr == address
    ours_kv, theirs_kv = ours.kv_transfer_config, theirs.kv_transfer_config
    for field in ("kv_connector", "kv_connector_module_path", "kv_role"):
        assert getattr(theirs_kv, field) == getattr(ours_kv, field)
    # The workers' connector settings load as the connector loads them.
    ConnectorConfig.from_extra_config(theirs_kv.kv_connector_extra_config)


# -- KV capacity: the examples hold their longest sequence --------------------------

#: What the rule needs of each example's model (its config.json) and GPUs.
MODELS = {
    "meta-llama/Llama-3.3-70B-Instruct": {
        "parameters": 70_553_706_496,
        "layers": 80,
        "kv_heads": 8,
        "head_dim": 128,
        "hidden": 8192,
    },
    "meta-llama/Llama-3.1-405B-Instruct": {
        "parameters": 405_853_388_800,
        "layers": 126,
        "kv_heads": 8,
        "head_dim": 128,
        "hidden": 16384,
    },
}
GPU_BYTES = {"NVIDIA-H100-80GB-HBM3": 80e9}  # by GPU feature discovery's product label
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: What vLLM keeps out of the KV pool per rank (activation peak, CUDA graphs, NCCL).
RESERVED_BYTES = 4e9
DEFAULT_EXTRACTED_LAYERS = 4  # [2, L//2, L-3, L]


def kv_capacity(values: dict[str, Any]) -> dict[str, float]:
    """The README's KV capacity rule, per tensor-parallel rank, for chart values."""
    engine = values["engine"]
    model = MODELS[values["model"]["name"]]
    tp = engine["tensorParallelSize"]
    dtype = DTYPE_BYTES[engine["dtype"]]
    gpu = GPU_BYTES[values["nodeSelector"]["nvidia.com/gpu.product"]]
    attention = 2 * model["layers"] * max(1, model["kv_heads"] // tp) * model["head_dim"] * dtype
    extracted = len(engine["layerIds"]) or DEFAULT_EXTRACTED_LAYERS
    states = extracted * model["hidden"] * dtype  # not sharded: on every rank
    weights = model["parameters"] * dtype / tp
    memory = gpu * engine["gpuMemoryUtilization"] - weights - RESERVED_BYTES
    tokens = max(memory, 0) / (attention + states)
    return {"attention": attention, "states": states, "weights": weights,
            "memory": memory, "tokens": tokens}  # fmt: skip


SIZED_EXAMPLES = [CHART / "examples" / f"values-{n}.yaml" for n in ("tp4", "multinode")]


@pytest.mark.parametrize("example", SIZED_EXAMPLES, ids=lambda p: p.name)
def test_tp_examples_hold_their_max_context(example: Path) -> None:
    values = merged(load(CHART / "values.yaml"), load(example))
    engine = values["engine"]
    assert engine["tensorParallelSize"] == values["gpu"]["count"] * (
        values["multiNode"]["size"] if values["multiNode"]["enabled"] else 1
    )
    capacity = kv_capacity(values)
    assert capacity["tokens"] >= engine["maxModelLen"], capacity


def test_kv_rule_numbers() -> None:
    """The README's table: two 80 GB GPUs cannot hold a 70B model's 16k sequence."""
    tp4 = merged(load(CHART / "values.yaml"), load(SIZED_EXAMPLES[0]))
    two = merged(tp4, {"engine": {"tensorParallelSize": 2}, "gpu": {"count": 2}})
    assert (kv_capacity(two)["attention"], kv_capacity(two)["states"]) == (163_840, 65_536)
    assert kv_capacity(two)["tokens"] == 0  # 72 - 70.55 - 4 GB < 0
    assert kv_capacity(tp4)["attention"] + kv_capacity(tp4)["states"] == 147_456
    assert int(kv_capacity(tp4)["tokens"]) == 221_918
    multinode = merged(load(CHART / "values.yaml"), load(MULTINODE_EXAMPLE))
    assert kv_capacity(multinode)["attention"] == 64_512  # 8 KV heads over 16: 1 a rank
    assert kv_capacity(multinode)["states"] == 131_072  # replicated, the larger part
    assert int(kv_capacity(multinode)["tokens"]) == 88_291
