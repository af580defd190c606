# Scores of checkpoints already evaluated live in results/eval_cache, outside the declared outputs
# (Snakemake deletes those before a rerun), so evaluating after more training scores only the new
# checkpoints.
rule evaluate:
    input:
        tokenizer=run_tokenizer,
        checkpoints="results/{run_dir}checkpoints",
        valid=data_file("tokens/valid.npy"),
        other_valid=lambda wildcards: list(other_valid_tokens(wildcards).values()),  # other runs' data
    output:
        table=report("results/{run_dir}eval.csv", caption="../report/eval.rst", category="Evaluation",
                     subcategory="{run_dir}"),
        plot=report("results/{run_dir}eval.png", caption="../report/plot.rst", category="Evaluation",
                    subcategory="{run_dir}"),
        notes=report("results/{run_dir}eval_columns.md", caption="../report/eval.rst", category="Evaluation",
                     subcategory="{run_dir}"),
    params:
        cfg=run_json("model", "train", "evaluate"),
        also=also_valid_arguments,
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{run_dir}logs/evaluate.log",
    benchmark:
        "results/{run_dir}benchmarks/evaluate.tsv"
    # evaluate.threads per process, evaluate.processes checkpoints at once (null: every core)
    threads: lambda wildcards: run_cfg(wildcards).evaluate.threads * (run_cfg(wildcards).evaluate.processes or workflow.cores)
    resources:
        gpu=one_gpu,
        mem_mb=2000,
    shell:
        "python -m tinylm evaluate --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --valid-tokens {input.valid}"
        " --output {output.table} --plot {output.plot} --notes {output.notes} --cache-dir results/eval_cache"
        " {params.also} 2> {log}"
