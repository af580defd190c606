rule encode:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        train="results/corpus/train.txt",
        valid="results/corpus/valid.txt",
    output:
        train="results/tokens/train.npy",
        valid="results/tokens/valid.npy",
    params:
        cfg=section_json("tokenizer", "encode"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/encode.log",
    benchmark:
        "results/benchmarks/encode.tsv"
    threads: lambda wildcards: config["encode"].get("num_workers") or workflow.cores
    resources:
        mem_mb=2000,
    shell:
        "python -m tinylm encode --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --input {input.train} {input.valid} --output {output.train} {output.valid} 2> {log}"
