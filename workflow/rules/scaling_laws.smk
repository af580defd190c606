# A ladder's scaling laws (`ladder:` in the config, tinylm/config/ladder.py): every ladder run, at every
# seed, trained and evaluated, then fitted by stage `scaling-laws` (tinylm/scaling_laws.py):
#   snakemake --cores all results/scaling_laws/fits.csv --configfile config/ladder.yaml
# Each point is a run's final exact validation loss, with its budget, N (matmul weights) and D (tokens).
LADDER_POINTS = [
    {"name": name, "config": run.name, "seed": seed, "budget": run.budget, "parameters": run.parameters,
     "tokens": run.tokens, "steps": run.steps, "eval": f"results/{run_dir(name)}eval.csv"}
    for run in LADDER.runs
    for name, seed in (
        [(n, s.seed) for n, s in SEEDED.items() if s.config == run.name] or [(run.name, None)]
    )
]


if LADDER_POINTS:

    rule scaling_laws:
        input:
            evals=[point["eval"] for point in LADDER_POINTS],
            train=f"results/{data_dir(LADDER_POINTS[0]['name'])}tokens/train.npy",
        output:
            fits=report("results/scaling_laws/fits.csv", caption="../report/scaling_laws.rst", category="Scaling laws"),
            isoflop=report("results/scaling_laws/isoflop.csv", caption="../report/scaling_laws.rst", category="Scaling laws"),
            predictions=report("results/scaling_laws/predictions.csv", caption="../report/scaling_laws.rst", category="Scaling laws"),
            points="results/scaling_laws/points.csv",
            plot=report("results/scaling_laws/scaling_laws.png", caption="../report/scaling_laws.rst", category="Scaling laws"),
        params:
            runs=json_file(json.dumps(LADDER_POINTS, sort_keys=True)),
            cfg=sections_json(RUNS[DEFAULT_RUN], "ladder"),
        conda:
            "../envs/tinylm.yaml"
        log:
            "results/logs/scaling_laws.log",
        threads: 1
        shell:
            "python -m tinylm scaling-laws --config-json {params.cfg:q} --runs-json {params.runs}"
            " --train-tokens {input.train} --output-dir results/scaling_laws 2> {log}"
