rule corpus:
    input:
        corpus_files,
    output:
        train="results/{data_dir}corpus/train.txt",
        valid="results/{data_dir}corpus/valid.txt",
    params:
        cfg=data_json("corpus"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{data_dir}logs/corpus.log",
    benchmark:
        "results/{data_dir}benchmarks/corpus.tsv"
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "python -m tinylm corpus --config-json {params.cfg:q}"
        " --train-out {output.train} --valid-out {output.valid} 2> {log}"
