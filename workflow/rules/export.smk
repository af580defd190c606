# On request only (not part of `rule all`): snakemake --cores all results/hf
rule export:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        checkpoints="results/checkpoints",
    output:
        directory("results/hf"),
    params:
        cfg=section_json("export"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/export.log",
    benchmark:
        "results/benchmarks/export.tsv"
    threads: config["export"]["threads"]
    resources:
        mem_mb=4000,
    shell:
        "python -m tinylm export --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --output {output} 2> {log}"
