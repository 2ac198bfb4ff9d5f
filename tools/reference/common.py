"""Shared pieces of the reference adapters: the case our side defines (tests/reference_case.py),
a plain copy of its tiny CNN that reference code can hold, and the provenance record.

An adapter takes the path of a fetched reference repository, imports that repository's own
update code from it, runs it on the stored case and writes its outputs under
``tests/data/reference/<method>/``. Nothing of the reference is copied into this project.
"""

from __future__ import annotations

import argparse

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT / "src", ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import reference_case  # noqa: E402  (tests/reference_case.py)
from fl_lightning.elastic.models import CNN, ViT


_ADDED: list = []


def repository_args(name: str = "repo") -> argparse.Namespace:
    """An adapter's command line: the reference repository's folder (``name``) and, for a folder
    extracted with ``git archive``, the commit it comes from; the run then uses one thread."""
    parser = argparse.ArgumentParser()
    parser.add_argument(name)
    parser.add_argument("--commit", default=None, help="the commit a folder extracted by git archive comes from")
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args


def add_repo(path: str, sub: str = "") -> Path:
    """Put a fetched repository (or its ``sub`` folder) first on ``sys.path``."""
    repo = Path(path).resolve()
    for name in list(sys.modules):  # another reference's top-level packages of the same name
        if name.split(".")[0] in ("utils", "models", "flcore", "algorithm", "Algorithm", "src"):
            del sys.modules[name]
    for old in _ADDED:  # a regular package of an earlier repository would shadow a namespace one
        if old in sys.path:
            sys.path.remove(old)
    _ADDED.append(str(repo / sub) if sub else str(repo))
    sys.path.insert(0, _ADDED[-1])
    return repo


def stub_modules(*names: str, **attrs) -> None:
    """Empty stand-ins for packages a reference imports only for I/O, logging, plotting or
    options it leaves off (never for the numbers compared), so that it imports without them;
    ``attrs`` maps ``"module.name"`` to the stand-in of a name imported from one."""
    import types

    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    for dotted, value in attrs.items():
        module, attr = dotted.rsplit(".", 1)
        setattr(sys.modules[module], attr, value)


def pfllib_args(model: nn.Module, algorithm: str, dataset: str, batch_size: int, lr: float, epochs: int = 1,
                **extra):
    """The ``args`` PFLlib's clients and servers read, from our training settings (its names);
    ``extra``: the method's own fields."""
    from types import SimpleNamespace

    return SimpleNamespace(model=model, algorithm=algorithm, dataset=dataset, device="cpu", save_folder_name="-",
                           num_classes=10, batch_size=batch_size, local_learning_rate=lr, local_epochs=epochs,
                           few_shot=0, learning_rate_decay_gamma=1.0, learning_rate_decay=False, **extra)


def out_dir(method: str) -> Path:
    d = reference_case.DATA_ROOT / method
    d.mkdir(parents=True, exist_ok=True)
    return d


def commit_of(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def write_provenance(method: str, repo: Path, repository: str, used: list, notes: str = "",
                     commit: str = None, **extra) -> None:
    """``commit``: for a folder that is not a git checkout (extracted with ``git archive``)."""
    record = {
        "repository": repository,
        "commit": commit or commit_of(repo),
        "used": used,
        "command": " ".join(["python", f"tools/reference/{Path(sys.argv[0]).name}"] + ["<path of the fetched repository>"]
                            + sys.argv[2:]),
        "notes": notes,
        "torch": torch.__version__,
        **extra,
    }
    (out_dir(method) / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")


class TinyCNN(nn.Module):
    """The same function as ``fl_lightning``'s ``cnn`` with channels (4, 8) on 1x8x8 inputs,
    built from plain layers: ``base`` (conv-BN-ReLU-maxpool, conv-BN-ReLU, global average
    pool, flatten) and a linear head whose attribute name the reference expects."""

    def __init__(self, head_name: str = "head", channels=(4, 8), num_classes: int = 10, split: bool = True):
        super().__init__()
        c0, c1 = channels
        self.head_name = head_name
        self.base = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(1, c0, 3, padding=1, bias=False)), ("bn0", nn.BatchNorm2d(c0)), ("relu0", nn.ReLU()),
            ("pool0", nn.MaxPool2d(2)),
            ("conv1", nn.Conv2d(c0, c1, 3, padding=1, bias=False)), ("bn1", nn.BatchNorm2d(c1)), ("relu1", nn.ReLU()),
            ("gap", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()),
        ]))
        setattr(self, head_name, nn.Linear(c1, num_classes))

    def forward(self, x):
        return getattr(self, self.head_name)(self.base(x))


