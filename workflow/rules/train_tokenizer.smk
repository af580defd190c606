rule train_tokenizer:
    input:
        "results/{data_dir}corpus/train.txt",
    output:
        "results/{data_dir}tokenizer/tokenizer.json",
    params:
        cfg=data_json("tokenizer"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{data_dir}logs/train_tokenizer.log",
    benchmark:
        "results/{data_dir}benchmarks/train_tokenizer.tsv"
    threads: workers("tokenizer")
    resources:
        mem_mb=4000,
    shell:
        "python -m tinylm train-tokenizer --config-json {params.cfg:q}"
        " --input {input} --output {output} 2> {log}"
