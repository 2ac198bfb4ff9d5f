"""Golden values for DeepFedNAS from the authors' code (bostankhan6/DeepFedNAS).

    pip install --no-deps --target <dir> ofa==0.1.0.post202307202001   # OFA, which DeepFedNAS imports
    PYTHONPATH=src:<dir> OMP_NUM_THREADS=1 python tools/reference/deepfednas.py /path/to/DeepFedNAS

Case (``tests/reference_fednas_case.py``): our unconstrained DeepFedNAS transfer on a two-stage
``ofa_resnet`` equal to the authors' ``GenericOFAResNet`` built from the arch parameters below,
3 clients (all of them every round), two rounds. The authors' side is their own round:
``Server/deepfednas_trainer.py: Deepfednas_Trainer.train_one_round`` (cohort, ``update_sample``,
``maxnet_cos_all_subnet``, the ``TS_optimal_path`` sampler, ``SubnetTrainer.train`` per client,
``_aggregate`` with ``GenericServerOFA.add_subnet``), run twice from our initial supernet, each
client fed the batches our loop drew for it in that round. Their Pareto path is read the way
they read it (``_prepare_subnet_cache``: a CSV sorted by MACs) from a CSV holding our path's
architectures with MACs from their own counter (``utils/subnet_cost.py: subnet_macs``).

Stand-ins (documented in the provenance): ``wandb`` (logging, checkpoint upload: ``wandb.run``
is a disabled run, so ``save`` returns at once); the ``random.choice`` the path sampler draws the
other clients' architecture with (``base_server_model.py``, line 388; Python's global ``random``)
returns our draw, which must be an element of their path; the round's evaluation of all
clients' test sets (``_efficient_local_test_on_all_clients``) is skipped, its checkpoint-subnet
pass runs on one test batch.
"""

from __future__ import annotations

import csv
import tempfile
import types

import torch

import common
import fednas_rounds as fr
from reference_fednas_case import DFN_MODEL, INPUT, MAXNET_STEPS, NUM_CLASSES

ARCH_PARAMS = {
    "num_stages": 2, "initial_input_hw": INPUT[1], "initial_input_channels": INPUT[0], "stem_stride": 1,
    "original_stem_out_channels": DFN_MODEL["init_args"]["stem_channels"],
    "original_stage_base_channels": list(DFN_MODEL["init_args"]["stage_channels"]),
    "stage_downsample_factors": list(DFN_MODEL["init_args"]["stage_strides"]),
    "max_extra_blocks_per_stage": DFN_MODEL["init_args"]["max_extra_blocks"],
    "channel_divisible_by": DFN_MODEL["init_args"]["divisor"],
    "width_multiplier_choices": list(DFN_MODEL["init_args"]["width_multipliers"]),
    "expansion_ratio_choices": [0.1, 0.14, 0.18, 0.22, 0.25], "n_classes": NUM_CLASSES,
}
BLOCKS = ARCH_PARAMS["max_extra_blocks_per_stage"] + 1
SCHEDULE = {"type": "maxnet_cos_all_subnet", "num_steps": MAXNET_STEPS, "init": 0.9, "final": 0.125}


def reference_arch(spec: dict) -> dict:
    """Our (stage-level) architecture in DeepFedNAS's encoding: one expansion per block slot."""
    return {"d": list(spec["d"]), "e": [e for e in spec["e"] for _ in range(BLOCKS)], "w_indices": list(spec["w"])}


