rule encode:
    input:
        tokenizer=lambda wildcards: tokenizer_of_data(wildcards.data_dir),
        train="results/{data_dir}corpus/train.txt",
        valid="results/{data_dir}corpus/valid.txt",
    output:
        train="results/{data_dir}tokens/train.npy",
        valid="results/{data_dir}tokens/valid.npy",
    params:
        cfg=data_json("tokenizer", "encode"),
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{data_dir}logs/encode.log",
    benchmark:
        "results/{data_dir}benchmarks/encode.tsv"
    threads: workers("encode")
    resources:
        mem_mb=2000,
    shell:
        "python -m tinylm encode --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --input {input.train} {input.valid} --output {output.train} {output.valid} 2> {log}"
