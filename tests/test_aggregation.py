"""Sparse aggregation against a naive per-position reference."""

import torch

from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.regions import Full, LeadingSlice, Mask, RollingSlice


def naive(global_state, clients):
    """Loop over every position and every client; clients = [(state, weight, regions)]."""
    out = {}
    for key, old in global_state.items():
        new = old.clone()
        for pos in torch.cartesian_prod(*[torch.arange(n) for n in old.shape]).reshape(-1, old.dim()).tolist():
            num, den = 0.0, 0.0
            for state, weight, regions in clients:
                if key not in regions:
                    continue
                region = regions[key]
                marker = torch.zeros(old.shape)
                region.fill_add(marker, 1.0)
                if marker[tuple(pos)] == 0:
                    continue
                # The local value standing at this global position.
                spread = torch.zeros(old.shape, dtype=torch.float64)
                region.scatter_add(spread, state[key].double(), 1.0)
                num += weight * float(spread[tuple(pos)])
                den += weight
            if den > 0:
                new[tuple(pos)] = num / den
        out[key] = new
    return out


def random_regions(shape, generator):
    kinds = []
    local = tuple(int(torch.randint(1, n + 1, (1,), generator=generator)) for n in shape)
    kinds.append(LeadingSlice(shape, local))
    starts = tuple(int(torch.randint(0, n, (1,), generator=generator)) for n in shape)
    kinds.append(RollingSlice(shape, starts, local))
    kinds.append(Mask(torch.rand(shape, generator=generator) < 0.5))
    return kinds


def test_sparse_aggregation_matches_naive_reference_with_uncovered_positions():
    g = torch.Generator().manual_seed(0)
    global_state = {"w": torch.randn(5, 4, generator=g), "b": torch.randn(6, generator=g)}
    clients = []
    for i in range(4):
        regions, state = {}, {}
        for key, value in global_state.items():
            region = random_regions(value.shape, g)[i % 3]
            if key == "w" and i == 0:
                region = LeadingSlice(value.shape, (2, 1))
            shape = value.shape if isinstance(region, Mask) else region.local_shape
            regions[key] = region
            state[key] = torch.randn(shape, generator=g)
        clients.append((state, float(i + 1) * 3, regions))
    acc = SparseAccumulator(global_state)
    for state, weight, regions in clients:
        acc.add(state, weight, {k: (k, r) for k, r in regions.items()})
    got = acc.result()
    want = naive(global_state, clients)
    for key in global_state:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    # Some position is covered by nobody and keeps its old value.
    covered = torch.zeros(global_state["w"].shape)
    for _, _, regions in clients:
        regions["w"].fill_add(covered, 1.0)
    if (covered == 0).any():
        assert torch.equal(got["w"][covered == 0], global_state["w"][covered == 0])


def test_dense_fedavg_and_heterofl_rules():
    """FedAvg: the dense sample-weighted mean; HeteroFL (Diao et al., 2021): each position the
    plain mean over the clients that cover it."""
    global_state = {"w": torch.zeros(2, 2)}
    a, b = {"w": torch.ones(2, 2)}, {"w": 3 * torch.ones(2, 2)}
    dense = SparseAccumulator(global_state, dense=True)
    for state, weight in ((a, 1.0), (b, 3.0)):
        dense.add(state, weight, {"w": ("w", Full((2, 2)))})
    assert torch.allclose(dense.result()["w"], torch.full((2, 2), 2.5))
    small = {"w": torch.full((1, 1), 5.0)}
    sparse = SparseAccumulator(global_state, dense=False)
    sparse.add(a, 1.0, {"w": ("w", Full((2, 2)))})
    sparse.add(small, 1.0, {"w": ("w", LeadingSlice((2, 2), (1, 1)))})
    out = sparse.result()
    assert out["w"][0, 0] == 3.0 and out["w"][1, 1] == 1.0


def test_cross_rank_sum_of_accumulators_equals_single_accumulator():
    g = torch.Generator().manual_seed(1)
    global_state = {"w": torch.randn(4, 3, generator=g)}
    clients = [({"w": torch.randn(n, 3, generator=g)}, float(n), {"w": ("w", LeadingSlice((4, 3), (n, 3)))}) for n in (1, 2, 4)]
    one = SparseAccumulator(global_state)
    for c in clients:
        one.add(*c)
    ranks = [SparseAccumulator(global_state), SparseAccumulator(global_state)]
    ranks[0].add(*clients[0])
    for c in clients[1:]:
        ranks[1].add(*c)
    summed = {k: ranks[0].tensors()[k] + ranks[1].tensors()[k] for k in ranks[0].tensors()}
    ranks[0].load_tensors(summed)
    torch.testing.assert_close(ranks[0].result()["w"], one.result()["w"])


def _reduced(global_state, groups):
    """Each group accumulated on its own "rank" in the given order, then summed (the all-reduce)."""
    ranks = []
    for group in groups:
        acc = SparseAccumulator(global_state)
        for state, weight, regions in group:
            acc.add(state, weight, regions)
        ranks.append(acc.tensors())
    out = SparseAccumulator(global_state)
    out.load_tensors({k: sum(r[k] for r in ranks) for k in ranks[0]})
    return out.result()


def test_non_integer_weights_give_the_same_bits_in_any_order_and_split_over_ranks():
    """MaxNet weights (0.9 for the max client, 0.025 for the others) and Fisher-trace weights
    spanning three orders of magnitude: one rank in plan order, the reverse order, and two ranks
    holding alternate clients give bit-identical results, within one float32 unit of the exact
    (float64, per-position) weighted mean."""
    g = torch.Generator().manual_seed(3)
    shape = (64, 64)
    global_state = {"w": torch.randn(shape, generator=g)}
    for weights in ([0.9] + [0.025] * 4, [7.3e-3, 1.9, 0.41, 12.7, 3.3e-2, 0.77]):
        clients = []
        for i, weight in enumerate(weights):
            region = Full(shape) if i == 0 else LeadingSlice(shape, (32 + 8 * (i % 4), 64))
            state = {"w": torch.randn(region.local_shape, generator=g)}
            clients.append((state, weight, {"w": ("w", region)}))
        plain = _reduced(global_state, [clients])["w"]
        assert torch.equal(plain, _reduced(global_state, [clients[::-1]])["w"])
        assert torch.equal(plain, _reduced(global_state, [clients[0::2], clients[1::2]])["w"])
        assert torch.equal(plain, _reduced(global_state, [clients[1::2][::-1], clients[0::2]])["w"])
        num, den = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        for state, weight, regions in clients:
            region = regions["w"][1]
            region.scatter_add(num, state["w"].double(), weight)
            region.fill_add(den, weight)
        exact = num / den
        assert ((plain.double() - exact).abs() <= exact.abs() * 2.0 ** -23 + 1e-30).all()