OURS_TO_PLAIN = {
    "features.block0.conv.": "base.conv0.", "features.block0.bn.": "base.bn0.",
    "features.block1.conv.": "base.conv1.", "features.block1.bn.": "base.bn1.",
}


def to_plain(state: Dict[str, torch.Tensor], head_name: str = "head") -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("fc."):
            out[head_name + k[2:]] = v.clone()
            continue
        for a, b in OURS_TO_PLAIN.items():
            if k.startswith(a):
                out[b + k[len(a):]] = v.clone()
                break
        else:
            raise KeyError(k)
    return out


def to_ours(state: Dict[str, torch.Tensor], head_name: str = "head") -> Dict[str, torch.Tensor]:
    back = {b: a for a, b in OURS_TO_PLAIN.items()}
    out = {}
    for k, v in state.items():
        if k.startswith(head_name + "."):
            out["fc" + k[len(head_name):]] = v.detach().clone()
            continue
        for b, a in back.items():
            if k.startswith(b):
                out[a + k[len(b):]] = v.detach().clone()
                break
        else:
            raise KeyError(k)
    return out


def plain_model(initial: Dict[str, torch.Tensor], head_name: str = "head") -> TinyCNN:
    model = TinyCNN(head_name)
    model.load_state_dict(to_plain(initial, head_name))
    return model


def check_same_function(initial, case_batches) -> None:
    """Our CNN and the plain copy give the same logits on a recorded batch."""
    from fl_lightning.elastic.models import build_model

    ours = build_model(CNN, 10, (1, 8, 8), channels=[4, 8])
    ours.load_state_dict(initial)
    plain = plain_model(initial)
    x = case_batches[0][0]
    ours.eval(), plain.eval()
    with torch.no_grad():
        diff = (ours(x) - plain(x)).abs().max().item()
    assert diff < 1e-6, f"plain copy differs from the project's CNN by {diff}"


# -- the BN-free case: the project's tiny ViT as a body and a head -------------------------------
class SplitViT(nn.Module):
    """``base``: the project's ViT's timm network with an identity classifier (its output is
    what enters the classifier: the class token after the final norm); ``head``: the classifier.
    The forward is the project's ViT's forward."""

    def __init__(self, initial: Dict[str, torch.Tensor], model_kwargs: dict):
        super().__init__()
        from fl_lightning.elastic.models import build_model

        ours = build_model(ViT, 10, (1, 8, 8), **model_kwargs)
        ours.load_state_dict(initial)
        vit = ours.vit
        self.head = vit.head
        vit.head = nn.Identity()
        self.base = vit
        x = torch.randn(3, 1, 8, 8)
        check = build_model(ViT, 10, (1, 8, 8), **model_kwargs)
        check.load_state_dict(initial)
        with torch.no_grad():
            assert (check(x) - self(x)).abs().max() < 1e-6

    def forward(self, x):
        return self.head(self.base(x))


def vit_to_ours(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("head."):
            out["vit." + k] = v.detach().clone()
        elif k.startswith("base."):
            out["vit." + k[len("base."):]] = v.detach().clone()
        else:
            raise KeyError(k)
    return out


def model_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return vit_to_ours(model.state_dict())
