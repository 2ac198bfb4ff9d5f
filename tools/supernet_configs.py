"""Write the supernet comparison's configs: one YAML per method and dataset.

    python tools/supernet_configs.py     # -> configs/supernet/{paper,offline}/<dataset>/<method>.yaml

Every family is generated from its FEAST config (``SOURCES``): the FEAST member is that config
as it stands, and every other member is it with only the method changed (model, algorithm, and
what the method itself prescribes), so data, population (seed, partition, budgets), schedule,
augmentation, evaluation and BN calibration stay FEAST's. Rerun the tool after editing a source
or a transfer overlay; ``tests/test_supernet_configs.py`` fails while the written files are stale.

``paper/``: FEAST's protocol (Sec. 4.1, Supp. E.1-E.2, Supp. Table 3) on CIFAR-100, CINIC-10 and
TinyImageNet-200. The weight-sharing baselines (HeteroFL, ScaleFL, FIARSE) use the common
ResNet-18 substrate (widths [64, 128, 256, 512], two BasicBlocks per stage) with the dataset's
stem; the four Table 3 transfers (SuperFedNAS / DeepFedNAS, constrained and unconstrained) train
FEAST's supernet with FEAST's cache, from ``configs/feast/transfers/``.

``offline/``: the same on CPU-sized runs, mirroring ``configs/feast_mnist_subset.yaml`` (the real
MNIST subset) and ``configs/quickstart.yaml`` (synthetic images). The baselines' ResNet-18 is
narrowed to width k/64, the k whose full-width MACs come nearest (in log) to the largest variant
of FEAST's cache for that config, as the paper's 555M substrate sits near its 596M variant; the
tool reads the config's shipped cache file or else runs its search (seconds), and needs the
dataset's loader.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import textwrap
from pathlib import Path

import yaml
from fl_lightning.elastic.models import ResNet18
from fl_lightning.tool_parser import ToolParser

ROOT = Path(__file__).resolve().parents[1]

SOURCES = {
    ("paper", "cifar100"): "configs/feast_cifar100.yaml",
    ("paper", "cinic10"): "configs/feast_cinic10.yaml",
    ("paper", "tinyimagenet"): "configs/feast_tinyimagenet.yaml",
    ("offline", "mnist_subset"): "configs/feast_mnist_subset.yaml",
    ("offline", "synthetic"): "configs/quickstart.yaml",
}
# Supp. E.1: a stride-one stem without max pooling at 32x32, the dataset's own stem at 64x64
STEMS = {"cifar100": "cifar", "cinic10": "cifar", "tinyimagenet": "tiny", "mnist_subset": "cifar",
         "synthetic": "cifar"}
TRANSFERS = ("sfn_constrained", "sfn_unconstrained", "dfn_constrained", "dfn_unconstrained")
METHODS = ("feast", "heterofl", "scalefl", "fiarse", *TRANSFERS)
TRANSFER_DIR = "configs/feast/transfers"
HETEROFL_TIERS = [0.0625, 0.125, 0.25, 0.5, 1.0]  # Supp. E.1: {1/16, 1/8, 1/4, 1/2, 1}
SUBSTRATE = "ResNet-18 substrate (widths [64, 128, 256, 512], two BasicBlocks per stage, {stem} stem)"

DESCRIPTIONS = {
    "feast": "FEAST, the family's reference: {source} unchanged.",
    "heterofl": ("HeteroFL on the {substrate}: width tiers 1/16 .. 1 by MAC budget (largest affordable, the "
                 "smallest as fallback), its Scaler, BN recalibrated per tier, alternating Mixup / CutMix "
                 "(docs/heterofl_supernet.md)."),
    "scalefl": ("ScaleFL on the {substrate} with exits after blocks 3, 4, 5: levels (3, 0.40), (4, 0.50), "
                "(5, 0.60), (8, 1.00) by MAC budget with the level-1 fallback, alternating Mixup / CutMix "
                "(docs/scalefl.md)."),
    "fiarse": ("FIARSE on the {substrate}: per-stage magnitude masks sized by budget, zero weight decay (its "
               "original setting, Supp. E.1), alternating Mixup / CutMix, evaluated on its 25-point mask grid "
               "(docs/fiarse.md)."),
    "transfer": ("{label} transfer of Table 3 ({what}): {overlay} applied to {source}, on FEAST's supernet and "
                 "cache (docs/fednas_transfers.md)."),
}
TRANSFER_LABELS = {"sfn": "SuperFedNAS", "dfn": "DeepFedNAS"}


def load_yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def class_parameters(class_path: str) -> dict:
    """The constructor's parameters and defaults of an algorithm named by its class path."""
    import importlib

    module, name = class_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def feast_arg(source: dict, key: str):
    """One of FEAST's init_args as the run has it: the config's value, else Feast's default."""
    args = source["algorithm"].get("init_args") or {}
    return args[key] if key in args else class_parameters(source["algorithm"]["class_path"])[key]


