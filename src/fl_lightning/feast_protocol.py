"""FEAST's published protocol constants, defined once for the algorithm, the cache search, the
extraction command and the accounting (a plain module: the command line imports it cheaply).
"""

CACHE_SEGMENTS = ((50e6, 596e6, 50, 0.31), (25e6, 75e6, 6, 0.40))
"""Supp. Table 1: ``(lowest MACs, highest MACs, targets, rho_0)`` of the main search and of the
low-compute extension."""

SEARCH_POPULATION, SEARCH_GENERATIONS, SEARCH_MUTATION = 256, 512, 0.3
"""Supp. B.1: genetic search per cache target."""

EXTRACTION_POPULATION = 512
"""Supp. E.3: post-hoc extraction searches with a larger population."""

KAPPA_FB = 3.0
"""Eq. 26: forward-plus-backward convolution MACs as a multiple of the forward MACs."""

def extraction_rho(budget: float) -> float:
    """The ceiling as Supp. E.3 states it for the paper's cache: the low-compute segment's rho_0
    below the main segment's lowest target (0.40 below 50M), else the main segment's (0.31).
    Post-hoc extraction reads the ceilings off the run's own cache instead
    (``algorithms/supernet/extraction_search.py``) and falls back to this only for a cache that records no
    search; DeepFedNAS's Pareto path over the complete supernet uses it as stated."""
    main, low = CACHE_SEGMENTS
    return low[3] if budget < main[0] else main[3]
