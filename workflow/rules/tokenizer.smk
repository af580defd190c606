rule train_tokenizer:
    input:
        "results/corpus/train.txt",
    output:
        "results/tokenizer/tokenizer.json",
    params:
        cfg=section_json("tokenizer"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/train_tokenizer.log",
    benchmark:
        "results/benchmarks/train_tokenizer.tsv"
    threads: lambda wildcards: config["tokenizer"].get("num_workers") or workflow.cores
    resources:
        mem_mb=4000,
    shell:
        "python -m tinylm train-tokenizer --config-json {params.cfg:q}"
        " --input {input} --output {output} 2> {log}"
