"""Golden values for ScaleFL's client objective from the authors' code (git-disl/scale-fl).

    python tools/reference/scalefl.py /path/to/scale-fl

Fixed logits of three exits (seeded, batch 6, 10 classes) and labels; ``models/model_utils.py:
KDLoss.loss_fn_kd`` gives each early exit's term (cross-entropy plus ``gamma T^2
KLDivLoss()``, the teacher being the last exit, not detached) and ``KDLoss.ce_loss`` the last
exit's; they are combined as ``train.py``'s training loop does (exit ``j`` weighted ``j + 1``,
the sum divided by ``k (k + 1) / 2``). Stored: the loss and its gradient with respect to every
exit's logits, with distillation on (``KD_gamma`` 0.05, ``KD_T`` 3) and off (``gamma_active``
false, the first quarter of the rounds).
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import torch

import common


def main():
    repo = common.add_repo(sys.argv[1])
    # the file alone: the package's __init__ imports every architecture (BERT needs transformers)
    spec = importlib.util.spec_from_file_location("scalefl_model_utils", repo / "models" / "model_utils.py")
    model_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_utils)
    KDLoss = model_utils.KDLoss

    torch.manual_seed(0)
    logits = [torch.randn(6, 10) * s for s in (1.0, 2.0, 3.0)]
    target = torch.randint(0, 10, (6,))
    criterion = KDLoss(SimpleNamespace(KD_T=3, KD_gamma=0.05))
    results = {}
    for active in (True, False):
        output = [z.clone().requires_grad_() for z in logits]
        loss = 0.0
        for j in range(len(output)):  # the combination of train.py's loop
            if j == len(output) - 1:
                loss += criterion.ce_loss(output[j], target) * (j + 1)
            else:
                loss += criterion.loss_fn_kd(output[j], target, output[-1], active) * (j + 1)
        loss /= len(output) * (len(output) + 1) / 2
        loss.backward()
        results[active] = {"loss": loss.detach(), "grads": [z.grad.clone() for z in output]}
    out = common.out_dir("scalefl")
    torch.save({"logits": logits, "target": target, "gamma": 0.05, "temperature": 3.0, "results": results},
               out / "authors.pt")
    common.write_provenance(
        "scalefl", repo, "https://github.com/git-disl/scale-fl",
        used=["models/model_utils.py: KDLoss.__init__, KDLoss.loss_fn_kd, KDLoss.ce_loss",
              "train.py: the exit weighting of the training loop (j + 1, divided by k (k + 1) / 2), applied here "
              "to the values KDLoss returns"],
        notes="Three exits, batch 6, 10 classes, logits torch.randn scaled by 1, 2, 3 after torch.manual_seed(0); "
              "KD_T 3, KD_gamma 0.05; gamma_active true and false.")


if __name__ == "__main__":
    main()
