"""Optimizers and learning-rate schedules: ``build`` (AdamW or LAMB, warmup then cosine/WSD/constant), ``lamb``.

Import the module that holds a name (``lit_titan.optim.build.build``, ``lit_titan.optim.build.lamb``): this file
re-exports nothing, so each name has one import path and LAMB is imported only when chosen.
"""
