"""Elastic layers: full parameters, leading-slice forward, extraction to plain modules."""
