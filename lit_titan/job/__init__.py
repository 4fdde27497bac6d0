"""A run built from its config: the pieces (build.py), the fit (run.py), resume (resume.py), the ranks (ranks.py).

What ``lit_titan.train`` runs and what the planner rebuilds on a fake process group; library code,
so nothing here imports a command (lit_titan/cli/).
"""
