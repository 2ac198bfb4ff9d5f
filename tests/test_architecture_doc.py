"""docs/architecture.md's table of hooks and parts is the code's: regenerated here and compared."""

import importlib.util
from pathlib import Path

import pytest

from fl_lightning.algorithms import Algorithm, FedAvg, FedOpt, FedSGA, HeteroFL

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("architecture_table", ROOT / "tools" / "architecture_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_table_is_the_code_table():
    tool = load_tool()
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start, stop = doc.index(tool.BEGIN) + len(tool.BEGIN), doc.index(tool.END)
    assert doc[start:stop].strip() == tool.table().strip(), \
        "docs/architecture.md is out of date: run python tools/architecture_table.py --write"


def test_the_table_reads_overrides_and_parts_from_the_classes():
    tool = load_tool()
    names = tool.hooks()
    assert "setup" not in names and "prepare" in names and "commit" in names
    assert tool.overridden(FedAvg, names) == []
    assert tool.overridden(FedOpt, names) == ["check", "prepare"]  # the server step is a kept part
    assert "ServerOptimizer" in tool.parts_used(FedOpt) and "ServerOptimizer" not in tool.parts_used(FedAvg)
    assert tool.client_class(FedSGA) == "FedSGAClient" and tool.client_class(FedAvg) == "LocalClient"
    assert tool.served(HeteroFL) == "sbn" and tool.served(FedAvg) == "aggregated"


class _SkipsSetup(FedAvg):
    def setup(self, ctx):  # a method that replaced the template would lose the shared steps
        self.ctx = ctx


class _WritesItsState(FedAvg):
    def state_dict(self):  # state written by hand instead of a kept part
        return {}


def test_the_abstract_base_has_at_most_twelve_hooks():
    tool = load_tool()
    assert len(tool.algorithm_hooks()) <= 12, tool.algorithm_hooks()
    assert {"plan", "fit_cohort", "commit", "finish_round", "evaluate"} <= set(Algorithm.__abstractmethods__)


def test_no_method_replaces_the_base_set_up_or_checkpointing():
    """Set-up is a template (methods extend ``prepare``) and state is carried by kept parts
    (``runtime/kept_state.py``): a method replacing either would skip the shared steps or drop
    a kept part from its checkpoint."""
    tool = load_tool()
    for name, cls in tool.methods():
        for own in tool.BASE_OWN:
            assert getattr(cls, own) is getattr(Algorithm, own), f"{name} overrides {own}"
    assert _SkipsSetup.setup is not Algorithm.setup  # the check above would catch them
    assert _WritesItsState.state_dict is not Algorithm.state_dict


@pytest.mark.parametrize("flag", [["--bogus"]])
def test_the_tool_refuses_unknown_options_in_one_line(flag, capsys):
    tool = load_tool()
    with pytest.raises(SystemExit) as stop:
        tool.main(flag)
    assert stop.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_kept_parts_round_trip_through_the_base_state():
    import torch

    from fl_lightning.runtime.client_store import ClientStateStore

    method = FedAvg()
    method.kept = []
    store = method.keep(ClientStateStore(lambda: {"x": torch.zeros(2)}))
    store.states = {3: {"x": torch.tensor([1.0, 2.0])}}
    saved = method.state_dict()
    assert list(saved) == ["clients/3/x"]
    store.states = {}
    method.load_state_dict(saved)
    assert torch.equal(store.states[3]["x"], torch.tensor([1.0, 2.0]))
