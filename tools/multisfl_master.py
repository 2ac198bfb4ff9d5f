"""MultiSFL's master from a run's checkpoint: its predictions and its batch-norm statistics.

    python tools/multisfl_master.py RUN_DIR [--checkpoint last|best|PATH] [--out FILE.json]

The master is the plain mean of the branches, running statistics included; the mean of the
branches' statistics is not the statistics of the averaged network's activations when the
branches have drifted apart. This prints, on the run's own data (its config and seed):

- the master's prediction histogram on the test split (and the label histogram);
- per batch-norm layer, the stored running mean/variance against those re-estimated by a
  forward pass of the averaged network over the union of the clients' shards (train mode,
  cumulative averages, no weight changes);
- test accuracy with the stored and with the re-estimated statistics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fl_lightning.cli import load_fit_config  # noqa: E402
from fl_lightning.data.federated import build_federated_data  # noqa: E402
from fl_lightning.elastic.models import build_model  # noqa: E402
from fl_lightning.runtime.client_data import eval_batches  # noqa: E402
from fl_lightning.tool_parser import ToolParser


def predictions(model, dataset, indices):
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x).argmax(1) for x, _ in eval_batches(dataset, indices, 500)])


def reestimate(model, batches):
    """Running statistics of ``model``'s batch norms as cumulative averages over ``batches``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.eval()


def main(argv=None):
    ap = ToolParser()
    ap.add_argument("run")
    ap.add_argument("--checkpoint", default="last")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)
    run = Path(opts.run)
    cfg = load_fit_config(run / "config.yaml")
    ckpt = Path(opts.checkpoint) if opts.checkpoint not in ("last", "best") else None
    if ckpt is None:
        found = sorted((run / "checkpoints").glob(f"{opts.checkpoint}*.ckpt"))
        ckpt = found[-1]
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    fed = build_federated_data(cfg.data, cfg.partition, cfg.seed)
    b = fed.bundle
    model = build_model(cfg.model, b.num_classes, b.input_shape)
    model.load_state_dict(state["model"])
    test, test_idx = fed.split("test")
    labels = torch.cat([y for _, y in eval_batches(test, test_idx, 500)])
    shards = [x for idx in fed.clients for x, _ in eval_batches(b.train, idx, 32)]  # every client's shard
    stored = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}

    pred = predictions(model, test, test_idx)
    out = {"run": str(run), "checkpoint": str(ckpt), "round": state.get("round"),
           "test_labels_histogram": torch.bincount(labels, minlength=b.num_classes).tolist(),
           "prediction_histogram": torch.bincount(pred, minlength=b.num_classes).tolist(),
           "test_acc_stored_stats": float((pred == labels).float().mean())}
    reestimate(model, shards)
    pred2 = predictions(model, test, test_idx)
    out["prediction_histogram_reestimated"] = torch.bincount(pred2, minlength=b.num_classes).tolist()
    out["test_acc_reestimated_stats"] = float((pred2 == labels).float().mean())
    layers = []
    new = model.state_dict()
    for k in stored:
        if k.endswith("running_mean"):
            layer = k[:-len(".running_mean")]
            m0, m1 = stored[k], new[k]
            v0, v1 = stored[layer + ".running_var"], new[layer + ".running_var"]
            layers.append({"layer": layer, "mean_stored_norm": float(m0.norm()), "mean_reest_norm": float(m1.norm()),
                           "mean_diff_over_reest_std": float(((m0 - m1).abs() / v1.sqrt().clamp_min(1e-5)).mean()),
                           "var_ratio_stored_over_reest_median": float((v0 / v1.clamp_min(1e-8)).median()),
                           "var_ratio_min_max": [float((v0 / v1.clamp_min(1e-8)).min()),
                                                 float((v0 / v1.clamp_min(1e-8)).max())]})
    out["bn_layers"] = layers
    print(json.dumps({k: v for k, v in out.items() if k != "bn_layers"}, indent=1))
    print(f"{'layer':34s} {'|mean| stored':>13s} {'|mean| re-est':>13s} {'|dmean|/std':>11s} {'var ratio med':>13s}  min..max")
    for r in layers:
        print(f"{r['layer']:34s} {r['mean_stored_norm']:13.3f} {r['mean_reest_norm']:13.3f} "
              f"{r['mean_diff_over_reest_std']:11.3f} {r['var_ratio_stored_over_reest_median']:13.3f}  "
              f"{r['var_ratio_min_max'][0]:.2g}..{r['var_ratio_min_max'][1]:.2g}")
    if opts.out:
        Path(opts.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