def mixing(source: dict) -> dict:
    """FEAST's Mixup / CutMix alternation, for the baselines that have the option."""
    return {"mix_schedule": feast_arg(source, "mix_schedule"), "mixup_alpha": feast_arg(source, "mixup_alpha"),
            "cutmix_alpha": feast_arg(source, "cutmix_alpha")}


def deep_update(base: dict, overlay: dict) -> dict:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def substrate(class_path: str, dataset: str, width: float | None) -> dict:
    kwargs = {"stem": STEMS[dataset]}
    if width is not None:
        kwargs = {"width": width, **kwargs}
    return {"class_path": class_path, "init_args": kwargs}


def config_for(where: str, dataset: str, method: str, width: float | None = None) -> dict:
    """The config of one method: its FEAST source with the method swapped in. ``width``: the
    offline baselines' narrowed substrate (None: the paper's full width)."""
    source = load_yaml(SOURCES[(where, dataset)])
    cfg = copy.deepcopy(source)
    cfg["name"] = f"{method}_{dataset}"
    if method == "feast":
        return cfg
    if method in TRANSFERS:
        overlay = load_yaml(f"{TRANSFER_DIR}/{method}.yaml")
        algorithm = overlay.pop("algorithm")
        accepted = class_parameters(algorithm["class_path"])
        # FEAST's cache, search and evaluation settings, where the transfer has them: the
        # evaluated operating points must be FEAST's for the numbers to compare
        args = {k: v for k, v in (source["algorithm"].get("init_args") or {}).items() if k in accepted}
        args.update(algorithm.get("init_args") or {})
        if "path" in accepted and "search" in args and not args.get("constrained", False):
            # unconstrained DeepFedNAS's path over the complete supernet: searched as FEAST's cache
            args["path"] = {k: v for k, v in args["search"].items()
                            if k in ("population", "generations", "mutation", "seed")}
        cfg["algorithm"] = {"class_path": algorithm["class_path"], "init_args": args}
        return deep_update(cfg, overlay)
    if method == "heterofl":
        cfg["model"] = substrate("fl_lightning.elastic.models.ResNet18", dataset, width)
        cfg["algorithm"] = {"class_path": "fl_lightning.algorithms.HeteroFL",
                            "init_args": {"assign": "budget", "tiers": list(HETEROFL_TIERS), "bn": "recalibrate",
                                          "scaler": True, **mixing(source)}}
    elif method == "scalefl":
        cfg["model"] = substrate("fl_lightning.elastic.models.ScaleFLResNet18", dataset, width)
        cfg["algorithm"] = {"class_path": "fl_lightning.algorithms.ScaleFL",  # defaults: Supp. E.1's levels
                            "init_args": mixing(source)}
    elif method == "fiarse":
        cfg["model"] = substrate("fl_lightning.elastic.models.ResNet18", dataset, width)
        cfg["algorithm"] = {"class_path": "fl_lightning.algorithms.FIARSE", "init_args": mixing(source)}
        cfg["train"]["weight_decay"] = 0.0
    else:
        raise KeyError(method)
    return cfg


def offline_width(source_path: str) -> dict:
    """The narrowed substrate of an offline family: the k/64 whose full-width ResNet-18 MACs
    (fvcore) are nearest in log to the largest variant of the FEAST config's cache (its shipped
    file, or else the one its search builds)."""
    from fl_lightning.algorithms.supernet.cached_variants import CacheSearch
    from fl_lightning.elastic.macs import count_macs
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.search.cache import VariantCache, build_cache

    source = load_yaml(source_path)
    from fl_lightning.saved_configs import dataset_of

    dataset, root = dataset_of(source)
    bundle = dataset.load(root, False, False)
    shape, classes = tuple(bundle.input_shape), bundle.num_classes
    supernet = build_model(source["model"], num_classes=classes, input_shape=shape)
    args = source["algorithm"]["init_args"]
    if args.get("cache"):  # a shipped cache (checked against the supernet) stands for the search
        cache = VariantCache.load(ROOT / args["cache"], supernet)
    else:
        search = CacheSearch(**args.get("search", {}))
        cache = build_cache(supernet, shape, segments=[tuple(s) for s in search.segments],
                            population=search.population, generations=search.generations,
                            mutation=search.mutation, seed=search.seed)
    largest = max(cache.macs)
    candidates = {}
    for k in range(1, 65):
        model = build_model(ResNet18, num_classes=classes, input_shape=shape, width=k / 64)
        candidates[k] = count_macs(model, shape)
        if candidates[k] > 4 * largest:  # MACs grow with width; nothing wider can be nearer
            break
    k = min(candidates, key=lambda j: abs(math.log(candidates[j] / largest)))
    return {"k": k, "width": k / 64, "macs": candidates[k], "largest": largest, "shape": shape}


