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
    assert set(tool.overridden(FedOpt, names)) >= {"prepare", "finish_round", "state_dict"}
    assert "ServerOptimizer" in tool.parts_used(FedOpt) and "ServerOptimizer" not in tool.parts_used(FedAvg)
    assert tool.client_class(FedSGA) == "FedSGAClient" and tool.client_class(FedAvg) == "LocalClient"
    assert tool.served(HeteroFL) == "sbn" and tool.served(FedAvg) == "aggregated"


class _SkipsSetup(FedAvg):
    def setup(self, ctx):  # a method that replaced the template would lose the shared steps
        self.ctx = ctx


def test_every_method_extends_prepare_and_none_replaces_setup():
    tool = load_tool()
    for name, cls in tool.methods():
        assert cls.setup is Algorithm.setup, f"{name} overrides setup; extend prepare instead"
    assert _SkipsSetup.setup is not Algorithm.setup  # the check above would catch it


@pytest.mark.parametrize("flag", [["--bogus"]])
def test_the_tool_refuses_unknown_options_in_one_line(flag, capsys):
    tool = load_tool()
    with pytest.raises(SystemExit) as stop:
        tool.main(flag)
    assert stop.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
