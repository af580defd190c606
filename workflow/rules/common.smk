import hashlib
import json
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

from tinylm.config import DEFAULT_RUN, RESULTS, data_hash, run_hash, run_state_dir
from tinylm.config.lineage import mixture_runs, parent_of, tokenizer_run
from tinylm.io import atomic_path
from tinylm.corpus.readers import matching_files

# Where artifacts live. The main config is the run "default": its files are where they always were
# (results/checkpoints, results/eval.csv, ...); a named run r writes results/runs/r/... instead.
# Data (corpus, tokenizer, token files) is shared by content: runs whose corpus and tokenizer
# sections equal the main config's use results/corpus, results/tokenizer and results/tokens;
# other data lives in results/data/<data hash>/. A branch (train.init_from) on a corpus of its own
# encodes it with its first ancestor's tokenizer (tinylm.config.lineage.tokenizer_run): its data
# folder trains no tokenizer, and TOKENIZER_DIR names the folder whose tokenizer it uses.
# Rules match these prefixes with the wildcards
# {run_dir} ("" or "runs/<name>/") and {data_dir} ("" or "data/<hash>/").
# Under `seeds:`, the run default.s<seed> (or .d<seed>) at the main config's own seed is the main config's run
# itself (the same config): it is trained once, in results/, for the default target and the sweep.
wildcard_constraints:
    run_dir=r"(runs/[A-Za-z0-9][A-Za-z0-9_.-]*/)?",
    data_dir=r"(data/[0-9a-f]{16}/)?",


MAIN_RUNS = {DEFAULT_RUN} | {
    run for run, seeded in SEEDED.items()
    if seeded.config == DEFAULT_RUN and run_hash(RUNS[run]) == run_hash(RUNS[DEFAULT_RUN])
}


def run_dir(run):
    return "" if run in MAIN_RUNS else f"runs/{run}/"


def data_dir(run):
    """The data folder of a run ("" for the main config's data, else "data/<data hash>/")."""
    root = tokenizer_run(run, RUNS)
    h = data_hash(RUNS[run], None if root == run else data_hash(RUNS[root]))
    return "" if h == data_hash(RUNS[DEFAULT_RUN]) else f"data/{h}/"


RUN_OF = {}  # run dir -> its run ("" -> "default", which comes first)
for _run in RUNS:
    RUN_OF.setdefault(run_dir(_run), _run)
DATA_OF = {}  # data dir -> the config of the first run that uses it
TOKENIZER_DIR = {}  # data dir -> the data dir whose tokenizer encodes it (itself, or a branch's ancestor's)
for _run, _cfg in RUNS.items():
    DATA_OF.setdefault(data_dir(_run), _cfg)
    TOKENIZER_DIR.setdefault(data_dir(_run), data_dir(tokenizer_run(_run, RUNS)))


def run_of(wildcards):
    if wildcards.run_dir not in RUN_OF:
        raise ValueError(f"results/{wildcards.run_dir}: no such run in the config (runs: {', '.join(RUNS)})")
    return RUN_OF[wildcards.run_dir]


def run_cfg(wildcards):
    return RUNS[run_of(wildcards)]


def json_file(text):
    """`@results/configs/<sha256 of text>.json`, the file that holds `text` (written once, atomically):
    how a rule hands a stage its config (`--config-json @FILE`) or the compared runs, so that job lines
    stay short. The name is the content's hash: editing a section changes the parameter, which reruns
    the jobs that get it (Snakemake's params trigger), and a stage rerun by hand reads the same JSON."""
    path = Path(RESULTS) / "configs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return f"@{path}"


def sections_json(cfg, *names):
    """The named config sections in a JSON file (json_file); editing any of them reruns the jobs that get them."""
    return json_file(json.dumps({name: asdict(getattr(cfg, name)) for name in names}, sort_keys=True))


def run_json(*names):
    return lambda wildcards: sections_json(run_cfg(wildcards), *names)


