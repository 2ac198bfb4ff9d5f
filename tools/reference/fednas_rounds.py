"""What the SuperFedNAS and DeepFedNAS adapters share: the stand-ins their repositories need to
import, the ``args`` their trainers read, and the driver that runs the reference's own
``train_one_round`` on our case (``tests/reference_fednas_case.py``) and records what it did.

Both repositories descend from the same FedML code: a server trainer (SuperFedNAS's
``FLOFA_Trainer``, DeepFedNAS's ``Deepfednas_Trainer``) whose ``train_one_round`` samples the
cohort, calls the server model's ``update_sample`` (the tracking sandwich's max / min clients),
the MaxNet weights ``maxnet_cos_all_subnet``, the server model's sampler and ``get_subnet`` per
client, the client's ``SubnetTrainer.train``, and ``_aggregate`` (the server model's
``add_subnet`` per client, then ``sum / count`` where covered). The driver calls exactly that
method, once per round; the wrappers below only record (they call the wrapped method and
return its result unchanged).
"""

from __future__ import annotations

import types
from typing import Dict

import torch

import common
from reference_fednas_case import (CLIENTS, MAXNET_STEPS, NUM_CLASSES, ROUNDS, TRAIN, subnet_block_index,
                                   to_reference_key)


class RunDisabled:
    """Stand-in of ``wandb.sdk.lib.RunDisabled``: ``wandb.run`` is one, so the references'
    ``save`` returns at once (no checkpoint files)."""


def stub_wandb() -> None:
    """``wandb`` serves only logging and checkpoint upload in both repositories."""
    common.stub_modules("wandb", "wandb.sdk", "wandb.sdk.lib", **{"wandb.sdk.lib.RunDisabled": RunDisabled})
    wandb = __import__("wandb")
    wandb.run = RunDisabled()
    wandb.log = lambda *args, **kwargs: None
    wandb.save = lambda *args, **kwargs: None


def bypass_package_init(root, *packages: str) -> None:
    """Register ``packages`` as plain namespace modules so that importing one of their
    submodules does not run the package's ``__init__.py`` (which imports every model of the
    repository: DARTS, TCN, MobileNet, none of them used here)."""
    import sys

    for name in packages:
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module


def trainer_args(weighted_avg_schedule: dict, ckpt_subnets: list, use_bn: bool = True, **extra) -> types.SimpleNamespace:
    """The fields the server trainer and ``SubnetTrainer`` read, from the case (their names):
    SGD at the case's rate and weight decay, gradient clipping at ``max_norm``, batch norm
    trained (``use_bn``; without it, their default, held at the identity), no distillation, no
    FedDyn, no sample weighting, one local epoch."""
    return types.SimpleNamespace(
        # server trainer
        top_k_maxnet=1, bottom_k_maxnet=1, client_num_in_total=CLIENTS, client_num_per_round=CLIENTS,
        num_multi_archs=1, diverse_subnets={}, ps_depth_only=0, best_model_freq=10 ** 6, feddyn=False,
        feddyn_alpha=0.01, weighted_avg_schedule=weighted_avg_schedule, lr=TRAIN.lr, dry_run=False,
        verbose=False, weight_dataset=False, wandb_watch=False, comm_round=10 ** 6, efficient_test=True,
        frequency_of_the_test=1, ckpt_subnets=ckpt_subnets, dataset="cifar10", model_checkpoint_freq=10 ** 6,
        ofa_config=None,
        # client trainer (Client/subnet_trainer.py)
        use_bn=use_bn, wd=TRAIN.weight_decay, largest_subnet_wd=0, mod_wd_dyn=False, client_optimizer="sgd",
        epochs=TRAIN.epochs, kd_ratio=0.0, kd_type="ce", max_norm=TRAIN.grad_clip, reset_bn_stats=False,
        reset_bn_stats_test=False, **extra)


def load_ours_into(server_model, initial: Dict[str, torch.Tensor], blocks_per_stage: int) -> None:
    """Our initial global state into the reference's supernet (its names); the reference's
    tensors that ours lacks (DeepFedNAS's unused projections of non-first blocks) keep theirs."""
    state = server_model.model.state_dict()
    for key, value in initial.items():
        ref = to_reference_key(key, blocks_per_stage, supernet=True)
        assert state[ref].shape == value.shape, (key, ref, state[ref].shape, value.shape)
        state[ref] = value.clone()
    server_model.model.load_state_dict(state)


