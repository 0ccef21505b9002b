"""Cluster descriptions (conf/cluster/) load, validate and refuse bad values clearly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeline_recipes.core.errors import ConfigError
from pipeline_recipes.planner.cluster import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = sorted(p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml"))


def _compose(*overrides: str):
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compose_config(list(overrides))


def test_the_issues_clusters_exist() -> None:
    assert {"local", "piz-daint", "v100-nvlink-ib", "dgx-h100", "h200"} <= set(CLUSTERS)


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_cluster_yaml_loads_and_validates(name: str) -> None:
    spec = ClusterSpec.from_config(_compose(f"cluster={name}").cluster)
    assert spec.name == name
    if not spec.measure:
        assert spec.devices_per_node >= 1 and spec.device_memory > 0 and spec.host_memory > 0
        assert spec.peak_flops("fp32") > 0 and spec.intra_node and spec.inter_node


def test_local_is_the_default_and_measures() -> None:
    spec = ClusterSpec.from_config(_compose().cluster)
    assert spec.name == "local" and spec.measure


def test_figures_read_in_their_units() -> None:
    spec = ClusterSpec.from_config(_compose("cluster=dgx-h100").cluster)
    assert spec.devices_per_node == 8 and spec.device_memory == 80 * 10**9
    assert spec.inter_node.alpha_beta.alpha == pytest.approx(8e-6)
    assert spec.inter_node.alpha_beta.beta == pytest.approx(1 / 50e9)
    assert spec.peak_flops("bf16") == pytest.approx(989.4e12)
    daint = ClusterSpec.from_config(_compose("cluster=piz-daint").cluster)
    assert daint.peak_flops("bf16") == pytest.approx(9.3e12)  # a P100 has no bf16 unit: fp32's
    assert daint.nodes(2048) == 2048


@pytest.mark.parametrize("override,key", [
    ("cluster.devices_per_node=0", "devices_per_node"),
    ("cluster.device_memory=lots", "device_memory"),
    ("cluster.inter_node.bandwidth_GBps=-1", "inter_node.bandwidth_GBps"),
    ("cluster.intra_node.latency_us=-3", "intra_node.latency_us"),
    ("cluster.allreduce=tree", "allreduce"),
    ("+cluster.peak_tflops.fp8=2000", "peak_tflops"),
])
def test_a_bad_value_is_refused_naming_key_value_rule_and_fix(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterSpec.from_config(_compose("cluster=dgx-h100", override).cluster)
    text = str(err.value)
    assert f"cluster.{key}=" in text and "must" in text and "Fix:" in text
