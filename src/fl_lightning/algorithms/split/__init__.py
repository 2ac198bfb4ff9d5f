"""Split FL: the model cut at a block boundary, client fronts and a server half trained through
one engine (``modules/split.py``). ``splitfed`` is the family's base (SplitFed V1/V2), ``common``
the client's split round and shared pieces; one file per method (``docs/fedsga.md``,
``docs/sfl_baselines.md``)."""
