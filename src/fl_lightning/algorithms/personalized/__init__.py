"""Personalized FL baselines of the split comparison (FedBABU, FedGH, FedAS), with their shared
head/body pieces (``head_body``; ``docs/fl_baselines.md``)."""
