rule corpus:
    output:
        train="results/corpus/train.txt",
        valid="results/corpus/valid.txt",
    params:
        cfg=section_json("corpus"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/corpus.log",
    benchmark:
        "results/benchmarks/corpus.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "python -m tinylm corpus --config-json {params.cfg:q}"
        " --train-out {output.train} --valid-out {output.valid} 2> {log}"
