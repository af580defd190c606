# Every run of the config side by side; `snakemake --cores all results/compare.csv` trains each run
# (in parallel when cores allow: each pretrain job's threads are its world_size * threads_per_rank).
# Under `seeds:` the compared runs are the seeded ones, <run>.s<seed>, each with its configuration (the
# run it repeats) and its seed: compare.csv gains those columns, compare_seeds.csv holds each
# configuration's mean and sample standard deviation over its seeds, and compare.png plots the means
# with their spread (the main config's plain "default" run, at its own seed, is not compared then).
# Without `seeds:` every run is its own configuration of one seed, and the outputs are as before.
# Each run's values of every key that some run overrides: the comparison table shows those that differ.
OVERRIDDEN = list(dict.fromkeys(key for overrides in OVERRIDES.values() for key in overrides))


COMPARED = [
    {"name": run, "config": SEEDED[run].config if SEEDED else run,
     "seed": SEEDED[run].seed if SEEDED else RUNS[run].train.seed,
     "eval": f"results/{run_dir(run)}eval.csv", "checkpoints": f"results/{run_dir(run)}checkpoints",
     "overrides": OVERRIDES[run], "values": {key: config_value(RUNS[run], key) for key in OVERRIDDEN}}
    for run in (SEEDED or RUNS)
]


rule compare:
    input:
        evals=[run["eval"] for run in COMPARED],
        checkpoints=[run["checkpoints"] for run in COMPARED],
    output:
        table=report("results/compare.csv", caption="../report/compare.rst", category="Comparison"),
        seeds=report("results/compare_seeds.csv", caption="../report/compare.rst", category="Comparison"),
        plot=report("results/compare.png", caption="../report/compare.rst", category="Comparison"),
    params:
        runs=json_file(json.dumps(COMPARED, sort_keys=True)),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/compare.log",
    threads: 1
    shell:
        "python -m tinylm compare --runs-json {params.runs} --output {output.table}"
        " --seeds-output {output.seeds} --plot {output.plot} 2> {log}"
