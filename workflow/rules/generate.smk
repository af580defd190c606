rule generate:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        checkpoints="results/checkpoints",
        # The samples' header quotes the final exact validation loss, so `results/samples.txt`
        # (the README's target) runs every stage.
        evaluation="results/eval.csv",
    output:
        report("results/samples.txt", caption="../report/samples.rst", category="Samples"),
    params:
        cfg=section_json("generate"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/generate.log",
    benchmark:
        "results/benchmarks/generate.tsv"
    threads: config["generate"]["threads"]
    resources:
        mem_mb=2000,
    shell:
        "python -m tinylm generate --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --checkpoint-dir {input.checkpoints} --eval {input.evaluation} --output {output} 2> {log}"
