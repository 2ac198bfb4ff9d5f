"""Federated supernet training: FEAST and the baselines it compares against (FIARSE, ScaleFL, the
SuperFedNAS and DeepFedNAS transfers), with the parts they share: the variant cache scored as
FEAST (``cached_variants``), FEAST's accounting and post-hoc extraction (``docs/feast.md``)."""