def supernet_to_ours(state, ours: Dict[str, torch.Tensor], blocks_per_stage: int) -> Dict[str, torch.Tensor]:
    """The reference's supernet under our names (and dtypes)."""
    ours_dtype = {k: v.dtype for k, v in ours.items()}
    return {k: state[to_reference_key(k, blocks_per_stage, supernet=True)].detach().clone().to(ours_dtype[k])
            for k in ours}


def subnet_to_ours(state, our_local: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A reference subnet's state under our names. Its tensors must be exactly those of our
    subnet of the same client, name for name and shape for shape (the two extractions of the
    architecture hold the same slices)."""
    index = subnet_block_index(list(our_local))
    names = {to_reference_key(k, 0, supernet=False, block_index=index): k for k in our_local}
    assert set(names) == set(state), sorted(set(names) ^ set(state))
    out = {}
    for ref, ours in names.items():
        assert state[ref].shape == our_local[ours].shape, (ref, state[ref].shape, our_local[ours].shape)
        out[ours] = state[ref].detach().clone()
    return out


def same_function(reference_subnet, our_model, spec, x) -> float:
    """Max |logit difference| of the reference's extracted subnet and ours (eval mode)."""
    ours = our_model.extract(spec).module
    ours.eval(), reference_subnet.eval()
    with torch.no_grad():
        return float((ours(x) - reference_subnet(x)).abs().max())


def check_same_functions(server_model, our_model, case, reference_arch, input_shape) -> float:
    """Every architecture of the case, extracted by both sides, gives the same logits."""
    from fl_lightning.elastic.models.ofa_resnet import OFASpec

    x = torch.randn(4, *input_shape, generator=torch.Generator().manual_seed(0))
    agree = 0.0
    specs = {str(t["spec"]): t["spec"] for rnd in case["rounds"] for t in rnd["tasks"]}
    for spec in specs.values():
        subnet = server_model.get_subnet(**reference_arch(spec)).model
        agree = max(agree, same_function(subnet, our_model, OFASpec(spec["d"], spec["e"], spec["w"]), x))
    assert agree < 1e-5, agree
    return agree


def drive(trainer, server_model, client_trainer, case, test_batch) -> dict:
    """Run the reference trainer's ``train_one_round`` for each of the case's rounds, feeding
    each client the batches our loop drew for it in that round; record the roles
    (``update_sample``), the MaxNet weights, each client's architecture, rate and trained
    subnet, and the supernet after each round."""
    record: dict = {"roles": [], "weights": [], "archs": [], "lrs": {}, "locals": {}, "globals": []}
    round_box = [0]

    update_sample = server_model.update_sample

    def recording_update_sample():
        update_sample()
        record["roles"].append({"largest": sorted(int(c) for c in server_model.largest_subnet_min_idx),
                                "smallest": sorted(int(c) for c in server_model.smallest_subnet_min_idx)})

    server_model.update_sample = recording_update_sample

    schedule = trainer.weighted_avg_scheduler["maxnet_cos_all_subnet"]

    def recording_schedule(round_num):
        weights = schedule(round_num)
        record["weights"].append([float(w) for w in weights])
        return weights

    trainer.weighted_avg_scheduler["maxnet_cos_all_subnet"] = recording_schedule

    train = client_trainer.train

    def recording_train(lr, local_ep, **kwargs):
        key = (round_box[0], int(client_trainer.client_idx))
        record["archs"].append((key, dict(client_trainer.client_model.model_config)))
        record["lrs"][key] = float(lr)
        model = train(lr, local_ep, **kwargs)
        record["locals"][key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    client_trainer.train = recording_train
    # the round's evaluation (every ``frequency_of_the_test`` rounds) scores every diverse subnet
    # on every client's test set for wandb; skipped, only the checkpoint-subnet pass runs (on one
    # test batch; it reads the supernet, never writes it)
    trainer._efficient_local_test_on_all_clients = lambda round_idx: (None, None)
    for r in range(ROUNDS):
        round_box[0] = r
        trainer.train_data_local_dict = {c: list(case["batches"][(r, c)]) for c in range(CLIENTS)}
        trainer.test_data_local_dict = {c: [test_batch] for c in range(CLIENTS)}
        trainer.train_one_round(r)
        record["globals"].append({k: v.detach().clone() for k, v in server_model.get_model_params().items()})
    # the schedule beyond the case's rounds, with the last round's max client (cohort position
    # 1): through the anneal (MAXNET_STEPS rounds) and after it, where it holds the final value
    record["schedule"] = [[float(w) for w in schedule(t)] for t in range(2 * MAXNET_STEPS + 1)]
    record["tracking"] = {"largest": [int(server_model.cli_subnet_track[c]["largest"]) for c in range(CLIENTS)],
                          "smallest": [int(server_model.cli_subnet_track[c]["smallest"]) for c in range(CLIENTS)]}
    return record


def dataset_list(case) -> list:
    """The 8-entry dataset list the server trainers unpack (sample counts from the batches)."""
    counts = {c: sum(len(y) for _, y in case["batches"][(0, c)]) for c in range(CLIENTS)}
    return [sum(counts.values()), 0, None, None, counts, {}, {}, NUM_CLASSES]


def golden(case, record, blocks_per_stage: int, extra: dict) -> dict:
    """What the test compares, under our names: the case's fingerprints and plan, the
    reference's roles, weights, architectures, round-0 client subnets and supernet after each
    round."""
    from reference_fednas_case import batch_fingerprints, float_state, state_fingerprint

    locals_ = {}
    for (r, c), state in record["locals"].items():  # every round's subnets are checked; round 0's kept
        mapped = float_state(subnet_to_ours(state, case["locals"][(r, c)]))
        if r == 0:
            locals_[c] = mapped
    globals_ = [float_state(supernet_to_ours(g, case["initial"], blocks_per_stage)) for g in record["globals"]]
    return {
        "case": {"initial": state_fingerprint(case["initial"]), "batches": batch_fingerprints(case["batches"]),
                 "rounds": case["rounds"]},
        "reference": {"roles": record["roles"], "weights": record["weights"], "archs": record["archs"],
                      "lrs": record["lrs"], "tracking": record["tracking"], "schedule": record["schedule"], **extra},
        "locals": locals_,
        "globals": globals_,
    }


def report(method: str, case, golden: dict) -> None:
    """Print how far our run is from the reference's (the test asserts the same)."""
    from reference_fednas_case import float_state

    def diff(a, b):
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)

    subnets = max(diff(float_state(case["locals"][(0, c)]), s) for c, s in golden["locals"].items())
    supernets = [diff(float_state(case["globals"][r]), g) for r, g in enumerate(golden["globals"])]
    print(f"{method}: client subnets (round 0) {subnets:.1e}; supernet after rounds 0, 1: "
          + ", ".join(f"{v:.1e}" for v in supernets))


def record(method: str, authors, repo) -> dict:
    """Our run of the case, the authors' two rounds on it, the golden files and the printed
    distances, with batch norm trained (``use_bn``) and held at the identity (their default):
    what both adapters' ``main`` does before writing its provenance."""
    from reference_fednas_case import run_case

    torch.set_num_threads(1)
    for frozen in (False, True):
        case = run_case(method, frozen_bn=frozen)
        golden = authors(repo, case)
        save_golden(method, golden, "authors_frozen" if frozen else "authors")
        report(method + (" (frozen BN)" if frozen else ""), case, golden)
    return golden


def save_golden(method: str, golden: dict, name: str = "authors") -> None:
    """Three files, each under 200 KB: the case, the reference's plan and the supernet after
    round 0 (``<name>.pt``); after round 1 (``<name>_round1.pt``); the clients' round-0
    subnets (``<name>_locals.pt``)."""
    out = common.out_dir(method)
    torch.save({"case": golden["case"], "reference": golden["reference"], "global": golden["globals"][0]},
               out / f"{name}.pt")
    torch.save({"global": golden["globals"][1]}, out / f"{name}_round1.pt")
    torch.save({"locals": golden["locals"]}, out / f"{name}_locals.pt")