def data_json(*names):
    return lambda wildcards: sections_json(DATA_OF[wildcards.data_dir], *names)


def init_checkpoints(wildcards):
    """The checkpoints folder a run with `train.init_from` starts from (the parent run's, so that the
    run waits for it and reruns when it changes), or no input."""
    run = RUN_OF[wildcards.run_dir]
    cfg = RUNS[run]
    if cfg.train.init_from is None:
        return []
    parent = parent_of(run, cfg, RUNS)
    return cfg.train.init_from if parent is None else f"results/{run_dir(parent)}checkpoints"


def data_file(path):
    """A run's data file, e.g. data_file("tokens/train.npy"), as a rule input."""
    return lambda wildcards: f"results/{data_dir(run_of(wildcards))}{path}"


def train_tokens(wildcards):
    """A run's training token files: its own, or with `train.mixture` those of each run it names, in
    its order (so that those runs' data stages run first)."""
    run = run_of(wildcards)
    mixed = mixture_runs(run, RUNS[run], RUNS)
    return [f"results/{data_dir(m)}tokens/train.npy" for m in mixed] or f"results/{data_dir(run)}tokens/train.npy"


def tokenizer_of_data(data_dir):
    return f"results/{TOKENIZER_DIR[data_dir]}tokenizer/tokenizer.json"


def run_tokenizer(wildcards):
    """The tokenizer a run's token files are encoded with, as a rule input."""
    return tokenizer_of_data(data_dir(run_of(wildcards)))


def other_valid_tokens(wildcards):
    """{run: its validation tokens} of the runs whose data a run trained on, or from, other than its
    own: a branch's parent on another corpus, the runs of a mixture; evaluated beside its own."""
    run = run_of(wildcards)
    parent = parent_of(run, RUNS[run], RUNS)
    seen, out = {data_dir(run)}, {}
    for other in [*([parent] if parent else []), *mixture_runs(run, RUNS[run], RUNS)]:
        if data_dir(other) not in seen:
            seen.add(data_dir(other))
            out[other] = f"results/{data_dir(other)}tokens/valid.npy"
    return out


def also_valid_arguments(wildcards):
    """evaluate's `--also-valid-tokens RUN=FILE ...` for other_valid_tokens, or nothing."""
    others = other_valid_tokens(wildcards)
    return " ".join(["--also-valid-tokens", *(f"{run}={path}" for run, path in others.items())]) if others else ""


def corpus_files(wildcards):
    """The local files of a `files` corpus, glob patterns expanded: the corpus rule's inputs, so that editing,
    adding or removing one reruns the corpus stage and everything after it. A path that does not exist is
    left out here, for the corpus stage to refuse with a message naming its key."""
    corpus = DATA_OF[wildcards.data_dir].corpus
    if corpus.source != "files":
        return []
    return [str(path) for path in matching_files([*corpus.train_files, *corpus.valid_files])]


def workers(section):
    """threads: of a data rule, from its num_workers (null: every core)."""
    return lambda wildcards: getattr(DATA_OF[wildcards.data_dir], section).num_workers or workflow.cores


def config_value(cfg, dotted):
    """The value of a dotted key ("train.lr_max") in a run's config."""
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def cuda_devices():
    """The CUDA devices of this machine as `nvidia-smi -L` lists them; 0 without nvidia-smi."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    try:
        listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


# Jobs declare the GPUs they take as the resource `gpu`, and a machine with GPUs offers all of its
# own (unless --resources gpu=N says otherwise), so that the runs of a sweep and their evaluations
# never share a device: a job waits until its GPUs are free.
GPUS = cuda_devices()
if GPUS and "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", GPUS)


def pretrain_gpus(wildcards):
    """One GPU per rank where the machine has enough (backend auto or nccl); none on the CPU."""
    train = run_cfg(wildcards).train
    return 0 if train.backend == "gloo" or train.world_size > GPUS else train.world_size


def one_gpu(wildcards):
    """evaluate and generate run on the first CUDA device when there is one."""
    return 1 if GPUS else 0
