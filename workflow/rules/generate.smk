rule generate:
    input:
        tokenizer=run_tokenizer,
        checkpoints="results/{run_dir}checkpoints",
        # The samples' header quotes the final exact validation loss, so `results/samples.txt`
        # (the README's target) runs every stage.
        evaluation="results/{run_dir}eval.csv",
    output:
        report("results/{run_dir}samples.txt", caption="../report/samples.rst", category="Samples",
               subcategory="{run_dir}"),
    params:
        cfg=run_json("model", "train", "generate"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{run_dir}logs/generate.log",
    benchmark:
        "results/{run_dir}benchmarks/generate.tsv"
    threads: lambda wildcards: run_cfg(wildcards).generate.threads
    resources:
        gpu=one_gpu,
        mem_mb=2000,
    shell:
        "python -m tinylm generate --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --eval {input.evaluation} --output {output} 2> {log}"