def _m(value: float) -> str:
    return f"{value / 1e6:.2f}".rstrip("0").rstrip(".") + "M"


def population_text(source: dict, method: str) -> str:
    p, b, t = source["partition"], source["partition"]["budgets"], source["train"]
    wd = 0.0 if method == "fiarse" else t["weight_decay"]
    gamma = p["gamma"]
    if method in TRANSFERS:
        gamma = load_yaml(f"{TRANSFER_DIR}/{method}.yaml").get("partition", {}).get("gamma", gamma)
    aug = "RandAugment({}, {}); ".format(*source["data"]["randaugment"]) if source["data"].get("randaugment") else ""
    epochs = f"{t['epochs']} local epoch{'s' if t['epochs'] != 1 else ''}"
    return (f"Seed {source['seed']}; {p['num_clients']} clients with Zipf({b['zipf_s']}) budgets in "
            f"[{_m(b['b_min'])}, {_m(b['b_max'])}] MACs, allocation capped at {_m(b['b_cap'])}, gamma = {gamma:g}, "
            f"alpha_eff = {p['alpha_eff']}; {source['federation']['clients_per_round']} clients per round, "
            f"{source['federation']['rounds']} rounds, {epochs} of batch {t['batch_size']}, SGD lr {t['lr']} "
            f"{t['lr_schedule']}, momentum {t['momentum']}, clipping {t['grad_clip']:g}, weight decay {wd:g}; "
            f"{aug}validation every {source['eval']['every']} rounds on {source['data']['val_size']} server-held "
            f"examples, BN calibration on {source['data']['calib_size']}.")


def comment(text: str) -> str:
    glued = text.replace(" = ", "\0=\0")  # keep "gamma = 1" on one line
    return textwrap.fill(glued, width=100, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False,
                         break_long_words=False).replace("\0", " ") + "\n"


def header(where: str, dataset: str, method: str, sub: dict | None) -> str:
    source_path = SOURCES[(where, dataset)]
    source_text = (ROOT / source_path).read_text()
    source = yaml.safe_load(source_text)
    protocol = "FEAST's paper protocol" if where == "paper" else "offline, CPU-sized"
    if method in TRANSFERS:
        family, kind = method.split("_")
        what = ("budget-constrained, gamma = 1" if kind == "constrained"
                else "unconstrained: samples ignore budgets, gamma = 0")
        text = DESCRIPTIONS["transfer"].format(label=TRANSFER_LABELS[family], what=what,
                                               overlay=f"{TRANSFER_DIR}/{method}.yaml", source=source_path)
    else:
        stem = {"cifar": "stride-one", "tiny": "TinyImageNet"}[STEMS[dataset]]
        text = DESCRIPTIONS[method].format(source=source_path, substrate=SUBSTRATE.format(stem=stem))
    if sub is not None and method in ("heterofl", "scalefl", "fiarse"):
        text += (f" The substrate is narrowed to width {sub['k']}/64: {_m(sub['macs'])} MACs at full width "
                 f"(fvcore, input {'x'.join(map(str, sub['shape']))}), near FEAST's largest cached variant "
                 f"here ({_m(sub['largest'])}).")
    out = comment(f"Supernet comparison (FEAST Sec. 4, Supp. E), {protocol}, {dataset}. {text}")
    out += comment(population_text(source, method))
    # the source's note on where the data must be (the paper datasets need local files)
    notes = " ".join(line[1:].strip() for line in source_text.splitlines() if line.startswith("#"))
    out += "".join(comment(need) for need in re.findall(r"Needs .*?\.(?=\s|$)", notes))
    out += comment(f"Written by tools/supernet_configs.py from {source_path}; edit that and rerun.")
    return out


class _Dumper(yaml.SafeDumper):
    pass


def _list(dumper, items):
    # short lists of numbers on one line, as the hand-written configs have them
    flow = all(isinstance(x, (int, float, str)) for x in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_Dumper.add_representer(list, _list)


def dump(cfg: dict) -> str:
    return yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, width=100)


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "configs" / "supernet"))
    args = parser.parse_args(argv)
    written = 0
    for (where, dataset), source_path in SOURCES.items():
        sub = offline_width(source_path) if where == "offline" else None
        for method in METHODS:
            cfg = config_for(where, dataset, method, None if sub is None else sub["width"])
            path = Path(args.out) / where / dataset / f"{method}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(header(where, dataset, method, sub) + dump(cfg))
            written += 1
        if sub is not None:
            print(f"{dataset}: substrate width {sub['k']}/64, {_m(sub['macs'])} MACs; "
                  f"FEAST's largest cached variant {_m(sub['largest'])}")
    print(f"{written} configs under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
