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
    deployment = next(d for d in documents if d["kind"] == "Deployment")
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
