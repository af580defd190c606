"""The typed config: one dataclass per stage section, validated with messages that name the key.

`config/config.yaml` is read into a `Config`; every key is checked (unknown keys, wrong types,
out-of-range values and cross-section rules such as `train.batch_size % train.world_size == 0`)
before any stage does work. An optional `runs:` section names variants of it for sweeps, each a
map of dotted keys to values (`lr3e-3: {train.lr_max: 0.003}`); `run_configs` validates every run
like the main config, which is itself the run named "default". A top-level `seeds: [0, 1, 2]`
repeats every run once per seed, as the runs `<run>.s<seed>` (`seed_runs`).

Each key is documented once, beside its default (`key(..., help=...)`, tinylm/keys.py): here, or
for the model's options in tinylm/model_options.py (`ModelOptions`, which `ModelConfig` extends with
the model's sizes). config/config.yaml's
comments and config/README.md's tables are generated from these dataclasses by
`python -m tinylm config-docs` (tinylm/config/docs.py), and a test fails when they drift.
"""

from tinylm.config.constants import DEFAULT_VALID_PLAYS, END_OF_TEXT, UINT16_VOCAB_LIMIT, URL_WITH_SHA256
from tinylm.config.loading import from_dict, read_config_file, validate
from tinylm.config.runs import (
    DEFAULT_RUN,
    EXECUTION_TRAIN_KEYS,
    RESULTS,
    RUN_NAME,
    SEEDS_KEY,
    SeedRun,
    config_hash,
    data_hash,
    default_weight_config,
    ladder_of,
    load_config,
    read_seeds,
    run_configs,
    run_hash,
    run_overrides,
    run_state_dir,
    seed_run_name,
    seed_runs,
    weight_config,
    weight_config_differences,
)
from tinylm.config.sections import (
    Config,
    CorpusConfig,
    EncodeConfig,
    EvaluateConfig,
    ExportConfig,
    GenerateConfig,
    ModelConfig,
    TokenizerConfig,
)
from tinylm.config.train import TrainConfig
from tinylm.keys import ConfigError, key

__all__ = [
    "DEFAULT_RUN",
    "DEFAULT_VALID_PLAYS",
    "END_OF_TEXT",
    "EXECUTION_TRAIN_KEYS",
    "RESULTS",
    "RUN_NAME",
    "SEEDS_KEY",
    "UINT16_VOCAB_LIMIT",
    "URL_WITH_SHA256",
    "Config",
    "ConfigError",
    "CorpusConfig",
    "EncodeConfig",
    "EvaluateConfig",
    "ExportConfig",
    "GenerateConfig",
    "ModelConfig",
    "SeedRun",
    "TokenizerConfig",
    "TrainConfig",
    "config_hash",
    "data_hash",
    "default_weight_config",
    "ladder_of",
    "from_dict",
    "key",
    "load_config",
    "read_config_file",
    "read_seeds",
    "run_configs",
    "run_hash",
    "run_overrides",
    "run_state_dir",
    "seed_run_name",
    "seed_runs",
    "validate",
    "weight_config",
    "weight_config_differences",
]
