"""The typed config: one dataclass per stage section, validated with messages that name the key.

`config/config.yaml` is read into a `Config`; every key is checked (unknown keys, wrong types,
out-of-range values and cross-section rules such as `train.batch_size % train.world_size == 0`)
before any stage does work. An optional `runs:` section names variants of it for sweeps, each a
map of dotted keys to values (`lr3e-3: {train.lr_max: 0.003}`); `run_configs` validates every run
like the main config, which is itself the run named "default".

Each key is documented once, here, beside its default (`key(..., help=...)`): config/config.yaml's
comments and config/README.md's tables are generated from these dataclasses by
`python -m tinylm config-docs` (tinylm/config/docs.py), and a test fails when they drift.
"""

from tinylm.config.keys import (
    DEFAULT_VALID_PLAYS,
    UINT16_VOCAB_LIMIT,
    URL_WITH_SHA256,
    ConfigError,
    key,
)
from tinylm.config.loading import from_dict, read_config_file, validate
from tinylm.config.runs import (
    DEFAULT_RUN,
    EXECUTION_TRAIN_KEYS,
    OPTIMIZER_CHOICE_KEYS,
    RUN_NAME,
    config_hash,
    data_hash,
    default_weight_config,
    load_config,
    run_configs,
    run_hash,
    run_overrides,
    weight_config,
)
from tinylm.config.sections import (
    MODEL_OPTION_KEYS,
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

__all__ = [
    "DEFAULT_RUN",
    "DEFAULT_VALID_PLAYS",
    "EXECUTION_TRAIN_KEYS",
    "MODEL_OPTION_KEYS",
    "OPTIMIZER_CHOICE_KEYS",
    "RUN_NAME",
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
    "TokenizerConfig",
    "TrainConfig",
    "config_hash",
    "data_hash",
    "default_weight_config",
    "from_dict",
    "key",
    "load_config",
    "read_config_file",
    "run_configs",
    "run_hash",
    "run_overrides",
    "validate",
    "weight_config",
]
