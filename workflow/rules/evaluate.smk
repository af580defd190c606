# Scores of checkpoints already evaluated live in results/eval_cache, outside the declared outputs
# (Snakemake deletes those before a rerun), so evaluating after more training scores only the new
# checkpoints.
rule evaluate:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        checkpoints="results/checkpoints",
        valid="results/tokens/valid.npy",
    output:
        table=report("results/eval.csv", caption="../report/eval.rst", category="Evaluation"),
        plot=report("results/eval.png", caption="../report/plot.rst", category="Evaluation"),
    params:
        cfg=section_json("evaluate"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/evaluate.log",
    benchmark:
        "results/benchmarks/evaluate.tsv"
    threads: config["evaluate"]["threads"]
    resources:
        mem_mb=2000,
    shell:
        "python -m tinylm evaluate --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --valid-tokens {input.valid}"
        " --output {output.table} --plot {output.plot} --cache-dir results/eval_cache 2> {log}"
