"""``--help`` of every entry point: the config groups and their options, the most-used keys, examples.

Why generated: a hand-written list of models or profiles goes stale the day a yaml file is added.
The groups and options are read from ``conf/`` (and a user's ``--config-dir``) when help is asked
for; the most-used keys are checked against the composed config by the tests
(``tests/commands/test_first_hour.py``), so a renamed key fails CI instead of misleading a user.
"""

from __future__ import annotations

from pathlib import Path

from lit_titan.cli.commands import COMMANDS

__all__ = ["KEYS", "config_groups", "render"]

# The keys a user changes most, one line each (every one exists in the composed config: tested).
KEYS = (
    ("trainer.max_steps", "optimizer steps to train"),
    ("data.seq_len", "tokens per sequence"),
    ("data.global_batch_size", "sequences per optimizer step, whatever the layout"),
    ("data.micro_batch_size", "sequences per rank per forward (gradient accumulation makes up the rest)"),
    ("optim.lr", "peak learning rate (warmup then cosine; optim.schedule=wsd|constant)"),
    ("seed", "model init and data order"),
    ("run_dir", "where the run writes everything (default runs/<model>-<time>)"),
    ("resume", "auto: continue from the newest complete checkpoint of run_dir; or a checkpoint PATH"),
    ("cluster.devices", "processes (CPU) or GPUs per node"),
    ("parallel.dp_shard", "FSDP degree (-1: the remaining ranks); also parallel.tp, pp, cp, dp_replicate"),
    (
        "precision",
        "32-true | bf16-mixed | bf16-true | 64-true (float64, for parity checks; default: the cluster profile's)",
    ),
    ("checkpoint.every_n_steps", "save a sharded checkpoint every N steps (0: at the end only)"),
    ("data.path", "your text or token shards (with data=text or data=tokens)"),
    ("module._target_", "your PretrainModule subclass, package.module.Class (+module.ARG=VALUE: its own arguments)"),
)

EXAMPLES = {
    "train": [
        "python -m lit_titan.train trainer.max_steps=20                      # the tiny default model, one CPU process",
        "python -m lit_titan.train cluster=cpu cluster.devices=4 parallel.dp_shard=2 parallel.tp=2 precision=32-true "
        "trainer.max_steps=10 data.global_batch_size=8 seed=0   # 4 processes, the same losses as one",
        "python -m lit_titan.train data=text data.path=my_texts/ model=llama3_2_1b cluster=gpu_1",
    ],
    "plan": [
        "lit-titan plan +recipe=llama3_405b_h100_512",
        "lit-titan plan model=llama3_8b cluster=h100_8 data.seq_len=8192 data.global_batch_size=16",
        "lit-titan plan search=true model=llama3_405b cluster=h100_512 data.seq_len=8192 data.global_batch_size=256",
    ],
    "prepare": [
        "lit-titan prepare data=text data.path=my_texts/ out=prepared/",
        "lit-titan prepare data=text data.path=my_texts/ data.tokenizer.kind=hf "
        "data.tokenizer.path=tokenizer.json out=prepared/ workers=8",
        "lit-titan prepare out=prepared/stdlib                    # the embedded corpus",
    ],
    "launch": [
        "lit-titan launch --dry-run +recipe=llama3_8b_h100_8",
        "lit-titan launch --dry-run +recipe=llama3_70b_h100_256   # an sbatch script with srun",
        "lit-titan launch cluster=gpu_1 cluster.devices=8 parallel.tp=2",
    ],
}

INTRO = {
    "train": (
        "lit-titan train: pre-train a Llama 3.1 with Lightning under any parallel layout.\n\n"
        "python -m lit_titan.train [OVERRIDES]         one run (run_dir=PATH, default runs/<model>-<time>)\n"
        "python -m lit_titan.train -m KEY=A,B ...      a sweep: one run per point in <sweep dir>/<n>, summary.csv\n"
        "python -m lit_titan.train --cfg job|hydra     print the composed config (--resolve: resolved)\n"
        "python -m lit_titan.train --info [searchpath|defaults|...]\n"
        "--config-dir DIR                              your own config groups (DIR/model/my_llama.yaml, ...)\n"
        "hydra/launcher=submitit_slurm|submitit_local  run the sweep's jobs through submitit (Slurm / locally)\n"
        "Hydra's own flags: --hydra-help. Launch paths: docs/launching.md."
    ),
}


def config_groups(extra_dirs: tuple[Path | str, ...] = ()) -> dict[str, list[str]]:
    """``{group: [options]}`` from the yaml files under ``conf/`` (and ``extra_dirs``: ``--config-dir``)."""
    from lit_titan.config import conf_dir

    groups: dict[str, set[str]] = {}
    for root in (conf_dir(), *(Path(d).expanduser() for d in extra_dirs)):
        for path in Path(root).rglob("*.yaml"):
            group = path.parent.relative_to(root).as_posix()
            if group != ".":
                groups.setdefault(group, set()).add(path.stem)
    # Hydra's own launcher options that our conf/ does not shadow (the default one, `basic`).
    if "hydra/launcher" in groups:
        groups["hydra/launcher"].add("basic")
    return {g: sorted(groups[g]) for g in sorted(groups, key=lambda g: (g.startswith("hydra"), g))}


def render(
    command: str, extra_dirs: tuple[Path | str, ...] = (), intro: str | None = None, examples: bool = True
) -> str:
    """The ``--help`` text of ``lit-titan COMMAND`` (one that takes the training overrides)."""
    lines = [
        intro or INTRO.get(command) or f"lit-titan {command}: {COMMANDS[command].summary}",
        "",
        "== Config groups (choose one per group, e.g. model=llama3_8b; callbacks and logger take lists: "
        "logger=[csv,tensorboard]; a recipe is added: +recipe=NAME) ==",
    ]
    lines += [f"{group}: {', '.join(options)}" for group, options in config_groups(extra_dirs).items()]
    lines += [
        "",
        "== Most-used keys (KEY=VALUE; every key: python -m lit_titan.train --cfg job, docs/configuration.md) ==",
    ]
    width = max(len(k) for k, _ in KEYS)
    lines += [f"{key:<{width}}  {text}" for key, text in KEYS]
    if examples:
        lines += ["", "== Examples =="]
        lines += EXAMPLES.get(command, EXAMPLES["train"])
    return "\n".join(lines)
