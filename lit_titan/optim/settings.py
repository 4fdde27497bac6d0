"""The optimizer choices the config schema checks against, torch-free so that ``--help`` and the schema
import them without loading torch; ``build.py`` uses the same names."""

SCHEDULES = ("cosine", "wsd", "constant")
