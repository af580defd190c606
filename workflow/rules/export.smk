# On request only (not part of `rule all`): snakemake --cores all results/hf (results/runs/<name>/hf
# for a named run).
rule export:
    input:
        tokenizer=run_tokenizer,
        checkpoints="results/{run_dir}checkpoints",
    output:
        directory("results/{run_dir}hf"),
    params:
        cfg=run_json("model", "train", "export"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{run_dir}logs/export.log",
    benchmark:
        "results/{run_dir}benchmarks/export.tsv"
    threads: lambda wildcards: run_cfg(wildcards).export.threads
    resources:
        mem_mb=4000,
    shell:
        "python -m tinylm export --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --output {output} 2> {log}"