def authors(repo, case) -> dict:
    fr.stub_wandb()
    common.add_repo(repo, "src")
    from deepfednas.Client.subnet_trainer import SubnetTrainer
    from deepfednas.Server import base_server_model
    from deepfednas.Server.deepfednas_trainer import Deepfednas_Trainer
    from deepfednas.Server.generic_server_model import GenericServerOFA
    from deepfednas.utils.subnet_cost import subnet_macs

    model = case["model"]
    assert tuple(ARCH_PARAMS["expansion_ratio_choices"]) == tuple(model.expansions)
    path = [reference_arch(s) for s in case["path"]]
    their_macs = [int(subnet_macs(depth_vec=a["d"], exp_vec=a["e"], w_indices=a["w_indices"],
                                  width_mult_options=ARCH_PARAMS["width_multiplier_choices"],
                                  arch_config_params=ARCH_PARAMS)[0]) for a in path]
    cache_csv = tempfile.mkdtemp() + "/path.csv"
    with open(cache_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["d", "e", "w_indices", "macs"])
        for a, macs in zip(path, their_macs):
            writer.writerow([str(a["d"]), str(a["e"]), str(a["w_indices"]), macs])

    # the other clients' draw: ours, which must be on their path
    draws = [reference_arch(t["spec"]) for rnd in case["rounds"] for t in rnd["tasks"] if t["role"] == "random"]

    def choice(seq):
        want = draws.pop(0)
        found = [a for a in seq if a == want]
        assert found, f"our draw {want} is not on the path they read"
        return found[0]

    base_server_model.random = types.SimpleNamespace(choice=choice)

    server = GenericServerOFA(dict(ARCH_PARAMS), "TS_optimal_path", fr.CLIENTS)
    fr.load_ours_into(server, case["initial"], BLOCKS)
    # the networks agree: every architecture of the case, extracted by both, gives the same logits
    agree = fr.check_same_functions(server, model, case, reference_arch, INPUT)

    args = fr.trainer_args(SCHEDULE, ckpt_subnets=[server.max_subnet_arch()], use_bn=not case["frozen_bn"],
                           subnet_cache_path=cache_csv,
                           model="ofaresnet_generic")
    client_trainer = SubnetTrainer(None, torch.device("cpu"), args)
    trainer = Deepfednas_Trainer(server, fr.dataset_list(case), client_trainer, args, None,
                                 wt_avg_sched_method="maxnet_cos_all_subnet")
    test_batch = case["batches"][(0, 0)][0]
    record = fr.drive(trainer, server, client_trainer, case, test_batch)
    assert not draws, "a random draw was left unused"
    extra = {"path": server.subnet_cache, "op_smallest": server.op_smallest_subnet,
             "op_largest": server.op_largest_subnet, "path_macs": their_macs, "same_function": agree}
    return fr.golden(case, record, BLOCKS, extra)


def main():
    args = common.repository_args()
    repo = common.add_repo(args.repo, "src")
    fr.record("deepfednas", authors, repo)
    import importlib.metadata as md

    common.write_provenance(
        "deepfednas", repo, commit=args.commit, repository="https://github.com/bostankhan6/DeepFedNAS",
        used=["src/deepfednas/Server/deepfednas_trainer.py: Deepfednas_Trainer.__init__ (line 33), _client_sampling "
              "(159), _aggregate (175), train_one_round (220), maxnet_cos_all_subnet (970)",
              "src/deepfednas/Server/base_server_model.py: BaseServerModel._prepare_subnet_cache (78), update_sample "
              "(110), tracking_sandwich_optimal_path_sampler (364, TS_optimal_path; its random.choice at 388)",
              "src/deepfednas/Server/generic_server_model.py: GenericServerOFA.max_subnet_arch (53), get_subnet (126), "
              "active_subnet_index (148), add_subnet (171)",
              "src/deepfednas/Client/subnet_trainer.py: SubnetTrainer.train (21), test (170)",
              "src/deepfednas/elastic_nn/generic_ofa_network.py: NewResidualBlock (31), DynamicResidualBlock (187), "
              "GenericOFAResNet (478; set_active_subnet 595, get_active_subnet 690)",
              "src/deepfednas/utils/subnet_cost.py: subnet_macs (49; the path CSV's MACs)"],
        notes="Synthetic 3x8x8 images, 4 classes, 3 iid clients of 24 examples, all 3 every round, 2 rounds; "
              "arch_params " + str(ARCH_PARAMS) + " (our ofa_resnet with the same widths, round_middle true); "
              "SGD lr 0.05, momentum 0 (their SubnetTrainer has none), weight decay 5e-4, max_norm 3.0, twice: use_bn "
              "(authors*.pt; ours frozen_bn false) and without it, their default (authors_frozen*.pt; ours frozen_bn "
              "true), "
              "kd_ratio 0, one epoch of batch 8 on the batches our loop drew; weighted_avg_schedule "
              + str(SCHEDULE) + "; TS_optimal_path over our Pareto path (4 architectures) written as their "
              "CSV with their subnet_macs. Stand-ins: wandb (logging; wandb.run a disabled run), "
              "base_server_model.random.choice returns our random-role draw (asserted to be on their path), "
              "_efficient_local_test_on_all_clients skipped (evaluation). ofa " + md.version("ofa") + " (PyPI, "
              "installed with --no-deps).",
        ofa=md.version("ofa"),
        setup="pip install --no-deps --target <dir> ofa==" + md.version("ofa") + "; then PYTHONPATH=src:<dir> "
              "OMP_NUM_THREADS=1 before the command")


if __name__ == "__main__":
    main()
