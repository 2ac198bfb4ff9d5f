"""The supernet comparison's configs (tools/supernet_configs.py): every family mirrors its FEAST
source, and the written files are what the tool writes now (stale files fail here)."""

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import supernet_configs as tool  # noqa: E402

# what a method may change in its FEAST source; everything else is the population and protocol
OWN = {"name", "model", "algorithm"}
METHOD_CHANGES = {"fiarse": {("train", "weight_decay")}, "sfn_unconstrained": {("partition", "gamma")},
                  "dfn_unconstrained": {("partition", "gamma")}}


def written(where, dataset, method):
    return yaml.safe_load((ROOT / "configs" / "supernet" / where / dataset / f"{method}.yaml").read_text())


def differences(a: dict, b: dict, prefix=()):
    for key in sorted(set(a) | set(b)):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            yield from differences(a[key], b[key], prefix + (key,))
        elif a.get(key) != b.get(key):
            yield prefix + (key,)


@pytest.mark.parametrize("where,dataset", list(tool.SOURCES))
def test_every_member_keeps_its_feast_sources_population_and_protocol(where, dataset):
    source = tool.load_yaml(tool.SOURCES[(where, dataset)])
    assert written(where, dataset, "feast") == {**source, "name": f"feast_{dataset}"}
    for method in tool.METHODS:
        cfg = written(where, dataset, method)
        changed = {d for d in differences(source, cfg) if d[0] not in OWN}
        assert changed == METHOD_CHANGES.get(method, set()), (method, changed)


@pytest.mark.parametrize("where,dataset", [k for k in tool.SOURCES if k[0] == "paper"])
def test_paper_files_are_what_the_tool_writes(where, dataset):
    for method in tool.METHODS:
        path = ROOT / "configs" / "supernet" / where / dataset / f"{method}.yaml"
        expected = tool.header(where, dataset, method, None) + tool.dump(tool.config_for(where, dataset, method))
        assert path.read_text() == expected, f"{path} is stale: rerun python tools/supernet_configs.py"


@pytest.mark.parametrize("where,dataset", [k for k in tool.SOURCES if k[0] == "offline"])
def test_offline_files_match_the_tool_on_the_substrate_written(where, dataset):
    """Without rerunning the cache search: the rest of each file follows from the width it holds."""
    width = written(where, dataset, "heterofl")["model"]["init_args"]["width"]
    for method in tool.METHODS:
        cfg = written(where, dataset, method)
        assert cfg == tool.config_for(where, dataset, method, width), f"{method}: rerun python tools/supernet_configs.py"
        if method in ("heterofl", "scalefl", "fiarse"):
            assert cfg["model"]["init_args"]["width"] == width


def test_paper_baselines_use_the_full_substrate_with_the_datasets_stem():
    for dataset, stem in (("cifar100", "cifar"), ("cinic10", "cifar"), ("tinyimagenet", "tiny")):
        assert written("paper", dataset, "heterofl")["model"] == {"class_path": "fl_lightning.elastic.models.ResNet18", "init_args": {"stem": stem}}
        assert written("paper", dataset, "scalefl")["model"] == {"class_path": "fl_lightning.elastic.models.ScaleFLResNet18",
                                                                 "init_args": {"stem": stem}}
        transfer = written("paper", dataset, "dfn_constrained")["algorithm"]["init_args"]
        assert transfer["cache"] == tool.load_yaml(tool.SOURCES[("paper", dataset)])["algorithm"]["init_args"]["cache"]
